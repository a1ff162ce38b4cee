"""The event loop never blocks on the journal (DESIGN §3.5: "async code never blocks
its event loop on the journal (no fsync and no lock wait on the loop)"), and a
cancelled call leaves its operation resumable."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest

import idempotently
from idempotently._commands import Insert, Record
from tests.faults import around_commit, commits
from tests.support import URL, recording_transport

LOCK_HELD = 1.0
"""Seconds another process holds the journal's write lock."""
TICK = 0.005
MAX_GAP = 0.5
"""A loop that waited for the lock would stall about LOCK_HELD; a loop that did not
stalls a few milliseconds, or a couple of hundred on a loaded 2-core machine where
the journal's thread and the loop take turns holding the GIL (0.22 s seen under CI).
The bound sits between, far enough from both that load cannot flip it."""

HOLD_WRITE_LOCK = """
import sqlite3, sys, time
connection = sqlite3.connect(sys.argv[1], isolation_level=None)
connection.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
connection.execute("COMMIT")
"""


@asynccontextmanager
async def write_lock_held(path: Path) -> AsyncIterator[anyio.abc.Process]:
    """Another process holds the journal's write lock for LOCK_HELD seconds."""
    async with await anyio.open_process(
        [sys.executable, "-c", HOLD_WRITE_LOCK, str(path), str(LOCK_HELD)]
    ) as process:
        assert process.stdout is not None
        with anyio.fail_after(10):
            assert b"locked" == (await process.stdout.receive()).strip()
        yield process
        await process.wait()


async def heartbeat(
    gaps: list[float], *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Wake every TICK seconds until cancelled; record how late each wake-up came."""
    last = time.monotonic()
    task_status.started()
    while True:
        await anyio.sleep(TICK)
        now = time.monotonic()
        gaps.append(now - last - TICK)
        last = now


def charges_answered(request: httpx.Request) -> httpx.Response:
    return httpx.Response(201, json={"id": "ch_1"})


@pytest.mark.anyio
@pytest.mark.parametrize("durability", ["fsync", "os"])
async def test_heartbeat_never_stalls_while_another_process_holds_the_write_lock(
    tmp_path: Path, anyio_backend: str, durability: str
) -> None:
    """A post waiting ~1 s for another process's lock never stalls a task on its loop
    (with "os", the key's write is tried on the loop first: it must not wait there)."""
    path = tmp_path / "journal.db"
    idempotently.Journal(path).close()  # the schema exists before the lock is taken
    gaps: list[float] = []
    client = httpx.AsyncClient(transport=httpx.MockTransport(charges_answered))
    journal = idempotently.Journal(path, busy_timeout=5, durability=durability)  # type: ignore[arg-type]
    async with (
        idempotently.AsyncSession(journal, client=client) as s,
        write_lock_held(path),
        anyio.create_task_group() as group,
    ):
        await group.start(heartbeat, gaps)
        started = time.monotonic()
        response = await s.post(URL, json={"amount": 1}, operation_id="op")
        waited = time.monotonic() - started
        await anyio.sleep(3 * TICK)  # a stalled heartbeat wakes and records its stall
        group.cancel_scope.cancel()
    await client.aclose()
    print(f"{anyio_backend}: post waited {waited:.3f}s, heartbeat max gap {max(gaps):.4f}s")
    assert 201 == response.status_code
    assert waited > LOCK_HELD / 2, "the post never waited for the lock: nothing was measured"
    assert max(gaps) < MAX_GAP


@pytest.mark.anyio
async def test_a_cancelled_call_leaves_its_operation_pending_without_a_lease(
    tmp_path: Path,
) -> None:
    """Cancelled mid-send: the operation stays pending, unleased, and a new call continues it."""
    sent: list[httpx.Request] = []
    in_flight = anyio.Event()

    async def never_answers(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        in_flight.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def answers(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(201, json={"id": "ch_1"})

    path = tmp_path / "journal.db"
    hanging = httpx.AsyncClient(transport=httpx.MockTransport(never_answers))
    async with idempotently.AsyncSession(path, client=hanging) as s:
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: s.post(URL, json={"amount": 1}, operation_id="op"))
            with anyio.fail_after(5):
                await in_flight.wait()
            group.cancel_scope.cancel()
        cancelled = s.journal.operation("op")
    await hanging.aclose()

    assert cancelled is not None
    assert ("pending", None, 0.0) == (
        cancelled.status,
        cancelled.lease_owner,
        cancelled.lease_until,
    )
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answers)) as client,
        idempotently.AsyncSession(path, client=client) as s,
    ):
        response = await s.post(URL, json={"amount": 1}, operation_id="op")
        settled = s.journal.operation("op")
    assert 201 == response.status_code
    assert [cancelled.key] * 2 == [request.headers["Idempotency-Key"] for request in sent]
    assert sent[0].content == sent[1].content
    assert settled is not None and ("succeeded", cancelled.key) == (settled.status, settled.key)


async def cancel_while_the_key_waits_for_the_lock(
    path: Path, sent: list[httpx.Request], durability: str = "fsync"
) -> tuple[idempotently.Operation | None, httpx.Response]:
    """Post, cancel it while the key's insert waits for another process's lock, then
    post the same operation again: (the operation after the cancel, the second answer)."""

    def answers(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(201, json={"id": "ch_1"})

    idempotently.Journal(path).close()
    policy = idempotently.RetryPolicy(deadline=0.5)  # a leased operation is not waited for long
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answers)) as client,
        idempotently.AsyncSession(
            idempotently.Journal(path, busy_timeout=5, durability=durability),  # type: ignore[arg-type]
            client=client,
            policy=policy,
        ) as s,
    ):
        async with write_lock_held(path), anyio.create_task_group() as group:
            group.start_soon(lambda: s.post(URL, json={"amount": 1}, operation_id="op"))
            await anyio.sleep(LOCK_HELD / 4)  # the key's insert is now waiting for the lock
            group.cancel_scope.cancel()
        cancelled = s.journal.operation("op")
        return cancelled, await s.post(URL, json={"amount": 1}, operation_id="op")


@pytest.mark.anyio
@pytest.mark.parametrize("durability", ["fsync", "os"])
async def test_a_call_cancelled_while_its_key_waits_for_the_lock_leaves_no_lease(
    tmp_path: Path, durability: str
) -> None:
    """Cancelled while its key waits for another process's lock: the key's write completes,
    no lease is left behind, and the next call settles the operation with that key."""
    sent: list[httpx.Request] = []
    cancelled, response = await cancel_while_the_key_waits_for_the_lock(
        tmp_path / "journal.db", sent, durability
    )
    assert cancelled is not None
    assert ("pending", None) == (cancelled.status, cancelled.lease_owner)
    assert 201 == response.status_code
    assert {cancelled.key} == {request.headers["Idempotency-Key"] for request in sent}


@pytest.mark.anyio
async def test_a_call_cancelled_before_its_send_sends_nothing(tmp_path: Path) -> None:
    """A call cancelled before its first byte went out sends nothing: one send in all."""
    sent: list[httpx.Request] = []
    cancelled, _ = await cancel_while_the_key_waits_for_the_lock(tmp_path / "journal.db", sent)
    assert cancelled is not None and 0 == cancelled.attempt_count
    assert 1 == len(sent)


@pytest.mark.anyio
async def test_an_at_most_once_send_cancelled_in_flight_is_never_resent(tmp_path: Path) -> None:
    """Cancelled mid-send, an at-most-once operation may have been delivered: the next
    call raises OperationAbandonedError and sends nothing."""
    sent: list[httpx.Request] = []
    in_flight = anyio.Event()

    async def first_never_answers(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        if len(sent) == 1:
            in_flight.set()
            await anyio.sleep_forever()
        return httpx.Response(201)

    path = tmp_path / "journal.db"
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(first_never_answers)) as client,
        idempotently.AsyncSession(path, client=client) as s,
    ):
        async with anyio.create_task_group() as group:
            group.start_soon(
                lambda: s.post(URL, json={"sms": 1}, operation_id="sms", delivery="at_most_once")
            )
            with anyio.fail_after(5):
                await in_flight.wait()
            group.cancel_scope.cancel()
        with pytest.raises(idempotently.OperationAbandonedError):
            await s.post(URL, json={"sms": 1}, operation_id="sms", delivery="at_most_once")
    assert 1 == len(sent)


def test_an_at_most_once_send_interrupted_in_flight_is_never_resent(tmp_path: Path) -> None:
    """The sync twin: Ctrl-C during an at-most-once send; the next call sends nothing."""
    sent: list[httpx.Request] = []

    def interrupted(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        if len(sent) == 1:
            raise KeyboardInterrupt
        return httpx.Response(201)

    path = tmp_path / "journal.db"
    with idempotently.Session(path, transport=httpx.MockTransport(interrupted)) as s:
        with pytest.raises(KeyboardInterrupt):
            s.post(URL, json={"sms": 1}, operation_id="sms", delivery="at_most_once")
        with pytest.raises(idempotently.OperationAbandonedError):
            s.post(URL, json={"sms": 1}, operation_id="sms", delivery="at_most_once")
    assert 1 == len(sent)


@pytest.mark.anyio
async def test_concurrent_tasks_share_thread_hops_and_commits_for_their_keys(
    tmp_path: Path,
) -> None:
    """16 tasks posting at once: their writes are committed off the loop, by the journal's
    thread, in batches (fewer commits than writes): their keys commit together, and each
    gets its own answer."""
    journal = idempotently.Journal(tmp_path / "journal.db")
    batches = commits(journal)
    answers: list[str] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(0.01)
        return httpx.Response(201, json={"n": json.loads(request.content)["n"]})

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client,
        idempotently.AsyncSession(journal, client=client) as s,
    ):

        async def post(n: int) -> None:
            response = await s.post(URL, json={"n": n})
            answers.append(f"{n}={response.json()['n']}")

        async with anyio.create_task_group() as group:
            for n in range(16):
                group.start_soon(post, n)
        counts = journal.counts()
    assert sorted(f"{n}={n}" for n in range(16)) == sorted(answers)
    assert 16 == counts["succeeded"]
    inserts = [batch.count(Insert) for batch in batches if batch.count(Insert)]
    completions = [batch.count(Record) for batch in batches if batch.count(Record)]
    assert threading.get_ident() not in {batch.thread for batch in batches}
    assert 16 == sum(inserts) and len(inserts) < 16
    assert 16 == sum(completions) and len(completions) < 16  # completions shared transactions


@pytest.mark.anyio
async def test_a_failed_batch_of_keys_fails_each_call_naming_its_own_operation(
    tmp_path: Path,
) -> None:
    """Keys committed together whose commit fails: every call raises, each error naming
    that call's operation, and nothing was sent."""
    sent: list[httpx.Request] = []
    journal = idempotently.Journal(tmp_path / "journal.db")

    def failing(write: object) -> None:
        raise idempotently.JournalWriteError("cannot write the journal: disk full")

    refusing = around_commit(journal, Insert, before=failing)
    refusing.__enter__()
    errors: dict[str, BaseException] = {}

    async def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(201)

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client,
        idempotently.AsyncSession(journal, client=client) as s,
    ):

        async def post(n: int) -> None:
            try:
                await s.post(URL, json={"n": n}, operation_id=f"op-{n}")
            except idempotently.JournalWriteError as error:
                errors[f"op-{n}"] = error

        async with anyio.create_task_group() as group:
            for n in range(8):
                group.start_soon(post, n)
    assert [] == sent
    assert {f"op-{n}": f"op-{n}" for n in range(8)} == {
        name: getattr(error, "operation_id", None) for name, error in errors.items()
    }


@pytest.mark.anyio
async def test_tasks_cancelled_while_their_keys_wait_in_a_batch_leave_no_lease(
    tmp_path: Path,
) -> None:
    """8 calls cancelled while their keys wait behind a held commit: every key's write
    completes, no lease is left behind, and nothing is sent."""
    sent: list[httpx.Request] = []
    journal = idempotently.Journal(tmp_path / "journal.db")
    gate = threading.Event()
    held = threading.Event()
    keys_held: list[int] = []

    def hold(writes: Sequence[Any], durable: bool) -> None:
        keys = sum(isinstance(write, Insert) for write in writes)
        if keys and not held.is_set():
            keys_held.append(keys)
            held.set()
            gate.wait(timeout=30)

    def keys_waiting() -> int:
        queued = sum(isinstance(job.write, Insert) for job in journal._writer._waiting)
        return sum(keys_held) + queued

    journal.observe_commits(before=hold)

    async def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(201)

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client,
        idempotently.AsyncSession(journal, client=client) as s,
    ):
        async with anyio.create_task_group() as group:
            for n in range(8):
                group.start_soon(lambda n=n: s.post(URL, json={"n": n}))
            # Not a fixed sleep: on a loaded machine 0.1 s saw only 2 of the 8 keys handed
            # over. Wait until a commit of keys is held and all 8 keys are in it or
            # queued behind it (a task may still be reading the origin pauses).
            with anyio.fail_after(30):
                while not held.is_set() or keys_waiting() < 8:
                    await anyio.sleep(0.01)
            await anyio.wait_all_tasks_blocked()
            group.cancel_scope.cancel()
            gate.set()
        journaled = s.journal.operations()
    assert [] == sent
    assert [("pending", None, 0.0)] * 8 == [
        (op.status, op.lease_owner, op.lease_until) for op in journaled
    ]


@pytest.mark.anyio
async def test_a_completion_failing_in_a_shared_transaction_fails_only_its_own_call(
    tmp_path: Path,
) -> None:
    """Tasks' completions committed together, one of which the journal refuses: that call
    raises, naming its operation; every other call gets its answer, journaled."""
    journal = idempotently.Journal(tmp_path / "journal.db")
    store = journal._store
    apply = store._apply

    def one_bad(write: Any, counts: dict[str, int]) -> Any:
        if isinstance(write, Record) and write.operation_id == "op-3":
            raise sqlite3.DataError("string or blob too big")
        return apply(write, counts)

    store._apply = one_bad  # type: ignore[method-assign]
    batches = commits(journal)
    outcomes: dict[str, object] = {}

    async def answer(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(0.01)
        return httpx.Response(201)

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client,
        idempotently.AsyncSession(journal, client=client) as s,
    ):

        async def post(n: int) -> None:
            try:
                response = await s.post(URL, json={}, operation_id=f"op-{n}")
                outcomes[f"op-{n}"] = response.status_code
            except idempotently.JournalWriteError as error:
                outcomes[f"op-{n}"] = error.operation_id

        async with anyio.create_task_group() as group:
            for n in range(8):
                group.start_soon(post, n)
        statuses = {op.operation_id: op.status for op in journal.operations()}
    assert {**{f"op-{n}": 201 for n in range(8)}, "op-3": "op-3"} == outcomes
    assert {**{f"op-{n}": "succeeded" for n in range(8)}, "op-3": "pending"} == statuses
    assert max(batch.count(Record) for batch in batches) > 1  # it shared a transaction


# -- writes on the loop ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_journal_another_thread_is_using_never_stalls_the_loop(tmp_path: Path) -> None:
    """While another thread holds the journal (a sync Session sharing it, say), a write is
    not tried on the loop, which would wait for it: it goes to a worker thread."""
    journal = idempotently.Journal(tmp_path / "journal.db", durability="os")
    batches = commits(journal)
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with journal._store._lock:
            taken.set()
            release.wait(timeout=10)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(timeout=10)
    gaps: list[float] = []
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(charges_answered)) as client,
        idempotently.AsyncSession(journal, client=client) as s,
        anyio.create_task_group() as group,
    ):
        await group.start(heartbeat, gaps)
        group.start_soon(lambda: s.post(URL, json={}, operation_id="op"))
        await anyio.sleep(LOCK_HELD / 2)
        release.set()
        with anyio.fail_after(10):
            while (operation := s.journal.operation("op")) is None or operation.status != (
                "succeeded"
            ):
                await anyio.sleep(TICK)
        group.cancel_scope.cancel()
    holder.join()
    loop = threading.get_ident()
    assert [batch for batch in batches if batch.count(Insert)], "nothing was committed"
    assert loop not in {batch.thread for batch in batches}  # the loop never waited for it
    assert max(gaps) < MAX_GAP


@pytest.mark.anyio
@pytest.mark.parametrize("durability", ["fsync", "os"])
async def test_no_journal_command_ever_runs_on_the_event_loop(
    tmp_path: Path, durability: str
) -> None:
    """Reads and writes alike (a key, a lookup, a completion, a resume's queue): the store
    is never entered from the event loop's thread, whatever the durability."""
    journal = idempotently.Journal(tmp_path / "journal.db", durability=durability)  # type: ignore[arg-type]
    store = journal._store
    threads: list[int] = []
    batches = commits(journal)
    for name in ("find", "operations", "queue"):
        real = getattr(store, name)

        def traced(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            threads.append(threading.get_ident())
            return _real(*args, **kwargs)

        setattr(store, name, traced)
    loop = threading.get_ident()
    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(charges_answered)) as client,
        idempotently.AsyncSession(journal, client=client) as s,
    ):
        async with anyio.create_task_group() as group:
            for n in range(8):
                group.start_soon(lambda n=n: s.post(URL, json={"n": n}, operation_id=f"op-{n}"))
        await s.resume()
        counts = journal.counts()
    assert 8 == counts["succeeded"]
    # Reads (at least the resume's queue) and writes (keys, then answers: two batches at
    # the fewest) were all seen, none on the loop's thread.
    assert len(threads) >= 1 and len(batches) >= 2
    assert loop not in threads + [batch.thread for batch in batches]


@pytest.mark.anyio
@pytest.mark.parametrize("durability", ["fsync", "os"])
async def test_a_call_on_a_closed_journal_names_its_operation_and_sends_nothing(
    tmp_path: Path, durability: str
) -> None:
    """A call whose journal was closed raises a JournalError naming the operation and
    saying the journal is closed, from the loop path as from the thread path."""
    transport, sent = recording_transport()
    journal = idempotently.Journal(tmp_path / "journal.db", durability=durability)  # type: ignore[arg-type]
    async with (
        httpx.AsyncClient(transport=transport) as client,
        idempotently.AsyncSession(journal, client=client) as s,
    ):
        journal.close()
        with pytest.raises(idempotently.JournalError) as caught:
            await s.post(URL, json={}, operation_id="op-1")
    assert [] == sent
    assert "op-1" == caught.value.operation_id
    assert "closed" in str(caught.value)


@pytest.mark.anyio
async def test_a_sync_session_in_a_thread_and_an_async_session_share_one_journal(
    tmp_path: Path,
) -> None:
    """A sync Session posting from a thread and an AsyncSession's tasks on one Journal
    object: every operation is sent once and settled, nothing deadlocks, and the loop
    never stalls waiting for the thread's writes."""
    journal = idempotently.Journal(tmp_path / "journal.db", durability="os")
    transport, sent = recording_transport()

    def sync_posts() -> None:
        with idempotently.Session(journal, transport=transport) as session:
            for n in range(150):
                session.post(URL, json={}, operation_id=f"sync-{n}")

    gaps: list[float] = []
    thread = threading.Thread(target=sync_posts)
    async with (
        httpx.AsyncClient(transport=transport) as client,
        idempotently.AsyncSession(journal, client=client) as s,
        anyio.create_task_group() as group,
    ):
        await group.start(heartbeat, gaps)
        thread.start()

        async def posts(task: int) -> None:
            for n in range(30):
                await s.post(URL, json={}, operation_id=f"async-{task}-{n}")

        async with anyio.create_task_group() as posting:
            for task in range(5):
                posting.start_soon(posts, task)
        await anyio.to_thread.run_sync(thread.join)
        group.cancel_scope.cancel()
    operations = journal.operations(limit=1000)
    keys = [request.headers["Idempotency-Key"] for request in sent]
    assert 300 == len(keys) == len(set(keys))
    assert {"succeeded": 300} == {
        status: sum(op.status == status for op in operations)
        for status in {op.status for op in operations}
    }
    assert max(gaps) < MAX_GAP


@pytest.mark.anyio
@pytest.mark.parametrize("durability", ["fsync", "os"])
async def test_a_journal_replaced_at_its_path_says_it_moved(
    tmp_path: Path, durability: str
) -> None:
    """The file renamed away and a new journal created at its path: the next named call
    raises JournalMovedError naming its operation and sends nothing."""
    path = tmp_path / "journal.db"
    transport, sent = recording_transport()
    journal = idempotently.Journal(path, durability=durability)  # type: ignore[arg-type]
    async with (
        httpx.AsyncClient(transport=transport) as client,
        idempotently.AsyncSession(journal, client=client) as s,
    ):
        await s.post(URL, json={}, operation_id="first")
        os.rename(path, f"{path}.moved")
        idempotently.Journal(path).close()
        with pytest.raises(idempotently.JournalMovedError) as caught:
            await s.post(URL, json={}, operation_id="second")
    assert 1 == len(sent)
    assert "second" == caught.value.operation_id
