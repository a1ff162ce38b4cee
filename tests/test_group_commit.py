"""Group commit: concurrent durable writes share one commit, and nobody returns early."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

import idempotently
from idempotently._group_commit import Failed, GroupCommit
from tests.test_journal import NOW, new_operation


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
    group: GroupCommit[int, int], items: range
) -> tuple[dict[int, int | Exception], list[threading.Thread]]:
    """Submit each item from its own thread; the results as they come, and the threads."""
    results: dict[int, int | Exception] = {}

    def one(item: int) -> None:
        try:
            results[item] = group.submit(item)
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
    group: GroupCommit[int, int] = GroupCommit(commit)
    first = threading.Thread(target=group.submit, args=(0,))
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
    group: GroupCommit[int, int] = GroupCommit(commit)
    seen: list[bool] = []

    def one(item: int) -> None:
        group.submit(item)
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

    group: GroupCommit[int, int] = GroupCommit(flaky)
    with pytest.raises(OSError, match="disk full"):
        group.submit(1)
    assert 2 == group.submit(2)


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

    group: GroupCommit[int, int] = GroupCommit(commit)
    interrupted: list[BaseException] = []

    def leader() -> None:
        try:
            group.submit(0)
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


def test_threads_sharing_a_session_share_fsyncs_for_their_keys(tmp_path: Path) -> None:
    """16 threads start operations while one key's commit is held up: the 15 others are
    made durable together, in one transaction, and every operation is journaled once."""
    journal = idempotently.Journal(tmp_path / "journal.db")
    batches: list[int] = []
    commit = journal._insert_batch
    group = journal._durable_inserts

    def held_first_batch(batch: Sequence[Any]) -> list[bool]:
        if not batches:
            while len(group._waiting) < 15:  # the others arrive while this one commits
                threading.Event().wait(0.001)
        batches.append(len(batch))
        return commit(batch)

    journal._insert_batch = held_first_batch  # type: ignore[method-assign]
    group._commit = held_first_batch
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
    assert [1, 15] == batches
    assert 16 == counts["succeeded"]


def test_writes_submitted_together_commit_together_each_with_its_own_outcome() -> None:
    """submit_many puts its items in one commit (with whatever else waited) and returns
    each item's result; a failed commit is each item's own copy of the error."""
    batches: list[list[int]] = []

    def commit(items: Sequence[int]) -> list[int]:
        batches.append(list(items))
        if 99 in items:
            raise OSError("disk full")
        return [item * 10 for item in items]

    group: GroupCommit[int, int] = GroupCommit(commit)
    assert [10, 20, 30] == group.submit_many([1, 2, 3])
    failed = group.submit_many([4, 99])
    assert [[1, 2, 3], [4, 99]] == batches
    assert all(isinstance(outcome, Failed) for outcome in failed)
    errors = [outcome.error for outcome in failed if isinstance(outcome, Failed)]
    assert ["disk full", "disk full"] == [str(error) for error in errors]
    assert errors[0] is not errors[1]


# -- completions of threads sharing a Journal (flat combining) ------------------------------


class CountingConnection:
    """The journal's connection, counting the transactions begun on it."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.transactions = 0

    def execute(self, sql: str, *args: Any) -> Any:
        self.transactions += sql.startswith("BEGIN")
        return self.conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


def combined_writes(
    journal: idempotently.Journal, writes: dict[int, Any]
) -> tuple[dict[int, Any], list[list[int]], int]:
    """Each write from its own thread while a first write holds the journal's transaction;
    each write's result (or error), the batches the writes were taken in, and how many
    transactions were begun."""
    gate = threading.Event()
    batches: list[list[int]] = []
    together = journal._commit_together
    counting = journal._conn = CountingConnection(journal._conn)  # type: ignore[assignment]

    def recorded(batch: Sequence[Any]) -> None:
        batches.append([each.write.number for each in batch])
        together(batch)

    journal._commit_together = recorded  # type: ignore[method-assign]
    results: dict[int, Any] = {}

    def blocker(conn: Any) -> None:
        gate.wait(timeout=10)

    blocker.number = 0  # type: ignore[attr-defined]
    first = threading.Thread(target=journal._write_combined, args=(blocker,))
    first.start()
    while not journal._combining:
        pass  # the first write now holds the transaction, behind the gate

    def one(number: int) -> None:
        try:
            results[number] = journal._write_combined(writes[number])
        except Exception as error:
            results[number] = error

    threads = [threading.Thread(target=one, args=(number,)) for number in writes]
    for thread in threads:
        thread.start()
    while len(journal._queued) < len(writes):
        pass
    gate.set()
    for thread in [first, *threads]:
        thread.join(timeout=10)
    journal._conn = counting.conn
    return results, batches, counting.transactions


def insert_attempt(number: int) -> Any:
    """A write that journals operation ``op-<number>`` and returns its number."""

    def write(conn: Any) -> int:
        conn.execute(
            "UPDATE operations SET attempt_count = ? WHERE operation_id = ?",
            (number, f"op-{number}"),
        )
        return number

    write.number = number  # type: ignore[attr-defined]
    return write


def journal_with_operations(tmp_path: Path, count: int) -> idempotently.Journal:
    """A journal holding operations op-1 ... op-<count>."""
    journal = idempotently.Journal(tmp_path / "journal.db", durability="os")
    for number in range(1, count + 1):
        new = new_operation(f"op-{number}")
        assert journal._insert_operation(new, owner="me", lease_until=NOW + 10)
    return journal


def test_threads_completions_waiting_for_a_commit_share_the_next_transaction(
    tmp_path: Path,
) -> None:
    """Writes queued while another thread commits go in one transaction, each returning
    its own result once it is committed."""
    journal = journal_with_operations(tmp_path, 8)
    with journal:
        results, batches, transactions = combined_writes(
            journal, {number: insert_attempt(number) for number in range(1, 9)}
        )
        assert {number: number for number in range(1, 9)} == results
        assert [[0], list(range(1, 9))] == batches
        assert 2 == transactions
        counts = {op.operation_id: op.attempt_count for op in journal.operations()}
        assert {f"op-{number}": number for number in range(1, 9)} == counts


def test_a_write_that_fails_in_a_shared_transaction_fails_only_its_own_caller(
    tmp_path: Path,
) -> None:
    """One bad write rolls the shared transaction back; every write then runs alone: the
    others are committed, and only the bad one's caller gets an error."""
    journal = journal_with_operations(tmp_path, 4)

    def bad(conn: Any) -> None:
        conn.execute("UPDATE no_such_table SET x = 1")

    bad.number = 3  # type: ignore[attr-defined]
    writes = {1: insert_attempt(1), 2: insert_attempt(2), 3: bad, 4: insert_attempt(4)}
    with journal:
        results, batches, transactions = combined_writes(journal, writes)
        assert isinstance(results.pop(3), idempotently.JournalWriteError)
        assert {1: 1, 2: 2, 4: 4} == results
        assert [[0], [1, 2, 3, 4]] == batches
        assert 1 + 1 + 4 == transactions  # the first; the shared one, rolled back; each alone
        counts = {op.operation_id: op.attempt_count for op in journal.operations()}
        assert {"op-1": 1, "op-2": 2, "op-3": 0, "op-4": 4} == counts
