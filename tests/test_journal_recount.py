"""`idempotently migrate --recount`: the counts of a SQLite journal counted again from its
rows, exact whatever else writes meanwhile; a damaged count says to run it."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from idempotently import Journal
from idempotently._rows import AttemptRecord
from idempotently._vocabulary import Status
from idempotently.cli import cli
from tests.journal_commands import record_attempt, set_status
from tests.support import recount
from tests.test_journal import NOW, insert, new_operation
from tests.test_journal_versions import assert_refusal, development_sqlite_journal, digest

REPOSITORY = Path(__file__).parent.parent


def run(path: Path, *command: str) -> Result:
    return CliRunner().invoke(cli, ["--journal", str(path), *command])


def answered(status_code: int, status: Status, *, replayed: bool = False) -> AttemptRecord:
    return AttemptRecord(
        started_at=NOW,
        elapsed=0.1,
        outcome="answered",
        status_code=status_code,
        status=status,
        response_status=status_code,
        response_body=b"{}",
        replayed=replayed,
    )


def fill(path: Path, count: int, *, prefix: str = "op") -> None:
    """``count`` operations: succeeded at once, failed, retried then replayed, pending
    after a 409, abandoned, in turn."""
    with Journal(path, durability="os") as journal:
        for number in range(count):
            operation_id = f"{prefix}-{number}"
            insert(journal, new_operation(operation_id))
            kind = number % 5
            if kind == 0:
                record_attempt(journal, operation_id, answered(201, "succeeded"), now=NOW)
            elif kind == 1:
                record_attempt(journal, operation_id, answered(422, "failed"), now=NOW)
            elif kind == 2:
                record_attempt(journal, operation_id, answered(503, "pending"), now=NOW)
                record_attempt(
                    journal, operation_id, answered(201, "succeeded", replayed=True), now=NOW
                )
            elif kind == 3:
                record_attempt(journal, operation_id, answered(409, "pending"), now=NOW)
            else:
                set_status(journal, operation_id, "abandoned", reason="by test", now=NOW)


def assert_counts_are_the_rows(path: Path) -> None:
    with Journal(path, readonly=True) as journal:
        figures = journal.stats(now=NOW + 100)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        truth = recount(conn, now=NOW + 100)
    assert truth == figures


def test_a_count_made_impossible_by_a_hand_edit_names_the_recount(tmp_path: Path) -> None:
    """An operation settled by hand in the sqlite3 shell (not counted), then pruned (its
    new status taken off the counts) leaves a count below zero: stats refuses it in one
    line naming `migrate --recount`, not "restore a backup", and after the recount the
    counts are the rows'."""
    path = tmp_path / "journal.db"
    fill(path, 1)
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("UPDATE operations SET status = 'failed'")
    assert 0 == run(path, "prune", "--older-than", "0s").exit_code

    refused = run(path, "stats")
    recounted = run(path, "migrate", "--recount")

    assert 1 == refused.exit_code
    assert 1 == len(refused.output.strip().splitlines())
    assert f"idempotently --journal {path} migrate --recount" in refused.output
    assert "restore a backup" not in refused.output
    assert 0 == recounted.exit_code, recounted.output
    assert 0 == run(path, "stats").exit_code
    assert_counts_are_the_rows(path)


def test_a_recount_twice_changes_nothing_the_second_time(tmp_path: Path) -> None:
    """Recounting is idempotent: the second run prints the same counts and leaves the
    counts row as the first left it, equal to the rows."""
    path = tmp_path / "journal.db"
    fill(path, 10)
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("UPDATE operations SET status = 'needs_reconcile' WHERE operation_id = 'op-0'")

    first, second = run(path, "migrate", "--recount"), run(path, "migrate", "--recount")

    assert (0, 0) == (first.exit_code, second.exit_code)
    assert first.output == second.output
    assert "needs_reconcile 1" in first.output
    assert_counts_are_the_rows(path)


WRITER = """
import sys
sys.path[:0] = [sys.argv[2]]
from pathlib import Path
from tests.test_journal_recount import fill
fill(Path(sys.argv[1]), int(sys.argv[3]), prefix="child")
"""


def test_a_recount_while_another_process_writes_leaves_the_counts_exact(
    tmp_path: Path,
) -> None:
    """Recounts run while another process journals operations (keys, answers, retries,
    settlements): each recount and each of the other's batches is one transaction, so
    after both the counts are the rows', to the unit."""
    path = tmp_path / "journal.db"
    fill(path, 5)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY / "src"), str(REPOSITORY)])}
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(REPOSITORY), "300"], env=env
    )
    try:
        recounts = 0
        while writer.poll() is None or recounts < 3:
            result = run(path, "migrate", "--recount")
            assert 0 == result.exit_code, result.output
            recounts += 1
    finally:
        assert 0 == writer.wait(timeout=300)

    assert_counts_are_the_rows(path)
    with Journal(path, readonly=True) as journal:
        assert 305 == sum(journal.counts().values())


def test_a_recount_of_a_development_journal_is_refused_unmodified(tmp_path: Path) -> None:
    """`migrate --recount` on a development journal is refused like every opener, and
    writes nothing."""
    path = tmp_path / "journal.db"
    development_sqlite_journal(path, 5)
    before = digest(path)

    result = run(path, "migrate", "--recount")

    assert 1 == result.exit_code
    assert_refusal(" ".join(result.output.split()), path, 5)
    assert before == digest(path)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` unwritable, even for root (who writes through a read-only mode: then the
    file is made immutable, or the test skipped where it cannot be)."""
    if os.geteuid() != 0:
        path.chmod(0o400)
        try:
            yield
        finally:
            path.chmod(0o600)
        return
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"root writes through a read-only mode, and chattr +i failed: {made.stderr}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_recount_of_a_read_only_file_says_so_and_changes_nothing(tmp_path: Path) -> None:
    """A journal the user cannot write: the recount fails in one line saying the file is
    read-only, and the file is as it was."""
    path = tmp_path / "journal.db"
    fill(path, 5)
    with read_only(path):
        before = digest(path)
        result = run(path, "migrate", "--recount")
        after = digest(path)

    assert 1 == result.exit_code
    assert 1 == len(result.output.strip().splitlines())
    assert "read-only" in result.output
    assert before == after
