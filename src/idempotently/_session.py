"""Session and AsyncSession: thin drivers over the shared engine.

They build the request, hand it to the engine (which journals it), then only
send and sleep; tenacity runs the loop with the engine's decisions.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import httpx

if TYPE_CHECKING:  # httpx's private modules, for annotations only
    from httpx._client import UseClientDefault
    from httpx._types import (
        CookieTypes,
        HeaderTypes,
        QueryParamTypes,
        RequestContent,
        RequestData,
        RequestExtensions,
        RequestFiles,
        TimeoutTypes,
    )

from idempotently._engine import (
    DEFAULT_KEY_EXPIRY_MARGIN,
    DEFAULT_LEASE_DURATION,
    Engine,
    Flight,
    ResumeFlow,
    ResumeResult,
    Settlement,
)
from idempotently._exceptions import IdempotentlyError, JournalError
from idempotently._journal import Journal, Operation
from idempotently._keys import redaction_set
from idempotently._policy import Delivery, RetryPolicy
from idempotently._profiles import GENERIC, ServerProfile

ClientT = TypeVar("ClientT", httpx.Client, httpx.AsyncClient)
JournalArg = str | os.PathLike[str] | Journal
Reconciler = Callable[[Operation, httpx.Client], "Settlement | None"]
AsyncReconciler = Callable[[Operation, httpx.AsyncClient], Awaitable["Settlement | None"]]
OnResult = Callable[[ResumeResult], object]
# What ends one operation's resume without ending the whole resume.
_SETTLING_ERRORS = (IdempotentlyError, httpx.TransportError)


def _advance(flow: ResumeFlow, reply: Any) -> Flight | Operation | ResumeResult | None:
    try:
        return flow.send(reply)
    except StopIteration:
        return None


def _report(result: ResumeResult, results: list[ResumeResult], on_result: OnResult | None) -> None:
    results.append(result)
    if on_result is not None:
        on_result(result)


class _SessionBase(Generic[ClientT]):
    _client_class: type[ClientT]

    def __init__(
        self,
        journal: JournalArg,
        *,
        client: ClientT | None = None,
        policy: RetryPolicy | None = None,
        profile: ServerProfile = GENERIC,
        redact_headers: Iterable[str] = (),
        fingerprint_headers: Iterable[str] = (),
        lease_duration: float = DEFAULT_LEASE_DURATION,
        key_expiry_margin: float = DEFAULT_KEY_EXPIRY_MARGIN,
        clock: Callable[[], float] = time.time,
        **client_kwargs: Any,
    ) -> None:
        if client is not None and client_kwargs:
            raise TypeError(
                f"pass either client= or httpx client options ({', '.join(client_kwargs)}), "
                "not both"
            )
        self._owns_journal = not isinstance(journal, Journal)
        self.journal = Journal(journal) if not isinstance(journal, Journal) else journal
        self._owns_client = client is None
        self.client: ClientT = client if client is not None else self._client_class(**client_kwargs)
        self.policy = policy or RetryPolicy()
        self.profile = profile
        self._engine = Engine(
            journal=self.journal,
            policy=self.policy,
            profile=profile,
            clock=clock,
            redact_headers=redaction_set(redact_headers),
            fingerprint_headers=tuple(fingerprint_headers),
            lease_duration=lease_duration,
            key_expiry_margin=key_expiry_margin,
        )

    def _build(
        self, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> httpx.Request:
        return self.client.build_request(method, url, headers=list(headers), content=body)

    def _render(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        content: RequestContent | None,
        data: RequestData | None,
        files: RequestFiles | None,
        json: Any | None,
        params: QueryParamTypes | None,
        headers: HeaderTypes | None,
        cookies: CookieTypes | None,
        timeout: TimeoutTypes | UseClientDefault,
        extensions: RequestExtensions | None,
    ) -> httpx.Request:
        return self.client.build_request(
            method,
            url,
            content=content,
            data=data,
            files=files,
            json=json,
            params=params,
            headers=headers,
            cookies=cookies,
            timeout=timeout,
            extensions=extensions,
        )

    def _prepare(
        self,
        request: httpx.Request,
        operation_id: str | None,
        idempotency_key: str | None,
        delivery: Delivery,
        deadline_at: float | None,
    ) -> Flight | httpx.Response:
        return self._engine.prepare(
            request,
            self._build,
            operation_id=operation_id,
            key=idempotency_key,
            delivery=delivery,
            deadline_at=deadline_at,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(journal={self.journal.path!r}, profile={self.profile.name!r})"
        )


class Session(_SessionBase[httpx.Client]):
    """An httpx client whose writes carry one journaled idempotency key each.

    ``Session("ops.db", base_url=..., headers=...)`` takes any ``httpx.Client``
    option; ``Session("ops.db", client=httpx.Client(...))`` wraps an existing one.
    """

    _client_class = httpx.Client

    def __init__(
        self,
        journal: JournalArg,
        *,
        sleep: Callable[[float], None] = time.sleep,
        **options: Any,
    ) -> None:
        super().__init__(journal, **options)
        self._sleep = sleep

    def post(
        self,
        url: httpx.URL | str,
        *,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
        operation_id: str | None = None,
        idempotency_key: str | None = None,
        delivery: Delivery = "exactly_once",
        deadline_at: float | None = None,
    ) -> httpx.Response:
        """POST once, whatever happens on the wire; see :meth:`request`."""
        return self.request(
            "POST",
            url,
            content=content,
            data=data,
            files=files,
            json=json,
            params=params,
            headers=headers,
            cookies=cookies,
            timeout=timeout,
            extensions=extensions,
            operation_id=operation_id,
            idempotency_key=idempotency_key,
            delivery=delivery,
            deadline_at=deadline_at,
        )

    def request(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
        operation_id: str | None = None,
        idempotency_key: str | None = None,
        delivery: Delivery = "exactly_once",
        deadline_at: float | None = None,
    ) -> httpx.Response:
        """Send one operation; return its final answer (2xx, 3xx or a final 4xx).

        The key is journaled before the first byte is sent. ``operation_id``
        makes the call repeatable across restarts: a settled operation returns
        its stored response without a network call, a pending one continues
        with its stored key. ``deadline_at`` (seconds since the epoch) is the
        operation's own deadline, kept across restarts.
        """
        request = self._render(
            method,
            url,
            content=content,
            data=data,
            files=files,
            json=json,
            params=params,
            headers=headers,
            cookies=cookies,
            timeout=timeout,
            extensions=extensions,
        )
        request.read()
        prepared = self._prepare(request, operation_id, idempotency_key, delivery, deadline_at)
        if isinstance(prepared, httpx.Response):
            return prepared
        return self._fly(prepared)

    def _fly(self, flight: Flight) -> httpx.Response:
        return flight.fly(self.client.send, self._sleep)

    def resume(
        self,
        *,
        reconciler: Reconciler | None = None,
        dry_run: bool = False,
        base_url: str | None = None,
        on_result: OnResult | None = None,
    ) -> list[ResumeResult]:
        """Re-drive every pending operation with its stored key and bytes.

        One result per operation, oldest first: sent and settled, still
        pending (waiting for ``not_before``, leased by another process, budget
        spent), abandoned (at-most-once), or needs_reconcile (key past its
        lifetime, replayed 5xx, own deadline passed). With a ``reconciler``,
        needs_reconcile operations are handed to it to settle. Credentials
        come from this session's client, never from the journal.
        """
        flow = self._engine.resume_flow(
            self._build, dry_run=dry_run, base_url=base_url, reconciling=reconciler is not None
        )
        results: list[ResumeResult] = []
        reply: Any = None
        while (step := _advance(flow, reply)) is not None:
            if isinstance(step, Flight):
                try:
                    reply = self._fly(step)
                except JournalError:
                    raise
                except _SETTLING_ERRORS as error:
                    reply = error
            elif isinstance(step, Operation):
                assert reconciler is not None
                reply = reconciler(step, self.client)
            else:
                _report(step, results, on_result)
                reply = None
        return results

    def close(self) -> None:
        if self._owns_client:
            self.client.close()
        if self._owns_journal:
            self.journal.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncSession(_SessionBase[httpx.AsyncClient]):
    """The async twin of :class:`Session`, on asyncio or trio (anyio)."""

    _client_class = httpx.AsyncClient

    def __init__(
        self,
        journal: JournalArg,
        *,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        **options: Any,
    ) -> None:
        super().__init__(journal, **options)
        self._sleep = sleep

    async def post(
        self,
        url: httpx.URL | str,
        *,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
        operation_id: str | None = None,
        idempotency_key: str | None = None,
        delivery: Delivery = "exactly_once",
        deadline_at: float | None = None,
    ) -> httpx.Response:
        """POST once, whatever happens on the wire; see :meth:`Session.request`."""
        return await self.request(
            "POST",
            url,
            content=content,
            data=data,
            files=files,
            json=json,
            params=params,
            headers=headers,
            cookies=cookies,
            timeout=timeout,
            extensions=extensions,
            operation_id=operation_id,
            idempotency_key=idempotency_key,
            delivery=delivery,
            deadline_at=deadline_at,
        )

    async def request(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        content: RequestContent | None = None,
        data: RequestData | None = None,
        files: RequestFiles | None = None,
        json: Any | None = None,
        params: QueryParamTypes | None = None,
        headers: HeaderTypes | None = None,
        cookies: CookieTypes | None = None,
        timeout: TimeoutTypes | UseClientDefault = httpx.USE_CLIENT_DEFAULT,
        extensions: RequestExtensions | None = None,
        operation_id: str | None = None,
        idempotency_key: str | None = None,
        delivery: Delivery = "exactly_once",
        deadline_at: float | None = None,
    ) -> httpx.Response:
        """Send one operation; see :meth:`Session.request`."""
        request = self._render(
            method,
            url,
            content=content,
            data=data,
            files=files,
            json=json,
            params=params,
            headers=headers,
            cookies=cookies,
            timeout=timeout,
            extensions=extensions,
        )
        await request.aread()
        prepared = self._prepare(request, operation_id, idempotency_key, delivery, deadline_at)
        if isinstance(prepared, httpx.Response):
            return prepared
        return await self._fly(prepared)

    async def _fly(self, flight: Flight) -> httpx.Response:
        return await flight.afly(self.client.send, self._sleep)

    async def resume(
        self,
        *,
        reconciler: AsyncReconciler | None = None,
        dry_run: bool = False,
        base_url: str | None = None,
        on_result: OnResult | None = None,
    ) -> list[ResumeResult]:
        """Re-drive every pending operation; see :meth:`Session.resume`."""
        flow = self._engine.resume_flow(
            self._build, dry_run=dry_run, base_url=base_url, reconciling=reconciler is not None
        )
        results: list[ResumeResult] = []
        reply: Any = None
        while (step := _advance(flow, reply)) is not None:
            if isinstance(step, Flight):
                try:
                    reply = await self._fly(step)
                except JournalError:
                    raise
                except _SETTLING_ERRORS as error:
                    reply = error
            elif isinstance(step, Operation):
                assert reconciler is not None
                reply = await reconciler(step, self.client)
            else:
                _report(step, results, on_result)
                reply = None
        return results

    async def aclose(self) -> None:
        if self._owns_client:
            await self.client.aclose()
        if self._owns_journal:
            self.journal.close()

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
