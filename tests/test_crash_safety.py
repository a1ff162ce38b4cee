"""Crash safety with real processes, a real journal file and the mock server on 127.0.0.1.

The promise (DESIGN §7, issue 4 item 3): whatever kills a worker and whatever
the network loses, after recovery the server's ledger holds exactly one charge
per order and the journal says every operation succeeded. Workers are
``tests/crash_child.py`` processes that stop themselves at an exact point, and
the tests wait on the lines they print, never on sleeps.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import idempotently
from idempotently.testing import MockServer, MockServerConfig, serve
from tests.crash_child import PHASES, USER, charge_body, operation_id
from tests.fault_proxy import FaultProxy
from tests.support import JsonLinesProcess

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("crash_child.py")
REPO = Path(__file__).parent.parent
AUTH = {"Authorization": f"Bearer {USER}"}
FAST_RETRIES = idempotently.RetryPolicy(initial_backoff=0.001, max_backoff=0.01)
# Longest any single wait may take: past this something hangs, the test fails instead.
WAIT = 60.0

ORDERS = 6
DOOMED = 2
# Phases after which the server has charged the doomed order.
CHARGED_PHASES = ("after_charge", "before_journal_update")
# Phases after which the doomed operation is journaled, pending, leased by the dead worker.
JOURNALED_PHASES = ("before_send", *CHARGED_PHASES)


class Worker(JsonLinesProcess):
    """A crash_child.py process whose JSON lines are read as they are printed."""

    wait = WAIT

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.stderr_path = tmp_path / f"worker-{time.monotonic_ns()}.stderr"
        self._stderr = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            cwd=REPO,
        )
        self.pid = self.proc.pid
        self._start_reading(f"worker {self.pid}")

    def wait_for(self, name: str, timeout: float = WAIT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            event = self.next_event(max(0.0, deadline - time.monotonic()))
            if event is None:
                raise AssertionError(f"worker {self.pid} ended before {name!r}: {self.diagnosis()}")
            if event["event"] == name:
                return event

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = WAIT) -> int:
        """Read to the end and reap the process; its exit code (negative: killed by a signal)."""
        deadline = time.monotonic() + timeout
        while self.next_event(max(0.0, deadline - time.monotonic())) is not None:
            pass
        return self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))

    def kill(self) -> None:
        """SIGKILL and reap: a reaped pid is gone, which is what lease checks look for."""
        self.proc.kill()
        self.proc.wait(timeout=WAIT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self._reader.join(timeout=WAIT)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()

    def diagnosis(self) -> str:
        return f"exit {self.proc.poll()}, stderr:\n{self.stderr_path.read_text()}"

    def answered(self) -> list[dict[str, Any]]:
        return [event for event in self.events if event["event"] == "answered"]


@contextmanager
def worker(tmp_path: Path, *args: str) -> Iterator[Worker]:
    process = Worker(tmp_path, *args)
    try:
        yield process
    finally:
        process.close()


def run_worker(tmp_path: Path, *args: str) -> tuple[int, Worker]:
    """Run a worker to its end (or its death); its exit code and what it printed."""
    with worker(tmp_path, *args) as process:
        return process.finish(), process


def charge_args(journal: Path, url: str, *extra: str, orders: int = ORDERS) -> list[str]:
    return ["charge", "--journal", str(journal), "--url", url, "--orders", str(orders), *extra]


@contextmanager
def refused_url() -> Iterator[str]:
    """A loopback URL whose port is bound but not listening: every connect is refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def session(journal: Path, url: str, **options: Any) -> idempotently.Session:
    options.setdefault("policy", FAST_RETRIES)
    return idempotently.Session(journal, base_url=url, headers=AUTH, **options)


def lease_pid(operation: idempotently.Operation) -> int:
    assert operation.lease_owner is not None
    return int(operation.lease_owner.split(":")[1])


def assert_every_order_charged_once(server: MockServer, journal: Path, orders: int) -> None:
    """The ledger: one charge per order, under the operation's journaled key; all succeeded."""
    assert {} == server.ledger.duplicates()
    assert {(USER, f"order-{i}"): 1 for i in range(orders)} == server.charge_count_by_order()
    charges = {charge.order_id: charge for charge in server.charges()}
    with idempotently.Journal(journal, create=False) as journaled:
        assert {"succeeded": orders} == {n: c for n, c in journaled.counts().items() if c}
        for i in range(orders):
            operation = journaled.operation(operation_id(i))
            assert operation is not None
            charge = charges[f"order-{i}"]
            assert charge.key == operation.key
            assert operation.response_body is not None
            assert charge.id == json.loads(operation.response_body)["id"]


# -- 1. the crash matrix -------------------------------------------------------


def assert_state_at_death(
    phase: str, journal: Path, server: MockServer, pid: int, stopping: dict[str, Any]
) -> None:
    """The worker really died where the phase says: journal and ledger as expected."""
    doomed_order = f"order-{DOOMED}"
    expected_before = {(USER, f"order-{i}"): 1 for i in range(DOOMED)}
    if phase in CHARGED_PHASES:
        expected_before[(USER, doomed_order)] = 1
    assert expected_before == server.charge_count_by_order()
    with idempotently.Journal(journal, create=False) as journaled:
        operation = journaled.operation(operation_id(DOOMED))
        assert DOOMED == journaled.counts()["succeeded"]
    if phase == "before_commit":
        assert operation is None
        return
    assert operation is not None
    assert ("pending", ()) == (operation.status, operation.attempts)
    assert pid == lease_pid(operation)
    # The dead worker's lease has most of its minute left: recovery must not wait it out.
    assert operation.lease_until > time.time() + 30
    if phase == "before_send":
        assert operation.key not in {record.key for record in server.idempotency_keys()}
        return
    [charge] = server.charges(order_id=doomed_order)
    assert operation.key == charge.key
    if phase == "after_charge":
        assert charge.id == stopping["charge_id"]  # seen by lookup, the answer never read
    else:
        assert 201 == stopping["status"]  # the answer arrived, its attempt not journaled


@pytest.mark.parametrize("durability", ["fsync", "os"])
@pytest.mark.parametrize("recovery", ["resume", "rerun"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_worker_killed_at_any_phase_charges_every_order_exactly_once(
    tmp_path: Path, phase: str, recovery: str, durability: str
) -> None:
    """SIGKILLed at any phase, then resumed and rerun: each order is charged exactly once,
    with the key fsync'd before the send or only committed (a killed process loses
    neither)."""
    journal = tmp_path / "journal.db"
    with serve() as server:
        code, killed = run_worker(
            tmp_path,
            *charge_args(
                journal,
                server.url,
                "--kill-at",
                phase,
                "--kill-on-order",
                str(DOOMED),
                "--durability",
                durability,
            ),
        )
        assert -signal.SIGKILL == code, killed.diagnosis()
        assert [operation_id(i) for i in range(DOOMED)] == [
            event["operation_id"] for event in killed.answered()
        ]
        stopping = killed.events[-1]
        assert ("stopping", phase) == (stopping["event"], stopping["phase"])
        assert_state_at_death(phase, journal, server, killed.pid, stopping)

        resumed_doomed = recovery == "resume" and phase in JOURNALED_PHASES
        if recovery == "resume":
            with session(journal, server.url) as resumer:
                results = resumer.resume()
            expected = [(operation_id(DOOMED), "succeeded", phase in CHARGED_PHASES)]
            assert (expected if resumed_doomed else []) == [
                (result.operation_id, result.action, result.replayed) for result in results
            ]

        requests_before = server.stats().requests
        code, rerun = run_worker(
            tmp_path, *charge_args(journal, server.url, "--durability", durability)
        )
        assert 0 == code, rerun.diagnosis()
        # Settled operations come back from the journal; only the rest reach the server.
        locally = [i <= DOOMED if resumed_doomed else i < DOOMED for i in range(ORDERS)]
        assert locally == [event["replayed_locally"] for event in rerun.answered()]
        assert locally.count(False) == server.stats().requests - requests_before
        server_replayed = [
            recovery == "rerun" and i == DOOMED and phase in CHARGED_PHASES for i in range(ORDERS)
        ]
        assert server_replayed == [event["replayed"] for event in rerun.answered()]
        assert [201] * ORDERS == [event["status"] for event in rerun.answered()]
        charges = {charge.order_id: charge.id for charge in server.charges()}
        assert [charges[f"order-{i}"] for i in range(ORDERS)] == [
            event["charge_id"] for event in rerun.answered()
        ]
        assert_every_order_charged_once(server, journal, ORDERS)


def test_a_lease_held_by_a_killed_worker_is_taken_at_once(tmp_path: Path) -> None:
    """A live worker's lease is respected; once it is SIGKILLed, resume sends at once."""
    journal = tmp_path / "journal.db"
    with (
        serve() as server,
        worker(
            tmp_path,
            *charge_args(
                journal, server.url, "--kill-at", "before_send", "--signal", "STOP", orders=1
            ),
        ) as stopped,
    ):
        stopped.wait_for("stopping")  # journaled and leased; the worker is stopping itself
        with idempotently.Journal(journal, create=False) as journaled:
            operation = journaled.operation(operation_id(0))
        assert operation is not None
        assert stopped.pid == lease_pid(operation)

        with session(journal, server.url) as resumer:
            assert ["leased"] == [result.action for result in resumer.resume()]
        assert [] == server.charges()

        stopped.kill()
        lease_left = operation.lease_until - time.time()
        started = time.monotonic()
        with session(journal, server.url) as resumer:
            results = resumer.resume()
        took = time.monotonic() - started
        assert [("succeeded", 201)] == [(result.action, result.status_code) for result in results]
        assert took < lease_left
        assert_every_order_charged_once(server, journal, 1)


# -- 2. faults on the wire -------------------------------------------------------

WIRE_OPERATIONS = 1000
RESET_EVERY = 7


def test_answers_lost_after_the_server_acted_are_neither_doubled_nor_lost(tmp_path: Path) -> None:
    """1,000 operations with every 7th answer reset after the server acted: 0 doubled, 0 lost."""
    journal = tmp_path / "journal.db"
    with serve() as server, FaultProxy(server.url, reset_every=RESET_EVERY) as proxy:
        with session(journal, proxy.url) as client:
            for i in range(WIRE_OPERATIONS):
                response = client.post(
                    "/v1/charges", json=charge_body(i), operation_id=operation_id(i)
                )
                assert 201 == response.status_code
        assert [] == proxy.errors
        resets = proxy.resets
        # Every 7th request is reset and its retry is the next one: one more request per reset.
        assert WIRE_OPERATIONS + resets == proxy.requests
        assert proxy.requests // RESET_EVERY == resets
        stats = server.stats()
        assert (proxy.requests, resets) == (stats.requests, stats.replays)
        assert_every_order_charged_once(server, journal, WIRE_OPERATIONS)
    with idempotently.Journal(journal, create=False) as journaled:
        outcomes = [
            [attempt.outcome for attempt in journaled.operation(operation_id(i)).attempts]  # type: ignore[union-attr]
            for i in range(WIRE_OPERATIONS)
        ]
    assert resets == outcomes.count(["maybe_delivered", "answered"])
    assert WIRE_OPERATIONS - resets == outcomes.count(["answered"])


# -- 3. concurrent resumers ----------------------------------------------------------

RESUMED_OPERATIONS = 50


def key_of(request: bytes) -> str:
    for line in request.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "idempotency-key":
            return value.strip()
    raise AssertionError("a request without an Idempotency-Key")


def test_two_resumers_on_one_journal_send_each_operation_once(tmp_path: Path) -> None:
    """Two processes resuming one journal at once: each operation is sent by one, charged once."""
    journal = tmp_path / "journal.db"
    with (
        refused_url() as nowhere,
        session(journal, nowhere, policy=idempotently.RetryPolicy(max_attempts=1)) as client,
    ):
        for i in range(RESUMED_OPERATIONS):
            with pytest.raises(idempotently.OperationPendingError):
                client.post("/v1/charges", json=charge_body(i), operation_id=operation_id(i))
    config = MockServerConfig(provider_latency=0.01)
    with (
        serve(config) as server,
        FaultProxy(server.url, hold_first=2) as proxy,
        worker(
            tmp_path, "resume", "--journal", str(journal), "--url", proxy.url, "--barrier"
        ) as first,
        worker(
            tmp_path, "resume", "--journal", str(journal), "--url", proxy.url, "--barrier"
        ) as second,
    ):
        resumers = (first, second)
        # Both read the same 50 pending operations before either sends.
        assert [RESUMED_OPERATIONS] * 2 == [r.wait_for("ready")["pending"] for r in resumers]
        for resumer in resumers:
            resumer.go()
        # A worker sends one request at a time, so two held requests are one from each:
        # both were sending at that moment, and never the same operation.
        held = proxy.wait_until_held(2, timeout=WAIT)
        assert 2 == len({key_of(request) for request in held})
        proxy.release()
        assert [0, 0] == [resumer.finish() for resumer in resumers], first.diagnosis()
        assert [] == proxy.errors
        stats = server.stats()
        assert_every_order_charged_once(server, journal, RESUMED_OPERATIONS)

    results = [[e for e in r.events if e["event"] == "resumed"] for r in resumers]
    sent = [[e["operation_id"] for e in found if e["action"] == "succeeded"] for found in results]
    # Each resumer went through the whole snapshot: what it did not send, the other had
    # leased (or, read again just before, had already finished).
    assert [RESUMED_OPERATIONS] * 2 == [len(found) for found in results]
    assert sorted(operation_id(i) for i in range(RESUMED_OPERATIONS)) == sorted(sent[0] + sent[1])
    assert all(sent), "both resumers sent something"
    others = {e["action"] for found in results for e in found if e["action"] != "succeeded"}
    assert others <= {"leased", "skipped"}
    # One request per operation: no key was ever sent twice, so never two at once.
    assert (RESUMED_OPERATIONS, 0, 0) == (stats.requests, stats.replays, stats.conflicts)
    with idempotently.Journal(journal, create=False) as journaled:
        for i in range(RESUMED_OPERATIONS):
            operation = journaled.operation(operation_id(i))
            assert operation is not None
            assert [("not_sent", None), ("answered", 201)] == [
                (attempt.outcome, attempt.status_code) for attempt in operation.attempts
            ]
