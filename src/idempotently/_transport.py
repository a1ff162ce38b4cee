"""Transport and AsyncTransport: the journal under any httpx client.

Vendor SDKs built on httpx accept an ``http_client``; giving that client one of
these transports journals every write the SDK sends, adopting the
``Idempotency-Key`` the SDK already put on the request. They run the same
operation flow as the sessions (``_flow.py``); these drivers only read
bodies, send through the wrapped transport and sleep.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Iterable

import anyio
import httpx

from idempotently._drivers import arun, run
from idempotently._flow import (
    DEFAULT_KEY_EXPIRY_MARGIN,
    DEFAULT_LEASE_DURATION,
    Call,
    Engine,
    Held,
    check_call_arguments,
)
from idempotently._keys import redaction_set
from idempotently._policy import RetryPolicy
from idempotently._profiles import GENERIC, ServerProfile
from idempotently._session import JournalArg, adopted_key, check_engine_options, open_journal
from idempotently._vocabulary import DELIVERIES, Delivery

OPERATION_ID_HEADER = "Idempotency-Operation-Id"
"""A request header naming the operation; sent on to the server unchanged."""
DELIVERY_HEADER = "Idempotency-Delivery"
"""A request header choosing ``exactly_once`` or ``at_most_once`` for one request;
it is not sent on to the server."""
DEFAULT_METHODS = frozenset({"POST", "PATCH"})


class _TransportBase:
    def __init__(
        self,
        journal: JournalArg,
        *,
        policy: RetryPolicy | None,
        profile: ServerProfile,
        methods: Collection[str],
        delivery: Delivery,
        redact_headers: Iterable[str],
        fingerprint_headers: Iterable[str],
        lease_duration: float,
        key_expiry_margin: float,
        clock: Callable[[], float],
        sleep: object,
    ) -> None:
        redact_headers = (
            redact_headers if isinstance(redact_headers, str) else tuple(redact_headers)
        )
        fingerprint_headers = (
            fingerprint_headers
            if isinstance(fingerprint_headers, str)
            else tuple(fingerprint_headers)
        )
        check_engine_options(
            policy=policy,
            profile=profile,
            redact_headers=redact_headers,
            fingerprint_headers=fingerprint_headers,
            lease_duration=lease_duration,
            key_expiry_margin=key_expiry_margin,
            clock=clock,
            sleep=sleep,
            asynchronous=isinstance(self, httpx.AsyncBaseTransport),
        )
        if isinstance(methods, str) or not all(isinstance(method, str) for method in methods):
            raise TypeError(f"methods must be a collection of method names, not {methods!r}")
        if delivery not in DELIVERIES:
            raise ValueError(f"delivery must be 'exactly_once' or 'at_most_once', not {delivery!r}")
        self.journal, self._owns_journal = open_journal(journal)
        self.profile = profile
        self.methods = frozenset(method.upper() for method in methods)
        self.delivery: Delivery = delivery
        self._engine = Engine(
            policy=policy or RetryPolicy(),
            profile=profile,
            clock=clock,
            redact_headers=redaction_set(redact_headers),
            fingerprint_headers=tuple(fingerprint_headers),
            lease_duration=float(lease_duration),
            key_expiry_margin=float(key_expiry_margin),
            namespace=self.journal._namespace,
        )

    def _journaled(self, request: httpx.Request) -> bool:
        return request.method.upper() in self.methods

    def _call(self, request: httpx.Request) -> Call:
        """The call a request (its body read) stands for: its key, operation and delivery.

        Without ``Idempotency-Operation-Id`` the key names the operation: the
        SDK's own retry, a caller continuing with the key an error gave it, or
        the same request object sent again all find it. With one, a named
        operation keeps the key it was first sent with (an SDK that draws a
        fresh key per call must not create a second operation on the server).
        """
        operation_id = request.headers.get(OPERATION_ID_HEADER)
        delivery: Delivery = request.headers.pop(DELIVERY_HEADER, self.delivery)  # type: ignore[assignment]  # checked below
        check_call_arguments(
            operation_id=operation_id, idempotency_key=None, delivery=delivery, deadline_at=None
        )
        key = adopted_key(self.profile, request, None)
        return Call(
            request,
            operation_id=operation_id,
            key=key,
            keep_journaled_key=operation_id is not None,
            delivery=delivery,
            new_operation_id=None if key is None else f"key:{key}",
        )

    def _build(self, request: httpx.Request) -> Callable[..., httpx.Request]:
        extensions = request.extensions

        def build(
            method: str, url: httpx.URL, headers: list[tuple[bytes, bytes]], body: bytes
        ) -> httpx.Request:
            # Keep the live request's extensions: its timeouts apply to a resend too.
            return httpx.Request(method, url, headers=headers, content=body, extensions=extensions)

        return build

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(journal={self.journal.path!r}, profile={self.profile.name!r})"
        )


class Transport(_TransportBase, httpx.BaseTransport):
    """An httpx transport that gives every POST and PATCH a journaled idempotency key.

    ``httpx.Client(transport=Transport("ops.db"))`` journals each write before
    it is sent, adopts the ``Idempotency-Key`` header the request carries (or
    adds one), retries through ``transport`` by the :class:`RetryPolicy`, and
    returns the stored answer for a key that already settled. It takes the
    Session's options, ``delivery=`` included, and raises what
    :class:`Session` raises (``KeyReuseError``, ``OperationPendingError``,
    ``RetryLaterError``, ...); other methods pass straight through.
    """

    def __init__(
        self,
        journal: JournalArg,
        *,
        transport: httpx.BaseTransport | None = None,
        policy: RetryPolicy | None = None,
        profile: ServerProfile = GENERIC,
        methods: Collection[str] = DEFAULT_METHODS,
        delivery: Delivery = "exactly_once",
        redact_headers: Iterable[str] = (),
        fingerprint_headers: Iterable[str] = (),
        lease_duration: float = DEFAULT_LEASE_DURATION,
        key_expiry_margin: float = DEFAULT_KEY_EXPIRY_MARGIN,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        if transport is not None and not isinstance(transport, httpx.BaseTransport):
            raise TypeError(
                f"transport must be an httpx.BaseTransport, not {type(transport).__name__}"
            )
        super().__init__(
            journal,
            policy=policy,
            profile=profile,
            methods=methods,
            delivery=delivery,
            redact_headers=redact_headers,
            fingerprint_headers=fingerprint_headers,
            lease_duration=lease_duration,
            key_expiry_margin=key_expiry_margin,
            clock=clock,
            sleep=sleep,
        )
        self.transport = transport if transport is not None else httpx.HTTPTransport()
        self._sleep = sleep

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not self._journaled(request):
            return self.transport.handle_request(request)
        request.read()
        call = self._call(request)
        held = Held()
        return run(
            self._engine.call(call, self._build(request), held),
            held,
            self.journal,
            send=self._send,
            sleep=self._sleep,
        )

    def _send(self, request: httpx.Request) -> httpx.Response:
        response = self.transport.handle_request(request)
        try:
            response.read()  # the flow journals the body of a final answer
        finally:
            response.close()
        return response

    def close(self) -> None:
        self.transport.close()
        if self._owns_journal:
            self.journal.close()


class AsyncTransport(_TransportBase, httpx.AsyncBaseTransport):
    """The async twin of :class:`Transport`, on asyncio or trio (anyio)."""

    def __init__(
        self,
        journal: JournalArg,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        policy: RetryPolicy | None = None,
        profile: ServerProfile = GENERIC,
        methods: Collection[str] = DEFAULT_METHODS,
        delivery: Delivery = "exactly_once",
        redact_headers: Iterable[str] = (),
        fingerprint_headers: Iterable[str] = (),
        lease_duration: float = DEFAULT_LEASE_DURATION,
        key_expiry_margin: float = DEFAULT_KEY_EXPIRY_MARGIN,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[object]] = anyio.sleep,
    ) -> None:
        if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
            raise TypeError(
                f"transport must be an httpx.AsyncBaseTransport, not {type(transport).__name__}"
            )
        super().__init__(
            journal,
            policy=policy,
            profile=profile,
            methods=methods,
            delivery=delivery,
            redact_headers=redact_headers,
            fingerprint_headers=fingerprint_headers,
            lease_duration=lease_duration,
            key_expiry_margin=key_expiry_margin,
            clock=clock,
            sleep=sleep,
        )
        self.transport = transport if transport is not None else httpx.AsyncHTTPTransport()
        self._sleep = sleep

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self._journaled(request):
            return await self.transport.handle_async_request(request)
        await request.aread()
        call = self._call(request)
        held = Held()
        return await arun(
            self._engine.call(call, self._build(request), held),
            held,
            self.journal,
            send=self._send,
            sleep=self._sleep,
        )

    async def _send(self, request: httpx.Request) -> httpx.Response:
        response = await self.transport.handle_async_request(request)
        try:
            await response.aread()
        finally:
            await response.aclose()
        return response

    async def aclose(self) -> None:
        await self.transport.aclose()
        if self._owns_journal:
            # In a thread: closing a PostgreSQL journal's pool waits for its workers.
            await anyio.to_thread.run_sync(self.journal.close)
