"""docs/tutorial.md runs as a reader follows it: its Python blocks and its commands, in
page order, in one empty folder, against one mock server.

tests/test_docs_snippets.py runs the Python blocks of every page; the tutorial also
has the reader type commands between them (`idempotently list` after the crash,
`resume` before the ledger is checked), so here both run in turn:

- a ```python block runs as test_docs_snippets runs it (one namespace; the mock
  server's address replaced by the test's server; a block titled as a file is saved);
- in a ```console block, each ``$ `` line is a command: ``export NAME=VALUE`` sets
  the environment of the commands after it, ``pip install`` and
  ``idempotently mock-server`` are skipped (the test's server stands in), and an
  ``idempotently`` command runs in a fresh process on an 80-column pseudo-terminal (a
  reader's screen: tables, not the tab-separated records of a pipe) and must exit 0,
  printing the first word of each output line the page shows under it (ids, times and
  keys differ from run to run; the rows and fields must not).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from idempotently.testing import serve

from .test_cli_pipes import run_on_a_terminal
from .test_docs_snippets import FILE_FENCE, on_the_page_server, run_block

ROOT = Path(__file__).parent.parent
TUTORIAL = ROOT / "docs" / "tutorial.md"
BLOCK = re.compile(r"^```(python|console)([^\n]*)\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def commands(block: str) -> list[tuple[str, list[str]]]:
    """Each ``$ `` line of a console block, with the output lines shown under it."""
    found: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            found.append((line[2:], []))
        elif found and line.strip():
            found[-1][1].append(line)
    return found


def run_command(command: str, shown: list[str], env: dict[str, str], folder: Path) -> None:
    words = shlex.split(command)
    if words[0] == "export":
        name, _, value = words[1].partition("=")
        env[name] = value
        return
    if words[:2] in (["pip", "install"], ["idempotently", "mock-server"]):
        return
    assert "idempotently" == words[0], f"the tutorial runs only idempotently commands: {command}"
    returncode, lines = run_on_a_terminal(
        [sys.executable, "-m", "idempotently", *words[1:]], env, cwd=folder
    )
    screen = "\n".join(lines)
    assert 0 == returncode, f"$ {command}\n{screen}"
    printed = screen.split()
    missing = [line for line in shown if line.split()[0] not in printed]
    assert [] == missing, f"$ {command} printed:\n{screen}"


def test_the_tutorial_runs_as_a_reader_follows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every block and command of docs/tutorial.md, in page order: each succeeds and
    prints what the page shows."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    text = TUTORIAL.read_text(encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with serve() as api:
        for match in FILE_FENCE.finditer(text):
            Path(match.group(1)).write_text(on_the_page_server(match.group(2), api.url))
        namespace: dict[str, object] = {"__name__": "__main__"}
        for block in BLOCK.finditer(text):
            kind, title, body = block.groups()
            if kind == "console":
                for command, shown in commands(body):
                    run_command(command, shown, env, tmp_path)
            elif "title=" not in title:
                line = text.count("\n", 0, block.start(3)) + 1
                run_block(namespace, "docs/tutorial.md", line, body, api.url)
        ledger = [charge.order_id for charge in api.charges()]
    assert ["order-1", "order-2"] == sorted(ledger)


def test_the_tutorial_shows_each_command_it_promises() -> None:
    """The tutorial takes the reader through list, show, resume and stats."""
    shown = {
        shlex.split(command)[1]
        for block in BLOCK.finditer(TUTORIAL.read_text(encoding="utf-8"))
        if block.group(1) == "console"
        for command, _ in commands(block.group(3))
        if command.startswith("idempotently ")
    }
    assert {"list", "show", "resume", "stats"} <= shown
