"""The journal's one writer: concurrent writes share one commit, and nobody returns early."""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

import idempotently
from idempotently._commands import Insert, Record
from idempotently._journal._writer import Writer
from idempotently._rows import AttemptRecord, Failed
from tests.journal_commands import execute_together, insert_operation
from tests.support import URL
from tests.test_journal import NOW, new_operation


def writer_of(commit: Any) -> Writer:
    """A writer over ``commit(items)`` (no durability: none of these writes is a key)."""
    return Writer(lambda writes, durable: commit(writes), lambda write: False)


class SlowCommit:
    """A commit that waits until ``gate`` opens, recording each batch it was given."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.committed: set[int] = set()

    def __call__(self, items: Sequence[int]) -> list[int]:
        self.gate.wait(timeout=10)
        self.batches.append(list(items))
        self.committed.update(items)
        return [item * 10 for item in items]


def submit_all(
    group: Writer, items: range
) -> tuple[dict[int, int | Exception], list[threading.Thread]]:
    """Submit each item from its own thread; the results as they come, and the threads."""
    results: dict[int, int | Exception] = {}

    def one(item: int) -> None:
        try:
            results[item] = group.write(item)
        except Exception as error:
            results[item] = error

    threads = [threading.Thread(target=one, args=(item,)) for item in items]
    for thread in threads:
        thread.start()
    return results, threads


def test_writes_arriving_during_a_commit_share_the_next_one() -> None:
    """While one batch commits, every other caller waits and the next batch takes them all:
    20 writes in 2 commits, each caller with its own result."""
    commit = SlowCommit()
    group: Writer = writer_of(commit)
    first = threading.Thread(target=group.write, args=(0,))
    first.start()
    while not group._committing:
        pass  # the first write is now being committed, behind the gate
    results, threads = submit_all(group, range(1, 20))
    while len(group._waiting) < 19:
        pass
    commit.gate.set()
    for thread in [first, *threads]:
        thread.join(timeout=10)
    assert [[0], list(range(1, 20))] == [sorted(batch) for batch in commit.batches]
    assert {item: item * 10 for item in range(1, 20)} == results


def test_a_caller_returns_only_once_its_write_is_committed() -> None:
    """No caller gets a result before the commit that holds its write has finished."""
    commit = SlowCommit()
    group: Writer = writer_of(commit)
    seen: list[bool] = []

    def one(item: int) -> None:
        group.write(item)
        seen.append(item in commit.committed)

    threads = [threading.Thread(target=one, args=(item,)) for item in range(8)]
    for thread in threads:
        thread.start()
    commit.gate.set()
    for thread in threads:
        thread.join(timeout=10)
    assert [True] * 8 == seen


def test_a_failed_commit_fails_every_write_in_it_and_no_other() -> None:
    """A transaction that fails is every caller's error in that batch; the next batch commits."""
    calls: list[list[int]] = []

    def flaky(items: Sequence[int]) -> list[int]:
        calls.append(list(items))
        if len(calls) == 1:
            raise OSError("disk full")
        return list(items)

    group: Writer = writer_of(flaky)
    with pytest.raises(OSError, match="disk full"):
        group.write(1)
    assert 2 == group.write(2)


def test_a_leader_interrupted_mid_commit_hands_the_others_to_the_next_leader() -> None:
    """KeyboardInterrupt in the committing caller: the writes that waited on it are
    committed by the next caller, not lost and not left waiting."""
    commit_calls: list[list[int]] = []
    release = threading.Event()

    def commit(items: Sequence[int]) -> list[int]:
        commit_calls.append(list(items))
        if len(commit_calls) == 1:
            release.wait(timeout=10)
            raise KeyboardInterrupt
        return list(items)

    group: Writer = writer_of(commit)
    interrupted: list[BaseException] = []

    def leader() -> None:
        try:
            group.write(0)
        except KeyboardInterrupt as error:
            interrupted.append(error)

    first = threading.Thread(target=leader)
    first.start()
    while not group._committing:
        pass
    results, threads = submit_all(group, range(1, 4))
    while len(group._waiting) < 3:
        pass
    release.set()
    for thread in [first, *threads]:
        thread.join(timeout=10)
    assert 1 == len(interrupted)
    assert {1: 1, 2: 2, 3: 3} == results


def test_writes_submitted_together_commit_together_each_with_its_own_outcome() -> None:
    """write_many puts its items in one commit (with whatever else waited) and returns
    each item's result; a failed commit is each item's own copy of the error."""
    batches: list[list[int]] = []

    def commit(items: Sequence[int]) -> list[int]:
        batches.append(list(items))
        if 99 in items:
            raise OSError("disk full")
        return [item * 10 for item in items]

    group: Writer = writer_of(commit)
    assert [10, 20, 30] == group.write_many([1, 2, 3])
    failed = group.write_many([4, 99])
    assert [[1, 2, 3], [4, 99]] == batches
    assert all(isinstance(outcome, Failed) for outcome in failed)
    errors = [outcome.error for outcome in failed if isinstance(outcome, Failed)]
    assert ["disk full", "disk full"] == [str(error) for error in errors]
    assert errors[0] is not errors[1]


def test_threads_sharing_a_session_share_fsyncs_for_their_keys(tmp_path: Path) -> None:
    """16 threads start operations while one key's commit is held up: the 15 others are
    made durable together, in one transaction, and every operation is journaled once."""
    journal = idempotently.Journal(tmp_path / "journal.db")
    batches: list[tuple[int, bool]] = []

    def held_first_batch(writes: Sequence[Any], durable: bool) -> None:
        keys = sum(isinstance(write, Insert) for write in writes)
        if keys and not batches:
            while sum(isinstance(job.write, Insert) for job in journal._writer._waiting) < 15:
                threading.Event().wait(0.001)  # the others arrive while this one commits
        if keys:
            batches.append((keys, durable))

    journal.observe_commits(before=held_first_batch)
    with idempotently.Session(
        journal, transport=httpx.MockTransport(lambda request: httpx.Response(201))
    ) as session:
        threads = [
            threading.Thread(
                target=session.post, args=("https://api.test/v1",), kwargs={"json": {"n": n}}
            )
            for n in range(16)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        counts = journal.counts()
    journal.close()
    assert [(1, True), (15, True)] == batches
    assert 16 == counts["succeeded"]


def journal_with_operations(tmp_path: Path, count: int) -> idempotently.Journal:
    """A journal holding operations op-1 ... op-<count>."""
    journal = idempotently.Journal(tmp_path / "journal.db", durability="os")
    for number in range(1, count + 1):
        new = new_operation(f"op-{number}")
        assert insert_operation(journal, new, owner="me", lease_until=NOW + 10)
    return journal


def attempt(number: int, body: bytes = b"{}") -> Record:
    """The answer of operation ``op-<number>``: 201, with ``body``."""
    return Record(
        f"op-{number}",
        AttemptRecord(
            started_at=NOW,
            elapsed=0.1,
            outcome="answered",
            status_code=201,
            status="succeeded",
            response_status=201,
            response_body=body,
        ),
        NOW,
        key=f"key-{number}",
    )


def test_threads_completions_waiting_for_a_commit_share_the_next_transaction(
    tmp_path: Path,
) -> None:
    """Writes queued while another thread commits go in one transaction, each returning
    once it is committed."""
    journal = journal_with_operations(tmp_path, 9)
    batches: list[list[str]] = []

    with journal:

        def recorded(writes: Sequence[Any], durable: bool) -> None:
            batches.append([write.operation_id for write in writes])
            if len(batches) == 1:
                while len(journal._writer._waiting) < 8:
                    threading.Event().wait(0.001)

        stop = journal.observe_commits(before=recorded)
        first = threading.Thread(target=journal._execute, args=(attempt(9),))
        first.start()
        while not batches:
            threading.Event().wait(0.001)
        threads = [
            threading.Thread(target=journal._execute, args=(attempt(number),))
            for number in range(1, 9)
        ]
        for thread in threads:
            thread.start()
        for thread in [first, *threads]:
            thread.join(timeout=10)
        stop()
        statuses = {op.operation_id: op.status for op in journal.operations()}
    assert ["op-9"] == batches[0]
    assert sorted(f"op-{n}" for n in range(1, 9)) == sorted(batches[1])
    assert 2 == len(batches)
    assert {f"op-{n}": "succeeded" for n in range(1, 10)} == statuses


def test_a_write_that_fails_in_a_shared_transaction_fails_only_its_own_caller(
    tmp_path: Path,
) -> None:
    """One write SQLite refuses (a body over its size limit) fails alone, in its savepoint:
    the others of the same batch are committed, and only the bad one's caller gets an error."""
    journal = journal_with_operations(tmp_path, 4)
    with journal:
        journal._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 4096)
        outcomes = execute_together(
            journal, [attempt(1), attempt(2), attempt(3, b"x" * 10_000), attempt(4)]
        )
        statuses = {op.operation_id: op.status for op in journal.operations()}
    assert [None, None, None] == [outcomes[0], outcomes[1], outcomes[3]]
    assert isinstance(outcomes[2], Failed)
    assert isinstance(outcomes[2].error, idempotently.JournalWriteError)
    assert ("op-3", "key-3") == (outcomes[2].error.operation_id, outcomes[2].error.key)
    assert {"op-1": "succeeded", "op-2": "succeeded", "op-3": "pending", "op-4": "succeeded"} == (
        statuses
    )


def test_a_batch_holding_a_key_is_made_durable_once_for_all_its_writes(tmp_path: Path) -> None:
    """Durability is decided once per batch: a key among completions makes the whole batch
    commit under synchronous=FULL, in one transaction."""
    journal = journal_with_operations(tmp_path, 2)
    journal._fsync_keys = True  # as with durability="fsync"
    levels: list[tuple[int, bool]] = []

    def recorded(writes: Sequence[Any], durable: bool) -> None:
        levels.append((len(writes), durable))

    with journal:
        journal.observe_commits(before=recorded)
        outcomes = execute_together(
            journal, [attempt(1), Insert(new_operation("op-3"), "me", NOW + 10), attempt(2)]
        )
    assert [None, True, None] == outcomes
    assert (3, True) == levels[-1]  # after the batch that held them back


def test_the_writer_over_the_in_memory_store_keeps_every_write_once() -> None:
    """32 threads each journal a key and its answer through one writer over the in-memory
    store: every operation ends succeeded exactly once, and a batch is durable exactly
    when it holds a key."""
    from tests.memory_store import MemoryStore
    from tests.test_store_contract import answer, new

    store = MemoryStore()
    batches: list[tuple[bool, bool]] = []

    def commit(writes: Sequence[Any], durable: bool) -> list[Any]:
        batches.append((any(isinstance(write, Insert) for write in writes), durable))
        return store.commit(writes, durable)

    writer = Writer(commit, lambda write: isinstance(write, Insert))
    start = threading.Barrier(32)

    def one(number: int) -> None:
        start.wait()
        assert writer.write(Insert(new(f"op-{number}"), "me", NOW + 30))
        writer.write(Record(f"op-{number}", answer(), NOW, "me"))

    threads = [threading.Thread(target=one, args=(number,)) for number in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert {"succeeded": 32} == {status: n for status, n in store.counts().items() if n}
    assert 64 == sum(size for size, _ in store.commits)
    assert all(has_key == durable for has_key, durable in batches)


# -- async callers: the writer's own thread ------------------------------------------------


def journal_threads(before: set[threading.Thread]) -> list[str]:
    """The names of the library's threads started since ``before`` and still alive."""
    return sorted(
        thread.name
        for thread in threading.enumerate()
        if thread not in before and thread.name.startswith("idempotently-") and thread.is_alive()
    )


@pytest.mark.anyio
async def test_async_writes_and_the_heartbeat_share_one_thread_per_journal(
    tmp_path: Path,
) -> None:
    """16 tasks posting at once, their leases held while their answers arrive: the
    journal runs one thread of its own, for their writes and the heartbeat alike."""
    before = set(threading.enumerate())
    seen: list[list[str]] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        seen.append(journal_threads(before))  # while this call's lease is kept alive
        return httpx.Response(201)

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client,
        idempotently.AsyncSession(tmp_path / "journal.db", client=client) as session,
    ):
        async with anyio.create_task_group() as group:
            for n in range(16):
                group.start_soon(lambda n=n: session.post(URL, json={"n": n}))
        counts = session.journal.counts()
    assert 16 == counts["succeeded"]
    assert {("idempotently-journal",)} == {tuple(names) for names in seen}


@pytest.mark.anyio
async def test_closing_the_journal_commits_what_is_queued_and_ends_its_thread(
    tmp_path: Path,
) -> None:
    """Journal.close() returns once every write queued is committed and the journal's
    thread has ended: none of its threads outlives it."""
    before = set(threading.enumerate())
    journal = idempotently.Journal(tmp_path / "journal.db")
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(201))) as client,
        idempotently.AsyncSession(journal, client=client) as session,
        anyio.create_task_group() as group,
    ):
        for n in range(8):
            group.start_soon(lambda n=n: session.post(URL, json={"n": n}))
    journal.close()
    assert [] == journal_threads(before)
    with idempotently.Journal(tmp_path / "journal.db") as reopened:
        assert 8 == reopened.counts()["succeeded"]


# -- the commit observer -------------------------------------------------------------------


def test_an_observer_sees_each_batch_before_and_after_its_commit(tmp_path: Path) -> None:
    """``before`` gets the writes and whether they are made durable, ``after`` what each
    came to; once stopped, it sees nothing more."""
    seen: list[tuple[str, list[str], object]] = []
    with idempotently.Session(
        tmp_path / "journal.db", transport=httpx.MockTransport(lambda r: httpx.Response(201))
    ) as session:
        stop = session.journal.observe_commits(
            before=lambda writes, durable: seen.append(
                ("before", [type(write).__name__ for write in writes], durable)
            ),
            after=lambda writes, outcomes: seen.append(
                ("after", [type(write).__name__ for write in writes], list(outcomes))
            ),
        )
        session.post(URL, json={}, operation_id="op-1")
        stop()
        session.post(URL, json={}, operation_id="op-2")
    assert [
        ("before", ["Insert"], True),
        ("after", ["Insert"], [True]),
        ("before", ["Record"], False),
        ("after", ["Record"], [None]),
    ] == seen


def test_an_observer_raising_before_a_commit_fails_that_batch_and_nothing_is_sent(
    tmp_path: Path,
) -> None:
    """The seam a test makes a write fail at: the call raises a JournalWriteError naming
    its operation, nothing is sent, and the journal holds nothing of it."""
    sent: list[httpx.Request] = []

    def full_disk(writes: Sequence[Any], durable: bool) -> None:
        raise idempotently.JournalWriteError("cannot write the journal: disk full")

    with idempotently.Session(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(lambda r: sent.append(r) or httpx.Response(201)),
    ) as session:
        session.journal.observe_commits(before=full_disk)
        with pytest.raises(idempotently.JournalWriteError) as raised:
            session.post(URL, json={}, operation_id="op-1")
        journaled = session.journal.operations()
    assert ("op-1", [], []) == (raised.value.operation_id, sent, journaled)


def test_an_observer_raising_after_a_commit_is_logged_and_the_write_stands(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After the commit the writes are journaled: an observer's error there is a warning,
    never the call's, and the call goes on."""

    def broken(writes: Sequence[Any], outcomes: Sequence[Any]) -> None:
        raise ValueError("observer bug")

    with idempotently.Session(
        tmp_path / "journal.db", transport=httpx.MockTransport(lambda r: httpx.Response(201))
    ) as session:
        session.journal.observe_commits(after=broken)
        with caplog.at_level(logging.WARNING, logger="idempotently"):
            response = session.post(URL, json={}, operation_id="op-1")
        operation = session.journal.operation("op-1")
    assert (201, "succeeded") == (response.status_code, operation and operation.status)
    assert "observer bug" in caplog.text
