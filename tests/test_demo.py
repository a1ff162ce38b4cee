"""`idempotently demo` tells the whole story and proves it: one charge per order."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_runs_end_to_end_and_shows_one_charge_per_order(tmp_path: Path) -> None:
    """The demo exits 0 after a SIGKILLed worker and a resume, with no duplicate charge."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "COLUMNS": "80"}
    result = subprocess.run(
        [sys.executable, "-m", "idempotently", "demo", "--no-keep"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert 0 == result.returncode, result.stdout + result.stderr
    out = result.stdout
    story = out + result.stderr  # shown whole when a promise below breaks
    assert "killed with SIGKILL" in out, story
    assert "order-9:charge: succeeded" in out, story  # finished by resume with its stored key
    assert "12 operations, 11 charges, 0 duplicates, 1 refused" in out, story
    assert "order-6   0 charges" in out, story  # the 400 was never retried
    assert "order-1   1 charge\n" in out, story
    assert "(s)" not in out, story  # counts are spelled as people do
    # 80 columns, but for the line naming the journal: a path is as long as it is.
    wide = [line for line in out.splitlines() if len(line) > 80 and str(tmp_path) not in line]
    assert [] == wide, story
    assert [] == list(tmp_path.iterdir())  # --no-keep leaves nothing behind


def test_demo_without_the_mock_extra_says_what_to_install(tmp_path: Path) -> None:
    """Without starlette/uvicorn the demo names the exact pip command, exit 1."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('starlette', 'uvicorn'):\n"
        "            raise ImportError(name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(
        [sys.executable, "-m", "idempotently", "demo"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert 1 == result.returncode
    assert "pip install 'idempotently[mock]'" in result.stderr
