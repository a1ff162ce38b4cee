"""One schema per store (version 10): a development journal (SQLite 1-5, PostgreSQL 1-3) is
refused, unmodified, with the build that drains it; a version-10 file is one no older
build reads."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import idempotently
from idempotently import JournalVersionError
from idempotently._journal import AttemptRecord, _sqlite, migration_sql
from idempotently.cli import cli

DEVELOPMENT = Path(__file__).parent / "data" / "development_journals"
SQLITE_VERSIONS = (1, 2, 3, 4, 5)


def development_sqlite_journal(path: Path, version: int, *, adopted: bool = False) -> None:
    """A SQLite journal as the development build of ``version`` left it, holding one
    pending operation; ``adopted``: inside an application's database (its own table,
    user_version 7), the journal's version a journal_meta row."""
    script = (DEVELOPMENT / f"sqlite_v{version}.sql").read_text()
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        if adopted:
            conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
            conn.execute("PRAGMA user_version = 7")
            script = script.replace(f"PRAGMA application_id = {_sqlite.APPLICATION_ID};", "")
            script = script.replace(f"PRAGMA user_version = {version};", "")
        conn.executescript(script)
        if adopted:
            conn.execute(
                "INSERT OR REPLACE INTO journal_meta (name, value) VALUES "
                f"('identity', 'idempotently'), ('schema_version', '{version}')"
            )
        conn.execute(
            "INSERT INTO operations (operation_id, key, status, delivery, method, url, "
            "request_headers, request_body, fingerprint, profile, key_header, created_at, "
            "updated_at, key_expires_at) VALUES ('charge-1', 'k-1', 'pending', "
            "'exactly_once', 'POST', 'https://api.example/charges', '[]', x'7b7d', 'f', "
            "'stripe', 'Idempotency-Key', 1, 1, 86401)"
        )
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def digest(path: Path) -> str:
    """The file's bytes (and its -wal's, if any): what "left as it is" compares."""
    parts = [path, path.with_name(path.name + "-wal")]
    return hashlib.sha256(b"".join(p.read_bytes() for p in parts if p.exists())).hexdigest()


def assert_refusal(message: str, path: Path, version: int, store: str = "SQLite") -> None:
    assert f"{path} is a development journal ({store} schema version {version})" in message
    assert "left as it is" in message
    assert (
        "Do not delete it while it holds pending, needs_reconcile or recently succeeded "
        "operations" in message
    )
    assert "git tag v0.1.0.dev-journal5" in message


OPENERS: dict[str, Callable[[Path], object]] = {
    "write": lambda path: idempotently.Journal(path),
    "readonly": lambda path: idempotently.Journal(path, readonly=True),
    "create=False": lambda path: idempotently.Journal(path, create=False),
    "adopt": lambda path: idempotently.Journal(path, adopt=True),
    "migrate --sql": lambda path: migration_sql(path),
}


@pytest.mark.parametrize(
    ("version", "adopted"),
    # Builds adopted an application's database from version 4 (the outbox) on.
    [(version, False) for version in SQLITE_VERSIONS] + [(4, True), (5, True)],
    ids=lambda value: {False: "own file", True: "adopted"}.get(value, str(value)),
)
@pytest.mark.parametrize("opener", list(OPENERS))
def test_a_development_sqlite_journal_is_refused_unmodified(
    tmp_path: Path, version: int, opener: str, adopted: bool
) -> None:
    """Every way of opening a SQLite journal of a development version refuses it in one
    line that names the version, says not to delete it and names the tag; the file is
    left byte for byte as it was."""
    path = tmp_path / "journal.db"
    development_sqlite_journal(path, version, adopted=adopted)
    before = digest(path)
    with pytest.raises(JournalVersionError) as refused:
        OPENERS[opener](path)
    assert_refusal(refused.value.message, path, version)
    assert "\n" not in refused.value.message
    assert before == digest(path)


@pytest.mark.parametrize("command", [["stats"], ["list"], ["resume"], ["migrate"]])
def test_the_cli_refuses_a_development_sqlite_journal(tmp_path: Path, command: list[str]) -> None:
    """The CLI says the same (exit 1, an error naming the file, never a traceback), and
    the file is left as it was."""
    path = tmp_path / "journal.db"
    development_sqlite_journal(path, 5)
    before = digest(path)
    result = CliRunner().invoke(cli, ["--journal", str(path), *command])
    assert 1 == result.exit_code
    assert isinstance(result.exception, SystemExit)
    assert_refusal(" ".join(result.output.split()), path, 5)
    assert before == digest(path)


def test_a_new_sqlite_journal_is_at_version_10_and_newer_than_every_development_build(
    tmp_path: Path,
) -> None:
    """A new journal file says version 10 where every development build reads its version
    (user_version; in an adopted database, journal_meta), so each refuses it as newer
    (they refuse any version above their own 1 to 5)."""
    own, adopted = tmp_path / "journal.db", tmp_path / "shop.db"
    idempotently.Journal(own).close()
    with contextlib.closing(sqlite3.connect(adopted)) as conn:
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    idempotently.Journal(adopted, adopt=True).close()
    with contextlib.closing(sqlite3.connect(own)) as conn:
        assert 10 == conn.execute("PRAGMA user_version").fetchone()[0]
    with contextlib.closing(sqlite3.connect(adopted)) as conn:
        assert (
            "10"
            == conn.execute(
                "SELECT value FROM journal_meta WHERE name = 'schema_version'"
            ).fetchone()[0]
        )
        assert 0 == conn.execute("PRAGMA user_version").fetchone()[0]
    assert 10 > max(SQLITE_VERSIONS)


def test_migrate_sql_from_a_development_version_is_refused() -> None:
    """There is no step from a development version: --from-version 5 is refused with the
    same words; from 0 the script creates version 10."""
    with pytest.raises(JournalVersionError) as refused:
        _sqlite.migration_sql(5, path="journal.db")
    assert_refusal(refused.value.message, Path("journal.db"), 5)
    assert "PRAGMA user_version = 10;" in _sqlite.migration_sql(0)


# -- PostgreSQL --------------------------------------------------------------------------

POSTGRES_VERSIONS = (1, 2, 3)


def development_postgres_journal(url: str, version: int) -> None:
    """A PostgreSQL journal as the development build of ``version`` left it, holding one
    pending operation."""
    import psycopg

    script = (DEVELOPMENT / f"postgres_v{version}.sql").read_text()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(script)  # type: ignore[arg-type]
        conn.execute(
            "INSERT INTO idempotently.operations (operation_id, key, status, delivery, "
            "method, url, request_headers, request_body, fingerprint, profile, key_header, "
            "created_at, updated_at, key_expires_at) VALUES ('charge-1', 'k-1', 'pending', "
            "'exactly_once', 'POST', 'https://api.example/charges', '[]', '\\x7b7d', 'f', "
            "'stripe', 'Idempotency-Key', 1, 1, 86401)"
        )


def postgres_state(url: str) -> list[object]:
    """The journal's tables, columns and rows: what "left as it is" compares."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return [
            conn.execute(
                "SELECT table_name, column_name FROM information_schema.columns "
                "WHERE table_schema = 'idempotently' ORDER BY 1, 2"
            ).fetchall(),
            conn.execute("SELECT * FROM idempotently.journal_meta ORDER BY name").fetchall(),
            conn.execute("SELECT * FROM idempotently.operations").fetchall(),
        ]


POSTGRES_OPENERS: dict[str, Callable[[str], object]] = {
    "write": lambda url: idempotently.Journal(url),
    "readonly": lambda url: idempotently.Journal(url, readonly=True),
    "create=False": lambda url: idempotently.Journal(url, create=False),
    "migrate --sql": lambda url: migration_sql(url),
}


@pytest.mark.postgres
@pytest.mark.parametrize("opener", list(POSTGRES_OPENERS))
@pytest.mark.parametrize("version", POSTGRES_VERSIONS)
def test_a_development_postgres_journal_is_refused_unmodified(
    postgres_url: str, version: int, opener: str
) -> None:
    """Every way of opening a PostgreSQL journal of a development version refuses it in
    one line naming the version, the tag and not to delete it; nothing in it changes."""
    development_postgres_journal(postgres_url, version)
    before = postgres_state(postgres_url)
    with pytest.raises(JournalVersionError) as refused:
        POSTGRES_OPENERS[opener](postgres_url)
    message = refused.value.message
    assert f"is a development journal (PostgreSQL schema version {version})" in message
    assert "Do not delete it while it holds pending" in message
    assert "git tag v0.1.0.dev-journal5" in message
    assert before == postgres_state(postgres_url)


@pytest.mark.postgres
def test_a_new_postgres_journal_is_at_version_10(postgres_url: str) -> None:
    """journal_meta says 10, which every development build (1 to 3) refuses as newer."""
    import psycopg

    idempotently.Journal(postgres_url).close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT value FROM idempotently.journal_meta WHERE name = 'schema_version'"
        ).fetchone()
    assert row is not None
    assert "10" == row[0]


# -- the development build on a version-10 journal -------------------------------------

REPOSITORY = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def development_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The source of the build at git tag v0.1.0.dev-journal5 (or the commit named by
    IDEMPOTENTLY_DEVELOPMENT_BUILD), taken from this repository's history."""
    revision = os.environ.get("IDEMPOTENTLY_DEVELOPMENT_BUILD", _sqlite.DEVELOPMENT_TAG)
    found = subprocess.run(
        ["git", "-C", str(REPOSITORY), "rev-parse", "--verify", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        pytest.skip(f"no {revision} in this repository's history (a checkout without tags)")
    target = tmp_path_factory.mktemp("development-build")
    archive = subprocess.run(
        ["git", "-C", str(REPOSITORY), "archive", found.stdout.strip(), "src/idempotently"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target / "src"


@pytest.mark.parametrize("adopted", [False, True], ids=["own file", "adopted"])
@pytest.mark.parametrize("readonly", [False, True])
def test_the_development_build_refuses_a_version_10_journal_unmodified(
    tmp_path: Path, development_build: Path, readonly: bool, adopted: bool
) -> None:
    """The build at the tag opens a journal of this version (its own file, or adopted into
    an application's database) as newer than it reads, says so, and leaves the file as
    it was."""
    path = tmp_path / "journal.db"
    if adopted:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    idempotently.Journal(path, adopt=adopted).close()
    before = digest(path)
    opened = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys, idempotently; idempotently.Journal(sys.argv[1], readonly={readonly})",
            str(path),
        ],
        env={**os.environ, "PYTHONPATH": str(development_build)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert 0 != opened.returncode
    assert "JournalVersionError" in opened.stderr
    assert "has journal schema version 10, but this idempotently reads up to version 5" in (
        opened.stderr
    )
    assert before == digest(path)


# -- a refused file with a -wal beside it ------------------------------------------------


def with_frames_in_its_wal(path: Path, version: int) -> None:
    """A development journal whose last writes are still frames of its -wal (the writer
    was killed before a checkpoint), followed by a torn frame (a write cut off): the pair
    of files a crashed development build leaves."""
    live = path.with_name("live.db")
    development_sqlite_journal(live, version)
    with contextlib.closing(sqlite3.connect(live, isolation_level=None)) as conn:
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute("UPDATE operations SET updated_at = 2, attempt_count = 1")
        # A copy of the pair while the writer still has it open: what SIGKILL leaves.
        path.write_bytes(live.read_bytes())
        wal = Path(f"{live}-wal").read_bytes()
        Path(f"{path}-wal").write_bytes(wal + wal[32 : 32 + 24 + 100])
    assert Path(f"{path}-wal").stat().st_size > 32


def cli_opener(*command: str) -> Callable[[Path], object]:
    def run(path: Path) -> object:
        result = CliRunner().invoke(cli, ["--journal", str(path), *command])
        assert 1 == result.exit_code, result.output
        assert isinstance(result.exception, SystemExit)
        raise JournalVersionError(" ".join(result.output.removeprefix("Error: ").split()))

    return run


WAL_OPENERS: dict[str, Callable[[Path], object]] = {
    **OPENERS,
    "Session": lambda path: idempotently.Session(path),
    "AsyncSession": lambda path: idempotently.AsyncSession(path),
    "Transport": lambda path: idempotently.Transport(path),
    **{
        f"cli {' '.join(command)}": cli_opener(*command)
        for command in (
            ["stats"],
            ["list"],
            ["show", "charge-1"],
            ["resume"],
            ["resume", "--dry-run"],
            ["prune", "--older-than", "1d"],
            ["migrate"],
            ["migrate", "--recount"],
            ["migrate", "--sql"],
        )
    },
}


@pytest.mark.parametrize("opener", list(WAL_OPENERS))
def test_a_development_journal_with_frames_in_its_wal_is_refused_unmodified(
    tmp_path: Path, opener: str
) -> None:
    """Refusing a development journal leaves its -wal as it is too: SQLite's checkpoint
    when the last connection to a file closes would copy the frames into the file and
    delete the -wal, so the refusal closes without one."""
    path = tmp_path / "journal.db"
    with_frames_in_its_wal(path, 5)
    before = digest(path)
    with pytest.raises(JournalVersionError) as refused:
        WAL_OPENERS[opener](path)
    assert_refusal(" ".join(refused.value.message.split()), path, 5)
    assert before == digest(path)
    assert Path(f"{path}-wal").exists()


def test_a_journal_from_the_future_with_frames_in_its_wal_is_left_as_it_is(
    tmp_path: Path,
) -> None:
    """A newer version's journal is refused with "the file was not modified", and so it is
    not: neither the file nor its -wal."""
    path = tmp_path / "journal.db"
    with_frames_in_its_wal(path, 5)
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute("PRAGMA user_version = 11")
        path.with_name("future.db").write_bytes(path.read_bytes())
        Path(f"{path.with_name('future.db')}-wal").write_bytes(Path(f"{path}-wal").read_bytes())
    future = path.with_name("future.db")
    before = digest(future)
    with pytest.raises(JournalVersionError, match="version 11"):
        idempotently.Journal(future)
    assert before == digest(future)


@pytest.mark.parametrize("version", [0, 6, 7, 9])
@pytest.mark.parametrize("opener", list(OPENERS))
def test_every_version_below_10_with_our_application_id_is_a_development_journal(
    tmp_path: Path, version: int, opener: str
) -> None:
    """Versions no build wrote (6 to 9) and 0 (a file whose creation never finished) with
    journal tables and our application_id: refused as development journals, unmodified."""
    path = tmp_path / "journal.db"
    development_sqlite_journal(path, 5)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(f"PRAGMA user_version = {version}")
    before = digest(path)
    with pytest.raises(JournalVersionError) as refused:
        OPENERS[opener](path)
    assert_refusal(refused.value.message, path, version)
    assert before == digest(path)


@contextlib.contextmanager
def read_only_directory(directory: Path) -> Iterator[None]:
    """No file can be made in ``directory`` (a -shm beside a journal, say), even by root
    (who writes through a read-only mode: the directory is then made immutable, or the
    test skipped where it cannot be)."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    made = subprocess.run(["chattr", "+i", str(directory)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"root writes through a read-only mode, and chattr +i failed: {made.stderr}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


@pytest.mark.parametrize("frames", [False, True], ids=["checkpointed", "frames in its -wal"])
@pytest.mark.parametrize("opener", list(WAL_OPENERS))
def test_a_development_journal_in_a_read_only_directory_is_refused_naming_its_version(
    tmp_path: Path, opener: str, frames: bool
) -> None:
    """Where SQLite cannot open a WAL file at all (its -shm cannot be made in a read-only
    directory), the refusal still names the development version, the tag and not to
    delete it, read from the file alone; the file and its -wal are left as they are."""
    directory = tmp_path / "journals"
    directory.mkdir()
    path = directory / "journal.db"
    if frames:
        with_frames_in_its_wal(path, 5)
        for made in directory.glob("live.db*"):
            made.unlink()
    else:
        development_sqlite_journal(path, 5)
    before = digest(path)
    with read_only_directory(directory):
        with pytest.raises(JournalVersionError) as refused:
            WAL_OPENERS[opener](path)
        after = digest(path)
    assert_refusal(" ".join(refused.value.message.split()), path, 5)
    assert before == after


def postgres_journal_state(url: str) -> list[object]:
    """`postgres_state` with the attempts and the counts: a version-10 journal's rows."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return [
            *postgres_state(url),
            conn.execute("SELECT * FROM idempotently.attempts ORDER BY 1, 2").fetchall(),
            conn.execute("SELECT * FROM idempotently.journal_counts ORDER BY slot").fetchall(),
        ]


@pytest.mark.postgres
@pytest.mark.parametrize(
    "opening",
    [
        "idempotently.Journal(sys.argv[1])",
        "idempotently.Journal(sys.argv[1], readonly=True)",
        "idempotently.Journal(sys.argv[1], create=False)",
        "idempotently.cli.cli(['--journal', sys.argv[1], 'migrate'])",
    ],
    ids=["write", "readonly", "create=False", "migrate"],
)
def test_the_development_build_refuses_a_version_10_postgres_journal_unmodified(
    postgres_url: str, development_build: Path, opening: str
) -> None:
    """The build at the tag (PostgreSQL schema 3) opens a version-10 PostgreSQL journal as
    newer than it reads, says so, and leaves its tables, rows and counts as they were."""
    from tests.journal_commands import record_attempt
    from tests.test_journal import NOW, insert, new_operation

    with idempotently.Journal(postgres_url) as journal:
        insert(journal, new_operation("charge-1"))
        record_attempt(
            journal,
            "charge-1",
            AttemptRecord(
                started_at=NOW, elapsed=0.1, outcome="answered", status_code=201, status="succeeded"
            ),
            now=NOW,
        )
    before = postgres_journal_state(postgres_url)
    opened = subprocess.run(
        [sys.executable, "-c", f"import sys, idempotently.cli; {opening}", postgres_url],
        env={**os.environ, "PYTHONPATH": str(development_build)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = opened.stdout + opened.stderr
    assert (True, True) == (
        "has PostgreSQL journal schema version 10" in said,
        "reads up to version 3" in said,
    ), said
    assert before == postgres_journal_state(postgres_url)


# -- columns this version does not know ---------------------------------------------------


def test_a_column_added_by_a_later_version_changes_no_read(journal_target: str) -> None:
    """Reads select the columns this version knows by name, never ``*``: a column a later
    version adds (while this one still runs) changes no operation read, listed or claimed."""
    from tests.journal_commands import claim_due
    from tests.test_journal import NOW, insert, new_operation

    with idempotently.Journal(journal_target) as journal:
        insert(journal, new_operation("charge-1"))
        before = journal.operation("charge-1")
    if journal_target.startswith("postgres"):
        import psycopg

        with psycopg.connect(journal_target, autocommit=True) as conn:
            conn.execute("ALTER TABLE idempotently.operations ADD COLUMN later text DEFAULT 'x'")
    else:
        with contextlib.closing(sqlite3.connect(journal_target)) as conn:
            conn.execute("ALTER TABLE operations ADD COLUMN later TEXT DEFAULT 'x'")
    with idempotently.Journal(journal_target) as journal:
        read = journal.operation("charge-1")
        listed = journal.operations()
        claimed = claim_due(journal, owner="worker", now=NOW + 10, lease_until=NOW + 60, limit=5)
    assert (before, [before]) == (read, listed)
    assert ["charge-1"] == [operation.operation_id for operation in claimed]
