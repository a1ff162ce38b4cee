"""Fleet operations on every store: claiming due operations, extending leases.

``_claim_due`` and ``_extend_leases`` are what ``resume --watch`` workers and
their heartbeats use; N workers on one journal must never claim one operation twice.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from idempotently import Journal
from idempotently._journal import AttemptRecord
from tests.journal_commands import (
    claim_due,
    extend_leases,
    insert_operation,
    record_attempt,
    set_status,
    take_lease,
)
from tests.test_journal import NOW, insert, new_operation


@pytest.fixture
def journal(journal_target: str) -> Iterator[Journal]:
    with Journal(journal_target) as opened:
        yield opened


# -- claims -------------------------------------------------------------------------


def due_and_not_due(journal: Journal) -> set[str]:
    """40 due operations and five that are not; the due ids."""
    for number in range(40):
        insert(
            journal, new_operation(f"due-{number:02}", created_at=NOW + number), lease_until=NOW - 1
        )
    insert(journal, new_operation("leased", created_at=NOW - 50), lease_until=NOW + 60)
    insert(journal, new_operation("later", created_at=NOW - 50))
    record_attempt(
        journal,
        "later",
        AttemptRecord(
            started_at=NOW, elapsed=0.1, outcome="answered", status_code=429, not_before=NOW + 60
        ),
        now=NOW - 10,
    )
    for status in ("succeeded", "needs_reconcile", "abandoned"):
        insert(journal, new_operation(status, created_at=NOW - 50))
        set_status(journal, status, status, reason=None, now=NOW - 10)  # type: ignore[arg-type]
    return {f"due-{number:02}" for number in range(40)}


def test_claim_due_takes_the_oldest_due_operations(journal: Journal) -> None:
    """_claim_due leases the oldest due pending operations, with their attempts."""
    due_and_not_due(journal)
    record_attempt(
        journal,
        "due-00",
        AttemptRecord(started_at=NOW, elapsed=0.1, outcome="not_sent"),
        now=NOW - 5,
    )

    claimed = claim_due(journal, owner="w1", now=NOW, lease_until=NOW + 30, limit=3)

    assert ["due-00", "due-01", "due-02"] == [operation.operation_id for operation in claimed]
    assert {("w1", NOW + 30, NOW)} == {
        (operation.lease_owner, operation.lease_until, operation.updated_at)
        for operation in claimed
    }
    assert [1] == [attempt.number for attempt in claimed[0].attempts]
    stored = journal.operation("due-01")
    assert stored is not None and ("w1", NOW + 30) == (stored.lease_owner, stored.lease_until)


def test_workers_claiming_at_once_never_claim_one_operation_twice(journal_target: str) -> None:
    """Eight workers (own connections) claiming at once: each due operation exactly once."""
    with Journal(journal_target) as setup:
        due = due_and_not_due(setup)
    start = threading.Barrier(8)
    claims: list[str] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        with Journal(journal_target) as journal:
            start.wait()
            while batch := claim_due(journal, owner=name, now=NOW, lease_until=NOW + 30, limit=3):
                with lock:
                    claims.extend(operation.operation_id for operation in batch)

    threads = [threading.Thread(target=worker, args=(f"w{n}",)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(due) == sorted(claims)


def test_extend_leases_pushes_back_only_leases_still_held(journal: Journal) -> None:
    """A heartbeat extends its own live leases, never another owner's or a finished one's."""
    for operation_id, owner, lease_until in (
        ("mine", "w1", NOW + 10),
        ("mine-later", "w1", NOW + 99),
        ("taken", "w2", NOW + 10),
        ("done", "w1", NOW + 10),
    ):
        insert_operation(journal, new_operation(operation_id), owner=owner, lease_until=lease_until)
    set_status(journal, "done", "succeeded", reason=None, now=NOW)

    extended = extend_leases(
        journal,
        [("mine", "w1"), ("mine-later", "w1"), ("taken", "w1"), ("done", "w1"), ("gone", "w1")],
        lease_until=NOW + 40,
        now=NOW,
    )

    leases = {
        operation.operation_id: (operation.lease_owner, operation.lease_until)
        for operation in journal.operations()
    }
    assert 2 == extended
    assert {
        "mine": ("w1", NOW + 40),
        "mine-later": ("w1", NOW + 99),
        "taken": ("w2", NOW + 10),
        "done": (None, 0.0),
    } == leases


def test_an_attempt_after_the_lease_was_lost_is_counted_but_changes_nothing(
    journal: Journal,
) -> None:
    """A caller whose lease another took: its attempt is kept, the taker's state stands."""
    insert(journal, new_operation(), lease_until=NOW - 1)  # "test-owner"'s lease, expired
    stale = journal.operation("op-1")
    assert stale is not None
    assert take_lease(journal, stale, owner="taker", lease_until=NOW + 30, now=NOW)

    record_attempt(
        journal,
        "op-1",
        AttemptRecord(
            started_at=NOW, elapsed=0.1, outcome="answered", status_code=201, status="succeeded"
        ),
        now=NOW + 1,
        owner="test-owner",
    )

    operation = journal.operation("op-1")
    assert operation is not None
    assert ("pending", "taker", NOW + 30, 1, None, [201]) == (
        operation.status,
        operation.lease_owner,
        operation.lease_until,
        operation.attempt_count,
        operation.last_status_code,
        [attempt.status_code for attempt in operation.attempts],
    )
