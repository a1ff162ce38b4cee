"""Operation groups with recovery points (DESIGN §3.11, issue 31 items 2 and 3).

``session.group("order-42")`` gives steps: ``g.post(url, ..., step="charge")`` is the
named operation ``order-42/charge``, journaled with its group and place. A step is sent
only once every earlier step has succeeded (checked where its lease is taken: a call, a
resume, a watch worker), a rerun continues at the first unsettled step, a failed or
abandoned step stops the group, a fork takes its step's place. Against a loopback
server that logs when each request starts and ends, real SQLite files and PostgreSQL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import idempotently
from idempotently._keys import derived_key
from idempotently.cli import cli
from idempotently.testing import crash_points
from tests import crash_scenarios
from tests.group_server import StepLog
from tests.scripted_server import serve

REPO = Path(__file__).resolve().parent.parent
ONCE = idempotently.RetryPolicy(max_attempts=1)


@pytest.fixture(scope="module")
def _server() -> Iterator[tuple[StepLog, str]]:
    app = StepLog()
    with serve(app) as url:
        yield app, url


@pytest.fixture
def server(_server: tuple[StepLog, str]) -> Iterator[tuple[StepLog, str]]:
    """A loopback server logging each request's start and end, answering 201 unless told."""
    app, url = _server
    app.reset()
    yield app, url
    app.reset()


def session(target: str, url: str, **options: Any) -> idempotently.Session:
    return idempotently.Session(target, base_url=url, policy=ONCE, **options)


def paths(app: StepLog) -> list[str]:
    return [path for path, _ in app.started()]


def steps_of(target: str, group_id: str) -> list[tuple[str, int | None, str]]:
    with idempotently.Journal(target, create=False) as journal:
        return [(op.operation_id, op.step, op.status) for op in journal.group(group_id)]


# -- a step is a named operation with its group and place ------------------------------


def test_a_step_is_the_named_operation_group_slash_step_with_its_place(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """Its id is order-42/charge, its key the ordinary derived one, its place the order
    the application first called the steps in."""
    app, url = server
    with session(journal_target, url) as s:
        group = s.group("order-42")
        group.post("/charge", json={"amount": 1}, step="charge")
        group.put("/ship", json={"to": "x"}, step="ship")
        group.patch("/email", json={"n": 1}, step="email")
        namespace = s.journal.namespace
        operation = s.journal.operation("order-42/charge")
    assert namespace is not None and operation is not None
    assert [
        ("order-42/charge", 1, "succeeded"),
        ("order-42/ship", 2, "succeeded"),
        ("order-42/email", 3, "succeeded"),
    ] == steps_of(journal_target, "order-42")
    assert derived_key(namespace, "order-42/charge") == operation.key
    assert ("order-42", 1, None) == (operation.group_id, operation.step, operation.successor)
    assert ["/charge", "/ship", "/email"] == paths(app)


def test_a_step_is_not_sent_while_the_step_before_is_pending(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """OperationPendingError naming the step it waits for; nothing sent, nothing journaled."""
    app, url = server
    app.answer("/charge", 503)
    with session(journal_target, url) as s:
        group = s.group("order-42")
        with pytest.raises(idempotently.OperationPendingError):
            group.post("/charge", json={}, step="charge")
        with pytest.raises(idempotently.OperationPendingError) as refused:
            group.post("/ship", json={}, step="ship")
    assert "waits for step 'charge'" in refused.value.message
    assert "order-42/ship" == refused.value.operation_id
    assert ["/charge"] == paths(app)
    assert [("order-42/charge", 1, "pending")] == steps_of(journal_target, "order-42")


def test_a_rerun_answers_settled_steps_and_continues_at_the_recovery_point(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """charge succeeded, ship left pending (503): the rerun returns charge's stored answer
    without a request, resends ship with its key, then sends email."""
    app, url = server
    app.answer("/ship", 503)
    with session(journal_target, url) as s:
        group = s.group("order-42")
        group.post("/charge", json={}, step="charge")
        with pytest.raises(idempotently.OperationPendingError):
            group.post("/ship", json={}, step="ship")
    with session(journal_target, url) as s:
        group = s.group("order-42")
        replayed = group.post("/charge", json={}, step="charge")
        group.post("/ship", json={}, step="ship")
        group.post("/email", json={}, step="email")
    assert replayed.extensions["idempotently"].replayed_locally
    assert ["/charge", "/ship", "/ship", "/email"] == paths(app)
    ship_keys = {key for path, key in app.started() if path == "/ship"}
    assert 1 == len(ship_keys)
    assert ["succeeded"] * 3 == [status for _, _, status in steps_of(journal_target, "order-42")]


def test_a_rerun_that_calls_steps_in_another_order_is_refused(
    tmp_path: Path, server: tuple[StepLog, str]
) -> None:
    """A journaled step called after one journaled later: KeyReuseError, nothing sent."""
    app, url = server
    target = str(tmp_path / "journal.db")
    with session(target, url) as s:
        group = s.group("order-42")
        group.post("/charge", json={}, step="charge")
        group.post("/ship", json={}, step="ship")
    with session(target, url) as s:
        group = s.group("order-42")
        group.post("/ship", json={}, step="ship")
        with pytest.raises(idempotently.KeyReuseError) as refused:
            group.post("/charge", json={}, step="charge")
    assert "in the order they were first called" in refused.value.message
    assert ["/charge", "/ship"] == paths(app)


# -- stop rules --------------------------------------------------------------------------


def test_a_failed_step_stops_the_group_and_abandons_its_enqueued_steps(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """charge answered 402 (failed): ship raises GroupStoppedError unsent, and the
    enqueued, never-sent email is settled abandoned "group stopped at charge"."""
    app, url = server
    app.answer("/charge", 402)
    with session(journal_target, url) as s:
        group = s.group("order-42")
        group.enqueue("POST", "/charge", json={}, step="charge")
        group.enqueue("POST", "/email", json={}, step="email")
        s.resume()
        with pytest.raises(idempotently.GroupStoppedError) as stopped:
            group.post("/ship", json={}, step="ship")
        email = s.journal.operation("order-42/email")
    assert ("order-42", "charge") == (stopped.value.group_id, stopped.value.stopped_at)
    assert "stopped at step 'charge'" in stopped.value.message
    assert email is not None
    assert ("abandoned", "group stopped at charge") == (email.status, email.reason)
    assert ["/charge"] == paths(app)


@pytest.mark.parametrize("action", ["abandon", "settle_failed"])
def test_abandoning_or_settling_a_step_failed_stops_the_group(
    journal_target: str, server: tuple[StepLog, str], action: str
) -> None:
    """An operator's abandon or settle --failed of a pending step stops the group: the
    later steps are never sent; a resume settles the enqueued one abandoned."""
    app, url = server
    app.answer("/charge", 503)
    with session(journal_target, url) as s:
        group = s.group("order-42")
        with pytest.raises(idempotently.OperationPendingError):
            group.post("/charge", json={}, step="charge")
        group.enqueue("POST", "/ship", json={}, step="ship")
        if action == "abandon":
            s.journal.abandon("order-42/charge", note="card expired")
        else:
            s.journal.settle("order-42/charge", "failed", note="declined by phone")
        results = s.resume()
        with pytest.raises(idempotently.GroupStoppedError):
            group.post("/email", json={}, step="email")
    assert [("order-42/ship", "abandoned")] == [(r.operation_id, r.action) for r in results]
    assert ["/charge"] == paths(app)
    assert "abandoned" == steps_of(journal_target, "order-42")[1][2]


def test_a_forked_step_takes_its_place_in_the_group(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """charge abandoned, then forked: the fork stands in charge's place (the link in
    successor), a rerun sends the fork for charge and goes on to ship."""
    app, url = server
    app.answer("/charge", 503)
    with session(journal_target, url) as s:
        group = s.group("order-42")
        with pytest.raises(idempotently.OperationPendingError):
            group.post("/charge", json={}, step="charge")
        s.journal.abandon("order-42/charge", note="stuck")
        fork = s.journal.fork("order-42/charge", note="send it again")
    with session(journal_target, url) as s:
        group = s.group("order-42")
        group.post("/charge", json={}, step="charge")
        group.post("/ship", json={}, step="ship")
        original = s.journal.operation("order-42/charge")
    assert original is not None and fork.operation_id == original.successor
    assert [
        ("order-42/charge", 1, "failed"),
        (fork.operation_id, 1, "succeeded"),
        ("order-42/ship", 2, "succeeded"),
    ] == steps_of(journal_target, "order-42")
    assert ["/charge", "/charge", "/ship"] == paths(app)


# -- resume and watch workers finish a group in order ------------------------------------


def test_resume_finishes_groups_in_order_one_step_at_a_time(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """Two groups of three enqueued steps, resumed four at a time: each group's steps
    reach the server in their order, never two of one group at once."""
    app, url = server
    with session(journal_target, url) as s:
        for name in ("a", "b"):
            group = s.group(name)
            for step in ("charge", "ship", "email"):
                group.enqueue("POST", f"/{name}/{step}", json={}, step=step)
        results = s.resume(concurrency=4)
    assert ["succeeded"] * 6 == [result.action for result in results]
    for name in ("a", "b"):
        mine = [path for path in paths(app) if path.startswith(f"/{name}/")]
        assert [f"/{name}/charge", f"/{name}/ship", f"/{name}/email"] == mine
    assert_no_two_steps_of_a_group_at_once(app)


def assert_no_two_steps_of_a_group_at_once(app: StepLog) -> None:
    in_flight: dict[str, int] = {}
    for event, path, _ in list(app.events):
        group = path.split("/")[1]
        in_flight[group] = in_flight.get(group, 0) + (1 if event == "start" else -1)
        assert in_flight[group] <= 1, app.events


def test_resume_leaves_a_step_pending_while_the_step_before_cannot_be_sent(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """charge answered 503 again: ship stays pending unsent, its result says why."""
    app, url = server
    app.answer("/charge", 503, 503)
    with session(journal_target, url) as s:
        group = s.group("order-42")
        group.enqueue("POST", "/charge", json={}, step="charge")
        group.enqueue("POST", "/ship", json={}, step="ship")
        results = s.resume()
    assert [("order-42/charge", "still_pending"), ("order-42/ship", "still_pending")] == [
        (r.operation_id, r.action) for r in results
    ]
    assert "waits for step 'charge'" in results[1].detail
    assert ["/charge"] == paths(app)


@pytest.mark.slow
def test_two_watch_workers_never_send_two_steps_of_a_group_at_once(
    tmp_path: Path, journal_target: str, server: tuple[StepLog, str]
) -> None:
    """Two `resume --watch` processes on one journal drain three groups of three enqueued
    steps: every step once, in its group's order, never two of one group in flight."""
    from tests.test_fleet import fleet, wait_until_drained

    app, url = server
    with session(journal_target, url) as s:
        for name in ("a", "b", "c"):
            group = s.group(name)
            for step in ("charge", "ship", "email"):
                group.enqueue("POST", f"/{name}/{step}", json={}, step=step)
    with fleet(
        tmp_path, journal_target, ["host-a", "host-b"], "--concurrency", "3", "--base-url", url
    ) as workers:
        wait_until_drained(workers, journal_target)
        for worker in workers:
            assert 0 == worker.stop(signal.SIGTERM), worker.diagnosis()
    for name in ("a", "b", "c"):
        mine = [path for path in paths(app) if path.startswith(f"/{name}/")]
        assert [f"/{name}/charge", f"/{name}/ship", f"/{name}/email"] == mine
    assert_no_two_steps_of_a_group_at_once(app)


_RUNNER = textwrap.dedent(
    """
    import sys, time, idempotently
    target, url = sys.argv[1], sys.argv[2]
    with idempotently.Session(target, base_url=url) as s:
        done = set()
        while len(done) < 3:
            group = s.group("order-42")
            for step in ("charge", "ship", "email"):
                try:
                    group.post("/order-42/" + step, json={}, step=step)
                    done.add(step)
                except (idempotently.OperationPendingError,
                        idempotently.OperationInProgressError):
                    time.sleep(0.01)
                    break
    print("done")
    """
)


@pytest.mark.slow
def test_two_processes_running_one_group_send_each_step_once_in_order(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """Two processes run the same group at once, each retrying what it is refused: each
    step reaches the server once, in order, never two at once."""
    app, url = server
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _RUNNER, journal_target, url],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]
    assert [("done\n", 0)] * 2 == [
        (out, process.returncode) for (out, _), process in zip(outputs, processes, strict=True)
    ], outputs
    assert ["/order-42/charge", "/order-42/ship", "/order-42/email"] == paths(app)
    assert_no_two_steps_of_a_group_at_once(app)


# -- async: asyncio and trio -------------------------------------------------------------


@pytest.mark.anyio
async def test_an_async_group_keeps_its_order_and_continues_at_the_recovery_point(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """AsyncSession.group: ship refused while charge is pending; a rerun continues."""
    app, url = server
    app.answer("/charge", 503)
    async with idempotently.AsyncSession(journal_target, base_url=url, policy=ONCE) as s:
        group = s.group("order-42")
        with pytest.raises(idempotently.OperationPendingError):
            await group.post("/charge", json={}, step="charge")
        with pytest.raises(idempotently.OperationPendingError):
            await group.post("/ship", json={}, step="ship")
    async with (
        idempotently.AsyncSession(journal_target, base_url=url) as s,
        s.group("order-42") as group,
    ):
        await group.post("/charge", json={}, step="charge")
        await group.post("/ship", json={}, step="ship")
        steps = await group.steps()
    assert ["/charge", "/charge", "/ship"] == paths(app)
    assert [(1, "succeeded"), (2, "succeeded")] == [(op.step, op.status) for op in steps]


# -- a crash at every step ---------------------------------------------------------------


@pytest.mark.slow
def test_a_three_step_group_killed_at_every_step_recovers_with_one_effect_each(
    tmp_path: Path,
) -> None:
    """crash_points kills the group at every journal step of each of its operations."""
    report = crash_points(crash_scenarios.three_step_group, directory=tmp_path)
    report.assert_exactly_once()
    assert ("order-7/charge", "order-7/ship", "order-7/email") == report.operations
    assert 3 == report.charges
    assert 15 == len(report.points)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_async_three_step_group_killed_at_its_last_step_recovers(
    tmp_path: Path, backend: Any
) -> None:
    report = crash_points(
        crash_scenarios.three_step_group_async,
        operations=[2],
        backend=backend,
        directory=tmp_path,
    )
    report.assert_exactly_once()
    assert 3 == report.charges


_KILLED_CHILD = textwrap.dedent(
    """
    import sys, idempotently
    target, url = sys.argv[1], sys.argv[2]
    with idempotently.Session(target, base_url=url) as s:
        group = s.group("order-42")
        group.post("/charge", json={}, step="charge")
        print("charged", flush=True)
        group.post("/ship", json={}, step="ship")
    """
)


@pytest.mark.slow
def test_a_rerun_after_sigkill_mid_step_continues_at_the_recovery_point(
    tmp_path: Path, server: tuple[StepLog, str]
) -> None:
    """The process is killed while ship is at the server: the rerun replays charge from
    the journal, resends ship with its key, and goes on."""
    app, url = server
    app.gates["/ship"] = threading.Event()  # ship is held at the server until the kill
    target = str(tmp_path / "journal.db")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CHILD, target, url],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert "charged\n" == child.stdout.readline()
        wait_for(lambda: len(app.started()) == 2)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        app.gates["/ship"].set()
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
    with session(target, url) as s:
        group = s.group("order-42")
        group.post("/charge", json={}, step="charge")
        group.post("/ship", json={}, step="ship")
        group.post("/email", json={}, step="email")
    assert ["/charge", "/ship", "/ship", "/email"] == paths(app)
    assert 1 == len({key for path, key in app.started() if path == "/ship"})


def wait_for(test: Any, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not test():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# -- the command line --------------------------------------------------------------------


def test_list_group_and_show_group_draw_where_the_group_stopped_and_what_is_next(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """list --group lists the steps in order; show GROUP says the recovery point."""
    app, url = server
    app.answer("/ship", 503)
    with session(journal_target, url) as s:
        group = s.group("order-42")
        group.post("/charge", json={}, step="charge")
        with pytest.raises(idempotently.OperationPendingError):
            group.post("/ship", json={}, step="ship")
    runner = CliRunner()
    listed = runner.invoke(
        cli, ["--journal", journal_target, "list", "--group", "order-42", "--format", "json"]
    )
    shown = runner.invoke(cli, ["--journal", journal_target, "show", "order-42"])
    as_json = runner.invoke(cli, ["--journal", journal_target, "show", "order-42", "--json"])
    assert 0 == listed.exit_code, listed.output
    assert ["order-42/charge", "order-42/ship"] == [
        operation["operation_id"] for operation in json.loads(listed.output)
    ]
    assert 0 == shown.exit_code, shown.output
    assert "next: ship (pending)" in shown.output
    document = json.loads(as_json.output)
    assert ("order-42", "ship", None) == (
        document["group_id"],
        document["next_step"],
        document["stopped_at"],
    )
    assert [1, 2] == [step["step"] for step in document["steps"]]


def test_show_group_says_where_a_stopped_group_stopped(
    tmp_path: Path, server: tuple[StepLog, str]
) -> None:
    app, url = server
    app.answer("/charge", 402)
    target = str(tmp_path / "journal.db")
    with session(target, url) as s:
        s.group("order-42").post("/charge", json={}, step="charge")
    shown = CliRunner().invoke(cli, ["--journal", target, "show", "order-42", "--json"])
    document = json.loads(shown.output)
    assert ("charge", None) == (document["stopped_at"], document["next_step"])


# -- bad input and poisoned rows ---------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "error"),
    [
        (None, TypeError),
        (3, TypeError),
        (True, TypeError),
        (b"charge", TypeError),
        ("", ValueError),
        ("a/b", ValueError),
        ("line\nbreak", ValueError),
        ("x" * 201, ValueError),
    ],
)
def test_a_bad_step_name_is_refused_before_anything_is_journaled(
    tmp_path: Path, server: tuple[StepLog, str], step: object, error: type[Exception]
) -> None:
    app, url = server
    with session(str(tmp_path / "journal.db"), url) as s:
        with pytest.raises(error) as refused:
            s.group("order-42").post("/charge", json={}, step=step)  # type: ignore[arg-type]
        assert [] == s.journal.operations()
    assert "order-42" in str(refused.value)
    assert [] == paths(app)


@pytest.mark.parametrize("group_id", [None, 42, b"g", "", "a\x00b"])
def test_a_bad_group_id_is_refused(tmp_path: Path, group_id: object) -> None:
    with (
        idempotently.Session(tmp_path / "journal.db") as s,
        pytest.raises((TypeError, ValueError), match="group_id"),
    ):
        s.group(group_id)  # type: ignore[arg-type]


def test_a_step_takes_no_operation_id(tmp_path: Path) -> None:
    with (
        idempotently.Session(tmp_path / "journal.db") as s,
        pytest.raises(TypeError, match="operation_id"),
    ):
        s.group("g").post("/x", step="a", operation_id="other")


def test_a_poisoned_step_row_is_reported_and_the_other_groups_resume(
    tmp_path: Path, server: tuple[StepLog, str]
) -> None:
    """One group's step row is damaged: resume reports it and finishes the other group;
    show GROUP still draws the damaged group."""
    import sqlite3

    app, url = server
    target = str(tmp_path / "journal.db")
    with session(target, url) as s:
        for name in ("a", "b"):
            s.group(name).enqueue("POST", f"/{name}/charge", json={}, step="charge")
    with sqlite3.connect(target) as conn:
        conn.execute("UPDATE operations SET step = 'x' WHERE group_id = 'a'")
    with session(target, url) as s:
        results = s.resume()
    assert {"a/charge": "not_sent", "b/charge": "succeeded"} == {
        r.operation_id: r.action for r in results
    }
    shown = CliRunner().invoke(cli, ["--journal", target, "show", "a"])
    assert 0 == shown.exit_code, shown.output
    assert "cannot be read" in shown.output
    assert ["/b/charge"] == paths(app)


def test_steps_journaled_at_once_from_two_journals_take_distinct_places(
    journal_target: str, server: tuple[StepLog, str]
) -> None:
    """Four Journals (four connections, four writers) enqueue steps of one group at once: every
    step gets a place of its own (PostgreSQL: the group's insert lock; SQLite: its one
    writer at a time)."""
    _, url = server
    barrier = threading.Barrier(4)

    def enqueue(name: str) -> None:
        with session(journal_target, url) as s:
            group = s.group("g")
            barrier.wait()
            for n in range(25):
                group.enqueue("POST", "/g", json={"n": n}, step=f"{name}-{n}")

    threads = [threading.Thread(target=enqueue, args=(name,)) for name in "wxyz"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    places = [step for _, step, _ in steps_of(journal_target, "g")]
    assert list(range(1, 101)) == places
