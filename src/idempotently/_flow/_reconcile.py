"""Reconcile: hand a needs_reconcile operation to a reconciler or a lookup, and journal
its verdict.
"""

from __future__ import annotations

import attrs
import httpx

from idempotently._backoff import jittered
from idempotently._codec import encoded
from idempotently._commands import Find
from idempotently._commands_rare import (
    AuditNote,
    AuditTrail,
    ForksTaken,
    LookUpLater,
    PlanReconcile,
    Queue,
    Reconcile,
    ReconcilePlan,
)
from idempotently._exceptions import (
    IdempotentlyError,
    JournalCorruptError,
    StoredProfileError,
)
from idempotently._flow._engine import Engine
from idempotently._flow._leases import lease_owner_alive
from idempotently._flow._operation import (
    Flow,
    Held,
    ResumeResult,
    Settlement,
    _iso,
    codec_of,
    json_text,
    profile_for,
    unresumable,
)
from idempotently._lookup import (
    LOOKUP_DEFERRED,
    LOOKUP_VERDICT,
    Verdict,
    unsettled_lookups,
)
from idempotently._operator import plan as plan_action
from idempotently._pauses import PAUSE_STATUS_CODES
from idempotently._policy import Answer
from idempotently._profiles import ServerProfile
from idempotently._rows import Operation
from idempotently._secret_params import journaled_answer_headers
from idempotently._text import storable_text
from idempotently._vocabulary import LOOKUP_ACTOR, Status


def reconcile_one(engine: Engine, operation: Operation, result: ResumeResult) -> Flow[ResumeResult]:
    """Hand a needs_reconcile operation to the reconciler (unless a lookup's backoff
    is still running) and journal its verdict; ``result`` if it decides nothing."""
    if operation.damaged is not None:
        return (
            yield from unresumable(
                engine, operation, Held(), JournalCorruptError(operation.damaged)
            )
        )
    current = (yield Find(operation.operation_id, None)) or operation
    if current.status != "needs_reconcile":
        return ResumeResult.of(current, current.status, "skipped", current.reason)
    if current.unreadable is not None:
        # Without its request no answer can be stored encoded, nor a fork made.
        return ResumeResult.of(
            current, current.status, "skipped", f"not reconciled: {current.unreadable}"
        )
    if (
        current.lookup_after is not None
        and current.lookup_after > engine.clock()
        and not (yield from _deferred_by_a_pause(engine, current))
    ):
        return ResumeResult.of(
            current,
            "needs_reconcile",
            "needs_reconcile",
            f"looked up already; not again before {_iso(current.lookup_after)}",
        )
    plan: ReconcilePlan | None = yield PlanReconcile(current)
    if plan is None:
        return result
    if plan.request is not None:
        deferred = yield from _lookup_paused(engine, current, plan.request)
        if deferred is not None:
            return deferred
    settlement = yield Reconcile(current, plan.request)
    if isinstance(settlement, Verdict):
        return (yield from apply_verdict(engine, current, settlement))
    if settlement is not None and not isinstance(settlement, Settlement):
        raise TypeError(
            f"the reconciler must return an idempotently.Settlement or None, not "
            f"{type(settlement).__name__} (for operation {current.operation_id!r})"
        )
    if settlement is not None:
        return (yield from _settle(engine, current, settlement, plan.actor))
    return result


def _lookup_profile(engine: Engine, operation: Operation) -> ServerProfile:
    """The profile whose ``pause_origin`` a lookup for ``operation`` honours: the
    operation's own (the session's, if its stored one cannot be read)."""
    try:
        return profile_for(engine, operation)
    except StoredProfileError:
        return engine.profile


def _lookup_paused(
    engine: Engine, operation: Operation, request: httpx.Request
) -> Flow[ResumeResult | None]:
    """Hold back a lookup whose origin is paused for its credentials: nothing is sent,
    and the operation, still needs_reconcile, is looked up once the pause is over
    (its ``lookup_after``, with an audit entry saying so); None if not paused."""
    now = engine.clock()
    pause = yield from engine.origin_pause(
        _lookup_profile(engine, operation), request, now, operation.operation_id
    )
    if pause is None:
        return None
    note = (
        f"not looked up: origin paused until {_iso(pause.until)} ({pause.origin}, "
        f"{pause.reason}); it is looked up after that"
    )
    if operation.lookup_after == pause.until:
        # Deferred to this very pause already: nothing new to journal.
        return ResumeResult.of(operation, "needs_reconcile", "waiting", note)
    yield LookUpLater(
        operation.operation_id,
        pause.until,
        now,
        AuditNote(
            operation.operation_id,
            LOOKUP_ACTOR,
            LOOKUP_DEFERRED,
            note,
            json_text({"origin": pause.origin, "paused_until": pause.until}),
        ),
    )
    return ResumeResult.of(operation, "needs_reconcile", "waiting", note)


def _deferred_by_a_pause(engine: Engine, operation: Operation) -> Flow[bool]:
    """Whether the operation's next lookup waits for a pause (its last audit entry a
    deferral), not for a lookup's backoff: then whether the pause still runs is read
    again, so a pause lifted early (`idempotently unpause`) lets it be looked up at
    once."""
    entries = yield AuditTrail(operation.operation_id)
    return bool(entries) and (entries[-1].actor, entries[-1].action) == (
        LOOKUP_ACTOR,
        LOOKUP_DEFERRED,
    )


def _lookup_answered(
    engine: Engine, operation: Operation, verdict: Verdict, now: float
) -> Flow[float | None]:
    """A lookup answered 429 or 503 with Retry-After pauses its origin, as any answer
    does; returns when the server asked to be asked again (None: it did not)."""
    if verdict.server_wait is None or verdict.status_code is None:
        return None
    request = verdict.request
    if (
        request is not None
        and verdict.status_code in PAUSE_STATUS_CODES
        and verdict.server_wait > 0
        and _lookup_profile(engine, operation).pause_origin
    ):
        answer = Answer(status_code=verdict.status_code, server_wait=verdict.server_wait)
        yield from engine.pause(request, answer, now)
    return now + verdict.server_wait


def _lookup_after(
    engine: Engine, operation: Operation, verdict: Verdict, now: float
) -> Flow[float]:
    """When an operation a lookup left unsettled is looked up next: an exponential
    backoff with full jitter, its ceiling doubled for each unsettled lookup in a row
    before this one (counted from its audit trail), capped."""
    entries = yield AuditTrail(operation.operation_id)
    streak = unsettled_lookups(entries) + 1
    return now + jittered(verdict.backoff, verdict.max_backoff, streak, engine.rand)


def reconcile_queue(engine: Engine) -> Flow[list[Operation]]:
    """The needs_reconcile operations, oldest first (what ``reconcile`` works through)."""
    queue: list[Operation] = yield Queue(("needs_reconcile",))
    return queue


def apply_verdict(engine: Engine, operation: Operation, verdict: Verdict) -> Flow[ResumeResult]:
    """Journal a lookup's verdict: settled (succeeded, failed, or failed and forked)
    by one audited compare-and-swap on the row as read, or left needs_reconcile
    with its note and the lookup's backoff."""
    now = engine.clock()
    if (
        verdict.outcome in ("failed", "resend")
        and operation.credentials_digest is not None
        and verdict.request is not None
    ):
        # Its key is bound to the credentials it was made with: the server keeps
        # one account's objects apart from another's, so absence seen under other
        # credentials proves nothing (and a fork would charge again).
        differ = yield from engine.credentials_differ(operation, verdict.request)
        if differ is not None:
            verdict = attrs.evolve(
                verdict,
                outcome="stay",
                note=(
                    "absent from the lookup, but the lookup was made with other "
                    "credentials than the operation's, so absence proves nothing; look "
                    "it up with the original ones"
                ),
            )
    if verdict.outcome == "stay":
        lookup_after = yield from _lookup_after(engine, operation, verdict, now)
        asked = yield from _lookup_answered(engine, operation, verdict, now)
        if asked is not None:
            lookup_after = max(lookup_after, asked)
        yield LookUpLater(
            operation.operation_id,
            lookup_after,
            now,
            AuditNote(
                operation.operation_id,
                LOOKUP_ACTOR,
                LOOKUP_VERDICT,
                verdict.note,
                json_text({"lookup_failed": verdict.lookup_failed}),
            ),
        )
        return ResumeResult.of(operation, "needs_reconcile", "needs_reconcile", verdict.note)
    forks_taken: tuple[str, ...] = ()
    if verdict.outcome == "resend":
        # Never an id another operation holds, nor one an earlier fork had: the
        # operator's fork's rule (`Journal._free_forks`).
        taken: tuple[str, ...] | IdempotentlyError = yield ForksTaken(operation)
        if isinstance(taken, IdempotentlyError):
            return ResumeResult.of(operation, operation.status, "needs_reconcile", taken.message)
        forks_taken = taken
    try:
        planned = plan_action(
            "fork" if verdict.outcome == "resend" else "settle",
            operation,
            actor=LOOKUP_ACTOR,
            note=verdict.note,
            now=now,
            lease_alive=operation.lease_owner is not None
            and lease_owner_alive(operation.lease_owner, engine.host_id),
            namespace=engine.namespace,
            status="succeeded" if verdict.outcome == "found" else "failed",
            key_expiry_margin=engine.key_expiry_margin,
            forks_taken=forks_taken,
        )
    except IdempotentlyError as error:
        return ResumeResult.of(operation, operation.status, "needs_reconcile", error.message)
    write = planned.write
    codec = codec_of(engine, operation)
    if codec is not None and write.fork is not None:
        # The fork keeps its parent's codec, so its bytes are stored as the parent's
        # are: encoded (``operation`` was read, and so decoded).
        write = attrs.evolve(
            write,
            fork=attrs.evolve(write.fork, request_body=encoded(codec, write.fork.request_body)),
        )
    if verdict.answer is not None:
        write = attrs.evolve(
            write,
            sets_answer=True,
            response_status=verdict.answer_status,
            response_headers=verdict.answer_headers(),
            response_body=(verdict.answer if codec is None else encoded(codec, verdict.answer)),
        )
    if not (yield write):
        return ResumeResult.of(
            operation,
            operation.status,
            "skipped",
            "it changed while it was looked up (another worker or an operator); "
            "nothing was written",
        )
    status: Status = "succeeded" if verdict.outcome == "found" else "failed"
    detail = verdict.note
    if write.fork is not None:
        detail += f"; forked as {write.fork.operation_id}, sent by the next resume"
    return ResumeResult.of(operation, status, "reconciled", detail)


def _settle(
    engine: Engine, operation: Operation, settlement: Settlement, actor: str
) -> Flow[ResumeResult]:
    """Journal a reconciler's Settlement as an operator's settle is journaled: one
    compare-and-swap on the row as read, with its audit entry (``actor`` names the
    reconciler), in one transaction; refused as an operator's would be."""
    now = engine.clock()
    note = storable_text(f"{settlement.note}")
    try:
        planned = plan_action(
            "settle",
            operation,
            actor=actor,
            note=note,
            now=now,
            lease_alive=operation.lease_owner is not None
            and lease_owner_alive(operation.lease_owner, engine.host_id),
            namespace=engine.namespace,
            status=settlement.status,
            key_expiry_margin=engine.key_expiry_margin,
        )
    except IdempotentlyError as error:
        return ResumeResult.of(operation, operation.status, "needs_reconcile", error.message)
    response = settlement.response
    codec = codec_of(engine, operation)
    write = attrs.evolve(
        planned.write,
        reason=f"reconciled: {note}",
        sets_answer=True,
        response_status=None if response is None else response.status_code,
        response_headers=None
        if response is None
        else journaled_answer_headers(
            response.headers, engine.redact_headers, engine.secret_params
        ),
        response_body=None
        if response is None
        else (response.content if codec is None else encoded(codec, response.content)),
    )
    if not (yield write):
        return ResumeResult.of(
            operation,
            operation.status,
            "skipped",
            "it changed while the reconciler looked at it (another worker or an "
            "operator); nothing was written",
        )
    return ResumeResult.of(
        operation,
        settlement.status,
        "reconciled",
        settlement.note,
        None if response is None else response.status_code,
    )
