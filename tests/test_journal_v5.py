"""Schema version 5 (PostgreSQL: 3): the codec rows' body digest. A version-4 journal is
upgraded in one transaction with every operation kept (their digest None), read as it is
when opened read-only, and a digest written by a call round-trips."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import psycopg

from idempotently import Journal
from idempotently._journal import _postgres, _sqlite
from idempotently._rows import Operation
from tests.at_rest import stored_column
from tests.test_journal import insert, new_operation
from tests.test_journal_v2 import user_version
from tests.test_journal_v3 import audit
from tests.test_journal_v4 import columns


def as_version_4(target: str) -> None:
    """Take a new journal back to what the previous idempotently made: SQLite version 4,
    PostgreSQL version 2 (no body_digest column). Its rows are kept as they are."""
    if target.startswith("postgresql://"):
        with psycopg.connect(target, autocommit=True) as conn:
            conn.execute("ALTER TABLE idempotently.operations DROP COLUMN body_digest")
            conn.execute(
                "UPDATE idempotently.journal_meta SET value = '2' WHERE name = 'schema_version'"
            )
        return
    with contextlib.closing(sqlite3.connect(target, isolation_level=None)) as conn:
        conn.execute("ALTER TABLE operations DROP COLUMN body_digest")
        conn.execute("PRAGMA user_version = 4")


def stored_version(target: str) -> int:
    if not target.startswith("postgresql://"):
        return user_version(Path(target))
    with psycopg.connect(target, autocommit=True) as conn:
        row = conn.execute(
            "SELECT value FROM idempotently.journal_meta WHERE name = 'schema_version'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_the_digest_is_a_column_of_both_stores_and_of_the_row() -> None:
    """The row type and both stores agree on the one column version 5 adds."""
    assert "body_digest" in {field.name for field in Operation.__attrs_attrs__}
    assert "ADD COLUMN body_digest BLOB" in _sqlite._SCHEMA_V5
    assert "ADD COLUMN body_digest bytea" in _postgres._MIGRATIONS[2]
    assert (5, 3) == (_sqlite.SCHEMA_VERSION, _postgres.SCHEMA_VERSION)
    assert frozenset({"body_digest"}) == _postgres._ADDED_IN_V3


def test_a_version_4_journal_is_upgraded_with_the_same_audits(journal_target: str) -> None:
    """Opened to write, a version-4 journal (PostgreSQL 2) gets the column, answers every
    audit as before, and its operations read their digest as None."""
    with Journal(journal_target) as journal:
        for number in range(3):
            insert(journal, new_operation(f"op-{number}"))
    as_version_4(journal_target)
    with Journal(journal_target, readonly=True) as backup:
        before = audit(backup)
        old = backup.operation("op-0")
    with Journal(journal_target) as journal:
        after = audit(journal)
        shown = journal.operation("op-0")
    expected = 5 if not journal_target.startswith("postgresql://") else 3
    assert expected == stored_version(journal_target)
    assert before == after
    assert old is not None and shown is not None
    assert (None, None) == (old.body_digest, shown.body_digest)
    assert old.request_body == shown.request_body


def test_a_version_4_backup_opened_read_only_is_left_as_it_is(tmp_path: Path) -> None:
    """A version-4 SQLite file opened read-only is read without the column, unmodified."""
    path = tmp_path / "ops.db"
    with Journal(path) as journal:
        insert(journal, new_operation())
    as_version_4(str(path))
    stamp = os.stat(path).st_mtime_ns, path.read_bytes()
    with Journal(path, readonly=True) as backup:
        shown = backup.operation("op-1")
        listed = backup.operations()
    assert 4 == user_version(path)
    assert stamp == (os.stat(path).st_mtime_ns, path.read_bytes())
    assert shown is not None and shown.body_digest is None
    assert ["op-1"] == [op.operation_id for op in listed]
    assert "body_digest" not in columns(path, "operations")


def test_a_postgres_version_2_journal_opened_read_only_is_read_as_it_is(
    postgres_url: str,
) -> None:
    """A version-2 PostgreSQL journal opened read-only: found and listed (digest None), its
    schema version unchanged."""
    with Journal(postgres_url) as journal:
        insert(journal, new_operation())
    as_version_4(postgres_url)
    with Journal(postgres_url, readonly=True) as backup:
        shown = backup.operation("op-1")
        listed = backup.operations()
    assert shown is not None and shown.body_digest is None
    assert ["op-1"] == [op.operation_id for op in listed]
    assert 2 == stored_version(postgres_url)


def test_the_digest_round_trips(journal_target: str) -> None:
    """A digest written with an operation is the one read back, as stored."""
    with Journal(journal_target) as journal:
        insert(journal, new_operation().__class__(**{**_fields(), "body_digest": b"\x01\x02"}))
        shown = journal.operation("op-1")
    assert shown is not None and b"\x01\x02" == shown.body_digest
    assert b"\x01\x02" == stored_column(journal_target, "op-1", "body_digest")


def test_migrate_sql_from_version_4_adds_the_column_only() -> None:
    """The script for an application's own migrations: version 4 to 5 is one statement."""
    script = _sqlite.migration_sql(4)
    assert "ADD COLUMN body_digest BLOB;" in script and "PRAGMA user_version = 5;" in script
    assert "CREATE TABLE" not in script
    pg_script = _postgres.migration_sql(2)
    assert "ADD COLUMN body_digest bytea;" in pg_script and "'3'" in pg_script


def _fields() -> dict[str, object]:
    new = new_operation()
    return {field.name: getattr(new, field.name) for field in new.__attrs_attrs__}
