"""Transport and AsyncTransport: the journal under any httpx client.

Vendor SDKs built on httpx accept an ``http_client``; giving that client one of
these transports journals every write the SDK sends, adopting the
``Idempotency-Key`` the SDK already put on the request. They run the same
operation flow as the sessions (``_flow/``); these drivers only read
bodies, send through the wrapped transport and sleep.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any, overload

import anyio
import attrs
import httpx

from idempotently import _httpx2
from idempotently._answers import DEFAULT_MAX_RESPONSE_BYTES
from idempotently._drivers import arun, run
from idempotently._flow._checks import check_call_arguments, check_host_id, check_timeouts
from idempotently._flow._config import DEFAULT_LEASE_DURATION
from idempotently._flow._engine import Engine
from idempotently._flow._leases import default_host_id
from idempotently._flow._operation import Call, Held
from idempotently._flow._read import retried_read
from idempotently._gate import alast_hook, last_hook
from idempotently._hooks import AsyncHook, Hook, check_hooks
from idempotently._keys import redaction_set
from idempotently._overrides import (
    POLICY_HEADER,
    check_policies,
    request_overrides,
)
from idempotently._policy import RetryPolicy
from idempotently._profiles import GENERIC, ProfileRule, ServerProfile
from idempotently._redirects import aread_redirect, read_redirect
from idempotently._session import JournalArg, adopted_key, check_engine_options, open_journal
from idempotently._vocabulary import DELIVERIES, Delivery

OPERATION_ID_HEADER = "Idempotency-Operation-Id"
"""A request header naming the operation; sent on to the server unchanged."""
DELIVERY_HEADER = "Idempotency-Delivery"
"""A request header choosing ``exactly_once`` or ``at_most_once`` for one request;
it is not sent on to the server."""
DEFAULT_METHODS = frozenset({"POST", "PATCH"})
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Retried without a journal or a key: the server may repeat them."""
IDEMPOTENT_METHODS = frozenset({"PUT", "DELETE"})
"""Retried so too with ``retry_idempotent_methods=True``."""

if TYPE_CHECKING:
    # The transports are httpx2 transports too when httpx2 is installed, so that
    # ``httpx2.Client(transport=Transport(...))`` type-checks.
    from httpx2 import AsyncBaseTransport as _Httpx2AsyncBase
    from httpx2 import BaseTransport as _Httpx2SyncBase
    from httpx2 import Request as _Httpx2Request
    from httpx2 import Response as _Httpx2Response
else:
    try:
        from httpx2 import AsyncBaseTransport as _Httpx2AsyncBase
        from httpx2 import BaseTransport as _Httpx2SyncBase
    except ImportError:  # httpx2 is optional (the [httpx2] extra)

        class _Httpx2SyncBase:
            pass

        class _Httpx2AsyncBase:
            pass


def _nothing_runs_in_between() -> bool:
    """A Transport journals a request after the client's hooks and auth flow ran, and
    sends it on to the wrapped transport with nothing of the client's in between: the
    gate of an attempt whose key is bound to no credentials would compare the request
    with itself (`Config.quiet_client`)."""
    return True


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
        host_id: str | None,
        key_expiry_margin: float | None,
        clock: Callable[[], float],
        sleep: object,
        hooks: Iterable[AsyncHook] = (),
        retry_idempotent_methods: bool = False,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        profile_rule: ProfileRule = "stored",
        policies: Mapping[str, RetryPolicy] | None = None,
    ) -> None:
        if not isinstance(retry_idempotent_methods, bool):
            raise TypeError(
                "retry_idempotent_methods must be True or False, not "
                f"{type(retry_idempotent_methods).__name__}"
            )
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
            max_response_bytes=max_response_bytes,
            profile_rule=profile_rule,
        )
        if isinstance(methods, str) or not all(isinstance(method, str) for method in methods):
            raise TypeError(f"methods must be a collection of method names, not {methods!r}")
        if delivery not in DELIVERIES:
            raise ValueError(f"delivery must be 'exactly_once' or 'at_most_once', not {delivery!r}")
        self.policies = check_policies(policies)
        """Policies a request picks by name with the ``Idempotency-Policy`` header."""
        host = default_host_id() if host_id is None else check_host_id(host_id)
        checked_hooks = check_hooks(hooks, asynchronous=isinstance(self, httpx.AsyncBaseTransport))
        self.journal, self._owns_journal = open_journal(journal)
        self.profile = profile
        self.methods = frozenset(method.upper() for method in methods)
        self.retried_methods = (
            READ_METHODS | (IDEMPOTENT_METHODS if retry_idempotent_methods else frozenset())
        ) - self.methods
        """Methods retried without a journal (a journaled method is never among them)."""
        self.delivery: Delivery = delivery
        self._engine = Engine(
            policy=policy or RetryPolicy(),
            profile=profile,
            profile_rule=profile_rule,
            clock=clock,
            redact_headers=redaction_set(redact_headers),
            fingerprint_headers=tuple(fingerprint_headers),
            lease_duration=float(lease_duration),
            host_id=host,
            key_expiry_margin=None if key_expiry_margin is None else float(key_expiry_margin),
            namespace=self.journal._namespace,
            codec=self.journal.codec,
            secret_params=self.journal.redact_query,
            hooks=checked_hooks,
            pauses=self.journal._pause_board,
            max_response_bytes=max_response_bytes,
            quiet_client=_nothing_runs_in_between,
        )

    def _journaled(self, request: httpx.Request) -> bool:
        return request.method.upper() in self.methods

    def _retried(self, request: httpx.Request) -> bool:
        return request.method.upper() in self.retried_methods

    def _overridden(self, request: httpx.Request, *, journaled: bool) -> tuple[Engine, str | None]:
        """The engine that sends ``request`` (this Transport's, or one with the policy and
        profile the request asks for: `request_overrides`) and the overrides to journal.
        A profile asked for is checked against an existing operation's journaled one, as
        ``resume --profile`` is: one that differs is refused before anything is sent."""
        policy, profile, overrides = request_overrides(
            request, self.policies, self._engine, journaled=journaled
        )
        engine = self._engine.overridden(policy, profile)
        if profile is not None and engine.profile_rule != "forced":
            engine = attrs.evolve(engine, profile_rule="checked")
        return engine, overrides

    def _call(self, request: httpx.Request) -> tuple[Call, Engine]:
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
        # The client's timeout, as a Session's: checked before the operation is journaled.
        check_timeouts(request)
        engine, overrides = self._overridden(request, journaled=True)
        key = adopted_key(engine.profile, request, None)
        call = Call(
            request,
            operation_id=operation_id,
            key=key,
            keep_journaled_key=operation_id is not None,
            delivery=delivery,
            new_operation_id=None if key is None else f"key:{key}",
            overrides=overrides,
        )
        return call, engine

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


class Transport(_TransportBase, httpx.BaseTransport, _Httpx2SyncBase):
    """An httpx transport that gives every POST and PATCH a journaled idempotency key.

    ``httpx.Client(transport=Transport("idempotently.db"))`` journals each write before
    it is sent, adopts the ``Idempotency-Key`` header the request carries (or
    adds one), retries through ``transport`` by the `RetryPolicy`, and
    returns the stored answer for a key that already settled. It takes the
    Session's options, ``delivery=`` included, and raises what
    `Session` raises (``KeyReuseError``, ``OperationPendingError``,
    ``RetryLaterError``, ...). GET, HEAD and OPTIONS (and PUT and DELETE with
    ``retry_idempotent_methods=True``) are retried on network errors, 5xx, 408,
    425 and 429 under the same policy, retry budget and origin pauses, without a
    key or an operation in the journal: an answer retried is closed unread, and
    the last answer or error comes through as it came (a redirect read to a 64 KiB
    excerpt first, as the client follows it after reading it). Other methods pass
    straight through. ``hooks=`` receive the same events as the Session's.

    Args:
        journal: The journal: a path, a `postgresql://` URL, or an open `Journal`.
        transport: The transport that really sends (`httpx.HTTPTransport()` when None).
        methods: The methods journaled and retried with a key (POST and PATCH);
            others pass straight through.
        delivery: `exactly_once` (resend with the same key) or `at_most_once`
            (never resend what may have arrived).
        policy: How hard each call tries (`RetryPolicy()` when None).
        profile: How the server spells the contract (`profiles.GENERIC`; see the
            catalog in `idempotently.profiles`).
        redact_headers: More request headers never to journal (credentials such as
            `Authorization` and `X-Api-Key` never are).
        fingerprint_headers: Request headers that take part in the request's
            fingerprint, so a call that differs in them is a `KeyReuseError`.
        lease_duration: Seconds a sender's lease lasts before another process may
            take the operation over (renewed while the attempt runs).
        host_id: This host's name in lease owners (`$IDEMPOTENTLY_HOST_ID`, else
            the hostname).
        key_expiry_margin: Seconds before the key's lifetime ends after which an
            operation is no longer resent, but goes to `needs_reconcile`. None (the
            default): each operation's profile's (`ServerProfile.key_expiry_margin`,
            journaled with it). A given one (at least 60, below the profile's key
            lifetime) applies where it is larger.
        profile_rule: How the profile journaled with an operation is read when a
            request continues it, as for `Session`: `"stored"` (the default),
            `"stored_only"`, `"checked"` or `"forced"`.
        clock: The time, in seconds since the epoch (inject one in tests).
        sleep: How to wait between attempts.
        hooks: Functions called with every event.
        retry_idempotent_methods: Also retry PUT and DELETE (without a journal or a
            key), for a server whose PUT and DELETE are idempotent.
        max_response_bytes: The largest final answer read and journaled (decoded
            bytes; 100 MiB by default). A larger one, or one still arriving at the
            policy's deadline, is journaled with its status and headers only, and
            the request raises `AnswerNotReadError`; an answer that may be retried
            (5xx, 408, 409, 425, 429) is read no further than a 64 KiB excerpt.
        policies: Named policies a request picks with the header
            ``Idempotency-Policy: NAME`` (for SDKs that can pass only headers); the
            header is removed before the request is sent or journaled, and a name not
            here is refused before anything is journaled. A request may instead carry
            ``extensions={"idempotently": {"policy": ..., "profile": ...}}``; its
            timeouts (httpx's ``extensions["timeout"]``) are journaled with the
            operation, so a resume applies them, as a Session call's ``timeout=``.
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
        host_id: str | None = None,
        key_expiry_margin: float | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], object] = time.sleep,
        hooks: Iterable[Hook] = (),
        retry_idempotent_methods: bool = False,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        profile_rule: ProfileRule = "stored",
        policies: Mapping[str, RetryPolicy] | None = None,
    ) -> None:
        if transport is not None and not _is_transport(transport, "handle_request"):
            raise TypeError(
                "transport must be an httpx.BaseTransport or an httpx2.BaseTransport, not "
                f"{type(transport).__name__}"
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
            host_id=host_id,
            key_expiry_margin=key_expiry_margin,
            clock=clock,
            sleep=sleep,
            hooks=hooks,
            retry_idempotent_methods=retry_idempotent_methods,
            max_response_bytes=max_response_bytes,
            profile_rule=profile_rule,
            policies=policies,
        )
        # Without transport=, requests go out through the library they came from:
        # httpx's HTTPTransport, or httpx2's for an httpx2 client (made on first use).
        self.transport: httpx.BaseTransport | Any = (
            transport if transport is not None else httpx.HTTPTransport()
        )
        self._default_transport = transport is None
        self._httpx2_transport: Any = None
        self._sleep = sleep

    def _inner(self, httpx2_request: bool) -> Any:
        if httpx2_request and self._default_transport:
            if self._httpx2_transport is None:
                self._httpx2_transport = _httpx2.httpx2_module().HTTPTransport()
            return self._httpx2_transport
        return self.transport

    @overload
    def handle_request(self, request: httpx.Request) -> httpx.Response: ...
    @overload
    def handle_request(self, request: _Httpx2Request) -> _Httpx2Response: ...

    def handle_request(self, request: Any) -> Any:
        """Journal and send a write; pass anything else through. httpx or httpx2 alike."""
        from_httpx2 = _httpx2.is_httpx2(request)
        inner = self._inner(from_httpx2)
        if self._retried(request):
            request.read()
            live = _as_httpx(request)
            check_timeouts(live)
            engine, _ = self._overridden(live, journaled=False)
            if from_httpx2:
                request.headers.pop(POLICY_HEADER, None)
            try:
                response = run(
                    retried_read(engine, live),
                    Held(),
                    self.journal,
                    send=lambda sent: self._send(inner, sent),
                    sleep=self._sleep,
                )
            except Exception as error:
                raise _httpx2.in_library_of(request, error)  # noqa: B904 (its cause is kept)
            if response.has_redirect_location and not response.is_stream_consumed:
                # The client above may follow it, after reading it whole (httpx's loop):
                # it finds it read, within bounds.
                try:
                    read_redirect(response, live, self._engine.clock)
                except Exception as error:
                    raise _httpx2.in_library_of(request, error)  # noqa: B904 (its cause is kept)
            if from_httpx2:
                # An httpx2 answer is handed over read (as its writes' answers are).
                try:
                    response.read()
                except Exception as error:
                    raise _httpx2.in_library_of(request, error)  # noqa: B904 (its cause is kept)
                finally:
                    response.close()
            return _returned(response, request)
        if not self._journaled(request):
            request.headers.pop(POLICY_HEADER, None)  # ours, never the server's
            if from_httpx2 == _httpx2.is_httpx2(inner):
                return inner.handle_request(request)
            request.read()
            response = self._send(inner, _as_httpx(request))
            try:
                response.read()  # converted to the request's library: read whole
            finally:
                response.close()
            return _returned(response, request)
        request.read()
        live = _as_httpx(request)
        call, engine = self._call(live)
        if from_httpx2:
            request.headers.pop(DELIVERY_HEADER, None)
            request.headers.pop(POLICY_HEADER, None)
        held = Held()
        try:
            response = run(
                engine.call(call, self._build(live), held),
                held,
                self.journal,
                send=lambda sent: self._send(inner, sent),
                sleep=self._sleep,
            )
        except Exception as error:
            raise _httpx2.in_library_of(request, error)  # noqa: B904 (its cause is kept)
        return _returned(response, request)

    def _send(self, inner: Any, request: httpx.Request) -> httpx.Response:
        """One attempt, its answer's body unread: a write's is read by the flow within
        bounds (a server can make a body endless); a read's final answer streams as it
        would without us (a download), and one the flow retries it closes unread. A
        write leaves here: its gate is passed first (the client's hooks and auth have run)."""
        last_hook(request)
        if _httpx2.is_httpx2(inner):
            try:
                answer = inner.handle_request(_httpx2.to_httpx2_request(request))
            except Exception as error:
                raise _httpx2.to_httpx_error(error) from error
            return _httpx2.unread_response(answer, request)
        response: httpx.Response = inner.handle_request(request)
        return response

    def close(self) -> None:
        self.transport.close()
        if self._httpx2_transport is not None:
            self._httpx2_transport.close()
        if self._owns_journal:
            self.journal.close()


class AsyncTransport(_TransportBase, httpx.AsyncBaseTransport, _Httpx2AsyncBase):
    """The async twin of `Transport`, on asyncio or trio (anyio).

    ``hooks=`` take plain or async functions, run on the event loop: keep them quick.

    Args:
        journal: As for `Transport`.
        transport: The async transport that really sends (`httpx.AsyncHTTPTransport()`).
        methods: As for `Transport`.
        delivery: As for `Transport`.
        policy: As for `Transport`.
        profile: As for `Transport`.
        redact_headers: As for `Transport`.
        fingerprint_headers: As for `Transport`.
        lease_duration: As for `Transport`.
        host_id: As for `Transport`.
        key_expiry_margin: As for `Transport`.
        profile_rule: As for `Transport`.
        clock: As for `Transport`.
        sleep: How to wait between attempts: a coroutine function (`anyio.sleep`).
        hooks: Plain or async functions called with every event.
        retry_idempotent_methods: As for `Transport`.
        max_response_bytes: As for `Transport`.
        policies: As for `Transport`.
    """

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
        host_id: str | None = None,
        key_expiry_margin: float | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Awaitable[object]] = anyio.sleep,
        hooks: Iterable[AsyncHook] = (),
        retry_idempotent_methods: bool = False,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        profile_rule: ProfileRule = "stored",
        policies: Mapping[str, RetryPolicy] | None = None,
    ) -> None:
        if transport is not None and not _is_transport(transport, "handle_async_request"):
            raise TypeError(
                "transport must be an httpx.AsyncBaseTransport or an httpx2.AsyncBaseTransport,"
                f" not {type(transport).__name__}"
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
            host_id=host_id,
            key_expiry_margin=key_expiry_margin,
            clock=clock,
            sleep=sleep,
            hooks=hooks,
            retry_idempotent_methods=retry_idempotent_methods,
            max_response_bytes=max_response_bytes,
            profile_rule=profile_rule,
            policies=policies,
        )
        self.transport: httpx.AsyncBaseTransport | Any = (
            transport if transport is not None else httpx.AsyncHTTPTransport()
        )
        self._default_transport = transport is None
        self._httpx2_transport: Any = None
        self._sleep = sleep

    def _inner(self, httpx2_request: bool) -> Any:
        if httpx2_request and self._default_transport:
            if self._httpx2_transport is None:
                self._httpx2_transport = _httpx2.httpx2_module().AsyncHTTPTransport()
            return self._httpx2_transport
        return self.transport

    @overload
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response: ...
    @overload
    async def handle_async_request(self, request: _Httpx2Request) -> _Httpx2Response: ...

    async def handle_async_request(self, request: Any) -> Any:
        """Journal and send a write; pass anything else through. httpx or httpx2 alike."""
        from_httpx2 = _httpx2.is_httpx2(request)
        inner = self._inner(from_httpx2)
        if self._retried(request):
            await request.aread()
            live = _as_httpx(request)
            check_timeouts(live)
            engine, _ = self._overridden(live, journaled=False)
            if from_httpx2:
                request.headers.pop(POLICY_HEADER, None)

            async def send_read(sent: httpx.Request) -> httpx.Response:
                return await self._send(inner, sent)

            try:
                response = await arun(
                    retried_read(engine, live),
                    Held(),
                    self.journal,
                    send=send_read,
                    sleep=self._sleep,
                )
            except Exception as error:
                raise _httpx2.in_library_of(request, error)  # noqa: B904 (its cause is kept)
            if response.has_redirect_location and not response.is_stream_consumed:
                try:
                    await aread_redirect(response, live, self._engine.clock)
                except Exception as error:
                    raise _httpx2.in_library_of(request, error)  # noqa: B904 (its cause is kept)
            if from_httpx2:
                try:
                    await response.aread()
                except Exception as error:
                    raise _httpx2.in_library_of(request, error)  # noqa: B904 (its cause is kept)
                finally:
                    await response.aclose()
            return _returned(response, request)
        if not self._journaled(request):
            request.headers.pop(POLICY_HEADER, None)  # ours, never the server's
            if from_httpx2 == _httpx2.is_httpx2(inner):
                return await inner.handle_async_request(request)
            await request.aread()
            response = await self._send(inner, _as_httpx(request))
            try:
                await response.aread()  # converted to the request's library: read whole
            finally:
                await response.aclose()
            return _returned(response, request)
        await request.aread()
        live = _as_httpx(request)
        call, engine = self._call(live)
        if from_httpx2:
            request.headers.pop(DELIVERY_HEADER, None)
            request.headers.pop(POLICY_HEADER, None)
        held = Held()

        async def send(sent: httpx.Request) -> httpx.Response:
            return await self._send(inner, sent)

        try:
            response = await arun(
                engine.call(call, self._build(live), held),
                held,
                self.journal,
                send=send,
                sleep=self._sleep,
            )
        except Exception as error:
            raise _httpx2.in_library_of(request, error)  # noqa: B904 (its cause is kept)
        return _returned(response, request)

    async def _send(self, inner: Any, request: httpx.Request) -> httpx.Response:
        """`Transport._send`, async."""
        await alast_hook(request)
        if _httpx2.is_httpx2(inner):
            try:
                answer = await inner.handle_async_request(_httpx2.to_httpx2_request(request))
            except Exception as error:
                raise _httpx2.to_httpx_error(error) from error
            return _httpx2.unread_response(answer, request, asynchronous=True)
        response: httpx.Response = await inner.handle_async_request(request)
        return response

    async def aclose(self) -> None:
        await self.transport.aclose()
        if self._httpx2_transport is not None:
            await self._httpx2_transport.aclose()
        if self._owns_journal:
            # In a thread: closing a PostgreSQL journal's pool waits for its workers.
            await anyio.to_thread.run_sync(self.journal.close)


def _is_transport(transport: object, method: str) -> bool:
    base = httpx.BaseTransport if method == "handle_request" else httpx.AsyncBaseTransport
    return isinstance(transport, base) or (
        _httpx2.is_httpx2(transport) and callable(getattr(transport, method, None))
    )


def _as_httpx(request: Any) -> httpx.Request:
    """The request the flow sees: the live httpx request, or an httpx copy of an httpx2 one."""
    return _httpx2.to_httpx_request(request) if _httpx2.is_httpx2(request) else request


def _returned(response: httpx.Response, request: Any) -> Any:
    """The answer in the library of the request it answers."""
    if _httpx2.is_httpx2(request):
        return _httpx2.to_httpx2_response(response, request)
    return response
