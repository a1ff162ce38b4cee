"""Operation groups under attack (DESIGN §3.11 against §7): ids shared with operations
outside the group, damaged links, and the group's edges. Against a loopback server,
real SQLite files and PostgreSQL."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import idempotently
from tests.group_server import StepLog
from tests.scripted_server import serve

ONCE = idempotently.RetryPolicy(max_attempts=1)


@pytest.fixture(scope="module")
def _server() -> Iterator[tuple[StepLog, str]]:
    app = StepLog(hold=0.0)
    with serve(app) as url:
        yield app, url


@pytest.fixture
def server(_server: tuple[StepLog, str]) -> Iterator[tuple[StepLog, str]]:
    app, url = _server
    app.reset()
    yield app, url
    app.reset()


def session(target: str, url: str, **options: Any) -> idempotently.Session:
    return idempotently.Session(target, base_url=url, policy=ONCE, **options)


def paths(app: StepLog) -> list[str]:
    return [path for path, _ in app.started()]


def test_a_step_whose_id_is_journaled_outside_its_group_is_refused_unsent(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """order-42/charge journaled as a lone operation: the step charge of group order-42
    is KeyReuseError, nothing sent (else it is sent outside the group, and ship after a
    failed charge is sent too)."""
    app, url = server
    app.answer("/charge", 402)
    with session(journal_target, url) as s:
        s.enqueue("POST", "/charge", json={}, operation_id="order-42/charge")
        group = s.group("order-42")
        with pytest.raises(idempotently.KeyReuseError) as refused:
            group.post("/charge", json={}, step="charge")
        with pytest.raises(idempotently.KeyReuseError):
            group.enqueue("POST", "/charge", json={}, step="charge")
        lone = s.journal.operation("order-42/charge")
    assert "outside group 'order-42'" in refused.value.message
    assert "order-42/charge" == refused.value.operation_id
    assert lone is not None
    assert ("pending", None, None) == (lone.status, lone.group_id, lone.first_send_at)
    assert [] == paths(app)


def test_a_step_in_another_group_of_the_same_id_is_refused_unsent(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """A step journaled in group a/b as c (id a/b/c) is no step of group a: group a's
    step b/c is refused for its '/', and a lone call of a/b/c keeps the group's order."""
    app, url = server
    app.answer("/charge", 503)
    with session(journal_target, url) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.group("a/b").post("/charge", json={}, step="charge")
        s.group("a/b").enqueue("POST", "/ship", json={}, step="ship")
        with pytest.raises(ValueError, match="without '/'"):
            s.group("a").post("/ship", json={}, step="b/ship")
        with pytest.raises(idempotently.OperationPendingError):
            s.post("/ship", json={}, operation_id="a/b/ship")
    assert ["/charge"] == paths(app)


@pytest.mark.parametrize(("cycle", "damaged_at"), [("self", "g/charge"), ("two", "g/ship")])
def test_a_successor_link_that_loops_is_a_clear_error_not_a_hang(
    tmp_path: Path, server: tuple[StepLog, str], cycle: str, damaged_at: str
) -> None:
    """A damaged successor column that leads back to a step already followed raises
    JournalCorruptError naming the step: nothing sent, the call does not spin forever."""
    app, url = server
    target = str(tmp_path / "journal.db")
    with session(target, url) as s:
        group = s.group("g")
        # One request for both, so that only the link can stop the call.
        group.enqueue("POST", "/pay", json={}, step="charge")
        group.enqueue("POST", "/pay", json={}, step="ship")
    with sqlite3.connect(target) as conn:
        if cycle == "self":
            conn.execute("UPDATE operations SET successor = operation_id WHERE step = 1")
        else:
            conn.execute("UPDATE operations SET successor = 'g/ship' WHERE step = 1")
            conn.execute("UPDATE operations SET successor = 'g/charge' WHERE step = 2")
    with session(target, url) as s, pytest.raises(idempotently.JournalCorruptError) as damaged:
        s.group("g").post("/pay", json={}, step="charge")
    assert "successor" in damaged.value.message
    assert damaged_at == damaged.value.operation_id
    assert [] == paths(app)


def test_a_stale_stop_never_abandons_a_step_sent_after_the_fork_that_restarted_the_group(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """A caller read the group while charge stopped it; charge is forked meanwhile, the
    fork succeeds and ship is at the server. That caller's stop, settling what it read,
    leaves ship alone: ship was sent (it ends succeeded, not "abandoned, group stopped")."""
    from idempotently._drivers import run
    from idempotently._flow._groups import stop
    from idempotently._flow._operation import Held

    app, url = server
    app.answer("/charge", 402)
    app.gates["/ship"] = threading.Event()
    with session(journal_target, url) as s:
        group = s.group("order-42")
        assert 402 == group.post("/charge", json={}, step="charge").status_code
        group.enqueue("POST", "/ship", json={}, step="ship")  # behind a failed charge
        stale = s.journal.group("order-42")
        s.journal.fork("order-42/charge", note="card replaced")
        resumed = threading.Thread(target=s.resume)
        resumed.start()
        try:
            wait_for(lambda: ["/charge", "/charge", "/ship"] == paths(app))
            settled = run(
                stop(s._engine, stale, stale[0]),
                Held(),
                s.journal,
                send=s._send,
                sleep=s._sleep,
            )
        finally:
            app.gates["/ship"].set()
            resumed.join()
        ship = s.journal.operation("order-42/ship")
    assert [] == settled
    assert ship is not None
    assert ("succeeded", 201) == (ship.status, ship.response_status)


def wait_for(test: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not test():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("damage", ["'x'", "1e400", "x'00'"])
def test_a_step_behind_a_damaged_step_row_is_not_sent(
    tmp_path: Path, server: tuple[StepLog, str], damage: str
) -> None:
    """charge's place is damaged (text, infinity, bytes): resume reports charge and
    leaves ship, the step after it, unsent (its earlier step never succeeded); a live
    call of ship is refused too; the other group goes on."""
    app, url = server
    target = str(tmp_path / "journal.db")
    with session(target, url) as s:
        for name in ("a", "b"):
            group = s.group(name)
            group.enqueue("POST", f"/{name}/charge", json={}, step="charge")
            group.enqueue("POST", f"/{name}/ship", json={}, step="ship")
    with sqlite3.connect(target) as conn:
        conn.execute(f"UPDATE operations SET step = {damage} WHERE operation_id = 'a/charge'")
    with session(target, url) as s:
        results = {r.operation_id: r.status for r in s.resume()}
        with pytest.raises(idempotently.OperationPendingError):
            s.group("a").post("/a/ship", json={}, step="ship")
    assert {
        "a/charge": "pending",
        "a/ship": "pending",
        "b/charge": "succeeded",
        "b/ship": "succeeded",
    } == results
    assert ["/b/charge", "/b/ship"] == paths(app)


@pytest.mark.parametrize(("group_id", "step"), [("g" * 10_000, "charge"), ("g" * 200, "s" * 60)])
def test_a_group_and_step_too_long_for_an_operation_id_are_refused_by_name(
    tmp_path: Path, server: tuple[StepLog, str], group_id: str, step: str
) -> None:
    """The error names the group and the step and says to shorten them (not "leave the
    operation id out", which a step cannot); nothing journaled or sent."""
    app, url = server
    with session(str(tmp_path / "journal.db"), url) as s:
        with pytest.raises(ValueError, match="give a shorter group id or step") as refused:
            s.group(group_id).post("/charge", json={}, step=step)
        assert [] == s.journal.operations()
    assert "leave it out" not in str(refused.value)
    assert f"step {step[:60]!r}" in str(refused.value)
    assert [] == paths(app)
