"""A SQLite journal's counts (no trigger: each batch of writes adds its own changes) equal
a count of its rows after any sequence of journal writes: keys, first and later attempts,
attempts that outlived their lease, status changes, operator actions, prunes, claims,
enqueues, a write failing inside a batch and a batch failing whole (disk full)."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from idempotently import IdempotentlyError, Journal
from idempotently._commands import Enqueue, Insert, Record, SetStatus
from idempotently._commands_rare import JournalCommand
from idempotently._journal import _sqlite
from idempotently._rows import AttemptRecord, Failed
from idempotently._vocabulary import STATUSES, Status
from tests.journal_commands import (
    claim_due,
    execute_together,
    find,
    record_attempt,
    set_status,
    take_lease,
)
from tests.support import recount
from tests.test_journal import NOW, new_operation

IDS = [f"op-{number}" for number in range(5)]
OWNERS = ["me", "other", None]
BODY_LIMIT = 64 * 1024
"""SQLite's limit on one value in these journals (lowered from 1 GB so a body over it is
cheap to make): a write holding a bigger one fails alone inside its batch."""

operation_ids = st.sampled_from(IDS)
owners = st.sampled_from(OWNERS)
statuses = st.sampled_from(STATUSES)
status_codes = st.sampled_from([None, 201, 409, 423, 422, 503])


@st.composite
def records(draw: st.DrawFn) -> AttemptRecord:
    status_code = draw(status_codes)
    return AttemptRecord(
        started_at=NOW,
        elapsed=0.1,
        outcome="maybe_delivered" if status_code is None else "answered",
        status_code=status_code,
        replayed=draw(st.booleans()),
        status=draw(statuses),
        response_status=status_code,
        response_body=None if status_code is None else b"{}",
        lease_until=draw(st.sampled_from([0.0, NOW + 10])),
    )


class CountsFollowTheRows(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = Path(tempfile.mkdtemp(prefix="idempotently-counts-"))
        self.path = self.directory / "journal.db"
        self.journal = Journal(self.path, durability="os")
        self.journal._store._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, BODY_LIMIT)  # type: ignore[attr-defined]
        self.clock = NOW
        self.forks = 0

    def teardown(self) -> None:
        self.journal.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def tick(self) -> float:
        self.clock += 1.0
        return self.clock

    @rule(operation_id=operation_ids, owner=owners, big=st.booleans())
    def insert(self, operation_id: str, owner: str | None, big: bool) -> None:
        new = attrs.evolve(new_operation(operation_id, created_at=self.tick()))
        if owner is None:
            self.journal._execute(Enqueue(new))
        else:
            self.journal._execute(Insert(new, owner, self.clock + 10))

    @rule(operation_id=operation_ids, record=records(), owner=owners)
    def record(self, operation_id: str, record: AttemptRecord, owner: str | None) -> None:
        record_attempt(self.journal, operation_id, record, now=self.tick(), owner=owner)

    @rule(operation_id=operation_ids, owner=st.sampled_from(["me", "other"]))
    def take_lease(self, operation_id: str, owner: str) -> None:
        operation = find(self.journal, operation_id, None)
        if operation is not None:
            take_lease(
                self.journal,
                operation,
                owner=owner,
                lease_until=self.clock + 10,
                now=self.tick(),
            )

    @rule(operation_id=operation_ids, status=statuses, expect=statuses)
    def set_status(self, operation_id: str, status: Status, expect: Status) -> None:
        set_status(
            self.journal, operation_id, status, reason="by test", now=self.tick(), expect=expect
        )

    @rule(
        operation_id=operation_ids,
        action=st.sampled_from(["succeeded", "failed", "abandon", "fork", "retry"]),
    )
    def operator(self, operation_id: str, action: str) -> None:
        with contextlib.suppress(IdempotentlyError):
            if action in ("succeeded", "failed"):
                self.journal.settle(operation_id, action, note="by test")  # type: ignore[arg-type]
            elif action == "abandon":
                self.journal.abandon(operation_id, note="by test")
            elif action == "fork":
                self.journal.fork(operation_id, note="by test")
            else:
                self.journal.retry_now(operation_id)

    @rule(older_than=st.sampled_from([0.0, 5.0, 1e6]))
    def prune(self, older_than: float) -> None:
        # Operator actions write with the real clock: prune far after both.
        self.journal.prune(older_than=older_than, now=4e9)

    @rule(owner=st.sampled_from(["me", "other"]), limit=st.integers(1, 3))
    def claim(self, owner: str, limit: int) -> None:
        claim_due(
            self.journal,
            owner=owner,
            now=self.tick() + 100,
            lease_until=self.clock + 200,
            limit=limit,
        )

    @rule(
        answers=st.lists(st.tuples(operation_ids, records(), owners), min_size=1, max_size=4),
        spoiled=st.integers(0, 4),
    )
    def batch_with_one_write_too_big(
        self, answers: list[tuple[str, AttemptRecord, str | None]], spoiled: int
    ) -> None:
        """Several answers in one transaction, one of them holding a body over SQLite's
        limit: that one fails alone (its savepoint rolled back, its count changes too)."""
        now = self.tick()
        commands: list[JournalCommand] = [
            Record(operation_id, record, now, owner) for operation_id, record, owner in answers
        ]
        index = spoiled % len(commands)
        too_big = attrs.evolve(answers[index][1], response_body=b"x" * (BODY_LIMIT + 1))
        commands[index] = Record(answers[index][0], too_big, now, answers[index][2])
        commands.append(SetStatus(answers[0][0], "abandoned", "by test", now, "pending"))
        outcomes = execute_together(self.journal, commands)
        failed = outcomes[index]
        if find(self.journal, answers[index][0], None) is not None:
            assert isinstance(failed, Failed), outcomes

    @rule(operation_id=operation_ids, record=records(), owner=owners)
    def batch_on_a_full_disk(
        self, operation_id: str, record: AttemptRecord, owner: str | None
    ) -> None:
        """A batch that runs out of room (SQLITE_FULL rolls the whole transaction back):
        nothing of it is written, its counts included."""
        conn: Any = self.journal._store._conn  # type: ignore[attr-defined]
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")
        try:
            big = new_operation(f"full-{self.clock}", created_at=self.tick(), body=b"y" * 60_000)
            outcomes = execute_together(
                self.journal,
                [
                    Record(operation_id, record, self.clock, owner),
                    Insert(big, "me", self.clock + 10),
                ],
            )
        finally:
            conn.execute("PRAGMA max_page_count = 1073741823")
        assert all(isinstance(outcome, Failed) for outcome in outcomes), outcomes

    @invariant()
    def counts_are_the_rows(self) -> None:
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            truth = recount(conn, now=self.clock)
            ids = [row[0] for row in conn.execute("SELECT operation_id FROM operations")]
        assert truth.counts == self.journal.counts()
        assert truth == attrs.evolve(self.journal.stats(now=self.clock), expiring=None)
        for operation_id in ids:
            operation = self.journal.operation(operation_id)
            assert operation is not None
            assert list(range(1, operation.attempt_count + 1)) == [
                attempt.number for attempt in operation.attempts
            ]


CountsFollowTheRows.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_counts_follow_the_rows = pytest.mark.filterwarnings("ignore")(CountsFollowTheRows.TestCase)


def test_the_recount_statement_is_the_scan_of_the_rows(tmp_path: Path) -> None:
    """`_RECOUNT` (what `migrate --recount` runs) writes the figures a scan finds."""
    machine = CountsFollowTheRows()
    try:
        for number, status in enumerate(["succeeded", "failed", "pending"]):
            machine.insert(IDS[number], "me", False)
            machine.record(
                IDS[number],
                AttemptRecord(
                    started_at=NOW, elapsed=0.1, outcome="answered", status_code=201, status=status
                ),
                "me",
            )
        machine.journal._store._conn.execute(  # type: ignore[attr-defined]
            "UPDATE journal_counts SET succeeded = 7"
        )
        machine.journal._store._conn.execute(_sqlite._RECOUNT)  # type: ignore[attr-defined]
        machine.counts_are_the_rows()
    finally:
        machine.teardown()
