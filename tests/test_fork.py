"""A process forked from one that used a journal: the child either works or says why,
never hangs on a lock held at the fork, and never sends with its parent's leases."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

import idempotently
from tests.support import URL

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def in_child(run: Callable[[], object], timeout: float = 10.0) -> dict[str, object]:
    """Fork; the child runs ``run`` and reports what it returned or raised; the parent
    waits at most ``timeout`` seconds (then kills it: it hung)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        try:
            outcome: dict[str, object] = {"returned": repr(run())}
        except BaseException as error:  # report anything, then leave without cleanup
            outcome = {"raised": type(error).__name__, "message": str(error)}
            outcome["operation_id"] = getattr(error, "operation_id", None)
        os.write(write, json.dumps(outcome).encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read)
        raise AssertionError(f"the child hung for {timeout} s")
    with os.fdopen(read, "rb") as pipe:
        return dict(json.loads(pipe.read()))


def test_a_forked_child_using_its_parents_session_gets_a_clear_error(tmp_path: Path) -> None:
    """The parent's Session in the child: JournalError naming the operation and saying to
    open a new Journal in the child; nothing is sent from the child."""
    sent: list[str] = []
    transport = httpx.MockTransport(lambda r: sent.append(str(os.getpid())) or httpx.Response(201))
    with idempotently.Session(tmp_path / "journal.db", transport=transport) as session:
        session.post(URL, json={"n": 1}, operation_id="in-parent")
        outcome = in_child(lambda: session.post(URL, json={"n": 2}, operation_id="in-child"))
        journaled = [op.operation_id for op in session.journal.operations()]
    assert "JournalError" == outcome["raised"]
    assert "in-child" == outcome["operation_id"]
    assert "fork" in str(outcome["message"]) and "in the child" in str(outcome["message"])
    assert [str(os.getpid())] == sent
    assert ["in-parent"] == journaled


def test_a_fork_while_another_thread_writes_never_hangs_the_child(tmp_path: Path) -> None:
    """Another thread of the parent holds the journal's writer and its connection at the
    moment of the fork: the child does not wait for a lock no thread of its own will ever
    release; it gets the clear error at once."""
    journal = idempotently.Journal(tmp_path / "journal.db")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with journal._writer._changed, journal._store._lock:  # type: ignore[attr-defined]
            held.set()
            release.wait(timeout=10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(timeout=10)
    try:
        with idempotently.Session(
            journal, transport=httpx.MockTransport(lambda r: httpx.Response(201))
        ) as session:
            outcome = in_child(
                lambda: session.post(URL, json={}, operation_id="in-child"), timeout=5
            )
    finally:
        release.set()
        holder.join()
        journal.close()
    assert "JournalError" == outcome["raised"]


def test_a_forked_child_opening_its_own_journal_works(tmp_path: Path) -> None:
    """A child that opens the journal itself (a new Session on the same file) sends and
    journals as any process does, with a heartbeat of its own."""
    path = tmp_path / "journal.db"
    with idempotently.Session(
        path, transport=httpx.MockTransport(lambda r: httpx.Response(201))
    ) as session:
        session.post(URL, json={"n": 1}, operation_id="in-parent")

        def child() -> int:
            with idempotently.Session(
                path, transport=httpx.MockTransport(lambda r: httpx.Response(201))
            ) as own:
                return own.post(URL, json={"n": 2}, operation_id="in-child").status_code

        outcome = in_child(child)
        statuses = {op.operation_id: op.status for op in session.journal.operations()}
    assert {"returned": "201"} == outcome
    assert {"in-parent": "succeeded", "in-child": "succeeded"} == statuses


def test_a_child_forked_while_the_journal_thread_runs_starts_clean(tmp_path: Path) -> None:
    """The parent's async writes left the journal's thread running at the fork: the child
    has no such thread, refuses its parent's journal, and an AsyncSession it opens itself
    commits through a thread of its own."""
    import anyio

    path = tmp_path / "journal.db"
    transport = httpx.MockTransport(lambda r: httpx.Response(201))

    async def post(journal: object, operation_id: str) -> int:
        async with idempotently.AsyncSession(journal, transport=transport) as session:  # type: ignore[arg-type]
            return (await session.post(URL, json={}, operation_id=operation_id)).status_code

    journal = idempotently.Journal(path)
    anyio.run(post, journal, "in-parent")
    running = journal._writer._thread  # lingering idle: the journal is still open

    def child() -> tuple[object, ...]:
        try:
            anyio.run(post, journal, "with-parents")
            refused = "no"
        except idempotently.JournalError:
            refused = "yes"
        return (journal._writer._thread, refused, anyio.run(post, path, "in-child"))

    try:
        outcome = in_child(child)
    finally:
        journal.close()
    with idempotently.Journal(path) as reopened:
        statuses = {op.operation_id: op.status for op in reopened.operations()}
    assert running is not None and running.is_alive() is False  # ended by close()
    assert {"returned": "(None, 'yes', 201)"} == outcome
    assert {"in-parent": "succeeded", "in-child": "succeeded"} == statuses


def test_a_child_forked_mid_commit_is_told_at_once_why_it_cannot_write(tmp_path: Path) -> None:
    """The parent's connection was inside a write transaction at the fork: SQLite's note of
    that lock lives on in the child, so no connection of the child can ever write the
    file. A Session the child opens itself says so at once (not after the 30 s busy
    timeout, not blaming another process), nothing is sent from the child, and the file
    stays writable by the parent and by other processes."""
    path = tmp_path / "journal.db"
    sent: list[int] = []
    transport = httpx.MockTransport(lambda r: sent.append(os.getpid()) or httpx.Response(201))
    journal = idempotently.Journal(path)
    with idempotently.Session(journal, transport=transport) as session:
        session.post(URL, json={"n": 1}, operation_id="in-parent")
        read, write = os.pipe()
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            # Another thread's batch, inside its BEGIN IMMEDIATE at the fork.
            with journal._store._write():  # type: ignore[attr-defined]
                held.set()
                release.wait(timeout=10)
            os.write(write, b"x")

        def child() -> object:
            os.read(read, 1)  # the parent's transaction is over: nobody holds the lock
            with idempotently.Session(path, transport=transport) as own:
                return own.post(URL, json={"n": 2}, operation_id="in-child").status_code

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(timeout=10)
        ender = threading.Timer(0.2, release.set)
        ender.start()
        # Bounded below the busy timeout (30 s): a child that waits it out has hung.
        outcome = in_child(child, timeout=20)
        ender.join()
        holder.join()
        os.close(read)
        os.close(write)
        session.post(URL, json={"n": 3}, operation_id="after")
        journaled = sorted(op.operation_id for op in journal.operations())
    journal.close()
    assert "JournalWriteError" == outcome["raised"]
    assert "forked while its parent was committing" in str(outcome["message"])
    assert "another process held" not in str(outcome["message"])
    assert [os.getpid(), os.getpid()] == sent
    assert ["after", "in-parent"] == journaled


def test_a_child_forked_during_a_read_snapshot_writes_as_any_process(tmp_path: Path) -> None:
    """The parent's connection was inside a read snapshot (its lock blocks no writer) at
    the fork: a Session the child opens itself sends and journals as usual."""
    path = tmp_path / "journal.db"
    transport = httpx.MockTransport(lambda r: httpx.Response(201))
    journal = idempotently.Journal(path)
    with idempotently.Session(journal, transport=transport) as session:
        session.post(URL, json={"n": 1}, operation_id="in-parent")
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with journal._store._snapshot():  # type: ignore[attr-defined]
                journal._store._conn.execute("SELECT count(*) FROM operations").fetchone()  # type: ignore[attr-defined]
                held.set()
                release.wait(timeout=10)

        def child() -> object:
            with idempotently.Session(path, transport=transport) as own:
                return own.post(URL, json={"n": 2}, operation_id="in-child").status_code

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(timeout=10)
        try:
            outcome = in_child(child, timeout=20)
        finally:
            release.set()
            holder.join()
        journaled = sorted(op.operation_id for op in journal.operations())
    journal.close()
    assert {"returned": "201"} == outcome
    assert ["in-child", "in-parent"] == journaled
