"""Docs cannot drift: every example runs, and the README shows the quickstart as it is."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_example_runs(example: Path, tmp_path: Path) -> None:
    """Each script in examples/ exits 0 in a fresh directory."""
    # The recipes need their SDK (the tests extra has them; openai/httpx2 need Python 3.11+).
    for sdk in ("stripe", "openai", "httpx2"):
        imported = re.search(rf"^import {sdk}$", example.read_text(), re.MULTILINE)
        if imported and importlib.util.find_spec(sdk) is None:
            pytest.skip(f"{example.name} needs {sdk}, which is not installed")
    result = subprocess.run(
        [sys.executable, str(example)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert 0 == result.returncode, result.stdout + result.stderr


def test_readme_example_is_the_quickstart_script() -> None:
    """The README's code block is examples/quickstart.py, so it is executed too."""
    quickstart = (ROOT / "examples" / "quickstart.py").read_text()
    assert quickstart.strip() in (ROOT / "README.md").read_text()


def test_readme_and_ci_run_the_same_test_command() -> None:
    """.ci/run runs exactly the test command the README gives newcomers."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = "python3 -m pip install nox && python3 -m nox -s tests lint mypy docs"
    readme_commands = [line.split("#")[0].strip() for line in readme.splitlines()]
    ci_commands = [line.strip() for line in ci.splitlines()]
    assert command in readme_commands and command in ci_commands
    assert "python3 -m idempotently demo" in readme
