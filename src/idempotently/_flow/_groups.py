"""Operation groups: multi-step operations with recovery points.

A group's steps are ordinary named operations (``f"{group_id}/{step}"``, their keys
derived as every named operation's are) journaled with the group and their place in
it (``group_id``, ``step``: 1 for the first step the application called, and so on).
The rule, kept by the journal where a lease is taken (a call's insert or lease, a
resume's lease, a watch worker's claim): a step is sent only while every earlier step
of its group has succeeded (a forked step by its successor, which takes its place).
This room says what a refusal means (`refusal`), settles a stopped group's never-sent
steps (`stop`), and orders a resume's queue so that a group is finished in order.
"""

from __future__ import annotations

from collections.abc import Sequence

from idempotently import _commands_lazy
from idempotently._commands import SetStatus, Sleep
from idempotently._exceptions import (
    GroupStoppedError,
    IdempotentlyError,
    OperationInProgressError,
    OperationPendingError,
)
from idempotently._flow._checks import MAX_OPERATION_ID_LENGTH
from idempotently._flow._config import Config
from idempotently._flow._operation import Flow, ResumeResult
from idempotently._rows import Operation
from idempotently._text import storable_text

STOPS = ("failed", "abandoned")
"""A step that ends so stops its group: nothing after it is ever sent."""

MAX_STEP_LENGTH = 200
"""The longest step name (the operation id, group and step, has its own bound)."""

_POLL = (0.01, 0.25)
"""A resume waiting for the step before, in flight in this run: first and longest poll."""


def check_group_id(group_id: object) -> str:
    """A group id is a non-empty printable str (the operation id's rules), or a clear error."""
    if not isinstance(group_id, str):
        raise TypeError(f"group_id must be a str (e.g. 'order-42'), not {type(group_id).__name__}")
    if not group_id or not group_id.isprintable():
        raise ValueError(
            f"group_id must be a non-empty str of printable characters, not {group_id[:60]!r}"
        )
    return group_id


def check_step(group_id: str, step: object) -> str:
    """The operation id of ``step`` of ``group_id``, or a clear error naming the step."""
    if not isinstance(step, str):
        raise TypeError(
            f"step must be a str naming the step (e.g. step='charge'), not "
            f"{type(step).__name__}, in group {group_id!r}"
        )
    if not step or len(step) > MAX_STEP_LENGTH or "/" in step or not step.isprintable():
        raise ValueError(
            f"step must be 1 to {MAX_STEP_LENGTH} printable characters without '/', not "
            f"{step[:60]!r}, in group {group_id!r}; nothing was journaled or sent"
        )
    operation_id = f"{group_id}/{step}"
    if len(operation_id) > MAX_OPERATION_ID_LENGTH:
        # Else the operation id's own check says "leave it out", which a step cannot.
        raise ValueError(
            f"group {group_id[:60]!r} and step {step[:60]!r} make the operation id "
            f"{operation_id[:60]!r}... of {len(operation_id)} characters, more than the "
            f"{MAX_OPERATION_ID_LENGTH} an operation id may have: give a shorter group id "
            "or step; nothing was journaled or sent"
        )
    return operation_id


def step_name(operation: Operation) -> str:
    """The step ``operation`` is in its group (a fork: its own id)."""
    group_id = operation.group_id
    if group_id is not None and operation.operation_id.startswith(group_id + "/"):
        return operation.operation_id[len(group_id) + 1 :]
    return operation.operation_id


def in_place(steps: Sequence[Operation]) -> list[Operation]:
    """The steps that stand in the group: each place's operation, a forked step's
    successor instead of it."""
    return [step for step in steps if step.successor is None]


def blocker(steps: Sequence[Operation], place: int | None) -> Operation | None:
    """The first step before ``place`` (before every step: None) that has not succeeded:
    what keeps a later step from being sent. None: nothing does."""
    for step in in_place(steps):
        # A damaged row whose place cannot be read may be earlier: it holds the rest.
        unplaced = step.step is None and step.damaged is not None
        if place is not None and (step.step or 0) >= place and not unplaced:
            continue
        if step.status != "succeeded":
            return step
    return None


def next_step(steps: Sequence[Operation]) -> Operation | None:
    """The recovery point: the first step standing in the group that has not succeeded."""
    return blocker(steps, None)


def stopped_at(steps: Sequence[Operation]) -> Operation | None:
    """The step the group stopped at (failed or abandoned), or None: not stopped."""
    first = next_step(steps)
    return first if first is not None and first.status in STOPS else None


def _stop_reason(stop: Operation) -> str:
    return f"group stopped at {step_name(stop)}"


def stop(engine: Config, steps: Sequence[Operation], at: Operation) -> Flow[list[str]]:
    """Settle ``abandoned`` every step after ``at`` (where the group stopped) that was
    never sent (enqueued, no first send), with the reason "group stopped at STEP";
    the ids settled. A step that may have been sent keeps its state (it was journaled
    as sent before the stop: only a person can say what it did)."""
    settled = []
    for step in in_place(steps):
        if (step.step or 0) <= (at.step or 0) or step.status != "pending":
            continue
        if step.first_send_at is not None or step.enqueued_at is None:
            continue
        stopping = SetStatus(
            step.operation_id,
            "abandoned",
            _stop_reason(at),
            engine.clock(),
            stopped_at=at.operation_id,
        )
        if (yield stopping):
            settled.append(step.operation_id)
    return settled


def refusal(
    group_id: str, operation_id: str, key: str | None, before: Operation
) -> IdempotentlyError:
    """What a call of step ``operation_id`` raises while ``before``, an earlier step of
    its group, has not succeeded: nothing of it was sent."""
    this = operation_id.removeprefix(group_id + "/")
    name = step_name(before)
    reason = storable_text(before.reason or "no reason journaled")
    if before.status in STOPS:
        error = GroupStoppedError(
            f"group {group_id!r} stopped at step {name!r} ({before.status}: {reason}); "
            f"step {this!r} was not sent, nor will any later step be. There is no "
            "compensation: what to undo of the steps that succeeded is yours to decide "
            f"(see `idempotently show {group_id}`)",
            operation_id=operation_id,
            key=key,
        )
        error.group_id, error.stopped_at = group_id, name
        return error
    waits = "is in flight or pending" if before.status == "pending" else "needs reconciling"
    return OperationPendingError(
        f"step {this!r} of group {group_id!r} waits for step {name!r}, which {waits}: "
        "nothing of this step was sent (a step is sent only once every earlier step has "
        "succeeded). Run the group again once it has (Session.resume() or `idempotently "
        f"resume` finishes it; `idempotently show {group_id}` shows where it is)",
        operation_id=operation_id,
        key=key,
    )


def refuse(
    engine: Config, group_id: str, operation_id: str, key: str | None, place: int | None
) -> Flow[None]:
    """Raise what keeps step ``operation_id`` (at ``place``; None: a step not yet
    journaled, after every step) from being sent, settling a stopped group's never-sent
    steps first; return if nothing earlier keeps it (its own lease is another's)."""
    steps: list[Operation] = yield _commands_lazy.GroupSteps(group_id)
    before = blocker(steps, place)
    if before is None:
        return
    if before.status in STOPS:
        yield from stop(engine, steps, before)
    raise refusal(group_id, operation_id, key, before)


def unjournaled(group_id: str, operation_id: str, key: str | None) -> IdempotentlyError:
    """The insert of a new step found neither its row nor a blocker: it raced a prune."""
    return OperationInProgressError(
        f"step {operation_id!r} of group {group_id!r} could not be journaled (another "
        "caller changed the group meanwhile); nothing was sent: call it again",
        operation_id=operation_id,
        key=key,
    )


# -- resume ----------------------------------------------------------------------------


def in_group_order(queue: list[Operation]) -> list[Operation]:
    """The resume queue with each group's steps in their order, where its first queued
    step stood (a fork made after a later step was enqueued goes before it)."""
    if all(operation.group_id is None for operation in queue):
        return queue
    groups: dict[str, list[Operation]] = {}
    for operation in queue:
        if operation.group_id is not None:
            groups.setdefault(operation.group_id, []).append(operation)
    ordered: list[Operation] = []
    for operation in queue:
        group_id = operation.group_id
        if group_id is None:
            ordered.append(operation)
        elif group_id in groups:
            steps = groups.pop(group_id)
            ordered.extend(sorted(steps, key=lambda step: step.step or 0))
    return ordered


class Progress:
    """What one resume run has finished of its queue's group steps: a step refused for an
    earlier step that this run has yet to finish waits for it (resume works through a
    group in order, even several operations at once)."""

    __slots__ = ("done", "queued")

    def __init__(self, queue: Sequence[Operation]) -> None:
        self.queued = frozenset(op.operation_id for op in queue if op.group_id is not None)
        self.done: set[str] = set()

    @classmethod
    def of(cls, queue: Sequence[Operation]) -> Progress | None:
        """None for a queue without a group step (nothing to wait for)."""
        if all(operation.group_id is None for operation in queue):
            return None
        return cls(queue)

    def finishing(self, operation_id: str) -> bool:
        """Whether this run has yet to finish ``operation_id``."""
        return operation_id in self.queued and operation_id not in self.done


def resume_refused(
    engine: Config, operation: Operation, progress: Progress | None
) -> Flow[ResumeResult | None]:
    """What a resume's refused lease on group step ``operation`` means: None when no
    earlier step keeps it (its lease was another caller's; or after waiting for the
    step before, which this run had still to finish): the lease is tried again on a
    fresh read. Else the step's result: waiting for a step that is pending or needs
    reconciling, or abandoned as the group stopped before it."""
    group_id = operation.group_id
    assert group_id is not None
    while True:
        steps: list[Operation] = yield _commands_lazy.GroupSteps(group_id)
        before = blocker(steps, operation.step)
        if before is None:
            return None
        if before.status in STOPS:
            settled = yield from stop(engine, steps, before)
            reason = f"{_stop_reason(before)} ({before.status}); not sent"
            if operation.operation_id in settled:
                return ResumeResult.of(operation, "abandoned", "abandoned", reason)
            return ResumeResult.of(operation, "pending", "not_sent", reason)
        if progress is None or not progress.finishing(before.operation_id):
            return ResumeResult.of(
                operation,
                "pending",
                "still_pending",
                f"waits for step {step_name(before)!r} of group {group_id!r} "
                f"({before.status}): a step is sent only once every earlier one has "
                "succeeded; it stays pending",
            )
        poll = _POLL[0]
        while progress.finishing(before.operation_id):
            yield Sleep(poll)
            poll = min(poll * 2, _POLL[1])
