"""Leases across hosts: claims of due operations, heartbeats, host identities."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

import idempotently
from idempotently._commands import ExtendLeases, Lease
from idempotently._flow._leases import lease_owner_alive, new_lease_owner
from idempotently._journal import Journal, NewOperation
from idempotently._journal import _writer as writer_module
from idempotently._journal._writer import Writer
from tests.journal_commands import (
    claim_due,
    extend_leases,
    insert_operation,
    set_status,
    take_lease,
)
from tests.support import URL, FakeTime

NOW = 1_800_000_000.0


def new_operation(operation_id: str, created_at: float) -> NewOperation:
    return NewOperation(
        operation_id=operation_id,
        key=f"key-{operation_id}",
        delivery="exactly_once",
        method="POST",
        url=URL,
        request_headers=(),
        request_body=b"{}",
        fingerprint="f",
        profile="generic",
        key_header="Idempotency-Key",
        created_at=created_at,
        key_expires_at=created_at + 86400,
        deadline_at=None,
    )


def pending(
    journal: Journal,
    operation_id: str,
    *,
    created_at: float,
    lease_until: float = 0.0,
    owner: str | None = None,
    not_before: float | None = None,
) -> None:
    """A pending operation with this lease and not_before."""
    assert insert_operation(
        journal,
        new_operation(operation_id, created_at),
        owner=owner or "old:1:x",
        lease_until=lease_until,
    )
    with journal._store._write() as conn:
        conn.execute(
            "UPDATE operations SET lease_owner = ?, lease_until = ?, not_before = ? "
            "WHERE operation_id = ?",
            (owner, lease_until, not_before, operation_id),
        )


@pytest.fixture
def journal(tmp_path: Path) -> Journal:
    with Journal(tmp_path / "journal.db", durability="os") as opened:
        yield opened


# -- _claim_due -----------------------------------------------------------------------


def test_claim_due_leases_due_operations_oldest_first(journal: Journal) -> None:
    """Only pending operations whose lease expired and whose not_before passed are claimed,
    oldest first, up to the limit; each gets the claimer's lease."""
    pending(journal, "c", created_at=NOW - 30)
    pending(journal, "a", created_at=NOW - 50)
    pending(journal, "b", created_at=NOW - 40, lease_until=NOW - 1, owner="dead:1:x")
    pending(journal, "leased", created_at=NOW - 60, lease_until=NOW + 10, owner="live:1:x")
    pending(journal, "later", created_at=NOW - 70, not_before=NOW + 5)
    pending(journal, "due_now", created_at=NOW - 20, not_before=NOW)
    pending(journal, "extra", created_at=NOW - 10)
    set_status(journal, "extra", "succeeded", reason=None, now=NOW)

    claimed = claim_due(journal, owner="w:1:t", now=NOW, lease_until=NOW + 60, limit=3)

    assert ["a", "b", "c"] == [operation.operation_id for operation in claimed]
    assert {("w:1:t", NOW + 60)} == {(op.lease_owner, op.lease_until) for op in claimed}
    rest = claim_due(journal, owner="w:2:t", now=NOW, lease_until=NOW + 60, limit=10)
    assert ["due_now"] == [operation.operation_id for operation in rest]
    stored = journal.operation("a")
    assert stored is not None and ("w:1:t", NOW + 60) == (stored.lease_owner, stored.lease_until)


def test_claim_due_returns_operations_with_their_attempts(journal: Journal) -> None:
    """A claimed operation comes with its attempts, like a Find."""
    with (
        idempotently.Session(
            journal,
            transport=httpx.MockTransport(lambda request: httpx.Response(503)),
            policy=idempotently.RetryPolicy(
                max_attempts=2, initial_backoff=0.001, max_backoff=0.001
            ),
        ) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post(URL, json={}, operation_id="op")
    [claimed] = claim_due(journal, owner="w:1:t", now=2e10, lease_until=2e10 + 60, limit=5)
    assert 2 == len(claimed.attempts) == claimed.attempt_count


def test_concurrent_claims_never_hand_one_operation_to_two_workers(tmp_path: Path) -> None:
    """Eight threads, each with its own connection, claim 400 due operations: each once."""
    path = tmp_path / "journal.db"
    with Journal(path, durability="os") as seed:
        for i in range(400):
            pending(seed, f"op-{i:03d}", created_at=NOW - 1000 + i)
    claims: dict[int, list[str]] = {n: [] for n in range(8)}
    start = threading.Barrier(8)

    def claimer(n: int) -> None:
        with Journal(path) as mine:
            start.wait()
            for _ in range(400):  # bounded: a broken claim must fail, not loop forever
                batch = claim_due(mine, owner=f"w:{n}:t", now=NOW, lease_until=NOW + 60, limit=7)
                if not batch:
                    break
                claims[n].extend(operation.operation_id for operation in batch)

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    claimed = [operation_id for ids in claims.values() for operation_id in ids]
    assert sorted(claimed) == [f"op-{i:03d}" for i in range(400)]
    with Journal(path) as check:
        owners = {op.operation_id: op.lease_owner for op in check.operations(limit=1000)}
    assert all(owners[op_id] == f"w:{n}:t" for n, ids in claims.items() for op_id in ids)


# -- _extend_leases ----------------------------------------------------------------------


def test_extend_leases_only_moves_live_leases_of_their_owner_forward(journal: Journal) -> None:
    """Only rows still pending and leased by the given owner are extended, never backwards."""
    pending(journal, "mine", created_at=NOW, lease_until=NOW + 10, owner="me:1:t")
    pending(journal, "far", created_at=NOW, lease_until=NOW + 500, owner="me:1:t")
    pending(journal, "theirs", created_at=NOW, lease_until=NOW + 10, owner="them:1:t")
    pending(journal, "done", created_at=NOW, lease_until=NOW + 10, owner="me:1:t")
    set_status(journal, "done", "succeeded", reason=None, now=NOW)

    extended = extend_leases(
        journal,
        [
            ("mine", "me:1:t"),
            ("far", "me:1:t"),
            ("theirs", "me:1:t"),
            ("done", "me:1:t"),
            ("missing", "me:1:t"),
        ],
        lease_until=NOW + 100,
        now=NOW,
    )

    assert 2 == extended  # "far" matched; its lease stays where it was
    leases = {op.operation_id: op.lease_until for op in journal.operations()}
    assert {"mine": NOW + 100, "far": NOW + 500, "theirs": NOW + 10, "done": 0.0} == leases
    assert 0 == extend_leases(journal, [], lease_until=NOW + 100, now=NOW)


# -- heartbeat ------------------------------------------------------------------------------


OTHER_HOST = """
import sys, httpx, idempotently
with idempotently.Session(
    sys.argv[1], host_id="host-b", clock=lambda: float(sys.argv[2]),
    transport=httpx.MockTransport(lambda request: httpx.Response(201)),
) as other:
    print(",".join(result.action for result in other.resume()))
"""


def test_a_long_attempt_is_not_taken_over_by_another_host(tmp_path: Path) -> None:
    """An attempt that outlives its lease keeps it: the heartbeat extends it, so another
    host's resume (a real second process) finds it leased and sends nothing."""
    path = tmp_path / "journal.db"
    fake = FakeTime(now=NOW)
    arrivals: list[str] = []
    second: list[str] = []

    def slow_server(request: httpx.Request) -> httpx.Response:
        arrivals.append(request.headers["Idempotency-Key"])
        fake.now += 25  # longer than the lease: without a heartbeat it would have expired
        session.journal._heartbeat.beat()
        other = subprocess.run(
            [sys.executable, "-c", OTHER_HOST, str(path), str(fake.now)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        second.append(other.stdout.strip())
        return httpx.Response(201)

    with idempotently.Session(
        path,
        host_id="host-a",
        lease_duration=10,
        clock=fake.clock,
        sleep=fake.sleep,
        transport=httpx.MockTransport(slow_server),
    ) as session:
        response = session.post(URL, json={}, operation_id="slow")
        assert 201 == response.status_code
        assert [] == session.journal._heartbeat.leases()  # the flow ended: no lease kept
    assert ["leased"] == second
    assert 1 == len(arrivals)


@pytest.mark.anyio
async def test_a_long_async_attempt_is_not_taken_over_by_another_host(tmp_path: Path) -> None:
    """The async driver keeps the lease of an attempt in flight alive too."""
    path = tmp_path / "journal.db"
    fake = FakeTime(now=NOW)
    second: list[str] = []
    lease_left: list[float | None] = []

    async def slow_server(request: httpx.Request) -> httpx.Response:
        fake.now += 25
        session.journal._heartbeat.beat()
        operation = session.journal.operation("slow")
        lease_left.append(None if operation is None else operation.lease_until - fake.now)
        with idempotently.Session(
            path,
            host_id="host-b",
            clock=fake.clock,
            sleep=fake.sleep,
            transport=httpx.MockTransport(lambda request: httpx.Response(201)),
        ) as other:
            second.extend(result.action for result in other.resume())
        return httpx.Response(201)

    async with idempotently.AsyncSession(
        path,
        host_id="host-a",
        lease_duration=10,
        clock=fake.clock,
        sleep=fake.async_sleep,
        transport=httpx.MockTransport(slow_server),
    ) as session:
        assert 201 == (await session.post(URL, json={}, operation_id="slow")).status_code
        assert [] == session.journal._heartbeat.leases()
    assert ["leased"] == second
    assert [10.0] == lease_left  # renewed in the journal, where other processes look


class RecordingCommit:
    """A store's commit whose heartbeat writes are recorded (or fail)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[list[tuple[str, str]], float]] = []
        self.called = threading.Event()

    def __call__(self, writes: Sequence[ExtendLeases], durable: bool) -> list[int]:
        self.calls.extend((list(write.leases), write.lease_until) for write in writes)
        self.called.set()
        if self.fail:
            raise idempotently.JournalWriteError("the journal is locked")
        return [len(write.leases) for write in writes]


def test_the_heartbeat_thread_extends_leases_every_third_of_their_duration() -> None:
    """Without being asked, the writer's thread renews a registered lease (and stops
    renewing it once removed)."""
    commit = RecordingCommit()
    heartbeat = Writer(commit, lambda write: False).heartbeat
    lease = Lease("op", "me:1:t", 0.15, lambda: NOW)
    with heartbeat.holding(lease):
        assert commit.called.wait(10)
    assert [([("op", "me:1:t")], NOW + 0.15)] == commit.calls[:1]
    assert [] == heartbeat.leases()


def test_a_failing_heartbeat_is_logged_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    """A heartbeat the journal refuses is a warning; the caller goes on."""
    heartbeat = Writer(RecordingCommit(fail=True), lambda write: False).heartbeat
    heartbeat.add(Lease("op", "me:1:t", 600, lambda: NOW))
    with caplog.at_level(logging.WARNING, logger="idempotently"):
        assert 0 == heartbeat.beat()
    assert "could not extend 1 lease" in caplog.text
    heartbeat.remove(Lease("op", "me:1:t", 600, lambda: NOW))


# -- host identity -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "a:b", "tab\there", " padded", "x" * 129])
def test_an_invalid_host_id_is_refused_before_the_journal_exists(tmp_path: Path, bad: str) -> None:
    """host_id must be printable, without ':', at most 128 characters: ValueError first."""
    for make in (
        idempotently.Session,
        idempotently.AsyncSession,
        idempotently.Transport,
        idempotently.AsyncTransport,
    ):
        with pytest.raises(ValueError, match="host_id"):
            make(tmp_path / "journal.db", host_id=bad)  # type: ignore[operator]
    assert not (tmp_path / "journal.db").exists()


def test_the_host_id_comes_from_the_environment_and_starts_lease_owners(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IDEMPOTENTLY_HOST_ID names the host in lease owners when host_id is not given."""
    monkeypatch.setenv("IDEMPOTENTLY_HOST_ID", "pod-7")
    owners: list[str | None] = []

    def look(request: httpx.Request) -> httpx.Response:
        operation = session.journal.operation("op")
        owners.append(None if operation is None else operation.lease_owner)
        return httpx.Response(201)

    with idempotently.Session(
        tmp_path / "journal.db", transport=httpx.MockTransport(look)
    ) as session:
        session.post(URL, json={}, operation_id="op")
    assert [f"pod-7:{os.getpid()}"] == [str(owner).rsplit(":", 1)[0] for owner in owners]
    monkeypatch.setenv("IDEMPOTENTLY_HOST_ID", "bad:id")
    with pytest.raises(ValueError, match="IDEMPOTENTLY_HOST_ID"):
        idempotently.Session(tmp_path / "other.db")


def test_another_host_id_on_this_machine_is_a_remote_host(tmp_path: Path) -> None:
    """A lease of a dead pid counts as dead only under our own host id: under another,
    resume waits for it to expire."""
    dead_pid = 2**22 + 12345  # above any pid_max: never a live process
    assert not lease_owner_alive(f"here:{dead_pid}:t", "here")
    assert lease_owner_alive(f"there:{dead_pid}:t", "here")
    fake = FakeTime(now=NOW)
    path = tmp_path / "journal.db"
    with Journal(path) as journal:
        pending(journal, "op", created_at=NOW, lease_until=NOW + 30, owner=f"there:{dead_pid}:t")
    sent: list[int] = []

    def server(request: httpx.Request) -> httpx.Response:
        sent.append(1)
        return httpx.Response(201)

    for host, expected in (("here", "leased"), ("there", "succeeded")):
        with idempotently.Session(
            path,
            host_id=host,
            clock=fake.clock,
            sleep=fake.sleep,
            transport=httpx.MockTransport(server),
        ) as session:
            assert [expected] == [result.action for result in session.resume()]
    assert [1] == sent


def test_another_process_with_our_pid_and_host_id_is_alive() -> None:
    """A lease of another process that has our pid and host id (pid 1 in two containers
    sharing a hostname) is waited out, never judged ended because no flow of ours holds
    it; an ended flow of this process is still seen as ended."""
    ours = new_lease_owner("here")
    stranger = f"here:{os.getpid()}:zzzzzzzzzzzz"  # never our hex tag
    assert (False, True) == (lease_owner_alive(ours, "here"), lease_owner_alive(stranger, "here"))


def test_lease_owners_are_unique_and_a_forked_child_makes_its_own() -> None:
    """Every flow gets an owner no other flow of this process has; a child forked from
    this process names its own pid and tag, so none of its owners is one of ours, and
    its leases are told from ours (alive while its flows run, not ours to judge)."""
    ours = [new_lease_owner("here") for _ in range(1000)]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        made = [new_lease_owner("here") for _ in range(1000)]
        os.write(write, "\n".join(made).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        theirs = pipe.read().decode().split("\n")
    os.waitpid(pid, 0)
    assert 1000 == len(set(ours)) == len(set(theirs))
    assert not set(ours) & set(theirs)
    assert {f"here:{os.getpid()}"} == {owner.rpartition(":")[0] for owner in ours}
    assert {f"here:{pid}"} == {owner.rpartition(":")[0] for owner in theirs}
    tags = {owner.rpartition(":")[2][:6] for owner in ours}
    assert 1 == len(tags) and not tags & {owner.rpartition(":")[2][:6] for owner in theirs}


def test_back_to_back_calls_reuse_one_heartbeat_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease registered soon after the last one ended finds the writer's thread still
    running (no thread start per call), and the thread ends once idle for IDLE."""
    monkeypatch.setattr(writer_module, "IDLE", 600.0)
    writer = Writer(RecordingCommit(), lambda write: False)
    with writer.heartbeat.holding(Lease("op-1", "me:1:t", 0.3, lambda: NOW)):
        thread = writer._thread
    with writer.heartbeat.holding(Lease("op-2", "me:1:t", 0.3, lambda: NOW)):
        assert thread is not None and thread is writer._thread
    monkeypatch.setattr(writer_module, "IDLE", 0.0)
    with writer._lock:
        writer._work.notify_all()  # however long it planned to linger, it looks again
    thread.join(10)
    assert not thread.is_alive()
    assert writer._thread is None


# -- the lease is checked again right before the bytes leave --------------------------------


@pytest.mark.parametrize("taken_over", [True, False])
def test_a_call_whose_lease_ran_out_before_its_send_never_sends_a_second_time(
    tmp_path: Path, taken_over: bool
) -> None:
    """A hook slower than lease_duration delays the first send: if another process took the
    expired lease (its compare-and-swap) and sent meanwhile, this call sends nothing
    (OperationInProgressError, naming the operation and key); if nobody took it, the call
    renews it and sends."""
    fake_time = FakeTime(now=NOW)
    sent: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers["Idempotency-Key"])
        return httpx.Response(201)

    with idempotently.Session(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(answer),
        hooks=[lambda event: slow_hook(event)],
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        lease_duration=10.0,
    ) as session:

        def slow_hook(event: object) -> None:
            if type(event).__name__ != "OperationStarted":
                return
            fake_time.now += 11.0  # the hook outlived the 10 s lease
            if taken_over:  # another process's resume finds it expired, takes it and sends
                operation = session.journal.operation("order-1")
                assert operation is not None
                assert take_lease(
                    session.journal,
                    operation,
                    owner="another-host:4242:0123456789ab",
                    lease_until=fake_time.now + 10.0,
                    now=fake_time.now,
                )
                sent.append(operation.key)

        if taken_over:
            with pytest.raises(idempotently.OperationInProgressError) as caught:
                session.post(URL, json={"amount": 1}, operation_id="order-1")
            assert ("order-1", sent[0]) == (caught.value.operation_id, caught.value.key)
        else:
            assert 201 == session.post(URL, json={"amount": 1}, operation_id="order-1").status_code
        operation = session.journal.operation("order-1")
    assert operation is not None
    assert [operation.key] == sent  # one send, whoever made it
    expected = ("pending", "another-host:4242:0123456789ab") if taken_over else ("succeeded", None)
    assert expected == (operation.status, operation.lease_owner)


@pytest.mark.anyio
async def test_an_async_call_whose_lease_ran_out_before_its_send_never_sends_twice(
    tmp_path: Path, anyio_backend: str
) -> None:
    """The same on asyncio and trio: a hook outlives the lease, another process takes it
    over and sends; this call sends nothing and raises OperationInProgressError."""
    fake_time = FakeTime(now=NOW)
    sent: list[str] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers["Idempotency-Key"])
        return httpx.Response(201)

    journal = idempotently.Journal(tmp_path / "journal.db")

    def slow_hook(event: object) -> None:
        if type(event).__name__ != "OperationStarted":
            return
        fake_time.now += 11.0  # the hook outlived the 10 s lease
        operation = journal.operation("order-1")
        assert operation is not None
        assert take_lease(
            journal,
            operation,
            owner="another-host:4242:0123456789ab",
            lease_until=fake_time.now + 10.0,
            now=fake_time.now,
        )
        sent.append(operation.key)  # the other process sends it

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client,
        idempotently.AsyncSession(
            journal,
            client=client,
            hooks=[slow_hook],
            clock=fake_time.clock,
            sleep=fake_time.async_sleep,
            lease_duration=10.0,
        ) as session,
    ):
        with pytest.raises(idempotently.OperationInProgressError) as caught:
            await session.post(URL, json={"amount": 1}, operation_id="order-1")
        operation = journal.operation("order-1")
    journal.close()
    assert operation is not None
    assert [operation.key] == sent  # one send: the other process's
    assert ("order-1", operation.key) == (caught.value.operation_id, caught.value.key)
