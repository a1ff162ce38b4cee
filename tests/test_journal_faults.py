"""Damaged, moved and placeholder journals: clear JournalErrors, never a raw traceback."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result

import idempotently
from idempotently import (
    Journal,
    JournalCorruptError,
    JournalError,
    JournalMovedError,
    JournalWriteError,
)
from idempotently._journal import AttemptRecord
from idempotently.cli import cli
from tests import scripted_server
from tests.journal_commands import claim_due, find, record_attempt
from tests.test_journal import NOW, insert, mode, new_operation

SRC = Path(__file__).parent.parent / "src"


def run(*args: str) -> Result:
    """The CLI in-process; an exception that is not a clean exit fails the test."""
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def assert_one_line_error(result: Result, path: Path | str, *words: str) -> None:
    assert 1 == result.exit_code, result.output
    assert 1 == len(result.stderr.strip().splitlines()), result.stderr
    assert str(path) in result.stderr
    assert "Traceback" not in result.output
    for word in words:
        assert word in result.stderr


def sql(path: Path, *statements: str) -> None:
    """Raw writes with sqlite3, as another program (or a bad disk) would make them."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA ignore_check_constraints = ON")
        for statement in statements:
            conn.execute(statement)
    finally:
        conn.close()


def edit(target: str | Path, *statements: str) -> None:
    """Raw writes, as another program (or a hand in psql) would make them: on PostgreSQL
    in the journal's schema, its CHECK on attempt numbers dropped first (as SQLite's
    ignore_check_constraints lets a wrong number in)."""
    if not str(target).startswith("postgresql://"):
        sql(Path(target), *statements)
        return
    import psycopg

    with psycopg.connect(str(target), autocommit=True) as conn:
        conn.execute("SET search_path TO idempotently")
        conn.execute("ALTER TABLE attempts DROP CONSTRAINT IF EXISTS attempts_number_check")
        for statement in statements:
            conn.execute(statement)  # type: ignore[call-overload]


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "ops.db"


def fill(path: Path, count: int) -> None:
    """``count`` operations op-000...; every third one pending, the others succeeded."""
    with Journal(path, durability="os") as journal:
        for number in range(count):
            operation_id = f"op-{number:03}"
            insert(journal, new_operation(operation_id, created_at=NOW + number, body=b"x" * 500))
            record_attempt(
                journal,
                operation_id,
                AttemptRecord(
                    started_at=NOW + number,
                    elapsed=0.1,
                    outcome="answered",
                    status_code=201,
                    status="pending" if number % 3 == 0 else "succeeded",
                ),
                now=NOW + number,
            )


# -- damaged pages --------------------------------------------------------------------


@pytest.fixture(scope="module")
def damaged_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 operations (about 75 pages), closed, then garbage from a third of the file on.

    Every b-tree (both tables, every index) has pages in that range, and op-299 (the
    newest row) lives on the last page of the operations table.
    """
    path = tmp_path_factory.mktemp("damaged") / "ops.db"
    fill(path, 300)
    data = bytearray(path.read_bytes())
    assert 50 * 4096 < len(data)
    start = len(data) // 3
    data[start:] = b"\xa5" * (len(data) - start)
    path.write_bytes(bytes(data))
    return path


@pytest.fixture
def damaged(damaged_template: Path, tmp_path: Path) -> Path:
    path = tmp_path / "ops.db"
    shutil.copyfile(damaged_template, path)
    return path


def later_attempt(journal: Journal) -> None:
    record_attempt(
        journal,
        "op-299",
        AttemptRecord(started_at=NOW, elapsed=0.1, outcome="not_sent"),
        now=NOW,
    )


READS: dict[str, Callable[[Journal], object]] = {
    "operations": lambda journal: journal.operations(),
    "operation": lambda journal: journal.operation("op-299"),
    "_find": lambda journal: find(journal, "op-299", None),
}
# The audits read the counts the triggers keep and the small partial indexes,
# never the tables: they meet only the damage on those pages.
AUDITS: list[tuple[str, str, Callable[[Journal], object]]] = [
    ("journal_counts", "counts", lambda journal: journal.counts()),
    ("journal_counts", "stats", lambda journal: journal.stats(now=NOW)),
    ("operations_pending", "stats", lambda journal: journal.stats(now=NOW)),
    (
        "operations_settled",
        "prune dry run",
        lambda journal: journal.prune(older_than=0, now=NOW + 1000, dry_run=True),
    ),
]
WRITES: dict[str, Callable[[Journal], object]] = {
    "prune": lambda journal: journal.prune(older_than=0, now=NOW + 1000),
    "_insert_operation": lambda journal: insert(journal, new_operation("new-1")),
    "_record_attempt": later_attempt,
}


@pytest.mark.parametrize("call", [*READS.values(), *WRITES.values()], ids=[*READS, *WRITES])
def test_damaged_pages_are_a_corrupt_error(
    damaged: Path, call: Callable[[Journal], object]
) -> None:
    """Every read and write on damaged pages raises JournalCorruptError naming the file."""
    with Journal(damaged) as journal, pytest.raises(JournalCorruptError) as caught:
        call(journal)

    message = str(caught.value)
    assert f"{damaged} is damaged (database disk image is malformed)" in message
    assert ".recover" in message
    assert "restore a backup" in message


@pytest.mark.parametrize("read", READS.values(), ids=list(READS))
def test_a_damaged_read_leaves_no_transaction_behind(
    damaged: Path, read: Callable[[Journal], object]
) -> None:
    """After a read fails on damage, the next write reports the damage, not a stuck transaction."""
    with Journal(damaged) as journal:
        with pytest.raises(JournalCorruptError) as first:
            read(journal)
        with pytest.raises(JournalError) as second:
            insert(journal, new_operation("new-1"))

        assert first.value is not None  # still referenced, as a caller's error handler would
        assert "JournalCorruptError" == type(second.value).__name__


def damage_root_page(path: Path, name: str) -> None:
    """Garbage over the root page of one table's or index's b-tree: every read through it fails."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        (page,) = conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = ?", (name,)
        ).fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
    data = bytearray(path.read_bytes())
    data[(page - 1) * size : page * size] = b"\xa5" * size
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("btree", "call"),
    [(btree, call) for btree, _, call in AUDITS],
    ids=[" ".join(a[:2]) for a in AUDITS],
)
def test_damage_under_an_audit_is_a_corrupt_error(
    tmp_path: Path, btree: str, call: Callable[[Journal], object]
) -> None:
    """counts, stats and the prune dry run on a damaged page they read: JournalCorruptError."""
    path = tmp_path / "ops.db"
    fill(path, 30)
    damage_root_page(path, btree)

    with Journal(path) as journal:
        with pytest.raises(JournalCorruptError) as caught:
            call(journal)
        assert not journal._conn.in_transaction

    assert f"{path} is damaged (database disk image is malformed)" in str(caught.value)


@pytest.mark.parametrize(
    ("btree", "args"),
    [
        ("journal_counts", ("stats",)),
        ("operations_pending", ("stats",)),
        ("operations_settled", ("prune", "--older-than", "0s", "--dry-run")),
        ("operations_settled", ("prune", "--older-than", "0s")),
    ],
    ids=" ".join,
)
def test_audit_commands_on_damaged_pages_fail_in_one_line(
    tmp_path: Path, btree: str, args: tuple[str, ...]
) -> None:
    """`stats` and `prune` on a damaged page they read: exit 1, one line naming the file."""
    path = tmp_path / "ops.db"
    fill(path, 30)
    damage_root_page(path, btree)

    result = run("--journal", str(path), *args)

    assert_one_line_error(result, path, "damaged", "restore a backup")


# -- damaged rows ------------------------------------------------------------------------


@pytest.fixture
def three(tmp_path: Path) -> Path:
    """A journal with op-000 (pending), op-001 and op-002 (succeeded)."""
    path = tmp_path / "ops.db"
    fill(path, 3)
    return path


ROW_READS: dict[str, Callable[[Journal], object]] = {
    "operation": lambda journal: journal.operation("op-001"),
    "operation by key": lambda journal: journal.operation("key-op-001"),
    "_find": lambda journal: find(journal, "op-001", None),
}


@pytest.mark.parametrize("read", ROW_READS.values(), ids=list(ROW_READS))
def test_a_row_with_broken_json_is_a_corrupt_error(
    three: Path, read: Callable[[Journal], object]
) -> None:
    """Broken JSON in one row raises JournalCorruptError naming the file, the operation, a fix."""
    sql(three, "UPDATE operations SET request_headers = '[[\"a\", ' WHERE operation_id = 'op-001'")

    with Journal(three) as journal, pytest.raises(JournalCorruptError) as caught:
        read(journal)

    message = str(caught.value)
    assert ("op-001", "key-op-001") == (caught.value.operation_id, caught.value.key)
    assert str(three) in message
    assert "'op-001'" in message
    assert "request_headers is not valid JSON" in message
    assert "restore a backup" in message


def test_a_listing_names_a_row_with_broken_json_and_lists_the_others(three: Path) -> None:
    """Broken JSON in one row never stops a listing (an audit, a resume's queue): every
    operation is listed, the damaged one marked with what is wrong."""
    sql(three, "UPDATE operations SET request_headers = '[[\"a\", ' WHERE operation_id = 'op-001'")

    with Journal(three) as journal:
        listed = {operation.operation_id: operation for operation in journal.operations()}

    assert ["op-000", "op-001", "op-002"] == sorted(listed)
    assert [None, None] == [listed["op-000"].damaged, listed["op-002"].damaged]
    assert "request_headers is not valid JSON" in (listed["op-001"].damaged or "")


@pytest.mark.parametrize(
    ("table", "column", "value", "problem"),
    [
        ("operations", "response_headers", "'{\"a\": 1}'", "response_headers is not a list"),
        ("operations", "request_headers", "'[[\"a\", 1]]'", "request_headers is not a list"),
        ("operations", "status", "'done'", "status is 'done', not one of"),
        ("operations", "created_at", "'yesterday'", "created_at holds str"),
        ("operations", "request_body", "'text'", "request_body holds str"),
        ("operations", "attempt_count", "1.5", "attempt_count holds float"),
        # The first attempt lives in its operation's row.
        ("operations", "attempt1_outcome", "'lost'", "outcome is 'lost', not one of"),
        ("operations", "attempt1_elapsed", "x'00'", "elapsed holds bytes"),
    ],
)
def test_a_row_with_a_wrong_value_is_a_corrupt_error(
    three: Path, table: str, column: str, value: str, problem: str
) -> None:
    """A value of the wrong type or outside its set raises JournalCorruptError saying which."""
    sql(three, f"UPDATE {table} SET {column} = {value} WHERE operation_id = 'op-001'")

    with Journal(three) as journal, pytest.raises(JournalCorruptError) as caught:
        journal.operation("op-001")

    assert "op-001" == caught.value.operation_id
    assert problem in str(caught.value)


def test_an_unknown_status_is_a_corrupt_error_in_counts_and_stats(three: Path) -> None:
    """A status outside the set, once counted (the counts follow the journal's own writes:
    after an edit by hand, recount() / `migrate --recount`), makes counts and stats raise
    JournalCorruptError too."""
    sql(three, "UPDATE operations SET status = 'done' WHERE operation_id = 'op-001'")

    with Journal(three) as journal:
        journal._store.recount()  # type: ignore[union-attr]
        for call in (journal.counts, lambda: journal.stats(now=NOW)):
            with pytest.raises(JournalCorruptError, match="status is 'done'"):
                call()


def test_the_other_rows_stay_readable(three: Path) -> None:
    """A damaged row does not hide the others from a lookup by id."""
    sql(three, "UPDATE operations SET request_headers = 'nope' WHERE operation_id = 'op-001'")

    with Journal(three) as journal:
        operation = journal.operation("op-002")

    assert operation is not None
    assert "op-002" == operation.operation_id


def counting_transport() -> tuple[httpx.MockTransport, list[httpx.Request]]:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(201, json={"id": "ch_1"})

    return httpx.MockTransport(handler), sent


def test_session_post_on_a_damaged_row_raises_before_sending(three: Path) -> None:
    """Session.post on an operation whose row is damaged: JournalCorruptError, nothing sent."""
    sql(three, "UPDATE operations SET request_headers = '{' WHERE operation_id = 'op-001'")
    transport, sent = counting_transport()

    with (
        idempotently.Session(three, transport=transport) as session,
        pytest.raises(JournalCorruptError) as caught,
    ):
        session.post("https://api.example.test/v1/charges", json={}, operation_id="op-001")

    assert [] == sent
    assert "op-001" == caught.value.operation_id


# -- a file deleted or replaced while open ---------------------------------------------


def remove_journal_files(path: Path) -> None:
    """What `rm ops.db*` (a cleanup job, a careless deploy) does under an open journal."""
    for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        name.unlink(missing_ok=True)


def test_a_journal_deleted_while_open_journals_no_new_key(path: Path) -> None:
    """A journal deleted under an open Journal refuses new keys; the ghost file gets none."""
    with Journal(path) as journal:
        insert(journal, new_operation("op-1"))
        remove_journal_files(path)

        with pytest.raises(JournalMovedError) as caught:
            insert(journal, new_operation("op-2"))

        assert journal.operation("op-2") is None  # read from the deleted file itself
    assert str(path) in str(caught.value)
    assert "deleted" in str(caught.value)
    assert not path.exists()


def test_a_journal_replaced_while_open_journals_no_new_key(path: Path, tmp_path: Path) -> None:
    """A journal renamed over while open refuses new keys, in the old file and the new one."""
    other = tmp_path / "other.db"
    Journal(other).close()
    with Journal(path) as journal:
        insert(journal, new_operation("op-1"))
        os.replace(other, path)

        with pytest.raises(JournalMovedError) as caught:
            insert(journal, new_operation("op-2"))

        assert journal.operation("op-2") is None
    with Journal(path) as new:
        assert new.operation("op-2") is None
    assert "replaced" in str(caught.value)


def test_a_journal_left_in_place_still_takes_keys(path: Path) -> None:
    """The check costs nothing when nothing moved: keys are journaled as before."""
    with Journal(path) as journal:
        journal._store.check_identity()
        assert insert(journal, new_operation("op-1"))


def test_session_post_after_the_journal_was_deleted_sends_nothing(path: Path) -> None:
    """Session.post on a deleted journal raises JournalMovedError before any byte is sent."""
    transport, sent = counting_transport()
    with idempotently.Session(path, transport=transport) as session:
        session.post("https://api.example.test/v1/charges", json={}, operation_id="first")
        remove_journal_files(path)

        with pytest.raises(JournalMovedError):
            session.post("https://api.example.test/v1/charges", json={}, operation_id="second")

    assert 1 == len(sent)  # the first call's request, and nothing for the second


def test_session_post_after_a_new_journal_was_created_in_its_place_says_it_moved(
    path: Path,
) -> None:
    """The file renamed away and a new journal created at its path (the old -wal and
    -shm left behind): a named post says the journal moved, naming the operation, and
    sends nothing; not a misleading "no such table"."""
    transport, sent = counting_transport()
    with idempotently.Session(path, transport=transport) as session:
        session.post("https://api.example.test/v1/charges", json={}, operation_id="first")
        os.rename(path, f"{path}.moved")
        Journal(path).close()

        with pytest.raises(JournalMovedError) as caught:
            session.post("https://api.example.test/v1/charges", json={}, operation_id="second")

    assert 1 == len(sent)
    assert "second" == caught.value.operation_id


# -- read-only opening and placeholder files ----------------------------------------------


@pytest.mark.parametrize("options", [{"readonly": True}, {"create": False}])
def test_an_empty_placeholder_is_never_initialised(path: Path, options: dict[str, Any]) -> None:
    """Journal(readonly=True) or create=False on a 0-byte file: 'not a journal', file untouched."""
    path.touch()

    with pytest.raises(JournalCorruptError) as caught:
        Journal(path, **options)

    assert 0 == path.stat().st_size
    assert ["ops.db"] == sorted(child.name for child in path.parent.iterdir())
    assert str(path) in str(caught.value)
    assert "not an idempotently journal" in str(caught.value)


def test_a_read_only_journal_reads_and_never_writes(path: Path) -> None:
    """readonly=True reads everything and refuses every write, leaving the file as it was."""
    fill(path, 3)
    before = path.read_bytes()

    with Journal(path, readonly=True) as journal:
        assert ["op-002", "op-001", "op-000"] == [op.operation_id for op in journal.operations()]
        with pytest.raises(JournalWriteError, match="opened read-only"):
            insert(journal, new_operation("op-9"))
        with pytest.raises(JournalWriteError, match="opened read-only"):
            journal.prune(older_than=0, now=NOW + 1000)

    assert before == path.read_bytes()


def test_a_read_only_journal_is_read_only_down_to_sqlite(path: Path) -> None:
    """readonly=True opens the file with SQLite's mode=ro: not even a raw statement writes."""
    fill(path, 1)

    with Journal(path, readonly=True) as journal, pytest.raises(sqlite3.OperationalError) as caught:
        journal._conn.execute("DELETE FROM operations")

    assert "readonly" in str(caught.value)


def journal_mode(path: Path) -> str:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0])


def test_read_only_opening_never_switches_the_journal_mode(path: Path) -> None:
    """A rollback-mode journal opened read-only stays in rollback mode."""
    fill(path, 1)
    sql(path, "PRAGMA journal_mode = DELETE")

    Journal(path, readonly=True).close()

    assert "delete" == journal_mode(path)


def test_a_rollback_mode_journal_is_switched_to_wal_when_opened_to_write(path: Path) -> None:
    """A journal left in rollback mode (by an older version) is in WAL mode once reopened."""
    fill(path, 1)
    sql(path, "PRAGMA journal_mode = DELETE")

    Journal(path).close()

    assert "wal" == journal_mode(path)


READ_ONLY_COMMANDS = [
    ("list",),
    ("show", "op-1"),
    ("stats",),
    ("resume", "--dry-run"),
    ("prune", "--older-than", "1d", "--dry-run"),
]


@pytest.mark.parametrize(
    "args", [*READ_ONLY_COMMANDS, ("resume",), ("prune", "--older-than", "1d")], ids=" ".join
)
def test_commands_leave_a_placeholder_file_untouched(path: Path, args: tuple[str, ...]) -> None:
    """Every command on a 0-byte file: one-line 'not a journal' error, exit 1, file untouched."""
    path.touch()

    result = run("--journal", str(path), *args)

    assert_one_line_error(result, path, "not an idempotently journal")
    assert 0 == path.stat().st_size
    assert ["ops.db"] == sorted(child.name for child in path.parent.iterdir())


@pytest.mark.parametrize("args", READ_ONLY_COMMANDS, ids=" ".join)
def test_read_only_commands_never_write(path: Path, args: tuple[str, ...]) -> None:
    """list, show, stats and the dry runs leave a rollback-mode journal byte for byte."""
    fill(path, 3)
    sql(path, "PRAGMA journal_mode = DELETE")
    before = path.read_bytes()

    result = run("--journal", str(path), *args)

    assert result.exit_code in (0, 1), result.output  # show op-1: no such operation
    assert "Traceback" not in result.output
    assert before == path.read_bytes()
    assert "delete" == journal_mode(path)


# -- symlinks --------------------------------------------------------------------------


@contextlib.contextmanager
def umask(value: int) -> Iterator[None]:
    previous = os.umask(value)
    try:
        yield
    finally:
        os.umask(previous)


def test_a_journal_created_through_a_dangling_symlink_is_private(tmp_path: Path) -> None:
    """Creating a journal through a dangling symlink makes its target (and -wal, -shm) 0600."""
    target = tmp_path / "data" / "ops.db"
    target.parent.mkdir()
    link = tmp_path / "ops.db"
    link.symlink_to(target)

    with umask(0o022), Journal(link) as journal:
        insert(journal, new_operation())
        wal, shm = Path(f"{target}-wal"), Path(f"{target}-shm")

        assert (0o600, 0o600, 0o600) == (mode(target), mode(wal), mode(shm))
    assert link.is_symlink()


def test_a_journal_created_through_a_symlinked_directory_is_private(tmp_path: Path) -> None:
    """Creating a journal under a symlink to a directory makes the file 0600."""
    (tmp_path / "data").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "data")

    with umask(0o022), Journal(tmp_path / "linked" / "ops.db") as journal:
        insert(journal, new_operation())

    assert 0o600 == mode(tmp_path / "data" / "ops.db")


def test_a_journal_opened_through_a_symlink_writes_its_target(tmp_path: Path) -> None:
    """A symlink to an existing journal: keys land in the target, which stays 0600."""
    target = tmp_path / "ops.db"
    Journal(target).close()
    link = tmp_path / "link.db"
    link.symlink_to(target)

    with umask(0o022), Journal(link) as journal:
        insert(journal, new_operation())
        assert 0o600 == mode(Path(f"{target}-wal"))

    with Journal(target) as journal:
        assert 1 == journal.counts()["pending"]
    assert 0o600 == mode(target)


# -- WAL mode ------------------------------------------------------------------------------


@contextlib.contextmanager
def read_lock(path: Path) -> Iterator[None]:
    """Another connection in a read transaction: reads go on, the switch to WAL cannot."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN")
        conn.execute("SELECT * FROM sqlite_master").fetchall()
        yield
        conn.execute("COMMIT")
    finally:
        conn.close()


def test_wal_mode_that_cannot_be_set_is_an_error_within_the_busy_timeout(path: Path) -> None:
    """When WAL mode cannot be set, JournalWriteError after about busy_timeout; no journal made."""
    path.touch()
    with read_lock(path):
        started = time.monotonic()
        with pytest.raises(JournalWriteError) as caught:
            Journal(path, busy_timeout=0.2)
        elapsed = time.monotonic() - started

    assert elapsed < 2.0  # it was up to 100 x busy_timeout
    assert "WAL mode" in str(caught.value)
    assert str(path) in str(caught.value)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert [] == conn.execute("SELECT name FROM sqlite_master").fetchall()


# -- the command line ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("list",),
        ("show", "op-299"),
        ("resume",),
        ("resume", "--dry-run"),
        ("prune", "--older-than", "0s"),
    ],
    ids=" ".join,
)
def test_commands_on_damaged_pages_fail_in_one_line(damaged: Path, args: tuple[str, ...]) -> None:
    """Every command on damaged pages: exit 1, one line naming the file and what to do."""
    result = run("--journal", str(damaged), *args)

    assert_one_line_error(result, damaged, "damaged", "restore a backup")


def test_show_of_a_damaged_row_fails_in_one_line(three: Path) -> None:
    """`show` of the row with broken JSON: exit 1, one line naming file and operation."""
    sql(three, "UPDATE operations SET response_headers = '[' WHERE operation_id = 'op-000'")

    result = run("--journal", str(three), "show", "op-000")

    assert_one_line_error(result, three, "'op-000'", "restore a backup")


@pytest.mark.parametrize(
    ("args", "exit_code"),
    [(("list",), 0), (("resume",), 1), (("resume", "--dry-run"), 0)],
    ids=lambda value: " ".join(value) if isinstance(value, tuple) else str(value),
)
def test_commands_listing_a_damaged_row_name_it_and_go_on(
    three: Path, args: tuple[str, ...], exit_code: int
) -> None:
    """list and resume over a row with broken JSON: every other operation is listed or
    resumed, the damaged one is named with what is wrong, and no traceback."""
    sql(three, "UPDATE operations SET request_headers = '[' WHERE operation_id = 'op-000'")

    result = run("--journal", str(three), *args)

    assert exit_code == result.exit_code, result.output
    assert "Traceback" not in result.output
    assert "op-000" in result.output
    assert "request_headers is not valid JSON" in result.output
    if args == ("list",):
        assert {"op-001", "op-002"} <= set(result.output.split())


def test_a_damaged_journal_from_a_real_process_is_one_line(three: Path) -> None:
    """`python -m idempotently show` of a damaged row: exit 1, one stderr line, no traceback."""
    sql(three, "UPDATE operations SET request_headers = '[' WHERE operation_id = 'op-001'")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    result = subprocess.run(
        [sys.executable, "-m", "idempotently", "--journal", str(three), "show", "op-001"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )

    assert 1 == result.returncode
    assert "" == result.stdout
    assert 1 == len(result.stderr.strip().splitlines()), result.stderr
    assert result.stderr.startswith("Error: ")
    assert "'op-001'" in result.stderr


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("ALTER TABLE operations DROP COLUMN attempt1_wait", "operations.attempt1_wait"),
        ("ALTER TABLE operations DROP COLUMN cap_reason", "operations.cap_reason"),
        ("ALTER TABLE attempts DROP COLUMN wait", "attempts.wait"),
        ("ALTER TABLE origin_pauses DROP COLUMN reason", "origin_pauses.reason"),
        ("DROP INDEX operations_forks", "operations_forks"),
        ("DROP TABLE operation_audit", "operation_audit"),
    ],
)
@pytest.mark.parametrize(
    "opener",
    ["write", "readonly", "show", "stats", "list", "resume --dry-run", "migrate"],
)
def test_a_version_10_journal_missing_a_part_is_refused_before_any_use(
    path: Path, damage: str, named: str, opener: str
) -> None:
    """A journal at this version missing a column, a table or an index (a damaged or
    half-made file) is refused when it is opened, naming what is missing, and left as
    it is: never half-used, never "no such column" with advice about disk space."""
    with Journal(path) as journal:
        insert(journal, new_operation("op-1"))
    sql(path, damage)
    before = path.read_bytes()
    if opener in ("write", "readonly"):
        with pytest.raises(JournalCorruptError) as caught:
            Journal(path, readonly=opener == "readonly")
        message = caught.value.message
    else:
        arguments = [*opener.split(), *(["op-1"] if opener == "show" else [])]
        result = CliRunner().invoke(cli, ["--journal", str(path), *arguments])
        assert 1 == result.exit_code, result.output
        message = " ".join(result.output.split())
    assert str(path) in message
    assert named in message
    assert "restore it from a backup" in message
    assert before == path.read_bytes()


ATTEMPT_EDITS = {
    # name: (the edit, what the read says, whether the row alone shows it)
    "attempt_count lowered to 0": (
        "UPDATE operations SET attempt_count = 0 WHERE operation_id = 'op-1'",
        "attempt_count is 0 but attempt 1 is journaled",
        True,
    ),
    "attempt 1 emptied": (
        "UPDATE operations SET attempt1_outcome = NULL WHERE operation_id = 'op-1'",
        "attempt_count is 2 but attempt 1 is not journaled",
        True,
    ),
    "attempt_count negative": (
        "UPDATE operations SET attempt_count = -1 WHERE operation_id = 'op-1'",
        "attempt_count is -1",
        True,
    ),
    "attempt_count raised": (
        "UPDATE operations SET attempt_count = 4 WHERE operation_id = 'op-1'",
        "attempt_count is 4 but its later attempts are numbered [2]",
        False,
    ),
    "attempt 2 renumbered 1": (
        "UPDATE attempts SET number = 1 WHERE operation_id = 'op-1'",
        "attempt_count is 2 but its later attempts are numbered [1]",
        False,
    ),
}


def two_pending_operations(path: Path | str, created_at: float = NOW) -> None:
    """op-1 and op-2, each answered 503 twice: pending, attempt 1 in its row, attempt 2
    in attempts."""
    with Journal(path, durability="os") as journal:
        for operation_id in ("op-1", "op-2"):
            insert(journal, new_operation(operation_id, created_at=created_at))
            for _ in range(2):
                record_attempt(journal, operation_id, answered_503(), now=created_at)


@pytest.mark.parametrize("change", list(ATTEMPT_EDITS))
def test_a_row_whose_attempts_disagree_with_its_count_is_refused_naming_it(
    journal_target: str, change: str
) -> None:
    """A first attempt is in its operation's row, later ones in attempts, and attempt_count
    says how many: a row edited so they disagree is never shown as a shorter or longer
    history. Reading it is a JournalCorruptError naming the operation, its key and what
    disagrees; `show` says so in one line; the other operations are shown and counted.
    Where the row alone shows it, a listing and a claim report it as damaged (never
    sent); where only its attempts do, it is listed and claimed as it is, as before.
    PostgreSQL, which joins the attempts in the same read, says the same as SQLite."""
    two_pending_operations(journal_target)
    damage, problem, in_row = ATTEMPT_EDITS[change]
    edit(journal_target, damage)

    with Journal(journal_target) as journal:
        shown_as = journal.path
        with pytest.raises(JournalCorruptError) as caught:
            journal.operation("op-1")
        healthy = journal.operation("op-2")
        listed = {operation.operation_id: operation.damaged for operation in journal.operations()}
        claimed = {
            operation.operation_id: operation.damaged
            for operation in claim_due(
                journal, owner="worker", now=NOW + 100, lease_until=NOW + 200, limit=10
            )
        }
    shown = run("--journal", journal_target, "show", "op-1", "--json")

    assert ("op-1", "key-op-1") == (caught.value.operation_id, caught.value.key)
    assert problem in caught.value.message
    assert_one_line_error(shown, shown_as, problem)
    assert healthy is not None
    assert [1, 2] == [attempt.number for attempt in healthy.attempts]
    assert {"op-1": problem if in_row else None, "op-2": None} == listed == claimed
    assert 0 == run("--journal", journal_target, "stats").exit_code


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("count", "problem"),
    [
        (1, "attempt_count is 1 but its later attempts are numbered [2]"),
        (3, "attempt_count is 3 but its later attempts are numbered [2]"),
    ],
)
def test_a_postgres_read_refuses_a_history_longer_or_shorter_than_its_count(
    postgres_url: str, count: int, problem: str
) -> None:
    """PostgreSQL reads every attempt with its row: a count lowered below the attempts
    journaled (which SQLite sees only at the next write) is refused by `show` as a count
    raised above them is, and a call's read still reads it as it is."""
    two_pending_operations(postgres_url)
    edit(postgres_url, f"UPDATE operations SET attempt_count = {count} WHERE operation_id = 'op-1'")

    with Journal(postgres_url) as journal:
        with pytest.raises(JournalCorruptError) as caught:
            journal.operation("op-1")
        called = find(journal, "op-1", None)

    assert ("op-1", "key-op-1", True) == (
        caught.value.operation_id,
        caught.value.key,
        problem in caught.value.message,
    )
    assert called is not None
    assert (count, [1, 2]) == (called.attempt_count, [a.number for a in called.attempts])


@pytest.mark.parametrize(
    "change", [change for change, (_, _, in_row) in ATTEMPT_EDITS.items() if in_row]
)
def test_a_resume_reports_a_row_whose_count_disagrees_and_resumes_the_others(
    journal_target: str, scripted: tuple[scripted_server.ScriptedApp, str], change: str
) -> None:
    """One row whose attempt_count disagrees with its first attempt never stops a resume:
    it is reported, nothing of it is sent, and the other operation is resumed (a real
    server sees one request); on SQLite and PostgreSQL."""
    app, url = scripted
    two_pending_operations(journal_target, created_at=time.time())
    damage, problem, _ = ATTEMPT_EDITS[change]
    edit(journal_target, damage)
    app.answer(scripted_server.Answer(status=201))

    with idempotently.Session(journal_target) as session:
        results = {result.operation_id: result for result in session.resume(base_url=url)}

    assert 1 == len(app.arrivals)  # op-2's resend; nothing of op-1
    assert ("succeeded", "pending") == (results["op-2"].status, results["op-1"].status)
    assert ("not_sent", True) == (results["op-1"].action, problem in results["op-1"].detail)


def journal_with_two_attempts(target: str) -> None:
    """op-1, answered twice (503 then 503, pending): attempt 1 in its row, attempt 2 in
    attempts."""
    with Journal(target, durability="os") as journal:
        insert(journal, new_operation("op-1"))
        for _ in range(2):
            record_attempt(
                journal,
                "op-1",
                AttemptRecord(started_at=NOW, elapsed=0.1, outcome="answered", status_code=503),
                now=NOW,
            )


@pytest.mark.postgres
@pytest.mark.parametrize(
    "damage",
    [
        "UPDATE idempotently.operations SET attempt_count = 0",
        "UPDATE idempotently.operations SET attempt1_outcome = NULL",
        "UPDATE idempotently.operations SET attempt_count = 5",
    ],
)
def test_a_postgres_row_whose_attempts_disagree_with_its_count_is_refused(
    postgres_url: str, damage: str
) -> None:
    """As on SQLite: reading a row whose attempt_count disagrees with its attempts is a
    JournalCorruptError naming the operation, never a shorter or longer history."""
    import psycopg

    journal_with_two_attempts(postgres_url)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(damage)  # type: ignore[arg-type]
    with Journal(postgres_url) as journal, pytest.raises(JournalCorruptError) as caught:
        journal.operation("op-1")
    assert ("op-1", "key-op-1") == (caught.value.operation_id, caught.value.key)


@pytest.mark.postgres
def test_a_postgres_journal_missing_a_column_is_refused_when_opened(postgres_url: str) -> None:
    """A version-10 PostgreSQL journal missing a column is refused at open, naming it."""
    import psycopg

    journal_with_two_attempts(postgres_url)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE idempotently.operations DROP COLUMN attempt1_wait")
    with pytest.raises(JournalCorruptError, match="attempt1_wait"):
        Journal(postgres_url).close()


def postgres_schema(url: str) -> tuple[list[Any], list[Any]]:
    """The journal's parts as PostgreSQL's catalog lists them, and its journal_meta rows."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        parts = conn.execute(
            "SELECT c.relname, c.relkind, a.attname FROM pg_class AS c "
            "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
            "LEFT JOIN pg_attribute AS a ON a.attrelid = c.oid AND a.attnum > 0 "
            "AND NOT a.attisdropped WHERE n.nspname = 'idempotently' ORDER BY 1, 2, 3"
        ).fetchall()
        meta = conn.execute("SELECT * FROM idempotently.journal_meta ORDER BY 1").fetchall()
    return parts, meta


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("ALTER TABLE operations DROP COLUMN cap_reason", "operations.cap_reason"),
        ("ALTER TABLE attempts DROP COLUMN wait", "attempts.wait"),
        ("ALTER TABLE origin_pauses DROP COLUMN reason", "origin_pauses.reason"),
        (
            "ALTER TABLE journal_counts DROP COLUMN answered_attempts",
            "journal_counts.answered_attempts",
        ),
        ("ALTER TABLE journal_meta DROP COLUMN value", "journal_meta.value"),
        ("DROP INDEX operations_forks", "operations_forks"),
        ("ALTER TABLE operations DROP CONSTRAINT operations_key_key", "operations_key_key"),
        ("DROP TABLE operation_audit", "(schema idempotently: operation_audit)"),
    ],
)
@pytest.mark.parametrize(
    "opener", ["write", "readonly", "show", "stats", "list", "resume --dry-run", "migrate"]
)
def test_a_version_10_postgres_journal_missing_a_part_is_refused_before_any_use(
    postgres_url: str, damage: str, named: str, opener: str
) -> None:
    """As on SQLite: a PostgreSQL journal at this version missing a column, a table or an
    index (its key's unique index included) is refused when it is opened, naming what is
    missing (a table, not each of its columns), and left as it is."""
    journal_with_two_attempts(postgres_url)
    edit(postgres_url, damage)
    before = postgres_schema(postgres_url)
    if opener in ("write", "readonly"):
        with pytest.raises(JournalCorruptError) as caught:
            Journal(postgres_url, readonly=opener == "readonly")
        message = caught.value.message
    else:
        arguments = [*opener.split(), *(["op-1"] if opener == "show" else [])]
        result = CliRunner().invoke(cli, ["--journal", postgres_url, *arguments])
        assert 1 == result.exit_code, result.output
        message = " ".join(result.output.split())
    assert postgres_url in message
    assert named in message
    assert "restore it from a backup" in message
    assert before == postgres_schema(postgres_url)


@pytest.mark.postgres
def test_a_postgres_journal_is_checked_for_every_part_its_schema_makes(
    postgres_url: str,
) -> None:
    """What opening checks is every table, column and index a new journal has (the
    indexes of its PRIMARY KEY and UNIQUE constraints included): none goes unchecked."""
    from idempotently._journal._postgres import _schema_parts

    Journal(postgres_url).close()
    parts, _ = postgres_schema(postgres_url)
    made = {
        name if kind != "r" or column is None else f"{name}.{column}"
        for name, kind, column in parts
        if kind in ("r", "i")
    } | {name for name, kind, _ in parts if kind == "r"}

    assert made == set(_schema_parts())


def test_a_read_racing_a_writer_of_a_later_attempt_is_never_called_damaged(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check of attempt_count against the attempts spans two reads (the row, then
    attempts 2..n): another connection journaling attempt 3 between them is no damage.
    The read is a whole history, 1..attempt_count, as one snapshot shows it."""
    with Journal(path, durability="os") as journal:
        insert(journal, new_operation("op-1"))
        for _ in range(2):
            record_attempt(journal, "op-1", answered_503(), now=NOW)
    with Journal(path, readonly=True) as reader, Journal(path, durability="os") as writer:
        store: Any = reader._store
        read_later = store._later_attempts
        raced: list[bool] = []

        def with_a_write_before(*args: Any, **kwargs: Any) -> Any:
            if not raced:
                raced.append(True)
                record_attempt(writer, "op-1", answered_503(), now=NOW)
            return read_later(*args, **kwargs)

        monkeypatch.setattr(store, "_later_attempts", with_a_write_before)
        operation = reader.operation("op-1")

    assert [True] == raced
    assert operation is not None
    assert (3, [1, 2, 3]) == (
        operation.attempt_count,
        [attempt.number for attempt in operation.attempts],
    )


def answered_503() -> AttemptRecord:
    return AttemptRecord(started_at=NOW, elapsed=0.1, outcome="answered", status_code=503)
