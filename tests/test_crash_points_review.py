"""`crash_points` under review: no false pass, no false failure, every misuse a clear error.

The scenarios live in `tests/crash_review_scenarios.py` (child processes import
them). Each test aims at as few crash points as proves its point: a point costs
three processes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from idempotently.testing import CrashHarnessError, crash_points
from idempotently.testing._crash_points import _charges, _Harness
from idempotently.testing._provider import Charge

from . import crash_review_scenarios as scenarios
from . import crash_scenarios

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        # A single step name is not a list of its letters.
        ({"steps": "after_key_commit"}, TypeError, r"e\.g\. steps=\['after_key_commit'\]"),
        ({"steps": 3}, TypeError, "steps must be a list of step names"),
        ({"operations": 1}, TypeError, r"operations must be a list .* not 1"),
        ({"operations": "01"}, TypeError, "operations must be a list"),
        # An empty list would crash nothing and report every point held.
        ({"operations": []}, ValueError, "operations is empty, so nothing would be crashed"),
        ({"timeout": float("inf")}, ValueError, r"at most 86400\)"),
        ({"timeout": 1e300}, ValueError, "timeout must be a positive number"),
        ({"timeout": float("nan")}, ValueError, "timeout must be a positive number"),
        ({"rerun": "no"}, TypeError, "rerun must be True or False"),
        ({"on_point": 3}, TypeError, "on_point must be a function"),
        ({"directory": 3}, TypeError, "directory must be a path"),
        # Rebuilt in the child, it would get the session as its self.
        ({"scenario": scenarios.Checkout().place}, TypeError, "is a bound method"),
    ],
)
def test_misuse_is_refused_before_anything_runs(
    tmp_path: Path, arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        crash_points(
            **{"scenario": crash_scenarios.place_orders, "directory": tmp_path, **arguments}
        )
    assert not (tmp_path / "clean").exists()


def test_a_directory_that_cannot_hold_the_runs_is_a_clear_error(tmp_path: Path) -> None:
    a_file = tmp_path / "runs"
    a_file.write_text("not a directory")
    for directory in (a_file, a_file / "below"):
        with pytest.raises(CrashHarnessError, match=r"cannot hold the runs' journals and logs"):
            crash_points(crash_scenarios.place_orders, directory=directory)
    assert a_file.read_text() == "not a directory"


def test_a_clean_run_that_charges_nothing_proves_nothing_and_says_so(tmp_path: Path) -> None:
    # Refused by the server (a negative amount): with no charge to count, every
    # point would "hold exactly once".
    with pytest.raises(CrashHarnessError, match=r"1 operation\(s\) made no charge without a crash"):
        crash_points(scenarios.charges_nothing, steps=["before_key_commit"], directory=tmp_path)


def test_a_step_the_clean_run_never_reached_is_a_failing_point_not_a_silent_skip(
    tmp_path: Path,
) -> None:
    # The wire steps are met inside httpx's transports; a transport of the user's
    # own never meets them, so nothing was crashed there.
    report = crash_points(
        crash_scenarios.place_orders,
        session=scenarios.session_on_its_own_transport,
        steps=["after_request_sent", "before_answer_recorded"],
        operations=[1],
        directory=tmp_path,
    )
    unreached, recorded = report.points
    assert (unreached.operation, unreached.step, unreached.killed) == (
        1,
        "after_request_sent",
        False,
    )
    assert unreached.problems == (
        "not crashed: the clean run never reached after_request_sent of it (it was never sent,"
        " or sent through a transport crash_points cannot see (it sees httpx's and httpx2's"
        " HTTPTransport and AsyncHTTPTransport))",
    )
    assert unreached.operation_id == "order-2:charge"
    assert recorded.ok, recorded
    assert not report.ok
    assert "1 of 2 crash points held exactly once" in report.describe()
    with pytest.raises(
        AssertionError,
        match=r"FAIL operation 1 \(order-2:charge\) not killed at after_request_sent",
    ):
        report.assert_exactly_once()


def test_a_directory_used_again_starts_each_run_afresh(tmp_path: Path) -> None:
    # Each call's clean run journals into tmp_path/clean, and only then is
    # operation 5 found not to exist. The second call's clean run must not meet
    # the first one's journal (its keys went to another server, on another port).
    for _ in range(2):
        with pytest.raises(ValueError, match="5 is not the position of one of the scenario's 2"):
            crash_points(crash_scenarios.place_orders, operations=[5], directory=tmp_path)
    assert (tmp_path / "clean" / "idempotently.db").exists()


UNGUARDED_SCRIPT = """
import idempotently
from idempotently.testing import crash_points


def charge_orders(session: idempotently.Session) -> None:
    session.post("/v1/charges", operation_id="order-1:charge",
                 json={"amount": 100, "currency": "usd", "customer": "cus_1"})


# No `if __name__ == "__main__":`, and the child process loads this file.
crash_points(charge_orders, steps=["after_key_commit"], timeout=20).assert_exactly_once()
"""


def test_a_script_that_calls_the_harness_as_it_is_imported_is_a_clear_error(
    tmp_path: Path,
) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        start_new_session=True,
    )
    assert result.returncode == 1
    assert (
        "CrashHarnessError: the scenario fails with no crash at all (CrashHarnessError:"
        " crash_points was called in one of its own child processes"
    ) in result.stderr
    assert 'Call it under `if __name__ == "__main__":` or in a test function' in result.stderr


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (Linux's /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_until_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def children_of(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rpartition(")")[2].split()[1]) == parent:
                found.append(int(stat.parent.name))
    return found


HANG = 120
"""The harness's timeout in the tests of a run that must not wait for it: far above what
three runs take on a loaded machine, so reaching it can only mean the harness waited."""

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


@needs_proc
def test_a_process_the_scenario_forks_neither_hangs_the_harness_nor_outlives_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("CRASH_REVIEW_PIDS", str(pids))
    started = time.monotonic()
    report = crash_points(
        scenarios.forks_a_sleeper,
        steps=["after_key_commit"],
        operations=[0],
        timeout=HANG,
        directory=tmp_path / "runs",
    )
    # The sleeper held the events pipe open: the harness waited for its end
    # until the timeout, then left it running.
    assert time.monotonic() - started < HANG
    assert report.ok, report.describe()
    forked = [int(path.name) for path in pids.iterdir()]
    assert len(forked) == 3  # the clean run, the crashed one, the recovery
    assert wait_until_gone(forked) == []


def test_a_scenario_that_leaves_a_thread_running_is_told_so_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(
        CrashHarnessError,
        match=r"returned with threads still running \(Thread-\d+ \(sleep\)\): join the threads",
    ):
        crash_points(scenarios.leaves_a_thread, timeout=HANG, directory=tmp_path)
    assert time.monotonic() - started < HANG  # not "ran until the timeout"


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        (scenarios.exits_early, "its process exited with status 0 before the scenario returned"),
        (scenarios.kills_itself, "its process was killed by SIGKILL before the scenario returned"),
    ],
)
def test_a_process_that_ends_before_its_scenario_returns_says_how(
    tmp_path: Path, scenario: Any, message: str
) -> None:
    with pytest.raises(CrashHarnessError, match=f"fails with no crash at all \\({message}"):
        crash_points(scenario, directory=tmp_path)


WAITING_HARNESS = """
from idempotently.testing import crash_points
from tests import crash_scenarios

crash_points(crash_scenarios.hangs, timeout=300)
"""


@needs_proc
def test_a_child_does_not_outlive_a_harness_killed_under_it(tmp_path: Path) -> None:
    harness = subprocess.Popen(
        [sys.executable, "-c", WAITING_HARNESS],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while not children and time.monotonic() < deadline:
            time.sleep(0.1)
            children = children_of(harness.pid)
        assert children, "the harness started no child"
        # Killed (a CI timeout, an OOM killer): it cannot kill its child any more.
        harness.kill()
        harness.wait()
        assert wait_until_gone(children) == []
    finally:
        harness.kill()
        harness.wait()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_an_operation_is_aimed_at_by_its_id_when_the_order_changes_between_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setenv("CRASH_REVIEW_RUNS", str(runs))
    report = crash_points(
        scenarios.reordered_on_restart,
        steps=["after_key_commit"],
        operations=[0],
        directory=tmp_path / "points",
    )
    assert report.operations == ("order-1:charge", "order-2:charge")
    [point] = report.points
    assert point.ok, point
    # The crashed run charged order-2 first, then died with order-1's key
    # committed: the point is order-1's, as the report says (by position, it
    # was order-2 that died, and order-1 was never crashed at all).
    assert point.operation_id == "order-1:charge"
    assert point.charges_at_crash == 1


class FakeLedger:
    """What `_ledger_problems` reads of a server: its charges (a wording check, no process)."""

    def __init__(self, *amounts: int) -> None:
        self._charges = [
            Charge(
                id=f"ch_{index}",
                user="user_1",
                key=f"k-{index}",
                amount=amount,
                currency="usd",
                customer="cus_1",
                metadata={},
                created=0,
            )
            for index, amount in enumerate(amounts)
        ]

    def charges(self) -> list[Charge]:
        return self._charges


@pytest.mark.parametrize(
    ("clean", "after", "problems"),
    [
        ((100,), (100, 100), ["charged twice: 100 usd to cus_1 (keys k-0, k-1)"]),
        ((100, 100), (100, 100, 100), ["charged 3 times (twice cleanly): 100 usd to cus_1"]),
        # A charge the clean run never made is not "charged twice".
        ((100,), (250,), ["charged once, never in the clean run: 250 usd", "lost: 100 usd"]),
        # Nor is a charge made once of two "never charged".
        ((100, 100), (100,), ["lost: 100 usd to cus_1 (keys k-0) charged once, twice cleanly"]),
        ((100, 100), (), ["lost: 100 usd to cus_1 never charged (2 missing)"]),
    ],
)
def test_the_ledgers_difference_is_told_as_it_is(
    tmp_path: Path, clean: tuple[int, ...], after: tuple[int, ...], problems: list[str]
) -> None:
    harness = _Harness({}, None, None, rerun=True, backend="asyncio", directory=tmp_path, timeout=1)
    reference = _charges(FakeLedger(*clean))  # type: ignore[arg-type]
    found = harness._ledger_problems(FakeLedger(*after), reference)  # type: ignore[arg-type]
    assert len(found) == len(problems), found
    for problem, start in zip(found, problems, strict=True):
        assert problem.startswith(start), (problem, start)


def test_a_step_met_again_on_a_retry_is_crashed_where_the_server_acted(tmp_path: Path) -> None:
    # order-1's first attempt is answered 503 (nothing charged), its retry charges:
    # a crash after the first answer would leave the case this step exists for,
    # a charge made and its answer lost, untested.
    report = crash_points(
        scenarios.unavailable_first, steps=["after_request_sent"], directory=tmp_path
    )
    assert report.ok, report.describe()
    [point] = report.points
    assert point.charges_at_crash == 1


def test_a_key_is_crashed_where_it_is_first_committed_not_where_a_call_is_made_again(
    tmp_path: Path,
) -> None:
    # The second pass over the orders meets the key's write again (answered from
    # the journal); a crash there would come after every charge was made.
    report = crash_points(
        scenarios.places_orders_twice,
        steps=["before_key_commit"],
        operations=[0],
        directory=tmp_path,
    )
    assert report.ok, report.describe()
    [point] = report.points
    assert point.charges_at_crash == 0


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        # An httpx.Client on idempotently.Transport: no resume() for recovery to call.
        (
            scenarios.transport_session,
            r"returned Client: a scenario that is not async needs an idempotently\.Session",
        ),
        # Its coroutines were never awaited: the scenario "journaled no operation".
        (
            scenarios.async_session,
            r"returned AsyncSession: a scenario that is not async needs an idempotently\.Session",
        ),
    ],
)
def test_a_session_factory_that_returns_no_session_is_a_clear_error(
    tmp_path: Path, factory: Any, message: str
) -> None:
    with pytest.raises(
        CrashHarnessError, match=f"fails with no crash at all \\(TypeError: .*{message}"
    ):
        crash_points(crash_scenarios.place_orders, session=factory, directory=tmp_path)


def test_a_kill_that_never_came_is_reported_not_counted_as_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setenv("CRASH_REVIEW_RUNS", str(runs))
    report = crash_points(
        scenarios.does_less_when_crashed,
        steps=["after_key_commit"],
        operations=[1],
        directory=tmp_path / "points",
    )
    [point] = report.points
    # Recovery charged order-2 as the clean run did: only the missed kill is wrong.
    assert not point.killed
    assert point.problems == (
        "the run never reached after_key_commit of operation 1: the scenario did not repeat"
        " the clean run (make its calls depend only on its input)",
    )
    assert not point.ok and not report.ok


def test_an_operation_left_pending_after_recovery_is_named(tmp_path: Path) -> None:
    report = crash_points(
        scenarios.leaves_one_pending,
        steps=["after_key_commit"],
        operations=[0],
        directory=tmp_path,
    )
    [point] = report.points
    assert point.killed
    [problem] = point.problems
    assert problem.startswith("order-2:charge (key ") and problem.endswith(") left pending")


def test_an_async_factory_and_a_task_group_hold_on_trio(tmp_path: Path) -> None:
    report = crash_points(
        scenarios.in_a_task_group,
        session=scenarios.async_session,
        backend="trio",
        steps=["after_request_sent"],
        operations=[1],
        directory=tmp_path,
    )
    assert report.ok, report.describe()
    [point] = report.points
    assert point.operation_id == report.operations[1]
    # Its own charge was made before the kill (the other one may have been, too).
    assert point.charges_at_crash >= 1


def test_an_async_scenario_behind_a_plain_decorator_is_a_clear_error(tmp_path: Path) -> None:
    # Called without await, its calls never ran ("journaled no operation").
    with pytest.raises(CrashHarnessError, match="the scenario returned an awaitable"):
        crash_points(scenarios.decorated_async, directory=tmp_path)


@pytest.mark.parametrize(
    ("scenario", "factory"),
    [
        # The client-side outbox: journaled by enqueue, sent by resume.
        (scenarios.enqueue_then_resume, None),
        # Per-call keys of the caller's own.
        (scenarios.own_keys, None),
        # An httpx2 client: its transport is a seam of its own.
        pytest.param(
            crash_scenarios.place_orders,
            scenarios.httpx2_session,
            marks=pytest.mark.skipif(
                importlib.util.find_spec("httpx2") is None, reason="httpx2 is not installed"
            ),
        ),
        # Bodies encrypted at rest: the harness reads the journal's statuses without the key.
        (crash_scenarios.place_orders, scenarios.encrypted_session),
        # Keys bound to credentials: the harness reads the journal without them.
        (crash_scenarios.place_orders, scenarios.bound_key_session),
        # ... and bound to credentials a request hook sets as the request leaves.
        (crash_scenarios.place_orders, scenarios.hook_bound_key_session),
        # Tens of thousands of lines on stdout and stderr.
        (scenarios.noisy, None),
    ],
)
def test_each_way_of_sending_is_crashed_where_the_server_acted_and_holds(
    tmp_path: Path, scenario: Any, factory: Any
) -> None:
    report = crash_points(
        scenario,
        session=factory,
        steps=["after_request_sent"],
        operations=[1],
        directory=tmp_path,
    )
    assert report.ok, report.describe()
    [point] = report.points
    assert point.killed and point.operation_id == "order-2:charge"
    assert point.charges_at_crash == 2


def test_a_thread_that_ends_a_moment_after_the_scenario_returns_is_no_error(
    tmp_path: Path,
) -> None:
    # AnyIO's worker threads end just after the loop closes: an async scenario
    # failed now and then as "returned with threads still running".
    with pytest.raises(ValueError, match="5 is not the position of one of the scenario's 1"):
        crash_points(scenarios.leaves_a_thread_that_ends_soon, operations=[5], directory=tmp_path)
