"""The one core the sync and async sessions share.

It decides (through :func:`idempotently._policy.decide`) and persists to the
journal (SQLite is synchronous in both worlds); its callers (the sessions in
``_session.py``, the transports in ``_transport.py``) only supply how to send
and how to sleep.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Generator, Sequence
from contextlib import suppress
from typing import Any, Literal

import attrs
import httpx
import tenacity as _t

from idempotently._exceptions import (
    RESUME_HINT,
    ErrorContext,
    IdempotentlyError,
    InvalidKeyError,
    JournalError,
    KeyReuseError,
    NeedsReconcileError,
    OperationAbandonedError,
    OperationInProgressError,
    OperationPendingError,
    RetryLaterError,
)
from idempotently._journal import AttemptRecord, Journal, NewOperation, Operation, Status
from idempotently._keys import (
    fingerprint,
    journaled_request_headers,
    journaled_response_headers,
    new_key,
    new_operation_id,
    redaction_set,
)
from idempotently._policy import (
    Action,
    CallState,
    Decision,
    Delivery,
    Outcome,
    RetryPolicy,
    decide,
    error_outcome,
)
from idempotently._profiles import BUILTIN_PROFILES, GENERIC, ServerProfile

logger = logging.getLogger("idempotently")

DEFAULT_LEASE_DURATION = 60.0
DEFAULT_KEY_EXPIRY_MARGIN = 3600.0
EXTENSION = "idempotently"
"""``response.extensions[EXTENSION]`` holds the :class:`Receipt`."""

_HOST = socket.gethostname()

RECONCILE_HINT = (
    "it will not be resent: look the object up on the server and settle it with "
    "Session.resume(reconciler=...)"
)
ABANDON_HINT = "check whether it arrived; a new operation_id sends it once more"

BuildRequest = Callable[[str, str, Sequence[tuple[str, str]], bytes], httpx.Request]
ResumeFlow = Generator["Flight | Operation | ResumeResult", Any, None]
Send = Callable[[httpx.Request], httpx.Response]
"""Sends one attempt and returns its response with the body read."""
AsyncSend = Callable[[httpx.Request], Awaitable[httpx.Response]]


@attrs.frozen
class Receipt:
    """What idempotently knows about a returned response.

    Found at ``response.extensions["idempotently"]``.
    """

    operation_id: str
    key: str
    attempts: int
    """Attempts journaled for the operation so far, across calls and restarts."""
    replayed: bool
    """The server marked the final answer as a replay of a stored response."""
    replayed_locally: bool
    """Returned from the journal without any network call."""


def new_lease_owner() -> str:
    return f"{_HOST}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def lease_owner_alive(owner: str) -> bool:
    """False only when the owner is provably gone: a dead process on this host."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != _HOST or not pid_text.isdigit():
        return True
    pid = int(pid_text)
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@attrs.frozen
class ResumeResult:
    """What resume did with one operation."""

    operation_id: str
    key: str
    status: Status
    """The operation's status in the journal afterwards."""
    action: str
    """``succeeded``, ``failed``, ``still_pending``, ``waiting``, ``leased``,
    ``needs_reconcile``, ``abandoned``, ``reconciled``, ``skipped``; with
    ``dry_run``: ``would_send``, ``would_wait``, ``would_skip_leased``,
    ``would_abandon``, ``would_need_reconcile`` or ``would_reconcile``."""
    detail: str
    status_code: int | None = None
    replayed: bool = False

    @classmethod
    def of(
        cls,
        operation: Operation,
        status: Status,
        action: str,
        detail: str | None,
        status_code: int | None = None,
        replayed: bool = False,
    ) -> ResumeResult:
        return cls(
            operation.operation_id,
            operation.key,
            status,
            action,
            detail or "",
            status_code,
            replayed,
        )

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class Settlement:
    """A reconciler's verdict: what really happened to a needs_reconcile operation.

    ``succeeded`` with the object it found (as a response, optional), or
    ``failed`` when it is sure the operation never took effect.
    """

    status: Literal["succeeded", "failed"]
    note: str
    response: httpx.Response | None = None


@attrs.frozen
class Step:
    """The result of one attempt, as tenacity carries it between attempts."""

    decision: Decision
    response: httpx.Response | None = None
    error: httpx.TransportError | None = None


@attrs.define
class Engine:
    """A session's configuration and its journal; starts flights."""

    journal: Journal
    policy: RetryPolicy = attrs.field(factory=RetryPolicy)
    profile: ServerProfile = GENERIC
    clock: Callable[[], float] = time.time
    rand: Callable[[], float] = random.random
    redact_headers: frozenset[str] = attrs.field(factory=redaction_set)
    fingerprint_headers: tuple[str, ...] = ()
    lease_duration: float = DEFAULT_LEASE_DURATION
    key_expiry_margin: float = DEFAULT_KEY_EXPIRY_MARGIN
    owner: str = attrs.field(factory=new_lease_owner)

    # -- starting a call -------------------------------------------------------

    def prepare(
        self,
        request: httpx.Request,
        build: BuildRequest,
        *,
        operation_id: str | None,
        key: str | None,
        delivery: Delivery,
        deadline_at: float | None,
    ) -> Flight | httpx.Response:
        """Journal the operation (or find it) before anything is sent.

        Returns the stored response when the operation is already settled.
        ``request.content`` must already be read.
        """
        if key is not None:
            try:
                self.profile.validate_key(key)
            except InvalidKeyError as error:
                error.operation_id = operation_id
                raise
        if delivery not in ("exactly_once", "at_most_once"):
            raise ValueError(f"delivery must be 'exactly_once' or 'at_most_once', not {delivery!r}")
        body = request.content
        print_ = fingerprint(
            request.method, request.url, body, request.headers, self.fingerprint_headers
        )
        for _ in range(3):  # a concurrent caller may insert between our find and insert
            # A call with neither id nor key is new by construction: no lookup.
            existing = None
            if operation_id is not None or key is not None:
                existing = self.journal._find(operation_id, key)
            if existing is not None:
                return self._continue(existing, request, build, print_, operation_id, key)
            new_id = operation_id or new_operation_id()
            new_key_ = key or new_key()
            request.headers[self.profile.key_header] = self.profile.render_key(new_key_)
            now = self.clock()
            operation = NewOperation(
                operation_id=new_id,
                key=new_key_,
                delivery=delivery,
                method=request.method,
                url=str(request.url),
                request_headers=journaled_request_headers(request.headers, self.redact_headers),
                request_body=body,
                fingerprint=print_,
                profile=self.profile.name,
                key_header=self.profile.key_header,
                created_at=now,
                key_expires_at=now + self.profile.key_lifetime,
                deadline_at=deadline_at,
            )
            if self._journal_call(
                new_id,
                new_key_,
                self.journal._insert_operation,
                operation,
                owner=self.owner,
                lease_until=now + self.lease_duration,
            ):
                logger.debug("operation %s: key %s journaled", new_id, new_key_)
                return Flight(self, new_id, new_key_, delivery, request, deadline_at, 0)
        raise OperationInProgressError(
            "another caller keeps creating this operation at the same moment; try again",
            operation_id=operation_id,
            key=key,
        )

    def _continue(
        self,
        operation: Operation,
        live: httpx.Request,
        build: BuildRequest,
        print_: str,
        operation_id: str | None,
        key: str | None,
    ) -> Flight | httpx.Response:
        ids: ErrorContext = {"operation_id": operation.operation_id, "key": operation.key}
        if operation_id is not None and operation.operation_id != operation_id:
            raise KeyReuseError(
                f"idempotency key {key!r} already belongs to operation "
                f"{operation.operation_id!r}; use a new key for a new operation",
                **ids,
            )
        if key is not None and operation.key != key:
            raise KeyReuseError(
                f"operation {operation_id!r} was journaled with another key; "
                "pass the same idempotency_key, or none",
                **ids,
            )
        if operation.fingerprint != print_:
            raise KeyReuseError(
                f"operation {operation.operation_id!r} was first sent as "
                f"{operation.method} {operation.url} with another payload; nothing was sent. "
                "Use a new operation_id for a different request",
                **ids,
            )
        if operation.status != "pending":
            return self.settled(operation, build)
        request = self.rebuild(operation, build, live=live)
        return self.resume_flight(operation, request)

    def blocker(self, operation: Operation, *, resuming: bool) -> tuple[str, str] | None:
        """Why a pending operation cannot be sent now, as (kind, reason); None if it can.

        Kinds: ``leased`` (another live sender), ``abandon`` (at-most-once that
        may have gone out), ``expired`` (key may be forgotten), ``deadline``
        (its own deadline passed), ``waiting`` (not_before in the future).
        """
        now = self.clock()
        owner = operation.lease_owner
        if (
            owner is not None
            and owner != self.owner
            and operation.lease_until > now
            and lease_owner_alive(owner)
        ):
            return "leased", (
                f"another caller ({owner}) is sending this operation; "
                f"its lease runs until {_iso(operation.lease_until)}: let it finish, or "
                "call again (or resume) after that"
            )
        if operation.delivery == "at_most_once" and (resuming or owner is not None):
            return "abandon", (
                "an at-most-once operation whose send may have gone out is never resent"
            )
        if now > operation.key_expires_at - self.key_expiry_margin:
            return "expired", (
                f"the key was created at {_iso(operation.created_at)} and the server may have "
                f"forgotten it (key lifetime "
                f"{operation.key_expires_at - operation.created_at:g}s, safety margin "
                f"{self.key_expiry_margin:g}s): resending could act twice; look the object "
                "up and settle it"
            )
        if operation.deadline_at is not None and now > operation.deadline_at:
            return "deadline", (
                f"the operation's own deadline ({_iso(operation.deadline_at)}) has passed"
            )
        if operation.not_before is not None and operation.not_before > now:
            return "waiting", (f"the server asked not to retry before {_iso(operation.not_before)}")
        return None

    def resume_flight(
        self, operation: Operation, request: httpx.Request, *, resuming: bool = False
    ) -> Flight:
        """Take the lease on a pending operation, or raise why it cannot go now."""
        ids: ErrorContext = {"operation_id": operation.operation_id, "key": operation.key}
        blocked = self.blocker(operation, resuming=resuming)
        if blocked is not None:
            kind, reason = blocked
            if kind == "leased":
                raise OperationInProgressError(reason, **ids)
            if kind == "waiting":
                assert operation.not_before is not None
                raise RetryLaterError(
                    f"{reason}; {RESUME_HINT}", not_before=operation.not_before, **ids
                )
            if kind == "abandon":
                self._settle_without_attempt(operation, "abandoned", reason)
                raise OperationAbandonedError(f"{reason}; {ABANDON_HINT}", **ids)
            self._settle_without_attempt(operation, "needs_reconcile", reason)
            raise NeedsReconcileError(f"{reason}; {RECONCILE_HINT}", **ids)
        now = self.clock()
        if not self._journal_call(
            operation.operation_id,
            operation.key,
            self.journal._take_lease,
            operation,
            owner=self.owner,
            lease_until=now + self.lease_duration,
            now=now,
        ):
            raise OperationInProgressError(
                "another caller took this operation's lease first: let it finish, or call "
                "again (or resume) later",
                **ids,
            )
        flight = Flight(
            self,
            operation.operation_id,
            operation.key,
            operation.delivery,  # type: ignore[arg-type]
            request,
            operation.deadline_at,
            operation.attempt_count,
        )
        flight.profile = self.profile_for(operation)
        return flight

    def profile_for(self, operation: Operation) -> ServerProfile:
        """The profile an operation was journaled under, to read its answers with.

        The session's own when the names match (it may be a custom variant),
        else the built-in of that name, else the session's.
        """
        if operation.profile == self.profile.name:
            return self.profile
        return BUILTIN_PROFILES.get(operation.profile, self.profile)

    # -- resume --------------------------------------------------------------------

    def resume_queue(self, *, include_needs_reconcile: bool) -> list[Operation]:
        """Pending operations, oldest first; needs_reconcile ones too for a reconciler."""
        statuses: list[Status] = ["pending"]
        if include_needs_reconcile:
            statuses.append("needs_reconcile")
        return self.journal.operations(status=statuses, newest_first=False)

    def resume_flow(
        self, build: BuildRequest, *, dry_run: bool, base_url: str | None, reconciling: bool
    ) -> ResumeFlow:
        """Resume as a sans-I/O flow the sync and async drivers step through.

        It yields a :class:`Flight` to send (send back the response, or the
        error that ended it), an :class:`Operation` to reconcile (send back
        the reconciler's ``Settlement`` or None), and each
        :class:`ResumeResult` as it is known (send back None).
        """
        for operation in self.resume_queue(include_needs_reconcile=reconciling):
            if dry_run:
                yield self.plan(operation)
                continue
            result = self.start_resume(operation, build, base_url)
            if isinstance(result, Flight):
                outcome = yield result
                if isinstance(outcome, httpx.Response):
                    result = self.result_of_response(operation, outcome)
                else:
                    result = self.result_of_error(operation, outcome)
            if reconciling and result.status == "needs_reconcile":
                current = self.journal.operation(operation.operation_id) or operation
                result = self.settle(current, (yield current)) or result
            yield result

    def plan(self, operation: Operation) -> ResumeResult:
        """What resume would do with this operation, without doing it (--dry-run)."""
        if operation.status != "pending":
            return ResumeResult.of(operation, operation.status, "would_reconcile", operation.reason)
        blocked = self.blocker(operation, resuming=True)
        if blocked is None:
            return ResumeResult.of(operation, "pending", "would_send", "would resend its key")
        kind, reason = blocked
        return ResumeResult.of(operation, "pending", _PLANNED_ACTIONS[kind], reason)

    def start_resume(
        self, operation: Operation, build: BuildRequest, base_url: str | None
    ) -> Flight | ResumeResult:
        """Lease a pending operation for resending, or say why it is not sent."""
        if operation.status != "pending":
            return ResumeResult.of(operation, operation.status, "skipped", operation.reason)
        request = self.rebuild(operation, build, base_url=base_url)
        try:
            return self.resume_flight(operation, request, resuming=True)
        except IdempotentlyError as error:
            return self.result_of_error(operation, error)

    def result_of_error(self, operation: Operation, error: BaseException) -> ResumeResult:
        """A resume outcome from the error a flight (or its start) raised."""
        response = getattr(error, "response", None)
        code = None if response is None else response.status_code
        message = getattr(error, "message", str(error))
        if isinstance(error, RetryLaterError):
            return ResumeResult.of(operation, "pending", "waiting", message, code)
        if isinstance(error, OperationInProgressError):
            return ResumeResult.of(operation, "pending", "leased", message, code)
        if isinstance(error, OperationPendingError):
            return ResumeResult.of(operation, "pending", "still_pending", message, code)
        if isinstance(error, NeedsReconcileError):
            return ResumeResult.of(operation, "needs_reconcile", "needs_reconcile", message, code)
        if isinstance(error, OperationAbandonedError):
            return ResumeResult.of(operation, "abandoned", "abandoned", message, code)
        return ResumeResult.of(operation, "failed", "failed", message, code)

    def result_of_response(self, operation: Operation, response: httpx.Response) -> ResumeResult:
        receipt = response.extensions.get(EXTENSION)
        replayed = bool(receipt and receipt.replayed)
        status: Status = "succeeded" if response.status_code < 400 else "failed"
        detail = f"{response.status_code}" + (" (replayed by the server)" if replayed else "")
        return ResumeResult.of(operation, status, status, detail, response.status_code, replayed)

    def settle(self, operation: Operation, settlement: Settlement | None) -> ResumeResult | None:
        """Record a reconciler's verdict on a needs_reconcile operation."""
        if settlement is None:
            return None
        response = settlement.response
        self._journal_call(
            operation.operation_id,
            operation.key,
            self.journal._settle,
            operation.operation_id,
            settlement.status,
            reason=f"reconciled: {settlement.note}",
            now=self.clock(),
            response_status=None if response is None else response.status_code,
            response_headers=None
            if response is None
            else journaled_response_headers(response.headers, self.redact_headers),
            response_body=None if response is None else response.content,
        )
        return ResumeResult.of(
            operation,
            settlement.status,
            "reconciled",
            settlement.note,
            None if response is None else response.status_code,
        )

    def rebuild(
        self,
        operation: Operation,
        build: BuildRequest,
        live: httpx.Request | None = None,
        base_url: str | None = None,
    ) -> httpx.Request:
        """The journaled request, byte-identical, with live credentials re-applied.

        ``base_url`` moves it to another origin (scheme, host, port), keeping path and query.
        """
        url = operation.url
        if base_url is not None:
            base = httpx.URL(base_url)
            url = str(httpx.URL(url).copy_with(scheme=base.scheme, host=base.host, port=base.port))
        request = build(operation.method, url, operation.request_headers, operation.request_body)
        if live is not None:
            for name in self.redact_headers:
                if name in live.headers:
                    request.headers[name] = live.headers[name]
        return request

    def settled(self, operation: Operation, build: BuildRequest) -> httpx.Response:
        """The stored answer of a finished operation, or the error that ended it."""
        ids: ErrorContext = {"operation_id": operation.operation_id, "key": operation.key}
        if operation.status == "needs_reconcile":
            raise NeedsReconcileError(
                f"operation needs reconciling ({operation.reason}); it is never resent: look "
                "it up on the server and settle it with Session.resume(reconciler=...), see "
                f"`idempotently show {operation.operation_id}`",
                **ids,
            )
        if operation.status == "abandoned":
            raise OperationAbandonedError(
                f"operation was abandoned ({operation.reason}); it is never sent again: check "
                "whether it arrived, and use a new operation_id to send it once more",
                **ids,
            )
        if operation.response_status is None:
            raise IdempotentlyError(
                f"operation failed before anything was sent ({operation.reason}); fix the "
                "request and send it under a new operation_id",
                **ids,
            )
        request = self.rebuild(operation, build)
        response = httpx.Response(
            operation.response_status,
            headers=list(operation.response_headers or ()),
            content=operation.response_body or b"",
            request=request,
        )
        response.extensions = {
            **response.extensions,
            EXTENSION: Receipt(
                operation_id=operation.operation_id,
                key=operation.key,
                attempts=operation.attempt_count,
                replayed=False,
                replayed_locally=True,
            ),
        }
        return response

    def _settle_without_attempt(self, operation: Operation, status: Status, reason: str) -> None:
        self._journal_call(
            operation.operation_id,
            operation.key,
            self.journal._set_status,
            operation.operation_id,
            status,
            reason=reason,
            now=self.clock(),
        )

    def _journal_call(
        self,
        operation_id: str | None,
        key: str | None,
        write: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """A journal write whose error names the operation it was for."""
        try:
            return write(*args, **kwargs)
        except IdempotentlyError as error:
            error.operation_id = error.operation_id or operation_id
            error.key = error.key or key
            raise


class Flight:
    """One call's attempts at one operation, from lease to settlement."""

    def __init__(
        self,
        engine: Engine,
        operation_id: str,
        key: str,
        delivery: Delivery,
        request: httpx.Request,
        deadline_at: float | None,
        attempts_before: int,
    ) -> None:
        self.engine = engine
        self.profile = engine.profile
        self.operation_id = operation_id
        self.key = key
        self.request = request
        self.delivery = delivery
        self.deadline_at = deadline_at
        self.attempts_before = attempts_before
        self.started_at = engine.clock()
        self.attempts = 0
        self.in_progress_answers = 0
        self._attempt_started = self.started_at
        self._settled = False

    # tenacity strategies: the decisions were made in on_response/on_error.
    @staticmethod
    def retry(state: _t.RetryCallState) -> bool:
        outcome = state.outcome
        if outcome is None or outcome.failed:
            return False
        return bool(outcome.result().decision.action is Action.RETRY)

    @staticmethod
    def wait(state: _t.RetryCallState) -> float:
        assert state.outcome is not None
        return float(state.outcome.result().decision.wait)

    def retrying_options(self, sleep: Callable[[float], Any]) -> dict[str, Any]:
        return {
            "sleep": sleep,
            "stop": _t.stop_never,
            "wait": self.wait,
            "retry": self.retry,
            "reraise": True,
        }

    # The two drivers every caller (Session, Transport) shares: only the send differs.
    def fly(self, send: Send, sleep: Callable[[float], None]) -> httpx.Response:
        """Attempt until the engine settles, then return the answer or raise."""
        try:
            step: Step = _t.Retrying(**self.retrying_options(sleep))(self._attempt, send)
        finally:
            self.release()
        return self.finish(step)

    async def afly(
        self, send: AsyncSend, sleep: Callable[[float], Awaitable[None]]
    ) -> httpx.Response:
        """The async twin of :meth:`fly`."""
        try:
            step: Step = await _t.AsyncRetrying(**self.retrying_options(sleep))(
                self._aattempt, send
            )
        finally:
            self.release()
        return self.finish(step)

    def _attempt(self, send: Send) -> Step:
        request = self.begin_attempt()
        try:
            response = send(request)
        except httpx.TransportError as error:
            return self.on_error(error)
        return self.on_response(response)

    async def _aattempt(self, send: AsyncSend) -> Step:
        request = self.begin_attempt()
        try:
            response = await send(request)
        except httpx.TransportError as error:
            return self.on_error(error)
        return self.on_response(response)

    def begin_attempt(self) -> httpx.Request:
        self._attempt_started = self.engine.clock()
        self.attempts += 1
        return self.request

    def on_response(self, response: httpx.Response) -> Step:
        engine = self.engine
        profile = self.profile
        if profile.is_in_progress(response):
            self.in_progress_answers += 1
        now = engine.clock()
        decision = decide(
            engine.policy,
            profile,
            self._state(),
            now=now,
            response=response,
            rand=engine.rand,
        )
        replayed = profile.is_replay(response)
        keep = decision.action in (Action.SUCCEED, Action.FAIL, Action.RECONCILE)
        self._persist(
            decision,
            now,
            outcome=Outcome.ANSWERED,
            status_code=response.status_code,
            replayed=replayed,
            response=response if keep else None,
        )
        response.extensions = {
            **response.extensions,
            EXTENSION: Receipt(
                operation_id=self.operation_id,
                key=self.key,
                attempts=self.attempts_before + self.attempts,
                replayed=replayed,
                replayed_locally=False,
            ),
        }
        return Step(decision, response=response)

    def on_error(self, error: httpx.TransportError) -> Step:
        now = self.engine.clock()
        decision = decide(
            self.engine.policy,
            self.profile,
            self._state(),
            now=now,
            error=error,
            rand=self.engine.rand,
        )
        self._persist(
            decision,
            now,
            outcome=error_outcome(error),
            error=f"{type(error).__name__}: {error}",
        )
        return Step(decision, error=error)

    def _state(self) -> CallState:
        return CallState(
            started_at=self.started_at,
            attempts=self.attempts,
            in_progress_answers=self.in_progress_answers,
            deadline_at=self.deadline_at,
            delivery=self.delivery,
        )

    def _persist(
        self,
        decision: Decision,
        now: float,
        *,
        outcome: Outcome,
        status_code: int | None = None,
        replayed: bool = False,
        error: str | None = None,
        response: httpx.Response | None = None,
    ) -> None:
        engine = self.engine
        action = decision.action
        status: Status = _STATUS_AFTER[action]
        retrying = action is Action.RETRY
        record = AttemptRecord(
            number=self.attempts_before + self.attempts,
            started_at=self._attempt_started,
            elapsed=now - self._attempt_started,
            outcome=outcome.value,
            status_code=status_code,
            replayed=replayed,
            error=error,
            wait=decision.wait if retrying else None,
            status=status,
            reason=None if action is Action.SUCCEED else decision.reason,
            not_before=decision.not_before,
            lease_until=now + decision.wait + engine.lease_duration if retrying else 0.0,
            response_status=None if response is None else response.status_code,
            response_headers=None
            if response is None
            else journaled_response_headers(response.headers, engine.redact_headers),
            response_body=None if response is None else response.content,
        )
        engine._journal_call(
            self.operation_id,
            self.key,
            engine.journal._record_attempt,
            self.operation_id,
            record,
            now=now,
        )
        self._settled = not retrying
        log = logger.info if retrying else logger.debug
        log(
            "operation %s (key %s) attempt %d: %s -> %s%s",
            self.operation_id,
            self.key,
            self.attempts_before + self.attempts,
            decision.reason,
            action.value,
            f" in {decision.wait:.3f}s" if retrying else "",
        )

    def finish(self, step: Step) -> httpx.Response:
        """Return the final answer, or raise what the decision means."""
        decision = step.decision
        action = decision.action
        ids: ErrorContext = {
            "operation_id": self.operation_id,
            "key": self.key,
            "response": step.response,
        }
        if action in (Action.SUCCEED, Action.FAIL):
            assert step.response is not None
            return step.response
        error: IdempotentlyError
        if action is Action.FAIL_LOCALLY:
            assert step.error is not None
            _add_note(
                step.error, f"idempotently: operation {self.operation_id!r}, key {self.key!r}"
            )
            raise step.error
        if action is Action.RETRY_LATER:
            assert decision.not_before is not None
            error = RetryLaterError(
                f"{decision.reason}; not before {_iso(decision.not_before)}: {RESUME_HINT}",
                not_before=decision.not_before,
                **ids,
            )
        elif action is Action.RECONCILE:
            error = NeedsReconcileError(f"{decision.reason}; {RECONCILE_HINT}", **ids)
        elif action is Action.ABANDON:
            error = OperationAbandonedError(f"{decision.reason}; {ABANDON_HINT}", **ids)
        else:
            error = OperationPendingError(
                f"outcome unknown after {self.attempts} attempt(s) ({decision.reason}); "
                + RESUME_HINT,
                **ids,
            )
        raise error from step.error

    def release(self) -> None:
        """Give up the lease if the call ends without settling (cancelled, crashed)."""
        if not self._settled:
            # If the journal cannot take this write either, the lease simply
            # expires; the error that ended the call is the one to report.
            with suppress(JournalError):
                self.engine.journal._release_lease(self.operation_id, owner=self.engine.owner)


_PLANNED_ACTIONS = {
    "leased": "would_skip_leased",
    "abandon": "would_abandon",
    "expired": "would_need_reconcile",
    "deadline": "would_need_reconcile",
    "waiting": "would_wait",
}

_STATUS_AFTER: dict[Action, Status] = {
    Action.SUCCEED: "succeeded",
    Action.FAIL: "failed",
    Action.RETRY: "pending",
    Action.PENDING: "pending",
    Action.RETRY_LATER: "pending",
    Action.RECONCILE: "needs_reconcile",
    Action.ABANDON: "abandoned",
    Action.FAIL_LOCALLY: "failed",
}


def _add_note(error: BaseException, note: str) -> None:
    add_note = getattr(error, "add_note", None)  # Python 3.11+
    if add_note is not None:
        add_note(note)


def _iso(timestamp: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat(
        timespec="seconds"
    )
