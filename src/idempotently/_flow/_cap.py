"""The cap on attempts across restarts: ``RetryPolicy(max_total_attempts=N)``.

Counted from the journal: the attempts of an operation that reached the server
(``answered`` or ``maybe_delivered``), whichever call, process, resume or watch worker
made them. An attempt ``not_sent``, and a send refused by the retry budget or an origin
pause (never journaled as an attempt), never counts: an outage must not turn committed
outbox orders into dead letters. At the cap the operation goes to ``needs_reconcile``,
or to ``failed`` when no attempt may have been acted on: the call state's ``acted``,
the predicate the final-4xx rule reads (`may_have_been_delivered` for the journaled
attempts, `maybe_acted` for each new one). Nothing here does I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from idempotently._commands import Find, SetStatus
from idempotently._flow._operation import End, Flow, Held
from idempotently._policy import CallState, Decision
from idempotently._rows import Operation
from idempotently._text import storable_text
from idempotently._vocabulary import STATUS_AFTER, Action

if TYPE_CHECKING:
    from idempotently._flow._config import Config

GOES_ON: Final[frozenset[Action]] = frozenset({"retry", "pending", "retry_later", "unresolved"})
"""The actions that leave the operation pending to be sent again: at the cap, none of
them stands. An action that settles it (or ``unsent``: nothing reached the server) does."""

_DOCS = "docs/when-the-journal-cannot-decide.md"


def reached(operation: Operation) -> int | None:
    """How many of ``operation``'s journaled attempts reached the server; None when the
    row does not carry them all (a listing): then they are read once."""
    attempts = operation.attempts
    if len(attempts) < operation.attempt_count:
        return None
    return sum(1 for attempt in attempts if attempt.outcome != "not_sent")


def stricter(journaled: int | None, given: int | None) -> int | None:
    """The smaller of two caps (None: no cap), as a resume applies them."""
    if journaled is None:
        return given
    if given is None:
        return journaled
    return min(journaled, given)


def cap_reason(cap: int, count: int) -> str:
    """The ``cap_reason`` journaled with the operation."""
    return (
        f"max_total_attempts={cap} reached: {count} attempt{'' if count == 1 else 's'} "
        "reached the server, counted from the journal across every call, process and resume"
    )


def unrecorded(operation: Operation | None, held: Held) -> bool:
    """Whether the row as read may hide an attempt: it was leased by another caller that
    never gave the lease back (a retry's record keeps it through the wait; every other
    end releases it). That caller died, or outlived its lease, in a wait or in a send
    whose attempt the journal never saw, and which the server may have acted on."""
    # A row bearing this flow's own owner is a `resume --watch` worker's claim, which
    # wrote its owner over whatever was there: it cannot tell a row released by its last
    # holder from one whose holder died mid-send, so it assumes the worse (at the cap:
    # needs_reconcile, never a failed it could not prove).
    return operation is not None and operation.lease_owner is not None


def at_cap(
    state: CallState, cap: int, count: int, why: str | None, *, unseen: bool = False
) -> Decision:
    """The decision for an operation at its cap: ``why`` is the decision it replaces
    (what the last attempt showed), None before any send; ``unseen``: an attempt may
    be missing from the journal (`unrecorded`), so failed is no promise it can make."""
    action: Action = "reconcile" if state.acted or unseen else "fail"
    reason = cap_reason(cap, count)
    return Decision(
        action,
        reason if why is None else f"{why}; {reason}",
        state,
        cap_reason=reason,
    )


def journaled_count(operation_id: str, operation: Operation | None) -> Flow[int]:
    """How many attempts of the operation reached the server before this call: from the
    row as read (none for a new one), or read once when it did not carry them all."""
    if operation is None:
        return 0
    count = reached(operation)
    if count is None:
        found: Operation | None = yield Find(operation_id, None)
        count = None if found is None else reached(found)
    # A row whose attempts cannot be read counts each as reached: never one more send.
    return operation.attempt_count if count is None else count


def before_send(
    engine: Config,
    operation_id: str,
    key: str,
    state: CallState,
    cap: int,
    count: int,
    held: Held,
    attempts: int,
    unseen: bool = False,
) -> Flow[End]:
    """An operation already at its cap (a stricter one given to this resume, or counted
    by other processes): nothing is sent, and it moves to its final status now."""
    decision = at_cap(state, cap, count, None, unseen=unseen)
    yield SetStatus(
        operation_id,
        STATUS_AFTER[decision.action],
        storable_text(decision.reason),
        engine.clock(),
        cap_reason=decision.cap_reason,
    )
    held.lease = None
    return End(operation_id, key, decision, attempts)
