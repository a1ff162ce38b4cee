"""Docs cannot drift: every example runs, and the README shows the quickstart as it is."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .support import fixed_port_lock

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def runnable(example: Path) -> bool:
    """Whether the SDK (or ORM) a recipe needs is installed (the tests extra has them;
    openai, anthropic and httpx2 need Python 3.11+)."""
    for sdk in ("stripe", "openai", "anthropic", "httpx2", "sqlalchemy", "django"):
        imported = re.search(rf"^(?:import|from) {sdk}\b", example.read_text(), re.MULTILINE)
        if imported and importlib.util.find_spec(sdk) is None:
            return False
    return True


def test_every_example_runs_twice_in_one_shared_folder(tmp_path: Path) -> None:
    """All the scripts in examples/ run in one folder, one after another, then again in
    the reverse order: each exits 0 every time.

    A developer copies them into one project and runs them in any order, beside the
    journal (./idempotently.db) they all share: no two may name the same operation or
    port (the second would get KeyReuseError), and a re-run sends the same requests
    (fixed ports keep its URLs), so the journal answers them.
    """
    examples = [example for example in EXAMPLES if runnable(example)]
    sources = "\n".join(example.read_text() for example in examples)
    with fixed_port_lock(sources):
        for run, order in (("first", examples), ("second", examples[::-1])):
            for example in order:
                result = subprocess.run(
                    [sys.executable, str(example)],
                    cwd=tmp_path,
                    capture_output=True,
                    text=True,
                    timeout=120,
                    env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                )
                assert 0 == result.returncode, (
                    f"{example.name}, {run} run:\n{result.stdout}{result.stderr}"
                )
    assert (tmp_path / "idempotently.db").exists()


def test_no_two_examples_share_a_port() -> None:
    """Each example's server has a port of its own, so they run side by side too."""
    ports = [
        int(port)
        for example in EXAMPLES
        for port in set(re.findall(r"serve\([^)]*port=(\d+)", example.read_text()))
    ]
    assert sorted(set(ports)) == sorted(ports)


def test_every_example_with_a_journal_has_a_fixed_port() -> None:
    """An example that journals and starts a server names its port (port 0 would change the URL)."""
    unfixed = [
        example.name
        for example in EXAMPLES
        if "idempotently.db" in example.read_text()
        and re.search(r"serve\((?![^)]*port=[1-9])", example.read_text())
    ]
    assert [] == unfixed


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


RECIPES = sorted((ROOT / "examples").glob("recipe_*.py"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.name)
def test_each_recipe_says_how_to_install_what_it_needs(recipe: Path) -> None:
    """A recipe's docstring opens with the pip command for idempotently and its SDK."""
    docstring = ast.get_docstring(ast.parse(recipe.read_text())) or ""
    install = re.search(r"^Install: ``(pip install [^`]+)``", docstring, re.MULTILINE)
    assert install is not None, f"{recipe.name} has no 'Install: ``pip install ...``' line"
    for sdk in ("stripe", "openai", "anthropic", "httpx2"):
        if re.search(rf"^import {sdk}$", recipe.read_text(), re.MULTILINE):
            assert sdk in install.group(1), f"{recipe.name} imports {sdk} but does not install it"


def test_the_recipes_page_names_an_install_command_for_each_sdk() -> None:
    """docs/recipes.md says how to install each recipe's SDK."""
    page = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    for command in (
        "pip install idempotently stripe",
        "pip install 'idempotently[httpx2]' openai",
        "pip install 'idempotently[httpx2]' anthropic",
    ):
        assert command in page


def test_the_outbox_pages_django_idiom_is_what_the_django_example_runs() -> None:
    """docs/outbox.md's Django block (saved, not run: Django's settings are the process's)
    says what examples/outbox_django.py runs: its atomic block, line for line."""
    page = (ROOT / "docs" / "outbox.md").read_text(encoding="utf-8")
    block = re.search(r'^```python title="orders\.py"\n(.*?)^```', page, re.DOTALL | re.M)
    assert block is not None
    shown = block.group(1)
    atomic = shown[shown.index("with transaction.atomic()") :].splitlines()
    example = {
        line.strip() for line in (ROOT / "examples" / "outbox_django.py").read_text().splitlines()
    }
    assert [] == [line.strip() for line in atomic if line.strip() not in example]
    assert "from django.db import connection, transaction" in shown
