"""A call SIGKILLed around each journal commit of its first attempt (a 503) and of its
second (the 201): with the first attempt in the operation's row and no trigger keeping
the counts, the journal still tells the truth after the crash and after the resume:
stats equal a count of the rows, the history is numbered 1..attempt_count, attempt 1
is never overwritten, and `show --json` says the same."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

import idempotently
from idempotently.cli import cli
from tests import scripted_server
from tests.support import recount

REPOSITORY = Path(__file__).parent.parent

CHILD = """
import os, signal, sys
import idempotently

path, url, moment, commit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
seen = 0

def before(writes, durable):
    global seen
    seen += 1
    if moment == "before" and seen == commit:
        os.kill(os.getpid(), signal.SIGKILL)

def after(writes, outcomes):
    if moment == "after" and seen == commit:
        os.kill(os.getpid(), signal.SIGKILL)

with idempotently.Session(path, base_url=url) as session:
    session.journal.observe_commits(before=before, after=after)
    session.post("/v1/charges", operation_id="charge-1", json={"amount": 100})
print(seen, flush=True)
"""

RETRY_NOW = scripted_server.Answer(
    status=503, headers=(("retry-after", "0"),), body=b'{"error": "busy"}'
)
CHARGED = scripted_server.Answer(status=201)


def assert_the_journal_tells_the_truth(path: Path) -> list[tuple[int, int | None]]:
    """The counts are the rows', the history is 1..attempt_count, show --json says so;
    the history as (number, status code)."""
    with idempotently.Journal(path, readonly=True) as journal:
        figures = journal.stats(now=2e9)
        operation = journal.operation("charge-1")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        truth = recount(conn, now=2e9)
    assert truth == attrs.evolve(figures, expiring=None)
    assert operation is not None
    history = [(attempt.number, attempt.status_code) for attempt in operation.attempts]
    assert list(range(1, operation.attempt_count + 1)) == [number for number, _ in history]
    shown = CliRunner().invoke(cli, ["--journal", str(path), "show", "charge-1", "--json"])
    assert 0 == shown.exit_code, shown.output
    document = json.loads(shown.output)
    assert (operation.attempt_count, history) == (
        document["attempts"],
        [(attempt["number"], attempt["status_code"]) for attempt in document["history"]],
    )
    return history


@pytest.mark.parametrize("moment", ["before", "after"])
@pytest.mark.parametrize("commit", [1, 2, 3], ids=["key", "attempt 1", "attempt 2"])
def test_a_call_killed_around_each_commit_of_its_attempts_leaves_a_truthful_journal(
    tmp_path: Path,
    scripted: tuple[scripted_server.ScriptedApp, str],
    moment: str,
    commit: int,
) -> None:
    """Killed before or after the commit of its key, of its first attempt (503) or of its
    second (201); then resumed against a server that charges: the journal is truthful
    after the kill and after the resume, attempt 1 keeps its 503 once journaled, and
    the operation ends succeeded."""
    app, url = scripted
    path = tmp_path / "journal.db"
    app.answer(RETRY_NOW, CHARGED)
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY / "src")}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), url, moment, str(commit)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert -signal.SIGKILL == child.returncode, child.stderr

    if moment == "before" and commit == 1:
        assert not path.exists() or 0 == sum(idempotently.Journal(path).counts().values())
        return
    killed = assert_the_journal_tells_the_truth(path)
    app.answer(CHARGED)
    with idempotently.Session(path) as session:
        session.resume(base_url=url)
    resumed = assert_the_journal_tells_the_truth(path)

    with idempotently.Journal(path, readonly=True) as journal:
        operation = journal.operation("charge-1")
    assert operation is not None
    assert "succeeded" == operation.status
    assert killed == resumed[: len(killed)]
    if commit == 3 or (commit, moment) == (2, "after"):
        assert (1, 503) == resumed[0]  # journaled before the kill: kept
