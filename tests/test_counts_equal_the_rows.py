"""The journal's counts (counts(), stats()) always equal a count of its rows.

Neither store counts at each read (a GROUP BY takes seconds at a million operations):
each write adds what it changes to the counts in its own transaction (SQLite one row,
PostgreSQL 16 slots, one per connection's backend). Whatever the sequence of writes
(keys, first and later attempts, with and without the lease, status changes, operator
actions, forks, prune, batches with a refused write in them), with two connections
writing at once and a recount between them, and with a writer killed mid-batch, every
figure equals a scan of the rows.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idempotently import IdempotentlyError, Journal
from idempotently._commands import Record, SetStatus, TakeLease
from idempotently._commands_rare import Write
from idempotently._rows import AttemptRecord, Failed
from idempotently.cli import cli
from tests.test_journal import NOW, insert, new_operation

OWNER = "test-owner"
"""The lease owner `insert` journals a key with."""
ATTEMPT_FIGURES = ("attempts", "answered_attempts", "replayed_attempts", "in_progress_attempts")
STATUSES = ("pending", "succeeded", "failed", "needs_reconcile", "abandoned")


def scanned(target: str) -> dict[str, int]:
    """Every figure the counts keep, by scanning the rows (a first attempt is in its
    operation's row, later ones in attempts)."""
    figures = dict.fromkeys((*STATUSES, *ATTEMPT_FIGURES), 0)
    with raw(target) as execute:
        for status, number in execute("SELECT status, count(*) FROM operations GROUP BY status"):
            figures[status] = int(number)
        for prefix, table in (("attempt1_", "operations"), ("", "attempts")):
            (found,) = execute(
                f"SELECT count({prefix}outcome), count({prefix}status_code), "
                f"coalesce(sum({prefix}replayed), 0), "
                f"count(*) FILTER (WHERE {prefix}status_code IN (409, 423)) FROM {table}"
            )
            for name, number in zip(ATTEMPT_FIGURES, found, strict=True):
                figures[name] += int(number)
    return figures


@contextlib.contextmanager
def raw(target: str) -> Iterator[Any]:
    """A function running one statement on the journal's tables as psql or sqlite3 would."""
    if target.startswith("postgres"):
        import psycopg

        with psycopg.connect(target, autocommit=True) as conn:
            conn.execute("SET search_path = idempotently")

            def execute(statement: str) -> list[Any]:
                cursor = conn.execute(statement)  # type: ignore[call-overload]
                return cursor.fetchall() if cursor.description else []

            yield execute
    else:
        with contextlib.closing(sqlite3.connect(target, isolation_level=None)) as conn:
            yield lambda statement: conn.execute(statement).fetchall()


def kept(journal: Journal) -> dict[str, int]:
    """Every figure as the journal reports it: counts() and stats()."""
    stats = journal.stats(now=NOW + 10_000)
    assert stats.counts == journal.counts()
    return {**stats.counts, **{name: getattr(stats, name) for name in ATTEMPT_FIGURES}}


def answer(code: int | None, status: str, *, replayed: bool = False) -> AttemptRecord:
    return AttemptRecord(
        started_at=NOW,
        elapsed=0.01,
        outcome="answered" if code is not None else "maybe_delivered",
        status_code=code,
        replayed=replayed,
        status=status,  # type: ignore[arg-type]
        response_status=code,
    )


# -- any sequence of writes -----------------------------------------------------------

OPERATIONS = 4
ids = st.integers(0, OPERATIONS - 1).map(lambda number: f"op-{number}")
statuses = st.sampled_from(STATUSES)
records = st.builds(
    lambda operation_id, code, status, owner, replayed: (
        "record",
        operation_id,
        code,
        status,
        owner,
        replayed,
    ),
    ids,
    st.sampled_from([None, 201, 409, 423, 500]),
    statuses,
    st.sampled_from([OWNER, None, "someone-else"]),
    st.booleans(),
)
status_changes = st.tuples(st.just("set_status"), ids, statuses, statuses)
one_write = st.one_of(records, status_changes)
steps = st.one_of(
    st.tuples(st.just("insert"), ids),
    records,
    status_changes,
    st.tuples(st.just("lease"), ids),
    st.tuples(st.sampled_from(["settle", "abandon", "fork", "retry"]), ids),
    st.tuples(st.just("prune"), st.sampled_from([0.0, 3600.0])),
    st.tuples(st.just("batch"), st.lists(one_write, min_size=2, max_size=5)),
)


def write_of(step: tuple[Any, ...], now: float) -> Write:
    """The journal write a record or set_status step is."""
    if step[0] == "record":
        _, operation_id, code, status, owner, replayed = step
        return Record(operation_id, answer(code, status, replayed=replayed), now, owner)
    _, operation_id, status, expect = step
    return SetStatus(operation_id, status, "by the test", now, expect)


def run(journal: Journal, step: tuple[Any, ...], now: float) -> None:
    """One step of a sequence; an operator action refused (a finished operation, a live
    lease) changes nothing, as in real use."""
    kind = step[0]
    if kind == "insert":
        insert(journal, new_operation(step[1]))
    elif kind in ("record", "set_status"):
        journal._execute(write_of(step, now))
    elif kind == "lease":
        found = journal.operation(step[1])
        if found is not None:
            journal._execute(TakeLease(found, OWNER, now + 60, now))
    elif kind == "prune":
        at = time.time() + 7200
        expected = journal.prune(older_than=step[1], now=at, dry_run=True)
        assert expected == journal.prune(older_than=step[1], now=at)
    elif kind == "batch":
        journal._store.commit([write_of(write, now) for write in step[1]], False)
    else:
        action = {
            "settle": lambda operation_id: journal.settle(
                operation_id, "succeeded", note="seen", actor="test"
            ),
            "abandon": lambda operation_id: journal.abandon(operation_id, note="no", actor="t"),
            "fork": lambda operation_id: journal.fork(operation_id, note="again", actor="t"),
            "retry": lambda operation_id: journal.retry_now(operation_id, actor="t"),
        }[kind]
        with contextlib.suppress(IdempotentlyError):
            action(step[1])


@pytest.fixture
def fresh(store: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """A function giving a new empty journal's target on the store, each call."""
    numbers = itertools.count()
    if store == "postgres":
        import psycopg

        url = str(request.getfixturevalue("postgres_url"))

        def emptied() -> str:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("DROP SCHEMA IF EXISTS idempotently CASCADE")
            return url

        return emptied
    return lambda: str(tmp_path / f"journal-{next(numbers)}.db")


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(sequence=st.lists(steps, min_size=1, max_size=25))
def test_after_any_sequence_of_writes_the_counts_equal_a_scan_of_the_rows(
    fresh: Any, sequence: list[tuple[Any, ...]]
) -> None:
    """Keys, first and later attempts (with the lease, without an owner, after losing
    it), status changes, operator actions, forks, prune and batches in any order: every
    figure of counts() and stats() equals a scan of the rows (and a prune deletes what
    its dry run counted just before)."""
    target = fresh()
    with Journal(target) as journal:
        for number, step in enumerate(sequence):
            run(journal, step, NOW + number)
        figures = kept(journal)
    assert scanned(target) == figures


@pytest.mark.postgres
def test_a_write_refused_in_a_batch_takes_its_count_change_back_with_it(
    postgres_url: str,
) -> None:
    """A batch whose middle write the server refuses (a status code past integer range):
    its savepoint is rolled back, its change to the counts with it, and the writes
    around it are counted once."""
    with Journal(postgres_url) as journal:
        for number in range(3):
            insert(journal, new_operation(f"op-{number}"))
        outcomes = journal._store.commit(
            [
                Record("op-0", answer(201, "succeeded"), NOW, OWNER),
                Record("op-1", answer(2**40, "failed"), NOW, OWNER),
                Record("op-2", answer(409, "pending", replayed=True), NOW, OWNER),
                SetStatus("op-0", "needs_reconcile", "later", NOW, "succeeded"),
            ],
            False,
        )
        figures = kept(journal)
    assert [None, True] == [outcomes[0], outcomes[3]]
    assert isinstance(outcomes[1], Failed)
    assert scanned(postgres_url) == figures
    expected = {"pending": 2, "needs_reconcile": 1, "attempts": 2, "answered_attempts": 2}
    assert {**expected, "replayed_attempts": 1, "in_progress_attempts": 1} == {
        name: number for name, number in figures.items() if number
    }


# -- two connections at once, and a recount between them -------------------------------


def test_two_connections_writing_at_once_and_recounts_between_them_keep_the_counts_exact(
    journal_target: str,
) -> None:
    """Two journals (two connections: on PostgreSQL, two slots or one) answer, retry and
    settle the same 60 operations at once, while a third recounts again and again
    (`migrate --recount`) until their last round: no change is lost or counted twice."""
    operations = [f"op-{number}" for number in range(60)]
    with Journal(journal_target) as journal:
        for operation_id in operations:
            insert(journal, new_operation(operation_id))
    failures: list[BaseException] = []
    halfway = threading.Event()

    def writer(offset: int) -> None:
        try:
            with Journal(journal_target) as journal:
                for round_number in range(3):
                    if round_number == 2 and offset == 0:
                        # The last round is counted by the writes alone: no recount after.
                        halfway.set()
                        counting.join()
                    for index, operation_id in enumerate(operations):
                        code = (201, 409, 500)[(index + offset + round_number) % 3]
                        status = "succeeded" if code == 201 else "pending"
                        owner = OWNER if round_number == 0 else None
                        journal._execute(Record(operation_id, answer(code, status), NOW, owner))
                        if index % 7 == offset:
                            journal._execute(
                                SetStatus(operation_id, "needs_reconcile", "?", NOW, "pending")
                            )
        except BaseException as error:  # pragma: no cover - reported below
            failures.append(error)

    def recounter() -> None:
        try:
            with Journal(journal_target) as journal:
                while not halfway.is_set():
                    journal._store.recount()
        except BaseException as error:  # pragma: no cover - reported below
            failures.append(error)

    threads = [threading.Thread(target=writer, args=(offset,)) for offset in (0, 1)]
    counting = threading.Thread(target=recounter)
    for thread in [*threads, counting]:
        thread.start()
    for thread in threads:
        thread.join()
    with Journal(journal_target) as journal:
        figures = kept(journal)
    assert [] == failures
    assert scanned(journal_target) == figures
    assert 2 * 3 * len(operations) == figures["attempts"]


# -- a writer killed mid-batch ----------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys
    from idempotently import Journal
    from idempotently._commands import Record, SetStatus
    from idempotently._journal import _postgres
    from idempotently._rows import AttemptRecord

    target, now = sys.argv[1], float(sys.argv[2])
    if target.startswith("postgres"):
        # The batch's last statement waits: the transaction is open, every write of
        # the batch made, when the process is killed.
        _postgres._ADD_NOTED = _postgres._ADD_NOTED.replace(
            " WHERE ", " WHERE (SELECT true FROM pg_sleep(0.2)) AND ", 1
        )
    with Journal(target) as journal:
        for round_number in range(1000):
            writes = []
            for number in range(20):
                code = (201, 409, 500)[(number + round_number) % 3]
                record = AttemptRecord(
                    started_at=now, elapsed=0.01, outcome="answered", status_code=code,
                    status="succeeded" if code == 201 else "pending", response_status=code,
                )
                writes.append(Record(f"op-{number}", record, now, None))
                writes.append(
                    SetStatus(f"op-{number}", "pending", "again", now, "succeeded")
                )
            journal._store.commit(writes, False)
            print(round_number, flush=True)
    """
)


def test_a_writer_killed_mid_batch_leaves_the_counts_exact(
    journal_target: str, tmp_path: Path
) -> None:
    """A process committing batches of answers and status changes is killed (SIGKILL)
    mid-batch: its transaction goes whole, rows and counts together, and every figure
    equals a scan of the rows; the next writer's changes are counted on top."""
    with Journal(journal_target) as journal:
        for number in range(20):
            insert(journal, new_operation(f"op-{number}"))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    environment = {
        **os.environ,
        # The server notices the dead client within 50 ms and rolls its transaction back.
        "PGOPTIONS": "-c client_connection_check_interval=50",
    }
    child = subprocess.Popen(
        [sys.executable, str(script), journal_target, str(NOW)],
        stdout=subprocess.PIPE,
        env=environment,
        text=True,
    )
    assert child.stdout is not None
    for _ in range(3):  # three batches committed: the fourth is under way
        child.stdout.readline()
    child.send_signal(signal.SIGKILL)
    child.wait()
    if journal_target.startswith("postgres"):
        import psycopg

        with psycopg.connect(journal_target, autocommit=True) as conn:
            for _ in range(200):  # the killed client's backend rolls back and leaves
                if not conn.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
                ).fetchall():
                    break
                time.sleep(0.05)
    with Journal(journal_target) as journal:
        journal._execute(Record("op-0", answer(201, "succeeded"), NOW, None))
        figures = kept(journal)
    assert scanned(journal_target) == figures
    assert figures["attempts"] % 20 == 1  # whole batches only, and the one after


# -- the recount ------------------------------------------------------------------------


def test_after_edits_by_hand_migrate_recount_makes_the_counts_exact(journal_target: str) -> None:
    """Rows edited by hand (psql, sqlite3) are not the journal's writes: the counts miss
    them until `idempotently migrate --recount`, which counts every row again (on
    PostgreSQL into slot 0, the other slots zero) and prints the counts."""
    with Journal(journal_target) as journal:
        for number in range(4):
            insert(journal, new_operation(f"op-{number}"))
            journal._execute(Record(f"op-{number}", answer(201, "succeeded"), NOW, OWNER))
    with raw(journal_target) as execute:
        execute("UPDATE operations SET status = 'failed' WHERE operation_id = 'op-1'")
        execute("DELETE FROM operations WHERE operation_id = 'op-2'")
    with Journal(journal_target) as journal:
        drifted = kept(journal)

    recounted = CliRunner().invoke(cli, ["--journal", journal_target, "migrate", "--recount"])

    with Journal(journal_target) as journal:
        figures = kept(journal)
    assert {"succeeded": 4, "attempts": 4, "answered_attempts": 4} == {
        name: number for name, number in drifted.items() if number
    }
    assert scanned(journal_target) == figures
    said = "pending 0, succeeded 2, failed 1, needs_reconcile 0, abandoned 0"
    assert (0, True) == (recounted.exit_code, said in recounted.output)
    if journal_target.startswith("postgres"):
        with raw(journal_target) as execute:
            slots = execute("SELECT slot, succeeded FROM journal_counts WHERE succeeded != 0")
        assert [(0, 2)] == slots


@pytest.mark.postgres
def test_a_write_committed_while_a_recount_counts_is_counted_on_top_of_it(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recount reads the rows in one snapshot, then writes the slots: an answer journaled
    in between (here while the recount sleeps, by a patch) waits for the recount's table
    lock and lands on the recounted slots, never under them."""
    import psycopg

    from idempotently._journal import _postgres

    slow = _postgres._RECOUNT + " WHERE (SELECT true FROM pg_sleep(2))"
    monkeypatch.setattr(_postgres, "_RECOUNT", slow)
    with Journal(postgres_url) as journal, psycopg.connect(postgres_url, autocommit=True) as conn:
        insert(journal, new_operation("op-0"))
        recounting = threading.Thread(target=journal._store.recount)
        recounting.start()
        while (
            recounting.is_alive()
            and not conn.execute(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'PgSleep'"
            ).fetchall()
        ):
            time.sleep(0.01)
        assert recounting.is_alive()  # the answer goes in while the recount sleeps
        journal._execute(Record("op-0", answer(201, "succeeded"), NOW, OWNER))
        recounting.join()
        figures = kept(journal)
    assert scanned(postgres_url) == figures
    assert (1, 1) == (figures["succeeded"], figures["attempts"])
