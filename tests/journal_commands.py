"""Journal writes by hand, for tests that set up or race a journal's rows directly.

Each one is a journal command run through the journal's one execute path
(`Journal._execute`: the checks, the writer, the errors naming their operation),
exactly as the drivers, the heartbeat and the watch worker run theirs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, cast

from idempotently import Journal
from idempotently._commands import (
    ClaimDue,
    ExtendLeases,
    Find,
    Insert,
    JournalWrite,
    Record,
    Release,
    SetStatus,
    TakeLease,
)
from idempotently._commands_rare import JournalCommand
from idempotently._rows import AttemptRecord, Failed, NewOperation, Operation
from idempotently._vocabulary import Status


def insert_operation(
    journal: Journal, new: NewOperation, *, owner: str, lease_until: float
) -> bool:
    return bool(journal._execute(Insert(new, owner, lease_until)))


def record_attempt(
    journal: Journal,
    operation_id: str,
    record: AttemptRecord,
    *,
    now: float,
    owner: str | None = None,
) -> None:
    journal._execute(Record(operation_id, record, now, owner))


def take_lease(
    journal: Journal, operation: Operation, *, owner: str, lease_until: float, now: float
) -> bool:
    return bool(journal._execute(TakeLease(operation, owner, lease_until, now)))


def set_status(
    journal: Journal,
    operation_id: str,
    status: Status,
    *,
    reason: str | None,
    now: float,
    expect: Status = "pending",
) -> bool:
    return bool(journal._execute(SetStatus(operation_id, status, reason, now, expect)))


def release_lease(journal: Journal, operation_id: str, *, owner: str) -> None:
    journal._execute(Release(operation_id, owner))


def claim_due(
    journal: Journal, *, owner: str, now: float, lease_until: float, limit: int
) -> list[Operation]:
    return cast(list[Operation], journal._execute(ClaimDue(owner, now, lease_until, limit)))


def extend_leases(
    journal: Journal, leases: Sequence[tuple[str, str]], *, lease_until: float, now: float
) -> int:
    return int(journal._execute(ExtendLeases(tuple(leases), lease_until, now)))


def find(journal: Journal, operation_id: str | None, key: str | None) -> Operation | None:
    return cast(Operation | None, journal._execute(Find(operation_id, key)))


def execute_together(journal: Journal, commands: Sequence[JournalCommand]) -> list[Any]:
    """Each command run by a caller of its own (a thread), all of them queued before any
    is committed, so the writes among them share one batch (one transaction), as
    concurrent callers' do; each one's reply, or a `Failed` holding the error it raised.

    A first write (a release of nothing) is held in its commit until every command is
    queued behind it; the next leader then takes them all at once."""
    writer = journal._writer
    queued = sum(isinstance(command, JournalWrite) for command in commands)
    plugged = threading.Event()
    outcomes: list[Any] = [None] * len(commands)

    def hold(writes: Sequence[Any], durable: bool) -> None:
        if not plugged.is_set():
            plugged.set()
            deadline = time.monotonic() + 30
            while len(writer._waiting) < queued and time.monotonic() < deadline:
                threading.Event().wait(0.001)

    def plug_in() -> None:
        try:
            journal._execute(Release("", ""))
        except Exception:  # a journal that takes no write: nothing to hold back
            pass
        finally:
            plugged.set()

    def run(index: int) -> None:
        try:
            outcomes[index] = journal._execute(commands[index])
        except Exception as error:
            outcomes[index] = Failed(error)

    stop = journal.observe_commits(before=hold)
    try:
        plug = threading.Thread(target=plug_in)
        plug.start()
        plugged.wait(timeout=30)
        callers = [threading.Thread(target=run, args=(index,)) for index in range(len(commands))]
        for caller in callers:
            caller.start()
        for caller in [plug, *callers]:
            caller.join(timeout=30)
    finally:
        stop()
    return outcomes
