"""The one core the sync and async sessions share.

It decides (through :func:`idempotently._policy.decide`) and persists to the
journal (SQLite is synchronous in both worlds); the drivers in ``_session.py``
only send, sleep and hand the results back.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import httpx
import tenacity as _t

from idempotently._exceptions import (
    RESUME_HINT,
    ErrorContext,
    IdempotentlyError,
    InvalidKeyError,
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
from idempotently._profiles import GENERIC, ServerProfile

logger = logging.getLogger("idempotently")

DEFAULT_LEASE_DURATION = 60.0
DEFAULT_KEY_EXPIRY_MARGIN = 3600.0
EXTENSION = "idempotently"
"""``response.extensions[EXTENSION]`` holds the :class:`Receipt`."""

_HOST = socket.gethostname()

BuildRequest = Callable[[str, str, Sequence[tuple[str, str]], bytes], httpx.Request]


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

    def resume_flight(self, operation: Operation, request: httpx.Request) -> Flight:
        """Take the lease on a pending operation, or raise why it cannot go now."""
        ids: ErrorContext = {"operation_id": operation.operation_id, "key": operation.key}
        now = self.clock()
        held = (
            operation.lease_owner is not None
            and operation.lease_owner != self.owner
            and operation.lease_until > now
            and lease_owner_alive(operation.lease_owner)
        )
        if held:
            raise OperationInProgressError(
                f"another caller ({operation.lease_owner}) is sending this operation; "
                f"its lease runs until {_iso(operation.lease_until)}",
                **ids,
            )
        if operation.delivery == "at_most_once" and operation.lease_owner is not None:
            reason = "an at-most-once send was interrupted and may have been delivered"
            self._settle_without_attempt(operation, "abandoned", reason)
            raise OperationAbandonedError(reason, **ids)
        if now > operation.key_expires_at - self.key_expiry_margin:
            reason = (
                f"the key was created at {_iso(operation.created_at)} and the server may have "
                f"forgotten it by now (key lifetime {self.profile.key_lifetime:g}s): resending "
                "could act twice; look the object up and settle it"
            )
            self._settle_without_attempt(operation, "needs_reconcile", reason)
            raise NeedsReconcileError(reason, **ids)
        if operation.deadline_at is not None and now > operation.deadline_at:
            reason = f"the operation's own deadline ({_iso(operation.deadline_at)}) has passed"
            self._settle_without_attempt(operation, "needs_reconcile", reason)
            raise NeedsReconcileError(reason, **ids)
        if operation.not_before is not None and operation.not_before > now:
            raise RetryLaterError(
                f"the server asked not to retry before {_iso(operation.not_before)}; "
                + RESUME_HINT,
                not_before=operation.not_before,
                **ids,
            )
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
                "another caller took this operation's lease first", **ids
            )
        return Flight(
            self,
            operation.operation_id,
            operation.key,
            operation.delivery,  # type: ignore[arg-type]
            request,
            operation.deadline_at,
            operation.attempt_count,
        )

    def rebuild(
        self, operation: Operation, build: BuildRequest, live: httpx.Request | None = None
    ) -> httpx.Request:
        """The journaled request, byte-identical, with live credentials re-applied."""
        request = build(
            operation.method, operation.url, operation.request_headers, operation.request_body
        )
        if live is not None:
            for name in self.redact_headers:
                if name in live.headers:
                    request.headers[name] = live.headers[name]
        return request

    def settled(self, operation: Operation, build: BuildRequest) -> httpx.Response:
        """The stored answer of a finished operation, or the error that ended it."""
        ids: ErrorContext = {"operation_id": operation.operation_id, "key": operation.key}
        if operation.status == "needs_reconcile":
            raise NeedsReconcileError(f"operation needs reconciling: {operation.reason}", **ids)
        if operation.status == "abandoned":
            raise OperationAbandonedError(f"operation was abandoned: {operation.reason}", **ids)
        if operation.response_status is None:
            raise IdempotentlyError(f"operation failed: {operation.reason}", **ids)
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

    def begin_attempt(self) -> httpx.Request:
        self._attempt_started = self.engine.clock()
        self.attempts += 1
        return self.request

    def on_response(self, response: httpx.Response) -> Step:
        engine = self.engine
        if engine.profile.is_in_progress(response):
            self.in_progress_answers += 1
        now = engine.clock()
        decision = decide(
            engine.policy,
            engine.profile,
            self._state(),
            now=now,
            response=response,
            rand=engine.rand,
        )
        replayed = engine.profile.is_replay(response)
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
            self.engine.profile,
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
            error = NeedsReconcileError(decision.reason, **ids)
        elif action is Action.ABANDON:
            error = OperationAbandonedError(decision.reason, **ids)
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
            self.engine.journal._release_lease(self.operation_id, owner=self.engine.owner)


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
