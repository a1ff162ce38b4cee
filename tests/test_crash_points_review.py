"""`crash_points` under review: no false pass, no false failure, every misuse a clear error.

The scenarios live in `tests/crash_review_scenarios.py` (child processes import
them). Each test aims at as few crash points as proves its point: a point costs
three processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from idempotently.testing import CrashHarnessError, crash_points

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
    ],
)
def test_misuse_is_refused_before_anything_runs(
    tmp_path: Path, arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        crash_points(crash_scenarios.place_orders, **{"directory": tmp_path, **arguments})
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
