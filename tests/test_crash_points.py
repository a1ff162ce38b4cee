"""`idempotently.testing.crash_points`: a user's code killed at every journal step, then recovered.

The scenarios live in `tests/crash_scenarios.py` (child processes import them).
A crash-safe scenario holds at every point, on every driver; each kind of
careless code the harness exists to catch is caught, with a message that says
what went wrong; and every misuse is a clear error before anything runs.
"""

from __future__ import annotations

import io
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from idempotently.testing import (
    CRASH_STEPS,
    CrashHarnessError,
    CrashPointResult,
    CrashReport,
    crash_points,
)

from . import crash_scenarios

pytestmark = pytest.mark.slow

# Charges the server has made when operation `n` (0-based) dies at each step:
# its own is made once the request has reached the server.
SERVER_ACTED = {"after_request_sent", "after_answer_arrived", "before_answer_recorded"}


def expected_charges_at_crash(point: CrashPointResult) -> int:
    return point.operation + (1 if point.step in SERVER_ACTED else 0)


def assert_every_point_held(report: CrashReport, operations: list[int]) -> None:
    assert report.ok, report.describe()
    assert report.operations == ("order-1:charge", "order-2:charge")
    assert report.charges == 2
    assert [(point.operation, point.step) for point in report.points] == [
        (operation, step) for operation in operations for step in CRASH_STEPS
    ]
    for point in report.points:
        assert point.killed
        assert point.operation_id == report.operations[point.operation]
        # The kill came where it was aimed: before or after the server acted.
        assert point.charges_at_crash == expected_charges_at_crash(point), point


def test_a_crash_safe_scenario_holds_at_every_step_of_every_operation(tmp_path: Path) -> None:
    seen: list[CrashPointResult] = []
    report = crash_points(crash_scenarios.place_orders, directory=tmp_path, on_point=seen.append)
    assert_every_point_held(report, [0, 1])
    assert list(report.points) == seen
    report.assert_exactly_once()
    assert "10 of 10 crash points held exactly once" in str(report)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_async_scenario_holds_at_every_step(tmp_path: Path, backend: Any) -> None:
    report = crash_points(
        crash_scenarios.place_orders_async, operations=[1], backend=backend, directory=tmp_path
    )
    assert_every_point_held(report, [1])


def test_fresh_operation_ids_each_run_are_caught_as_a_double_charge(tmp_path: Path) -> None:
    report = crash_points(
        crash_scenarios.fresh_ids,
        operations=[1],
        steps=["after_key_commit", "after_answer_arrived"],
        directory=tmp_path,
    )
    assert not report.ok
    assert len(report.failures) == 2
    for point in report.failures:
        assert point.killed
        # The rerun made order-1 again under a new id, hence a new key.
        assert any(
            problem.startswith('charged twice: 100 usd to cus_1 {"order_id": "order-1"} (keys ')
            for problem in point.problems
        ), point.problems
    with pytest.raises(AssertionError, match="0 of 2 crash points held exactly once"):
        report.assert_exactly_once()
    # A failing run's journals and logs are kept, for the test to show.
    assert (tmp_path / "operation-1-after_key_commit" / "crash.log").exists()


def test_a_body_that_changes_between_runs_is_refused_by_the_journal(tmp_path: Path) -> None:
    report = crash_points(
        crash_scenarios.priced_by_the_clock, steps=["after_key_commit"], directory=tmp_path
    )
    [point] = report.points
    assert point.killed
    assert any(
        problem.startswith("recovery failed: KeyReuseError") for problem in point.problems
    ), point.problems


def test_resume_alone_cannot_bring_back_what_the_scenario_never_journaled(
    tmp_path: Path,
) -> None:
    report = crash_points(
        crash_scenarios.place_orders,
        rerun=False,
        steps=["before_key_commit", "after_key_commit"],
        operations=[0],
        directory=tmp_path,
    )
    lost, resumed = report.points
    # Killed before order-1's key committed: neither order was ever made.
    assert not lost.ok
    assert sorted(p for p in lost.problems if p.startswith("lost: ")) == [
        'lost: 100 usd to cus_1 {"order_id": "order-1"} never charged',
        'lost: 100 usd to cus_1 {"order_id": "order-2"} never charged',
    ]
    # Killed after it committed: resume sends order-1, order-2 is still lost.
    assert [p for p in resumed.problems if p.startswith("lost: ")] == [
        'lost: 100 usd to cus_1 {"order_id": "order-2"} never charged'
    ]


def test_a_journal_thrown_away_on_restart_is_caught(tmp_path: Path) -> None:
    report = crash_points(
        crash_scenarios.place_orders,
        session=crash_scenarios.session_with_a_fresh_journal,
        steps=["after_request_sent"],
        operations=[0],
        directory=tmp_path,
    )
    [point] = report.points
    assert point.killed and point.charges_at_crash == 1
    assert any(problem.startswith("charged twice: ") for problem in point.problems)


def test_a_session_factory_gives_the_scenario_its_session(tmp_path: Path) -> None:
    report = crash_points(
        crash_scenarios.place_orders,
        session=crash_scenarios.session_as_user_2,
        steps=["before_answer_recorded"],
        operations=[1],
        directory=tmp_path,
    )
    assert report.ok, report.describe()


def test_the_runs_logs_are_private(tmp_path: Path) -> None:
    crash_points(
        crash_scenarios.place_orders, steps=["after_key_commit"], operations=[0], directory=tmp_path
    )
    for log in tmp_path.rglob("*.log"):
        assert stat.S_IMODE(log.stat().st_mode) == 0o600, log


def test_the_fixture_keeps_the_runs_in_tmp_path(
    idempotently_crash_points: Any, tmp_path: Path
) -> None:
    report = idempotently_crash_points(
        crash_scenarios.place_orders, steps=["after_answer_arrived"], operations=[1]
    )
    assert report.ok, report.describe()
    assert report.directory == tmp_path / "crash-points"
    assert (tmp_path / "crash-points" / "operation-1-after_answer_arrived" / "recover.log").exists()


def test_a_temporary_directory_is_removed_when_every_point_held() -> None:
    report = crash_points(crash_scenarios.place_orders, steps=["after_key_commit"], operations=[0])
    assert report.ok, report.describe()
    assert not report.directory.exists()


@pytest.mark.parametrize(
    ("scenario", "timeout", "message"),
    [
        (
            crash_scenarios.fails,
            60.0,
            r"fails with no crash at all \(RuntimeError: the scenario's own bug\)",
        ),
        (crash_scenarios.sends_nothing, 60.0, "journaled no operation"),
        (crash_scenarios.hangs, 3.0, "ran past 3.0 s"),
    ],
)
def test_a_scenario_that_cannot_be_crashed_is_a_clear_error(
    tmp_path: Path, scenario: Any, timeout: float, message: str
) -> None:
    with pytest.raises(CrashHarnessError, match=message):
        crash_points(scenario, timeout=timeout, directory=tmp_path)


def test_a_session_journaled_elsewhere_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CrashHarnessError, match="journaled elsewhere than"):
        crash_points(
            crash_scenarios.place_orders,
            session=crash_scenarios.session_elsewhere,
            directory=tmp_path,
        )


def nested_scenario() -> Any:
    def scenario(session: Any) -> None:
        pass

    return scenario


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"scenario": lambda session: None}, TypeError, "define it at the top level of a module"),
        ({"scenario": nested_scenario()}, TypeError, "not a lambda or a function inside"),
        ({"scenario": "place_orders"}, TypeError, "scenario must be a function"),
        ({"session": lambda journal, url: None}, TypeError, "session <function"),
        ({"steps": ["after_commit"]}, ValueError, "unknown crash step 'after_commit'"),
        ({"steps": []}, ValueError, "steps is empty"),
        ({"backend": "curio"}, ValueError, "backend must be 'asyncio' or 'trio'"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number"),
        ({"timeout": True}, ValueError, "timeout must be a positive number"),
        ({"config": {"provider_latency": 1}}, TypeError, "config must be a MockServerConfig"),
        ({"operations": [-1]}, ValueError, "-1 is not the position"),
        ({"operations": ["0"]}, ValueError, "'0' is not the position"),
    ],
)
def test_misuse_is_refused_before_anything_runs(
    tmp_path: Path, arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    arguments = {"scenario": crash_scenarios.place_orders, **arguments}
    with pytest.raises(error, match=message):
        crash_points(directory=tmp_path, **arguments)
    assert not (tmp_path / "clean").exists()


def test_an_operation_past_the_scenarios_last_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"5 is not the position of one of the scenario's 2"):
        crash_points(crash_scenarios.place_orders, operations=[5], directory=tmp_path)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_each_point_is_shown_as_it_is_known_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    crash_points(
        crash_scenarios.place_orders,
        steps=["after_key_commit", "after_answer_arrived"],
        operations=[1],
        directory=tmp_path,
    )
    assert terminal.getvalue().splitlines() == [
        "[1/2] ok   operation 1 (order-2:charge) killed after_key_commit: exactly once",
        "[2/2] ok   operation 1 (order-2:charge) killed after_answer_arrived: exactly once",
    ]


def test_nothing_is_shown_when_stderr_is_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    crash_points(
        crash_scenarios.place_orders, steps=["after_key_commit"], operations=[0], directory=tmp_path
    )
    assert capsys.readouterr().err == ""
