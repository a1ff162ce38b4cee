"""The journal's writer and stores under attack: batches and savepoints, durability per
batch, the one writer, the moved-file check, forks, leases renewed before a send, and
schema version 3. Each test states one promise (from an adversarial review)."""

from __future__ import annotations

import contextlib
import gc
import os
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import pytest

import idempotently
from idempotently import Journal, JournalCorruptError, JournalMovedError
from idempotently._commands import ClaimDue, Find, Insert, Record, Release, RenewLease, TakeLease
from idempotently._journal._sqlite import _INSERT_OPERATION
from idempotently._journal._writer import _Job
from idempotently._rows import AttemptRecord, Failed
from tests.faults import around_commit
from tests.journal_commands import (
    execute_together,
    extend_leases,
    find,
    insert_operation,
    release_lease,
    set_status,
    take_lease,
)
from tests.support import URL, recount
from tests.test_fork import in_child
from tests.test_journal import NOW, new_operation
from tests.test_writer import attempt, journal_with_operations

# -- helpers -------------------------------------------------------------------------------


def retrying(number: int) -> Record:
    """A 503 on ``op-<number>``: the operation stays pending, its lease released."""
    return Record(
        f"op-{number}",
        AttemptRecord(
            started_at=NOW,
            elapsed=0.1,
            outcome="answered",
            status_code=503,
            status="pending",
        ),
        NOW,
        key=f"key-{number}",
    )


@contextlib.contextmanager
def key_commit_levels(journal: Journal) -> Iterator[list[str]]:
    """The ``synchronous`` level in force when each transaction holding a new key's row
    committed (a lone INSERT in autocommit commits as it runs), from SQLite's own trace."""
    conn = journal._conn
    statements: list[str] = []
    level = {1: "NORMAL", 2: "FULL", 0: "OFF", 3: "EXTRA"}[
        conn.execute("PRAGMA synchronous").fetchone()[0]
    ]
    conn.set_trace_callback(statements.append)
    levels: list[str] = []
    try:
        yield levels
    finally:
        conn.set_trace_callback(None)
        in_transaction = holds_key = False
        # SQLite traces a statement again for each trigger it fires; values are expanded,
        # so a repeat in a row is the same statement.
        for statement in [s for n, s in enumerate(statements) if statements[n - 1 : n] != [s]]:
            text = statement.strip().upper()
            if text.startswith("PRAGMA SYNCHRONOUS ="):
                level = text.split("=")[1].strip()
            elif text.startswith("BEGIN"):
                in_transaction, holds_key = True, False
            elif text.startswith("COMMIT"):
                if holds_key:
                    levels.append(level)
                in_transaction = holds_key = False
            elif text == "ROLLBACK":
                in_transaction = holds_key = False
            elif text.startswith("INSERT INTO OPERATIONS"):
                if in_transaction:
                    holds_key = True
                else:
                    levels.append(level)


def counting_transport() -> tuple[httpx.MockTransport, Counter[str]]:
    """A 201 for everything, and how many times each Idempotency-Key was sent."""
    sent: Counter[str] = Counter()
    lock = threading.Lock()

    def answer(request: httpx.Request) -> httpx.Response:
        with lock:
            sent[request.headers["idempotency-key"]] += 1
        return httpx.Response(201, json={"id": "ch_1"})

    return httpx.MockTransport(answer), sent


# -- batches and savepoints ------------------------------------------------------------------


def test_a_closed_journal_tells_each_batched_write_about_its_own_operation(
    tmp_path: Path,
) -> None:
    """An async batch on a closed journal: each write's error names its own operation and
    says what is true of it (a Record's attempt may have been sent), each its own object."""
    journal = journal_with_operations(tmp_path, 1)
    journal.close()
    outcomes = execute_together(
        journal, [Insert(new_operation("new-1"), "me", NOW + 10), attempt(1)]
    )
    errors = [outcome.error for outcome in outcomes if isinstance(outcome, Failed)]
    assert 2 == len(errors)
    assert [("new-1", "key-new-1"), ("op-1", "key-1")] == [
        (error.operation_id, error.key) for error in errors
    ]
    assert errors[0] is not errors[1]
    assert "was in flight" in str(errors[1])


def test_a_disk_full_batch_fails_every_write_and_leaves_no_transaction(tmp_path: Path) -> None:
    """The disk fills up in the middle of a batch: every write of it fails with a
    JournalWriteError saying the disk is full (none is reported written), the connection is
    out of any transaction, its synchronous level is the one the store believes, and once
    there is room the same writes commit."""
    journal = journal_with_operations(tmp_path, 2)
    journal._fsync_keys = True  # as with durability="fsync": the batch commits under FULL
    conn = journal._conn
    conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}")
    keys = [Insert(new_operation(f"new-{n}", body=b"x" * 3000), "me", NOW + 10) for n in range(4)]
    with journal:
        outcomes = execute_together(journal, [attempt(1), *keys, attempt(2)])
        state = (
            conn.in_transaction,
            journal._store._synchronous,  # type: ignore[attr-defined]
            {1: "NORMAL", 2: "FULL"}[conn.execute("PRAGMA synchronous").fetchone()[0]],
        )
        before = {op.operation_id: op.status for op in journal.operations()}
        conn.execute("PRAGMA max_page_count = 1000000")
        again = execute_together(journal, [attempt(1), *keys, attempt(2)])
    assert all(isinstance(outcome, Failed) for outcome in outcomes)
    assert all(
        isinstance(outcome.error, idempotently.JournalWriteError)
        and "disk is full" in str(outcome.error)
        for outcome in outcomes
        if isinstance(outcome, Failed)
    )
    assert (False, state[2]) == (state[0], state[1])
    assert {"op-1": "pending", "op-2": "pending"} == before
    assert [None, True, True, True, True, None] == again


def test_a_failing_write_rolls_back_only_its_own_savepoint_and_the_counts_stay_exact(
    tmp_path: Path,
) -> None:
    """One write over SQLite's size limit among status changes: its savepoint alone is rolled
    back (its count changes included), and every count still equals a recount of the rows."""
    journal = journal_with_operations(tmp_path, 4)
    with journal:
        journal._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 4096)
        outcomes = execute_together(
            journal, [attempt(1), retrying(2), attempt(3, b"x" * 10_000), attempt(4)]
        )
        figures = journal.stats(now=NOW + 100)
        truth = recount(journal._conn, now=NOW + 100)
    assert [None, None, None] == [outcomes[0], outcomes[1], outcomes[3]]
    assert isinstance(outcomes[2], Failed)
    assert truth == figures
    assert {"pending": 2, "succeeded": 2} == {
        status: n for status, n in figures.counts.items() if n
    }


def by_hand(journal_target: str, statement: str) -> None:
    """Run ``statement`` on the journal's tables as an operator would (sqlite3, psql)."""
    if journal_target.startswith("postgres"):
        import psycopg

        with psycopg.connect(journal_target, autocommit=True) as conn:
            conn.execute("SET search_path = idempotently")  # type: ignore[arg-type]
            conn.execute(statement)  # type: ignore[arg-type]
    else:
        with contextlib.closing(sqlite3.connect(journal_target, isolation_level=None)) as conn:
            conn.execute(statement)


def with_operations(journal_target: str, count: int) -> Journal:
    """A journal on either store holding operations op-1 ... op-<count>, unleased."""
    journal = Journal(journal_target, durability="os")
    for number in range(1, count + 1):
        assert insert_operation(
            journal, new_operation(f"op-{number}", f"key-{number}"), owner="me", lease_until=0.0
        )
    return journal


@pytest.mark.parametrize(
    "store",
    [
        pytest.param("sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_an_attempt_count_lowered_by_hand_is_a_corrupt_error(journal_target: str) -> None:
    """A damaged row (attempt_count below the attempts it has): recording the next attempt
    raises JournalCorruptError naming the operation, alone and in a batch; never a raw
    database error."""
    journal = with_operations(journal_target, 2)
    with journal:
        journal._execute(retrying(1))
        by_hand(journal_target, "UPDATE operations SET attempt_count = 0")
        with pytest.raises(JournalCorruptError) as lone:
            journal._execute(retrying(1))
        outcomes = execute_together(journal, [retrying(1), attempt(2)])
    assert "op-1" == lone.value.operation_id
    assert isinstance(outcomes[0], Failed)
    # In a PostgreSQL pipeline psycopg may report the refusal only as "pipeline aborted":
    # the write still fails alone, as a JournalWriteError.
    assert isinstance(outcomes[0].error, JournalCorruptError) or (
        "pipeline aborted" in str(outcomes[0].error)
    )
    assert None is outcomes[1]


@pytest.mark.parametrize(
    "store",
    [
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_a_claim_meeting_a_damaged_row_reads_it_as_damaged(journal_target: str) -> None:
    """A resume worker's claim reads a damaged row while another caller's key shares its
    batch: the claim returns the sound row and the damaged one as its stand-in (what is
    wrong in ``damaged``, for the worker to report, never to send); the key is journaled
    as usual."""
    journal = with_operations(journal_target, 2)
    with journal:
        by_hand(
            journal_target,
            "UPDATE operations SET request_headers = 'not json' WHERE operation_id = 'op-2'",
        )
        outcomes = execute_together(
            journal,
            [Insert(new_operation("new-1"), "me", NOW), ClaimDue("worker", NOW + 5, NOW + 60, 10)],
        )
        journaled = find(journal, "new-1", None)
    assert True is outcomes[0]
    claimed = {operation.operation_id: operation for operation in outcomes[1]}
    assert ["new-1", "op-1", "op-2"] == sorted(claimed)  # new-1: unleased, due too
    assert None is claimed["op-1"].damaged
    damaged = claimed["op-2"].damaged
    assert damaged is not None and "request_headers is not valid JSON" in damaged
    assert ("key-2", b"") == (claimed["op-2"].key, claimed["op-2"].request_body)
    assert journaled is not None


@pytest.mark.postgres
def test_a_value_postgresql_refuses_fails_alone_in_its_savepoint(postgres_url: str) -> None:
    """A URL holding a NUL byte (text PostgreSQL cannot store) among other writes: that
    write fails alone with a JournalWriteError naming its operation, the others commit,
    and the pooled connection serves the next write."""
    journal = with_operations(postgres_url, 2)
    bad = attrs.evolve(new_operation("bad"), url="https://api.test/\x00")
    with journal:
        outcomes = execute_together(
            journal, [Insert(new_operation("new-1"), "me", NOW), Insert(bad, "me", NOW), attempt(1)]
        )
        journal._execute(attempt(2))
        statuses = {op.operation_id: op.status for op in journal.operations()}
    assert [True, None] == [outcomes[0], outcomes[2]]
    assert isinstance(outcomes[1], Failed)
    assert isinstance(outcomes[1].error, idempotently.JournalWriteError)
    assert ("bad", "key-bad") == (outcomes[1].error.operation_id, outcomes[1].error.key)
    assert {"new-1": "pending", "op-1": "succeeded", "op-2": "succeeded"} == statuses


# -- durability, batch by batch --------------------------------------------------------------


@pytest.mark.parametrize(("durability", "level"), [("fsync", "FULL"), ("os", "NORMAL")])
def test_every_key_commits_at_its_durability_whoever_leads_the_batch(
    tmp_path: Path, durability: str, level: str
) -> None:
    """Sequential calls (a lone INSERT in autocommit) and 12 threads at once (batches led by
    whichever thread, its own write a key or an answer): every transaction holding a key
    commits with synchronous=FULL under "fsync", and never with FULL under "os"."""
    journal = Journal(tmp_path / "journal.db", durability=durability)  # type: ignore[arg-type]
    transport, sent = counting_transport()
    with (
        idempotently.Session(journal, transport=transport) as session,
        key_commit_levels(journal) as levels,
    ):
        for n in range(3):
            session.post(URL, json={"n": n}, operation_id=f"alone-{n}")
        threads = [
            threading.Thread(
                target=session.post,
                args=(URL,),
                kwargs={"json": {"n": n}, "operation_id": f"t-{n}"},
            )
            for n in range(12)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    assert 15 == len(sent)
    assert 4 <= len(levels) <= 15
    assert {level} == set(levels)


@pytest.mark.anyio
@pytest.mark.parametrize(("durability", "level"), [("fsync", "FULL"), ("os", "NORMAL")])
async def test_an_async_batch_of_keys_commits_at_its_durability(
    tmp_path: Path, durability: str, level: str
) -> None:
    """20 tasks of an AsyncSession: their keys, batched in the worker thread, commit with
    synchronous=FULL under "fsync" and without it under "os"."""
    journal = Journal(tmp_path / "journal.db", durability=durability)  # type: ignore[arg-type]
    transport, sent = counting_transport()
    with key_commit_levels(journal) as levels:
        async with (
            idempotently.AsyncSession(journal, transport=transport) as session,
            anyio.create_task_group() as tasks,
        ):
            for n in range(20):
                tasks.start_soon(
                    lambda n=n: session.post(URL, json={"n": n}, operation_id=f"a-{n}")
                )
    assert 20 == len(sent)
    assert {level} == set(levels)


def test_after_a_failed_durable_batch_the_next_key_is_still_fsyncd(tmp_path: Path) -> None:
    """A durable batch that fails (disk full) leaves the level right: the next key's lone
    insert commits under FULL and the next answer under NORMAL."""
    journal = Journal(tmp_path / "journal.db")
    conn = journal._conn
    with journal:
        assert insert_operation(journal, new_operation("op-1"), owner="me", lease_until=NOW)
        conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}")
        with pytest.raises(idempotently.JournalWriteError, match="disk is full"):
            insert_operation(
                journal, new_operation("op-2", body=b"x" * 20_000), owner="me", lease_until=NOW
            )
        conn.execute("PRAGMA max_page_count = 1000000")
        with key_commit_levels(journal) as levels:
            assert insert_operation(journal, new_operation("op-3"), owner="me", lease_until=NOW)
        journal._execute(Record("op-1", attempt(1).record, NOW))
        after_answer = conn.execute("PRAGMA synchronous").fetchone()[0]
    assert ["FULL"] == levels
    assert 1 == after_answer  # NORMAL


# -- the one writer -------------------------------------------------------------------------


def test_writes_committed_just_before_a_keyboard_interrupt_are_not_run_again(
    tmp_path: Path,
) -> None:
    """Ctrl-C lands in the leader right after its batch committed: the followers' writes
    are never run a second time (one attempt row, no key found "taken" by its own row);
    each follower is told its write may or may not be journaled, never that it failed
    for sure, and its key's row is there for a resume."""
    journal = journal_with_operations(tmp_path, 2)
    # Two other threads' writes, queued while the leader's commit was in flight.
    followers = [_Job(attempt(1), False), _Job(Insert(new_operation("new-1"), "me", NOW), False)]
    journal._writer._waiting.extend(followers)
    interrupted: list[object] = []

    def ctrl_c(write: object) -> None:
        if not interrupted:
            interrupted.append(write)
            raise KeyboardInterrupt

    with journal:
        with around_commit(journal, Release, after=ctrl_c), pytest.raises(KeyboardInterrupt):
            journal._execute(Release("op-2", "me"))
        # The next caller leads (in a real process: one of the followers, woken).
        journal._execute(Release("op-2", "me"))
        operation = journal.operation("op-1")
        new_key = journal.operation("new-1")
    assert operation is not None
    assert (1, 1) == (len(operation.attempts), operation.attempt_count)
    assert [True, True] == [followers[0].done, followers[1].done]
    assert all(
        isinstance(job.error, idempotently.JournalWriteError) and "may or may not" in str(job.error)
        for job in followers
    )
    assert new_key is not None and "pending" == new_key.status


def test_fifty_threads_and_two_event_loops_send_each_operation_exactly_once(
    tmp_path: Path,
) -> None:
    """40 threads and 2 event loops in 2 more threads (10 tasks each), 20 operations each
    called by 3 of them at once on one Journal: every key is sent exactly once, every
    operation succeeds, and every caller gets its answer (or OperationInProgressError)."""
    journal = Journal(tmp_path / "journal.db", durability="os")
    transport, sent = counting_transport()
    outcomes: list[object] = []
    calls = [f"op-{n % 20}" for n in range(60)]

    def record(call: Any) -> None:
        try:
            outcomes.append(call().status_code)
        except idempotently.OperationInProgressError as error:
            outcomes.append(type(error).__name__)

    async def loop(ids: Sequence[str]) -> None:
        async with (
            idempotently.AsyncSession(journal, transport=transport) as session,
            anyio.create_task_group() as tasks,
        ):
            for operation_id in ids:

                async def one(operation_id: str = operation_id) -> None:
                    try:
                        outcomes.append(
                            (
                                await session.post(URL, json={}, operation_id=operation_id)
                            ).status_code
                        )
                    except idempotently.OperationInProgressError as error:
                        outcomes.append(type(error).__name__)

                tasks.start_soon(one)

    with idempotently.Session(journal, transport=transport) as session:
        threads = [
            threading.Thread(
                target=record,
                args=(
                    lambda operation_id=operation_id: session.post(
                        URL, json={}, operation_id=operation_id
                    ),
                ),
            )
            for operation_id in calls[:40]
        ]
        threads += [
            threading.Thread(target=anyio.run, args=(loop, calls[40:50])),
            threading.Thread(
                target=anyio.run, args=(loop, calls[50:60]), kwargs={"backend": "trio"}
            ),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        counts = journal.counts()
    journal.close()
    assert 20 == len(sent)
    assert {1} == set(sent.values())
    assert 20 == counts["succeeded"]
    assert 60 == len(outcomes)
    assert set(outcomes) <= {201, "OperationInProgressError"}


# -- the moved-file check --------------------------------------------------------------------


def test_a_moved_journal_still_takes_answers_and_refuses_only_new_keys(tmp_path: Path) -> None:
    """The file is renamed away while a batch holds an answer, a lease taken and a new key:
    the answer commits, the lease and the key fail alone with JournalMovedError."""
    path = tmp_path / "journal.db"
    journal = journal_with_operations(tmp_path, 2)
    with journal:
        operation = journal.operation("op-2")
        assert operation is not None
        os.rename(path, tmp_path / "elsewhere.db")
        outcomes = execute_together(
            journal,
            [
                attempt(1),
                TakeLease(operation, "other", NOW + 10, NOW + 20),
                Insert(new_operation("new-1"), "me", NOW + 10),
            ],
        )
        status = journal._store.operation("op-1")
    assert None is outcomes[0]
    assert [JournalMovedError, JournalMovedError] == [
        type(outcome.error) for outcome in outcomes[1:] if isinstance(outcome, Failed)
    ]
    assert status is not None and "succeeded" == status.status


def test_a_journal_moved_between_the_check_and_the_commit_sends_nothing(tmp_path: Path) -> None:
    """Another process renames the file just after the moved-file check: the new key is
    still refused (JournalMovedError), since nobody would resume it."""
    path = tmp_path / "journal.db"
    journal = Journal(path)
    store = journal._store
    real_check = store.check_identity

    def check_then_renamed() -> None:
        real_check()
        if path.exists():
            os.rename(path, tmp_path / "elsewhere.db")

    store.check_identity = check_then_renamed  # type: ignore[method-assign]
    with journal, pytest.raises(JournalMovedError):
        insert_operation(journal, new_operation("op-1"), owner="me", lease_until=NOW + 10)


# -- forks ------------------------------------------------------------------------------------


def test_a_child_closing_its_parents_journal_mid_commit_leaves_the_parents_file_whole(
    tmp_path: Path,
) -> None:
    """A thread of the parent is inside a write transaction (pages already spilled to the
    WAL) when the process forks; the child closes the parent's journal and drops it: the
    parent's transaction commits, every row is there and the file passes integrity_check
    (closing the inherited connection would roll back into the shared WAL index)."""
    path = tmp_path / "journal.db"
    journal = Journal(path, durability="os")
    journal._conn.execute("PRAGMA cache_size = 5")  # spill dirty pages into the WAL early
    inside, commit = threading.Event(), threading.Event()

    def write() -> None:
        with journal._store._write() as conn:  # type: ignore[attr-defined]
            for n in range(100):
                row = new_operation(f"op-{n}", body=b"m" * 3000).row("me", 0.0)
                conn.execute(_INSERT_OPERATION, row)
            inside.set()
            commit.wait(timeout=10)

    writer = threading.Thread(target=write)
    writer.start()
    inside.wait(timeout=10)

    def child() -> str:
        nonlocal journal
        journal.close()
        del journal
        gc.collect()
        return "closed"

    outcome = in_child(child)
    commit.set()
    writer.join(timeout=10)
    journal.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT count(*) FROM operations").fetchone()[0]
        check = conn.execute("PRAGMA integrity_check").fetchone()[0]
    assert {"returned": "'closed'"} == outcome
    assert (100, "ok") == (rows, check)


def test_a_grandchild_names_the_process_that_opened_the_journal(tmp_path: Path) -> None:
    """A fork of a fork using the original Session: the error names the process that opened
    the journal, not the intermediate child."""
    opener = os.getpid()
    with idempotently.Session(
        tmp_path / "journal.db", transport=httpx.MockTransport(lambda r: httpx.Response(201))
    ) as session:

        def grandchild() -> object:
            return session.post(URL, json={}, operation_id="in-grandchild")

        outcome = in_child(lambda: in_child(grandchild))
    assert "JournalError" in outcome["returned"]  # type: ignore[operator]
    assert f"opened in process {opener}," in outcome["returned"]  # type: ignore[operator]


# -- leases renewed before a send ----------------------------------------------------------


def test_a_call_whose_lease_was_taken_and_released_meanwhile_sends_nothing(
    tmp_path: Path,
) -> None:
    """A hook stalls a call past its lease; another caller takes the lease over and releases
    it (its own call ended early): the stalled call's renewal fails, it raises
    OperationInProgressError and sends nothing."""
    fake = {"now": NOW}
    transport, sent = counting_transport()
    journal = Journal(tmp_path / "journal.db")
    took: list[bool] = []

    def stall_and_steal(event: object) -> None:
        if type(event).__name__ != "OperationStarted":
            return
        fake["now"] += 100  # the lease (10 s) ran out while the hook ran
        operation = journal.operation("op-1")
        assert operation is not None
        took.append(take_lease(journal, operation, owner="other", lease_until=NOW + 200, now=NOW))
        release_lease(journal, "op-1", owner="other")

    with (
        idempotently.Session(
            journal,
            transport=transport,
            clock=lambda: fake["now"],
            lease_duration=10,
            hooks=[stall_and_steal],
        ) as session,
        pytest.raises(idempotently.OperationInProgressError),
    ):
        session.post(URL, json={}, operation_id="op-1")
    operation = journal.operation("op-1")
    journal.close()
    assert [True] == took
    assert 0 == len(sent)
    assert operation is not None and "pending" == operation.status


def test_a_renewal_racing_the_heartbeat_never_shortens_nor_steals_a_lease(
    tmp_path: Path,
) -> None:
    """The heartbeat extends a lease while a renewal of the same owner lands: the lease ends
    at least at the later of the two; a renewal by another owner changes nothing."""
    journal = journal_with_operations(tmp_path, 1)
    with journal:
        extended = extend_leases(journal, [("op-1", "me")], lease_until=NOW + 50, now=NOW)
        renewed = execute_together(
            journal,
            [RenewLease("op-1", "me", NOW + 40, NOW), RenewLease("op-1", "thief", NOW + 99, NOW)],
        )
        extend_leases(journal, [("op-1", "me")], lease_until=NOW + 45, now=NOW)
        operation = journal.operation("op-1")
    assert 1 == extended
    assert [True, False] == renewed
    assert operation is not None
    assert ("me", NOW + 45) == (operation.lease_owner, operation.lease_until)


# -- async batches ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_call_cancelled_while_its_key_commits_leaves_it_journaled_and_unleased(
    tmp_path: Path,
) -> None:
    """Cancelled while its batch is in the worker thread: the key's write completes, nothing
    is sent, and the lease is released (resume may send it at once, with the same key)."""
    journal = Journal(tmp_path / "journal.db", durability="os")
    transport, sent = counting_transport()
    in_commit, go_on = threading.Event(), threading.Event()

    def hold(write: object) -> None:
        in_commit.set()
        go_on.wait(timeout=10)

    async with idempotently.AsyncSession(journal, transport=transport) as session:
        with around_commit(journal, Insert, before=hold):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(lambda: session.post(URL, json={}, operation_id="op-1"))
                await anyio.to_thread.run_sync(in_commit.wait, 10)
                tasks.cancel_scope.cancel()
                go_on.set()
        operation = journal.operation("op-1")
    assert 0 == len(sent)
    assert operation is not None
    assert ("pending", None, 0.0) == (
        operation.status,
        operation.lease_owner,
        operation.lease_until,
    )


def test_a_read_that_fails_in_a_batch_fails_alone(tmp_path: Path) -> None:
    """An async batch mixing reads and writes, one read hitting a damaged row: that read
    gets its JournalCorruptError, the other read and the writes their results."""
    journal = journal_with_operations(tmp_path, 3)
    with journal:
        journal._conn.execute(
            "UPDATE operations SET request_headers = 'not json' WHERE operation_id = 'op-3'"
        )
        outcomes = execute_together(
            journal, [Find("op-3", None), attempt(1), Find("op-2", None), retrying(2)]
        )
        statuses = [op.status for op in journal.operations(status=["succeeded"])]
    assert isinstance(outcomes[0], Failed)
    assert isinstance(outcomes[0].error, JournalCorruptError)
    assert "op-3" == outcomes[0].error.operation_id
    assert None is outcomes[1] and None is outcomes[3]
    assert "op-2" == outcomes[2].operation_id
    assert ["succeeded"] == statuses


# -- schema version 3 -------------------------------------------------------------------------


@pytest.mark.parametrize("readonly", [False, True])
@pytest.mark.parametrize(
    "damage",
    ["DROP INDEX operations_settled", "DROP INDEX operations_pending", "DROP TABLE journal_counts"],
)
def test_a_journal_missing_a_part_is_a_corrupt_error(
    tmp_path: Path, damage: str, readonly: bool
) -> None:
    """A journal without one of its indexes or its counts: opening it is a
    JournalCorruptError, read-only or not, and the file is not repaired behind our back."""
    path = tmp_path / "journal.db"
    Journal(path).close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(damage)
    with pytest.raises(JournalCorruptError, match="missing journal tables or indexes"):
        Journal(path, readonly=readonly)


def test_after_hand_edits_in_the_sqlite3_shell_a_recount_makes_the_counts_exact(
    tmp_path: Path,
) -> None:
    """The counts follow the journal's own writes, not a trigger: an operator who settles,
    reopens, inserts and deletes rows by hand runs recount() (`migrate --recount`), and
    counts() equals a scan of the rows again, and keeps following the journal's writes."""
    journal = journal_with_operations(tmp_path, 4)
    conn = journal._conn
    with journal:
        journal._execute(attempt(1))
        conn.execute("UPDATE operations SET status = 'needs_reconcile' WHERE operation_id = 'op-2'")
        conn.execute("UPDATE operations SET status = 'pending' WHERE operation_id = 'op-1'")
        conn.execute("DELETE FROM operations WHERE operation_id = 'op-3'")
        columns = (
            "delivery, method, url, request_headers, request_body, fingerprint, profile, "
            "key_header, created_at, updated_at, key_expires_at"
        )
        conn.execute(
            f"INSERT INTO operations (operation_id, key, status, {columns}) "
            f"SELECT 'copy', 'key-copy', 'failed', {columns} "
            "FROM operations WHERE operation_id = 'op-4'"
        )
        journal._store.recount()
        settled = set_status(
            journal, "op-2", "abandoned", reason="by hand", now=NOW, expect="needs_reconcile"
        )
        figures = journal.stats(now=NOW + 100)
        truth = recount(conn, now=NOW + 100)
    assert settled
    assert truth == figures
    assert {"pending": 2, "abandoned": 1, "failed": 1} == {
        status: n for status, n in figures.counts.items() if n
    }
