"""Resume: send the journal's pending operations again with their stored keys."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import httpx

from idempotently._commands import Find, Release, TakeLease
from idempotently._commands_rare import Queue, Report
from idempotently._exceptions import (
    CodecError,
    IdempotentlyError,
    JournalCorruptError,
    StoredProfileError,
)
from idempotently._flow._cap import stricter
from idempotently._flow._engine import Engine
from idempotently._flow._groups import Progress, in_group_order, resume_refused
from idempotently._flow._operation import (
    EXTENSION,
    UNREADABLE_ROW,
    BuildRequest,
    Flow,
    Held,
    ResumeResult,
    _iso,
    apply_blocker,
    blocker_of,
    codec_of,
    missing_params,
    profile_for,
    rebuild,
    state_of,
    times_from_now,
    unresumable,
)
from idempotently._flow._reconcile import reconcile_one
from idempotently._keys import secret_values
from idempotently._overrides import read_overrides
from idempotently._rows import Operation
from idempotently._secret_params import MissingParams
from idempotently._vocabulary import (
    RESUME_ACTION_OF,
    RESUME_ACTION_OF_BLOCKER,
    STATUS_AFTER,
    Status,
)


def _missing_params_reason(names: Sequence[str]) -> str:
    listed = ", ".join(repr(name) for name in names)
    return (
        f"the secret query parameter{'s' if len(names) > 1 else ''} {listed} "
        f"{'were' if len(names) > 1 else 'was'} journaled redacted and this resume has no "
        "value for it: give the Session redacted_params={...} (or its client params={...}) "
        "with it, or "
        "`idempotently resume --param-env NAME=ENVVAR` (or call again with the same "
        "operation_id and the full URL); nothing was sent and it stays pending"
    )


def resume(
    engine: Engine,
    build: BuildRequest,
    held: Held,
    *,
    dry_run: bool,
    base_url: str | None,
    reconciling: bool,
) -> Flow[list[ResumeResult]]:
    """Every pending operation (and needs_reconcile ones for a reconciler), oldest
    first, one after the other: each reported as soon as it is known, all returned
    at the end. (With concurrency, a driver runs `resume_queue` and then
    `resume_operation` for each operation in its own flow.)"""
    results: list[ResumeResult] = []
    for listed in (yield from resume_queue(engine, reconciling=reconciling)):
        # One after the other, in group order: a step never waits for a step of this run.
        result = yield from resume_operation(
            engine, listed, build, held, dry_run=dry_run, base_url=base_url, reconciling=reconciling
        )
        results.append(result)
    return results


def resume_queue(engine: Engine, *, reconciling: bool) -> Flow[list[Operation]]:
    """What resume works through: pending operations (and needs_reconcile ones for a
    reconciler), oldest first."""
    statuses: tuple[Status, ...] = ("pending",)
    if reconciling:
        statuses += ("needs_reconcile",)
    queue: list[Operation] = yield Queue(statuses)
    return in_group_order(queue)


def resume_operation(
    engine: Engine,
    listed: Operation,
    build: BuildRequest,
    held: Held,
    *,
    dry_run: bool,
    base_url: str | None,
    reconciling: bool,
    claimed_by: str | None = None,
    progress: Progress | None = None,
) -> Flow[ResumeResult]:
    """Resume one operation of the queue: send, wait, settle or plan it, report the
    result and return it.

    It is sent from ``listed``, the row as the queue (or a worker's claim) read it,
    with its attempts: the lease's compare-and-swap fails if the row was written since,
    and only then is it read again, and decided on afresh. Whatever else a stale row
    would decide (a blocker, a status other than pending) is decided on a fresh read too.

    ``claimed_by``: the owner that leased it for this resume (a resume worker's
    claim); that lease is its own, renewed by compare-and-swap, not raced for.
    ``progress``: what this run has finished of its queue's group steps (a step
    whose earlier step is still to be finished by this run waits for it): given,
    `resume_tracked` runs it."""
    if listed.damaged is not None:
        # Read again, it would raise what the listing turned into this stand-in.
        result = yield from unresumable(engine, listed, held, JournalCorruptError(listed.damaged))
        yield Report(result)
        return result
    operation = listed
    try:
        if dry_run:
            result = plan(engine, operation)
        else:
            sent = yield from _resume_one(
                engine, operation, build, held, base_url, claimed_by, fresh=False, progress=progress
            )
            if sent is _STALE:
                operation = (yield Find(listed.operation_id, None)) or listed
                sent = yield from _resume_one(
                    engine,
                    operation,
                    build,
                    held,
                    base_url,
                    claimed_by,
                    fresh=True,
                    progress=progress,
                )
            assert isinstance(sent, ResumeResult)
            result = sent
    except UNREADABLE_ROW as error:
        if isinstance(error, IdempotentlyError) and not isinstance(error, CodecError):
            raise
        result = yield from unresumable(engine, operation, held, error)
    else:
        if reconciling and not dry_run and result.status == "needs_reconcile":
            result = yield from reconcile_one(engine, operation, result)
    yield Report(result)
    return result


def resume_tracked(
    engine: Engine,
    listed: Operation,
    build: BuildRequest,
    held: Held,
    *,
    dry_run: bool,
    base_url: str | None,
    reconciling: bool,
    progress: Progress,
) -> Flow[ResumeResult]:
    """`resume_operation` in a run whose queue holds group steps: once it ends, however,
    ``progress`` knows (a later step of its group waiting for it goes on). A run
    without group steps runs `resume_operation` itself, one generator less per command."""
    try:
        return (
            yield from resume_operation(
                engine,
                listed,
                build,
                held,
                dry_run=dry_run,
                base_url=base_url,
                reconciling=reconciling,
                progress=progress,
            )
        )
    finally:
        progress.done.add(listed.operation_id)


def plan(engine: Engine, operation: Operation) -> ResumeResult:
    """What resume would do with this operation, without doing it (dry run)."""
    if operation.status != "pending":
        return ResumeResult.of(operation, operation.status, "would_reconcile", operation.reason)
    blocked = blocker_of(engine, operation, resuming=True)
    if blocked is None:
        try:
            profile_for(engine, operation)
        except StoredProfileError as error:
            return ResumeResult.of(operation, "pending", "not_sent", error.message)
        if operation.unreadable is not None:
            return ResumeResult.of(
                operation,
                "pending",
                "not_sent",
                f"{operation.unreadable}; nothing would be sent",
            )
        missing = missing_params(engine, operation)
        if missing:
            return ResumeResult.of(
                operation, "pending", "not_sent", _missing_params_reason(missing)
            )
        return ResumeResult.of(operation, "pending", "would_send", "would resend its key")
    kind, reason = blocked
    return ResumeResult.of(operation, "pending", RESUME_ACTION_OF_BLOCKER[kind][1], reason)


class _Stale:
    """What `_resume_one` returns for a row it would not decide on as read (the queue's,
    not read again): a blocker or a status other than pending to check on a fresh read,
    or a lease that could not be taken on it (the row was written since)."""


_STALE = _Stale()


def _resume_one(
    engine: Engine,
    operation: Operation,
    build: BuildRequest,
    held: Held,
    base_url: str | None,
    claimed_by: str | None = None,
    *,
    fresh: bool,
    progress: Progress | None = None,
) -> Flow[ResumeResult | _Stale]:
    if operation.status != "pending":
        if not fresh:
            return _STALE
        return ResumeResult.of(operation, operation.status, "skipped", operation.reason)
    claimed = claimed_by is not None and operation.lease_owner == claimed_by
    if claimed_by is not None and claimed:
        # Ours: whatever ends this flow early releases it (a blocker's SetStatus does too).
        held.take(operation.operation_id, claimed_by)
    operation = yield from times_from_now(engine, operation)
    blocked = blocker_of(engine, operation, resuming=True, claimed_by=claimed_by)
    if blocked is not None:
        if not fresh:
            return _STALE
        kind, reason = blocked
        status = yield from apply_blocker(engine, operation, kind, reason)
        return ResumeResult.of(operation, status, RESUME_ACTION_OF_BLOCKER[kind][0], reason)
    try:
        profile = profile_for(engine, operation)
    except StoredProfileError as error:
        return ResumeResult.of(operation, "pending", "not_sent", error.message)
    if operation.unreadable is not None:
        return ResumeResult.of(
            operation,
            "pending",
            "not_sent",
            f"{operation.unreadable}; nothing was sent and it stays pending",
        )
    try:
        request = rebuild(engine, operation, build, base_url=base_url)
    except MissingParams as missing:
        return ResumeResult.of(
            operation, "pending", "not_sent", _missing_params_reason(missing.names)
        )
    except (httpx.HTTPError, ValueError, TypeError) as error:
        return ResumeResult.of(
            operation,
            "pending",
            "not_sent",
            f"the journaled request cannot be rebuilt ({type(error).__name__}): it keeps "
            f"its state; see `idempotently show {operation.operation_id}`",
        )
    secrets = secret_values(request.headers, engine.redact_headers, request.url)
    sending = engine
    if operation.overrides is not None:
        # The caller's own policy and timeouts, as journaled with the operation.
        try:
            policy, timeouts = read_overrides(operation.overrides)
        except ValueError as error:
            return ResumeResult.of(
                operation,
                "pending",
                "not_sent",
                f"{error}; nothing was sent and it stays pending (see "
                f"`idempotently show {operation.operation_id}`)",
            )
        # Within this run's bounds (a resume's --max-attempts and --deadline bound
        # each operation, so a dead host costs what the run allows): the stricter of
        # the two. The journaled timeouts stay: the deadline caps every attempt's.
        if policy is not None:
            policy = attrs.evolve(
                policy,
                max_attempts=min(policy.max_attempts, engine.policy.max_attempts),
                deadline=min(policy.deadline, engine.policy.deadline),
                max_total_attempts=stricter(
                    policy.max_total_attempts, engine.policy.max_total_attempts
                ),
            )
        sending = engine.overridden(policy, None)
        if timeouts is not None:
            request.extensions = {**request.extensions, "timeout": timeouts}
    # After the journaled timeouts are on the request: a probe's claim lasts as long as
    # its request may take (`_half_open`).
    pause = yield from engine.origin_pause(profile, request, engine.clock(), operation.operation_id)
    if pause is not None:
        # still_pending, not waiting (a not_before of its own): a watch worker parks
        # it with its backoff instead of claiming it again at once.
        return ResumeResult.of(
            operation,
            "pending",
            "still_pending",
            f"not sent: {pause.origin} is paused until {_iso(pause.until)} "
            f"({pause.reason}); it stays pending with its key",
        )
    # Always with a circuit breaker: an origin that is down is paused after a few
    # failures and the rest of its operations stay pending unsent (`_pauses`).
    sending = sending.resuming()
    # A claimed lease is renewed by the same compare-and-swap on the row just read:
    # it fails only if the claim expired and another caller took the operation.
    owner = claimed_by if claimed_by is not None and claimed else engine.new_owner()
    now = engine.clock()
    held.take(operation.operation_id, owner)
    held.lease_until = now + engine.lease_duration
    if not (yield TakeLease(operation, owner, held.lease_until, now)):
        if engine.pauses.probes:
            yield from engine.release_probe(request)  # a probe it will not send
        held.lease = None
        if operation.group_id is not None:
            # Refused for an earlier step of its group: wait for it in flight, or say why.
            refused = yield from resume_refused(engine, operation, progress)
            if refused is not None:
                if claimed and refused.status == "pending":
                    yield Release(operation.operation_id, owner)
                return refused
        if not fresh:
            return _STALE
        return ResumeResult.of(
            operation, "pending", "leased", "another caller took its lease first"
        )
    end = yield from sending.attempts(
        operation.operation_id,
        operation.key,
        request,
        state_of(engine, operation, now, resuming=True),
        profile,
        operation.attempt_count,
        held,
        secrets,
        codec_of(engine, operation),
        binding=operation.credentials_digest,
        journaled=operation,
    )
    decision = end.decision
    code = None if end.response is None else end.response.status_code
    replayed = bool(end.response is not None and end.response.extensions[EXTENSION].replayed)
    detail = decision.reason
    if decision.action == "succeed" and replayed:
        detail += " (replayed by the server)"
    if end.unkept is not None:
        detail += f"; {end.unkept}"
    return ResumeResult.of(
        operation,
        STATUS_AFTER[decision.action],
        RESUME_ACTION_OF[decision.action],  # never "retry": the attempts end otherwise
        detail,
        code,
        replayed,
    )
