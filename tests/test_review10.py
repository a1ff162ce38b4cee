"""Review of the loop path (Journal._try_now): an AsyncSession's journal writes that run
on the event loop never fsync there and never wait there, and every older promise holds."""

from __future__ import annotations

import os
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

import idempotently
import idempotently._journal
from idempotently._journal import NOT_NOW
from tests.support import URL, recording_transport
from tests.test_async_loop import (
    HOLD_WRITE_LOCK,
    LOCK_HELD,
    MAX_GAP,
    TICK,
    charges_answered,
    counting_hops,
    heartbeat,
)
from tests.test_journal import new_operation

OWNER: dict[str, Any] = {"owner": "test-owner", "lease_until": 0.0}


def checkpoint_everything(path: Path) -> None:
    """Another connection checkpoints every WAL frame (as another process's Session does)."""
    other = sqlite3.connect(path, isolation_level=None)
    try:
        busy, frames, done = other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        assert (0, frames) == (busy, done), "the checkpoint left frames: nothing to test"
    finally:
        other.close()


# -- no fsync on the loop ----------------------------------------------------------------------


def test_a_write_that_would_start_the_wal_over_is_never_run_now(tmp_path: Path) -> None:
    """Once every WAL frame is checkpointed, the next write starts the WAL over and fsyncs
    its header even without synchronous=FULL: _try_now refuses it, having written nothing."""
    path = tmp_path / "journal.db"
    journal = idempotently.Journal(path, durability="os")
    journal._insert_operation(new_operation("op-0"), **OWNER)  # in a thread: fsyncs there
    assert (True, True) == journal._try_now(
        lambda: journal._insert_operation(new_operation("op-1"), **OWNER)
    )
    checkpoint_everything(path)
    assert NOT_NOW == journal._try_now(
        lambda: journal._insert_operation(new_operation("op-2"), **OWNER)
    )
    assert 2 == journal.counts()["pending"]
    journal._insert_operation(new_operation("op-2"), **OWNER)  # the thread starts the WAL over
    assert (True, True) == journal._try_now(
        lambda: journal._insert_operation(new_operation("op-3"), **OWNER)
    )
    assert 4 == journal.counts()["pending"]
    journal.close()


def test_the_first_write_to_a_journal_nobody_had_open_is_never_run_now(tmp_path: Path) -> None:
    """A journal opened after every other connection closed has no WAL: its first write
    creates one and fsyncs the header, so it is not run on the loop."""
    path = tmp_path / "journal.db"
    idempotently.Journal(path).close()  # the last connection out removes the WAL
    journal = idempotently.Journal(path, durability="os")
    assert NOT_NOW == journal._try_now(
        lambda: journal._insert_operation(new_operation("op-1"), **OWNER)
    )
    assert 0 == journal.counts()["pending"]
    journal.close()


@pytest.mark.anyio
async def test_a_post_after_another_connections_checkpoint_writes_its_key_in_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After another connection checkpointed the whole WAL, a post's first write (which
    starts the WAL over, with an fsync) goes to a worker thread; the rest stay on the loop."""
    path = tmp_path / "journal.db"
    journal = idempotently.Journal(path, durability="os")
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(charges_answered)) as client,
        idempotently.AsyncSession(journal, client=client) as s,
    ):
        for n in range(2):
            assert 201 == (await s.post(URL, json={"n": n})).status_code
        checkpoint_everything(path)
        hops = counting_hops(monkeypatch)
        assert 201 == (await s.post(URL, json={"n": 2})).status_code
        assert 1 == len(hops)
        assert 201 == (await s.post(URL, json={"n": 3})).status_code
        assert 1 == len(hops)
    assert 4 == journal.counts()["succeeded"]


# -- the WAL stays bounded ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_wal_is_checkpointed_when_the_command_sent_to_a_thread_only_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command sent to a thread for the checkpoint may be a read (a named post's Find),
    which commits nothing: the next write goes there too, so the WAL still stays bounded."""
    every = 51  # a multiple of a named post's three commands, as the default 201 is
    monkeypatch.setattr(idempotently._journal, "CHECKPOINT_EVERY", every - 1)
    path = tmp_path / "journal.db"
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(charges_answered)) as client,
        idempotently.AsyncSession(idempotently.Journal(path, durability="os"), client=client) as s,
    ):
        await s.post(URL, json={})  # two commands: every later Find falls on the thread's turn
        for n in range(400):
            await s.post(URL, json={"n": n}, operation_id=f"op-{n}")
        page_size = s.journal._conn.execute("PRAGMA page_size").fetchone()[0]
        wal_pages = os.path.getsize(f"{path}-wal") // (page_size + 24)
    assert 401 == s.journal.counts()["succeeded"]
    assert wal_pages < 1000 + every * 20


# -- a subclass's code is not run on the loop --------------------------------------------------


@pytest.mark.anyio
async def test_a_journal_subclass_that_writes_its_own_way_runs_in_a_worker_thread(
    tmp_path: Path,
) -> None:
    """A Journal subclass overriding a write (an audit trail, say) has its code run in a
    worker thread, as before the loop path: nobody vouched it never waits."""
    threads: list[int] = []

    class Audited(idempotently.Journal):
        def _record_attempt(self, operation_id: str, record: Any, **kwargs: Any) -> None:
            threads.append(threading.get_ident())
            super()._record_attempt(operation_id, record, **kwargs)

    journal = Audited(tmp_path / "journal.db", durability="os")
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(charges_answered)) as client,
        idempotently.AsyncSession(journal, client=client) as s,
    ):
        assert 201 == (await s.post(URL, json={}, operation_id="op")).status_code
    assert 1 == len(threads)
    assert threading.get_ident() not in threads
    assert 1 == journal.counts()["succeeded"]


# -- attacks that held -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_completion_while_another_process_holds_the_write_lock_never_stalls_the_loop(
    tmp_path: Path,
) -> None:
    """Another process takes the write lock while the request is in flight: the completion
    waits for it in a worker thread, never on the loop, and is recorded once it is free."""
    path = tmp_path / "journal.db"
    journal = idempotently.Journal(path, durability="os", busy_timeout=5)
    holders: list[Any] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        holder = await anyio.open_process(
            [sys.executable, "-c", HOLD_WRITE_LOCK, str(path), str(LOCK_HELD)]
        )
        holders.append(holder)
        assert holder.stdout is not None
        assert b"locked" == (await holder.stdout.receive()).strip()
        return httpx.Response(201)

    gaps: list[float] = []
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client,
        idempotently.AsyncSession(journal, client=client) as s,
        anyio.create_task_group() as group,
    ):
        await group.start(heartbeat, gaps)
        started = time.monotonic()
        assert 201 == (await s.post(URL, json={}, operation_id="op")).status_code
        waited = time.monotonic() - started
        await anyio.sleep(3 * TICK)
        group.cancel_scope.cancel()
    for holder in holders:
        await holder.wait()
        await holder.aclose()
    operation = journal.operation("op")
    assert operation is not None and ("succeeded", None) == (
        operation.status,
        operation.lease_owner,
    )
    assert waited > LOCK_HELD / 2, "the completion never met the lock: nothing was measured"
    assert max(gaps) < MAX_GAP


@pytest.mark.anyio
async def test_a_memory_journal_commits_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ":memory:" journal has no WAL to start over and no other connection: its writes
    run on the loop and every call is recorded."""
    journal = idempotently.Journal(":memory:", durability="os")
    hops = counting_hops(monkeypatch)
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(charges_answered)) as client,
        idempotently.AsyncSession(journal, client=client) as s,
    ):
        for n in range(3):
            assert 201 == (await s.post(URL, json={}, operation_id=f"op-{n}")).status_code
    assert [] == hops
    assert 3 == journal.counts()["succeeded"]


@pytest.mark.anyio
async def test_a_journal_moved_away_refuses_the_key_on_the_loop_path(tmp_path: Path) -> None:
    """A journal moved away (with its -wal and -shm) while an AsyncSession uses it: the next
    key is refused with JournalMovedError naming the operation, and nothing is sent."""
    path = tmp_path / "journal.db"
    transport, sent = recording_transport()
    async with (
        httpx.AsyncClient(transport=transport) as client,
        idempotently.AsyncSession(idempotently.Journal(path, durability="os"), client=client) as s,
    ):
        assert 201 == (await s.post(URL, json={}, operation_id="op-1")).status_code
        for suffix in ("", "-wal", "-shm"):
            os.rename(f"{path}{suffix}", tmp_path / f"moved.db{suffix}")
        with pytest.raises(idempotently.JournalMovedError) as caught:
            await s.post(URL, json={}, operation_id="op-2")
    assert 1 == len(sent)
    assert "op-2" == caught.value.operation_id


@pytest.mark.anyio
async def test_a_full_disk_on_the_loop_fails_only_that_call_and_restores_the_connection(
    tmp_path: Path,
) -> None:
    """A key the disk has no room for (SQLITE_FULL) on the loop path: that call fails with a
    JournalWriteError naming its operation and sends nothing; the next call works."""
    journal = idempotently.Journal(tmp_path / "journal.db", durability="os")
    transport, sent = recording_transport()
    async with (
        httpx.AsyncClient(transport=transport) as client,
        idempotently.AsyncSession(journal, client=client) as s,
    ):
        assert 201 == (await s.post(URL, json={}, operation_id="op-0")).status_code
        pages = journal._conn.execute("PRAGMA page_count").fetchone()[0]
        journal._conn.execute(f"PRAGMA max_page_count = {pages}")
        with pytest.raises(idempotently.JournalWriteError) as caught:
            await s.post(URL, content=b"x" * 200_000, operation_id="op-1")
        journal._conn.execute("PRAGMA max_page_count = 1073741823")
        assert 201 == (await s.post(URL, json={}, operation_id="op-2")).status_code
    assert "op-1" == caught.value.operation_id
    assert "sqlite3" not in type(caught.value).__module__
    assert 2 == len(sent)
    assert (30_000, 1000, None, False) == (
        journal._conn.execute("PRAGMA busy_timeout").fetchone()[0],
        journal._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0],
        journal._now_thread,
        journal._refuse_busy,
    )
    assert {"op-0", "op-2"} == {op.operation_id for op in journal.operations()}


def test_an_interrupt_inside_a_write_on_the_loop_leaves_the_journal_usable(
    tmp_path: Path,
) -> None:
    """KeyboardInterrupt in the middle of a loop-path write: nothing of it is committed,
    the lock is free, and the busy timeout and automatic checkpoint are back."""
    from idempotently._journal import AttemptRecord

    journal = idempotently.Journal(tmp_path / "journal.db", durability="os")
    journal._insert_operation(new_operation("op-1"), **OWNER)
    record = AttemptRecord(
        started_at=1.0, elapsed=0.1, outcome="answered", status_code=201, status="succeeded"
    )
    write = journal._attempt_write("op-1", record, 2.0, None)

    def interrupted(conn: sqlite3.Connection) -> None:
        write(conn)
        raise KeyboardInterrupt

    journal._attempt_write = lambda *args: interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        journal._try_now(lambda: journal._record_attempt("op-1", record, now=2.0))
    operation = journal.operation("op-1")
    assert operation is not None and (0, "pending") == (
        operation.attempt_count,
        operation.status,
    )
    assert (30_000, 1000, None, False) == (
        journal._conn.execute("PRAGMA busy_timeout").fetchone()[0],
        journal._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0],
        journal._now_thread,
        journal._refuse_busy,
    )
    free: list[bool] = []

    def take_and_release() -> None:
        free.append(journal._lock.acquire(timeout=5))
        journal._lock.release()

    other = threading.Thread(target=take_and_release)
    other.start()
    other.join()
    assert [True] == free
    del journal._attempt_write
    assert (True, None) == journal._try_now(
        lambda: journal._record_attempt("op-1", record, now=2.0)
    )


def test_two_event_loops_in_two_threads_share_one_journal_exactly_once(tmp_path: Path) -> None:
    """Two AsyncSessions on two event loops (threads) and one Journal object: every
    operation is sent once and settled, and neither loop deadlocks."""
    journal = idempotently.Journal(tmp_path / "journal.db", durability="os")
    transport, sent = recording_transport()

    async def posts(loop: int) -> None:
        async with (
            httpx.AsyncClient(transport=transport) as client,
            idempotently.AsyncSession(journal, client=client) as s,
            anyio.create_task_group() as group,
        ):
            for task in range(4):

                async def post(task: int = task) -> None:
                    for n in range(25):
                        await s.post(URL, json={}, operation_id=f"{loop}-{task}-{n}")

                group.start_soon(post)

    threads = [
        threading.Thread(target=anyio.run, args=(posts, loop), kwargs={"backend": backend})
        for loop, backend in enumerate(("asyncio", "trio"))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a loop deadlocked"
    keys = [request.headers["Idempotency-Key"] for request in sent]
    assert 200 == len(keys) == len(set(keys))
    assert (200, 0) == (journal.counts()["succeeded"], journal.counts()["pending"])
