"""What the flows share about one operation: the types a flow holds and returns, and
the helpers every use case asks (is it blocked, rebuild its request, its stored answer).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import attrs
import httpx

from idempotently._codec import Codec
from idempotently._commands import (
    RebaseOperation,
    Record,
    Release,
    SetStatus,
    assert_never,
)
from idempotently._exceptions import (
    RESUME_HINT,
    AnswerNotReadError,
    ErrorContext,
    IdempotentlyError,
    NeedsReconcileError,
    NoStoredAnswerError,
    OperationAbandonedError,
    OperationInProgressError,
    RequestNotSentError,
    RetryLaterError,
    StoredProfileError,
)
from idempotently._flow._config import Config
from idempotently._flow._leases import (
    in_flight,
    lease_owner_alive,
    mark_in_flight,
    unmark_in_flight,
)
from idempotently._policy import (
    CallState,
    Decision,
    key_born_at,
    key_expiry_margin,
    key_past_margin,
    may_have_been_delivered,
    never_sent,
)
from idempotently._profiles import (
    ServerProfile,
    stored_profile,
)
from idempotently._rows import AttemptRecord, Operation, answered_by
from idempotently._secret_params import (
    MissingParams,
    reapplied_url,
    values_in_url,
)
from idempotently._text import storable_text
from idempotently._vocabulary import (
    AnsweredBy,
    Blocker,
    Delivery,
    ResumeAction,
    Status,
)

if TYPE_CHECKING:
    from idempotently._commands_rare import Command

T = TypeVar("T")


Flow = Generator["Command", Any, T]  # named, not evaluated: `Command` loads when used


EXTENSION = "idempotently"
"""``response.extensions[EXTENSION]`` holds the `Receipt`."""


SETTLED_REASONS = ("settled ", "reconciled: ")
"""How the reason of an operation an operator or a reconciler settled begins."""


def json_text(value: object) -> str:
    import json

    return json.dumps(value, sort_keys=True)


RECONCILE_HINT = (
    "it will not be resent: look the object up on the server and settle it with "
    "Session.resume(reconciler=...) (idempotently.Lookup looks it up for you), or "
    "`idempotently reconcile --lookup URL`, or by hand with `idempotently settle` or `fork`"
)


ABANDON_HINT = "check whether it arrived; a new operation_id sends it once more"


BuildRequest = Callable[[str, httpx.URL, list[tuple[bytes, bytes]], bytes], httpx.Request]
"""Builds a request from its journaled parts (the client's defaults re-applied)."""


@attrs.frozen
class Receipt:
    """What idempotently knows about a returned response.

    Found at ``response.extensions["idempotently"]``.
    """

    operation_id: str
    """The operation's id."""
    key: str
    """The operation's idempotency key."""
    attempts: int
    """Attempts journaled for the operation so far, across calls and restarts."""
    replayed: bool
    """The server marked the final answer as a replay of a stored response."""
    replayed_locally: bool
    """Returned from the journal without any network call."""
    answered_by: AnsweredBy = "server"
    """Whose answer this is: ``"server"`` (the server's answer to this request),
    ``"lookup"`` (the object a lookup found, with the status of the lookup's GET and its
    URL as ``Content-Location``: not the create's answer) or ``"reconciler"`` (the
    response a reconciler of your own settled the operation with)."""


@attrs.frozen
class ResumeResult:
    """What resume did with one operation."""

    operation_id: str
    """The operation's id."""
    key: str
    """The operation's idempotency key."""
    status: Status
    """The operation's status in the journal afterwards."""
    action: ResumeAction
    """What happened: ``succeeded``, ``failed``, ``still_pending``, ``unresolved``,
    ``not_sent``, ``waiting``, ``leased``, ``needs_reconcile``, ``abandoned``,
    ``reconciled``, ``skipped``; with ``dry_run``: ``would_send``, ``would_wait``,
    ``would_skip_leased``, ``would_abandon``, ``would_need_reconcile`` or
    ``would_reconcile``."""
    detail: str
    """What happened or what to do about it, in words (the error, the server's hint, which
    option to pass)."""
    status_code: int | None = None
    """The HTTP status of the last answer this resume got, or None."""
    replayed: bool = False
    """That answer was the server's stored one for this key (a replay)."""

    @classmethod
    def of(
        cls,
        operation: Operation,
        status: Status,
        action: ResumeAction,
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

    status: Literal["succeeded", "failed"] = attrs.field(
        validator=attrs.validators.in_(("succeeded", "failed"))
    )
    """`succeeded`: it took effect (the object was found); `failed`: it surely never did."""
    note: str
    """Why, in words: journaled as the operation's reason and shown by `show`."""
    response: httpx.Response | None = None
    """The object found, as an `httpx.Response`, stored as the operation's answer (None: none
    stored)."""


@attrs.define
class Held:
    """What a running flow holds, so that its driver can clean up if the flow ends
    early (cancelled, interrupted, a journal error)."""

    lease: tuple[str, str] | None = None
    """(operation_id, owner)"""
    owners: list[str] = attrs.Factory(list)
    """The lease owners this flow made: in flight until the driver calls `end`."""
    interrupted: tuple[str, str, str | None, float, Delivery] | None = None
    """While an attempt is being sent: (operation_id, key, owner, started_at, delivery)
    of the attempt to journal if it never returns (it may have been delivered), which
    also releases the lease; the record itself (`interrupted_attempt`) is built
    only then, not before every send."""
    lease_until: float = 0.0
    """When the lease this flow last wrote runs out (by the engine's clock)."""

    def take(self, operation_id: str, owner: str) -> None:
        """This flow is about to hold (or try to take) the operation's lease as ``owner``."""
        mark_in_flight(owner)
        self.owners.append(owner)
        self.lease = (operation_id, owner)

    def end(self) -> None:
        """The flow has ended: its owners are no longer in flight."""
        for owner in self.owners:
            unmark_in_flight(owner)
        self.owners.clear()

    def recorded(self, record: Record) -> None:
        """A Record of this flow is in the journal: nothing to journal for it if we stop
        now, and no lease to release once it released it (the driver calls this as soon
        as the write returns, before a cancellation can be delivered)."""
        self.interrupted = None
        if record.record.lease_until == 0:
            self.lease = None

    def cleanup(self) -> Record | Release | None:
        """The journal command that leaves things right after an early end."""
        if self.interrupted is not None:
            return interrupted_attempt(*self.interrupted)
        if self.lease is not None:
            return Release(*self.lease)
        return None


def interrupted_attempt(
    operation_id: str, key: str, owner: str | None, started: float, delivery: Delivery
) -> Record:
    """The record of an attempt whose send never returned (cancelled, interrupted)."""
    return Record(
        operation_id,
        AttemptRecord(
            started_at=started,
            elapsed=0.0,
            outcome="maybe_delivered",
            error="interrupted while sending: it may have been delivered",
            status="abandoned" if delivery == "at_most_once" else "pending",
            reason=(
                "interrupted while sending an at-most-once operation: it may have been "
                "delivered, so it is never resent"
                if delivery == "at_most_once"
                else "interrupted while sending; the key makes a resend safe"
            ),
        ),
        started,
        owner,
        key,
    )


@attrs.frozen
class Call:
    """One call's request and what its caller said about it (already validated)."""

    request: httpx.Request
    """Rendered, its body read."""
    operation_id: str | None = None
    key: str | None = None
    keep_journaled_key: bool = False
    """A named operation keeps the key it was first sent with, whatever ``key`` says
    (an SDK that draws a fresh key on every call, behind a Transport)."""
    delivery: Delivery = "exactly_once"
    deadline_at: float | None = None
    new_operation_id: str | None = None
    """The id a new operation gets when ``operation_id`` is None (else a random one)."""
    overrides: str | None = None
    """The call's own policy and timeouts, journaled (``_overrides.py``) for resume."""
    group: str | None = None
    """The operation group it is a step of (``_groups.py``), or None."""


@attrs.frozen
class End:
    """How an operation's attempts ended this time."""

    operation_id: str
    key: str
    decision: Decision
    attempts: int
    """Attempts journaled for the operation so far."""
    response: httpx.Response | None = None
    error: BaseException | None = None
    unkept: str | None = None
    """Why the final answer's body was not kept (too large, too slow), if it was not:
    the operation is journaled with its status and headers only."""


UNREADABLE_ROW = (Exception,)
"""What a journaled value that cannot be used raises while its operation is resumed (an
OverflowError, a URL httpx cannot parse, a JSON or Unicode error...): that operation is
reported, the resume goes on. So is the codec's failure on that operation's body or
answer (a `CodecError`). Any other `IdempotentlyError` is a verdict (the journal's own
failure included), never a damaged row: it is raised as before."""


def _blocker_error(operation: Operation, kind: Blocker, reason: str) -> IdempotentlyError:
    ids = _ids(operation)
    if kind == "waiting" and operation.not_before is not None:
        return RetryLaterError(f"{reason}; {RESUME_HINT}", not_before=operation.not_before, **ids)
    if kind == "abandon":
        return OperationAbandonedError(f"{reason}; {ABANDON_HINT}", **ids)
    if kind == "leased":
        return OperationInProgressError(reason, **ids)
    return NeedsReconcileError(f"{reason}; {RECONCILE_HINT}", **ids)


def _ids(operation: Operation) -> ErrorContext:
    return {"operation_id": operation.operation_id, "key": operation.key}


def _iso(timestamp: float) -> str:
    try:
        moment = datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return f"{timestamp:g} (seconds since the epoch)"
    return moment.isoformat(timespec="seconds")


def codec_of(engine: Config, operation: Operation) -> Codec | None:
    """The codec an answer to ``operation`` is stored with: the journal's, when the
    row's bodies are encoded (it was read, so with this codec); None for a row in clear."""
    return engine.codec if operation.codec is not None else None


def state_of(engine: Config, operation: Operation, started: float, *, resuming: bool) -> CallState:
    """A new call's state, from what the journal knows of the operation's attempts."""
    profile = profile_for(engine, operation)
    in_progress_since = None
    for attempt in operation.attempts:
        if attempt.status_code in profile.in_progress_statuses:
            in_progress_since = in_progress_since or attempt.started_at
        else:
            in_progress_since = None
    return CallState(
        started_at=started,
        deadline_at=operation.deadline_at,
        delivery=operation.delivery,
        # An operation picked up again (resume, or a second call with its id) whose
        # first attempt left no record may have been delivered: a final 4xx is then
        # no proof that nothing happened.
        acted=may_have_been_delivered(operation),
        in_progress_since=in_progress_since,
        resuming=resuming,
    )


def missing_params(engine: Config, operation: Operation) -> list[str]:
    """The redacted query parameters of ``operation`` that a resume has no value for."""
    if not operation.secret_params:
        return []
    source = engine.param_values
    return [
        name for name in json.loads(operation.secret_params) if source is None or not source(name)
    ]


def blocker_of(
    engine: Config, operation: Operation, *, resuming: bool = False, claimed_by: str | None = None
) -> tuple[Blocker, str] | None:
    """Why a pending operation cannot be sent now, and the reason; None if it can.

    A lease held by ``claimed_by`` (a resume worker's claim) is no blocker."""
    now = engine.clock()
    owner = operation.lease_owner
    if (
        owner is not None
        and owner != claimed_by
        and (operation.lease_until > now or in_flight(owner))
        and lease_owner_alive(owner, engine.host_id)
    ):
        return "leased", (
            f"another caller ({owner}) is sending this operation; "
            f"its lease runs until {_iso(operation.lease_until)}: let it finish, or "
            "call again (or resume) after that"
        )
    if (
        operation.delivery == "at_most_once"
        # Enqueued (or forked) and never sent: nothing went out, so it is sent.
        and not never_sent(operation)
        and (resuming or owner is not None or may_have_been_delivered(operation))
    ):
        return "abandon", (
            "an at-most-once operation whose send may have gone out is never resent"
            + (
                " (its first attempt left no record, so it may have been sent)"
                if operation.attempt_count == 0
                else ""
            )
        )
    margin = expiry_margin(engine, operation)
    if key_past_margin(operation, now, margin):
        born = key_born_at(operation)
        return "expired", (
            f"the key was {'first sent' if born != operation.created_at else 'created'} at "
            f"{_iso(born)} and the server may have forgotten it (key lifetime "
            f"{operation.key_expires_at - born:g}s, safety margin "
            f"{margin:g}s): resending could act twice; look the object "
            "up and settle it"
        )
    if operation.deadline_at is not None and now > operation.deadline_at:
        return "deadline", (
            f"the operation's own deadline ({_iso(operation.deadline_at)}) has passed"
        )
    if operation.not_before is not None and operation.not_before > now:
        return "waiting", f"the server asked not to retry before {_iso(operation.not_before)}"
    return None


def expiry_margin(engine: Config, operation: Operation) -> float:
    """The key-expiry margin for ``operation``: its profile's (journaled), or this
    engine's given one when larger (`_policy.key_expiry_margin`)."""
    try:
        profile: ServerProfile | None = profile_for(engine, operation)
    except StoredProfileError:
        profile = None
    return key_expiry_margin(operation, profile, engine.key_expiry_margin)


def times_from_now(engine: Config, operation: Operation) -> Flow[Operation]:
    """The operation with its not_before and lease counted from our now, in the
    journal, when the clock that wrote them (its ``updated_at``) was ahead of ours: a
    server's "not before 5 s", or a 60 s lease, from a host ten years fast is 5 s (60
    s) from when we first see it, as an origin pause is (`_origin_pause`). A live
    owner's heartbeat writes its lease again (and its own now) every third of it, so
    it keeps it as it would with clocks in step."""
    now = engine.clock()
    if not operation.updated_at > now or not (
        (operation.not_before or 0.0) > now or operation.lease_until > now
    ):
        return operation
    rebased = yield RebaseOperation(operation.operation_id, operation.updated_at, now)
    if rebased is None:
        return operation  # changed meanwhile: what was read decides, as before
    not_before, lease_until = rebased
    return attrs.evolve(operation, not_before=not_before, lease_until=lease_until, updated_at=now)


def apply_blocker(engine: Config, operation: Operation, kind: Blocker, reason: str) -> Flow[Status]:
    """Journal what a blocker means for the operation; return its status."""
    status: Status = "pending"
    if kind == "abandon":
        status = "abandoned"
    elif kind in ("expired", "deadline"):
        status = "needs_reconcile"
    if status != "pending":
        yield SetStatus(operation.operation_id, status, storable_text(reason), engine.clock())
    return status


def profile_for(engine: Config, operation: Operation) -> ServerProfile:
    """The profile an operation was journaled under, to read its answers with.

    Its journaled spec (or the built-in it named), read as ``profile_rule`` says;
    a row written before profiles were stored (a bare name that is no built-in) is
    read with the session's profile (the legacy rule). Raises
    `StoredProfileError` rather than guess."""
    return stored_profile(
        operation.profile,
        engine.profile,
        engine.profile_rule,
        operation_id=operation.operation_id,
        key=operation.key,
    )


def unresumable(
    engine: Config, operation: Operation, held: Held, error: Exception
) -> Flow[ResumeResult]:
    """The one answer to a row that cannot be resumed (a number no float holds, a
    document that is not JSON, a value of the wrong type, from a damaged row or an
    older version): that operation is reported with what is wrong and the others go
    on. Its lease is given back, or its attempt journaled if one had begun."""
    cleanup = held.cleanup()
    held.lease = held.interrupted = None
    if cleanup is not None:
        yield cleanup
    what = storable_text(f"{type(error).__name__}: {error}"[:300])
    match cleanup:
        case Record(record=record):
            return ResumeResult.of(
                operation,
                record.status,
                "still_pending",
                f"its resume stopped while sending ({what}): the request may have been "
                + (
                    "delivered; as an at-most-once operation it is never resent (look it "
                    "up on the server and settle it: `idempotently settle`)"
                    if record.status == "abandoned"
                    else "delivered; the next resume finishes it with its key"
                ),
            )
        case Release() | None:
            return ResumeResult.of(
                operation,
                operation.status,
                "not_sent",
                f"its journaled row cannot be resumed ({what}); nothing was sent and it stays "
                f"{operation.status}: `idempotently show {operation.operation_id}` says what "
                "is wrong; repair that row and resume sends it, or record what happened with "
                "`idempotently settle` or `abandon`",
            )
        case _:
            assert_never(cleanup)


@functools.lru_cache(maxsize=512)
def journaled_url(url: str, base_url: str | None) -> httpx.URL:
    """The journaled ``url`` as an `httpx.URL`, moved to ``base_url``'s origin (scheme,
    host, port) if given. Parsed once per distinct pair: a resume sends hundreds of
    operations to a handful of endpoints, and each parse costs as much as the rest of
    the request's rebuild (an httpx.URL is immutable: every request can share it). A URL
    httpx cannot parse raises here, each time (errors are not cached)."""
    parsed = httpx.URL(url)
    if base_url is None:
        return parsed
    base = httpx.URL(base_url)
    return parsed.copy_with(scheme=base.scheme, host=base.host, port=base.port)


def rebuild(
    engine: Config,
    operation: Operation,
    build: BuildRequest,
    *,
    live: httpx.Request | None = None,
    base_url: str | None = None,
    strict: bool = True,
) -> httpx.Request:
    """The journaled request, byte for byte, with live credentials re-applied (and
    the values of its redacted query parameters: `MissingParams` if one has
    none, unless not ``strict``: a request that is not to be sent).

    ``base_url`` moves it to another origin (scheme, host, port), keeping path and query.
    """
    url = journaled_url(operation.url, base_url)
    if operation.secret_params:
        # Redacted in the journal: the live request's values, else the session's.
        names = json.loads(operation.secret_params)
        source = values_in_url(live.url) if live is not None else engine.param_values
        try:
            url = reapplied_url(url, names, source or (lambda name: None))
        except MissingParams:
            if strict:
                raise
    if live is not None and live.url.userinfo and live.url.host == url.host:
        url = url.copy_with(username=live.url.username, password=live.url.password)
    headers = [
        (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in operation.request_headers
    ]
    if live is not None:
        # The live request's credentials, as the bytes it carries (latin-1 included).
        headers.extend(
            (raw_name, raw_value)
            for raw_name, raw_value in live.headers.raw
            if raw_name.decode("latin-1").lower() in engine.redact_headers
        )
    return build(operation.method, url, headers, operation.request_body)


def stored_response(engine: Config, operation: Operation, build: BuildRequest) -> httpx.Response:
    """The stored answer of a finished operation, or the error that ended it."""
    ids = _ids(operation)
    if (
        operation.cap_reason is not None
        and operation.status in ("needs_reconcile", "failed")
        # Settled since (by an operator, a reconciler, a fork): their word ends it, and
        # the cap_reason kept for stats no longer says why.
        and not (operation.reason or "").startswith(SETTLED_REASONS)
    ):
        from idempotently._exceptions import attempts_cap_error

        raise attempts_cap_error(
            operation.status, operation.reason or "", operation.cap_reason, ids
        )
    if operation.status == "needs_reconcile":
        raise NeedsReconcileError(
            f"operation needs reconciling ({operation.reason}); it is never resent: look "
            "it up on the server and settle it with Session.resume(reconciler=...) or "
            "`idempotently reconcile --lookup URL` (or `idempotently settle`), see "
            f"`idempotently show {operation.operation_id}`",
            **ids,
        )
    if operation.status == "abandoned":
        raise OperationAbandonedError(
            f"operation was abandoned ({operation.reason}); it is never sent again: check "
            "whether it arrived, and use a new operation_id to send it once more",
            **ids,
        )
    if (
        operation.response_status is not None
        and operation.response_body is None
        and operation.status in ("succeeded", "failed")
    ):
        # Its answer's body was too large (or too slow) to keep: only its status was.
        raise AnswerNotReadError(
            f"operation {operation.status} with the server's {operation.response_status} "
            f"answer ({operation.reason}); there is no whole response to return. It is "
            "never sent again: look the object up on the server",
            **ids,
        )
    if operation.response_status is None and operation.status == "succeeded":
        raise NoStoredAnswerError(
            f"operation succeeded ({operation.reason}), but no answer of the server is "
            "stored, so there is no response to return; it is never sent again: look the "
            "object up on the server",
            **ids,
        )
    if operation.response_status is None and (operation.reason or "").startswith(SETTLED_REASONS):
        # Settled failed by an operator or a reconciler, not by an answer.
        raise RequestNotSentError(
            f"operation was settled failed ({operation.reason}); it is never sent again: "
            "send it under a new operation_id (or `idempotently fork` it)",
            **ids,
        )
    if operation.response_status is None:
        raise RequestNotSentError(
            f"operation failed before anything reached the server ({operation.reason}); "
            "fix the request and send it under a new operation_id",
            **ids,
        )
    response = httpx.Response(
        operation.response_status,
        headers=[
            (name.encode("latin-1"), value.encode("latin-1"))
            for name, value in operation.response_headers or ()
        ],
        content=operation.response_body or b"",
        request=rebuild(engine, operation, build, strict=False),
    )
    response.extensions = {
        **response.extensions,
        EXTENSION: Receipt(
            operation_id=operation.operation_id,
            key=operation.key,
            attempts=operation.attempt_count,
            replayed=False,
            replayed_locally=True,
            answered_by=answered_by(operation),
        ),
    }
    return response
