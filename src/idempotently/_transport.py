"""Transport and AsyncTransport: the journal under any httpx client.

Vendor SDKs built on httpx accept an ``http_client``; giving that client one of
these transports journals every write the SDK sends, adopting the
``Idempotency-Key`` the SDK already put on the request. The decisions are the
engine's; these drivers only read bodies, send through the wrapped transport
and sleep.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence

import anyio
import httpx

from idempotently._engine import Engine, Flight
from idempotently._journal import Journal
from idempotently._keys import redaction_set
from idempotently._policy import RetryPolicy
from idempotently._profiles import GENERIC, ServerProfile

OPERATION_ID_HEADER = "Idempotency-Operation-Id"
"""A request header naming the operation; sent on to the server unchanged."""
DEFAULT_METHODS = frozenset({"POST", "PATCH"})

JournalArg = str | os.PathLike[str] | Journal


class _TransportBase:
    def __init__(
        self,
        journal: JournalArg,
        *,
        policy: RetryPolicy | None,
        profile: ServerProfile,
        methods: Collection[str],
        redact_headers: Iterable[str],
        clock: Callable[[], float],
    ) -> None:
        self._owns_journal = not isinstance(journal, Journal)
        self.journal = journal if isinstance(journal, Journal) else Journal(journal)
        self.profile = profile
        self.methods = frozenset(method.upper() for method in methods)
        self._engine = Engine(
            journal=self.journal,
            policy=policy or RetryPolicy(),
            profile=profile,
            clock=clock,
            redact_headers=redaction_set(redact_headers),
        )

    def _journaled(self, request: httpx.Request) -> bool:
        return request.method.upper() in self.methods

    def _prepare(self, request: httpx.Request) -> Flight | httpx.Response:
        """Journal the request (its body already read) under its adopted key and operation."""
        key = self._adopted_key(request)
        operation_id = request.headers.get(OPERATION_ID_HEADER)
        if operation_id is None:
            # The SDK's own retry resends the same key: it must find the same operation.
            operation_id = None if key is None else f"key:{key}"
        elif key is not None and self.journal._find(operation_id, None) is not None:
            # A named operation keeps the key it was first sent with: an SDK that
            # makes a fresh key per call (after a restart, say) must not create a
            # second operation on the server.
            key = None
        extensions = request.extensions

        def build(
            method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes
        ) -> httpx.Request:
            # Keep the live request's extensions: its timeouts apply to a resend too.
            return httpx.Request(
                method, url, headers=list(headers), content=body, extensions=extensions
            )

        return self._engine.prepare(
            request,
            build,
            operation_id=operation_id,
            key=key,
            delivery="exactly_once",
            deadline_at=None,
        )

    def _adopted_key(self, request: httpx.Request) -> str | None:
        value: str | None = request.headers.get(self.profile.key_header)
        if value is None:
            return None
        if (
            self.profile.key_format == "sf-string"
            and len(value) >= 2
            and value[0] == value[-1] == '"'
        ):
            return value[1:-1]  # the engine renders the quotes again
        return value

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(journal={self.journal.path!r}, profile={self.profile.name!r})"
        )


class Transport(_TransportBase, httpx.BaseTransport):
    """An httpx transport that gives every POST and PATCH a journaled idempotency key.

    ``httpx.Client(transport=Transport("ops.db"))`` journals each write before
    it is sent, adopts the ``Idempotency-Key`` header the request carries (or
    adds one), retries through ``transport`` by the :class:`RetryPolicy`, and
    returns the stored answer for a key that already settled. It raises what
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
        redact_headers: Iterable[str] = (),
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(
            journal,
            policy=policy,
            profile=profile,
            methods=methods,
            redact_headers=redact_headers,
            clock=clock,
        )
        self.transport = transport if transport is not None else httpx.HTTPTransport()
        self._sleep = sleep

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not self._journaled(request):
            return self.transport.handle_request(request)
        request.read()
        prepared = self._prepare(request)
        if isinstance(prepared, httpx.Response):
            return prepared
        return prepared.fly(self._send, self._sleep)

    def _send(self, request: httpx.Request) -> httpx.Response:
        response = self.transport.handle_request(request)
        try:
            response.read()  # the engine journals the body of a final answer
        except BaseException:
            response.close()
            raise
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
        redact_headers: Iterable[str] = (),
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        super().__init__(
            journal,
            policy=policy,
            profile=profile,
            methods=methods,
            redact_headers=redact_headers,
            clock=clock,
        )
        self.transport = transport if transport is not None else httpx.AsyncHTTPTransport()
        self._sleep = sleep

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self._journaled(request):
            return await self.transport.handle_async_request(request)
        await request.aread()
        prepared = self._prepare(request)
        if isinstance(prepared, httpx.Response):
            return prepared
        return await prepared.afly(self._send, self._sleep)

    async def _send(self, request: httpx.Request) -> httpx.Response:
        response = await self.transport.handle_async_request(request)
        try:
            await response.aread()
        except BaseException:
            await response.aclose()
            raise
        return response

    async def aclose(self) -> None:
        await self.transport.aclose()
        if self._owns_journal:
            self.journal.close()
