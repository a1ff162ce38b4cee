"""Schema version 4 (PostgreSQL: 2): the columns and tables the operator's journal, data at
rest and retry control write. Older journals are upgraded in one transaction with every
operation kept, read as they are when opened read-only, and a new column round-trips."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import psycopg
import pytest

from idempotently import Journal
from idempotently._journal import _postgres, _sqlite
from idempotently._rows import Operation
from tests.test_journal import insert, new_operation
from tests.test_journal_v2 import user_version
from tests.test_journal_v3 import audit, v2_journal

NEW_COLUMNS = {
    "codec": "fernet",
    "secret_params": '["api_key"]',
    "credentials_digest": "scrypt$c2FsdA$ZGlnZXN0",
    "overrides": '{"timeout": 3.0}',
    "forked_from": "op-0",
    "lookup_after": 1_800_000_000.5,
    "enqueued_at": 1_700_000_000.25,
    "first_send_at": 1_700_000_001.75,
}


def v3_journal(path: Path) -> None:
    """A version-3 journal as the previous idempotently left it."""
    v2_journal(path)
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN")
        for statement in _sqlite._split_statements(_sqlite._SCHEMA_V3):
            conn.execute(statement)
        conn.execute("PRAGMA user_version = 3")
        conn.execute("COMMIT")


def columns(path: Path, table: str) -> list[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]


def test_every_new_operation_field_is_a_journal_column() -> None:
    """The row type and both stores agree: each new field is a column of both schemas."""
    for name in NEW_COLUMNS:
        assert name in {field.name for field in Operation.__attrs_attrs__}
        assert f"ADD COLUMN {name} " in _sqlite._SCHEMA_V4
        assert f"ADD COLUMN {name} " in _postgres._MIGRATIONS[1]
    assert NEW_COLUMNS.keys() == _postgres._ADDED_IN_V2


def test_a_version_3_journal_is_upgraded_in_one_transaction_with_the_same_audits(
    tmp_path: Path,
) -> None:
    """Opened to write, a version-3 journal gets the new columns and tables, answers every
    audit as before, and its operations read the new fields as None."""
    path = tmp_path / "ops.db"
    v3_journal(path)
    with Journal(path, readonly=True) as backup:
        before = audit(backup)
    with Journal(path) as journal:
        after = audit(journal)
        shown = journal.operation("op-0")
    assert _sqlite.SCHEMA_VERSION == user_version(path)
    assert before == after
    assert set(NEW_COLUMNS) <= set(columns(path, "operations"))
    assert columns(path, "operation_audit")
    assert columns(path, "origin_pauses")
    assert shown is not None
    assert all(getattr(shown, name) is None for name in NEW_COLUMNS)


def test_a_version_3_backup_opened_read_only_is_read_and_left_as_it_is(tmp_path: Path) -> None:
    """A version-3 file opened read-only is read with its own columns and not modified."""
    path = tmp_path / "ops.db"
    v3_journal(path)
    stamp = os.stat(path).st_mtime_ns, path.read_bytes()
    with Journal(path, readonly=True) as backup:
        shown = backup.operation("op-0")
        listed = backup.operations()
    assert 3 == user_version(path)
    assert stamp == (os.stat(path).st_mtime_ns, path.read_bytes())
    assert shown is not None and shown.codec is None
    assert listed


def test_a_journal_missing_a_version_4_table_is_refused(tmp_path: Path) -> None:
    """A version-4 file whose audit table was dropped is damaged: say so, never half-read it."""
    path = tmp_path / "ops.db"
    Journal(path).close()
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("DROP TABLE operation_audit")
    with pytest.raises(Exception, match="missing journal tables"):
        Journal(path)


def test_the_new_columns_round_trip_on_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "ops.db"
    with Journal(path) as journal:
        insert(journal, new_operation())
        journal._conn.execute(
            "UPDATE operations SET "
            + ", ".join(f"{name} = ?" for name in NEW_COLUMNS)
            + " WHERE operation_id = 'op-1'",
            tuple(NEW_COLUMNS.values()),
        )
        shown = journal.operation("op-1")
        listed = journal.operations()
    assert shown is not None
    assert NEW_COLUMNS == {name: getattr(shown, name) for name in NEW_COLUMNS}
    assert NEW_COLUMNS == {name: getattr(listed[0], name) for name in NEW_COLUMNS}


def test_the_new_columns_round_trip_on_postgres(postgres_url: str) -> None:
    with Journal(postgres_url) as journal:
        insert(journal, new_operation())
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE idempotently.operations SET "
                + ", ".join(f"{name} = %s" for name in NEW_COLUMNS)
                + " WHERE operation_id = 'op-1'",
                tuple(NEW_COLUMNS.values()),
            )
        shown = journal.operation("op-1")
        listed = journal.operations()
    assert shown is not None
    assert NEW_COLUMNS == {name: getattr(shown, name) for name in NEW_COLUMNS}
    assert NEW_COLUMNS == {name: getattr(listed[0], name) for name in NEW_COLUMNS}


def _as_version_1(url: str) -> None:
    """Take a new PostgreSQL journal back to version 1, as the previous idempotently made it."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE idempotently.operation_audit, idempotently.origin_pauses")
        conn.execute("DROP INDEX idempotently.operations_forks")
        conn.execute(
            "ALTER TABLE idempotently.operations "
            + ", ".join(f"DROP COLUMN {name}" for name in [*NEW_COLUMNS, "body_digest"])
        )
        conn.execute(
            "UPDATE idempotently.journal_meta SET value = '1' WHERE name = 'schema_version'"
        )


def test_a_postgres_version_1_journal_is_read_only_read_and_upgraded_to_write(
    postgres_url: str,
) -> None:
    """Read-only, a version-1 PostgreSQL journal is read as it is (new fields None, nothing
    changed); opened to write, it is upgraded with its operations kept."""
    with Journal(postgres_url) as journal:
        insert(journal, new_operation())
    _as_version_1(postgres_url)
    with Journal(postgres_url, readonly=True) as backup:
        shown = backup.operation("op-1")
        listed = backup.operations()
    assert shown is not None and shown.codec is None and shown.first_send_at is None
    assert ["op-1"] == [op.operation_id for op in listed]
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT value FROM idempotently.journal_meta WHERE name = 'schema_version'"
        ).fetchone()
    assert row == ("1",)
    with Journal(postgres_url) as journal:
        upgraded = journal.operation("op-1")
    assert upgraded is not None and upgraded.operation_id == "op-1"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT value FROM idempotently.journal_meta WHERE name = 'schema_version'"
        ).fetchone()
    assert row == (str(_postgres.SCHEMA_VERSION),)


def test_a_column_a_later_version_adds_while_the_journal_is_open_is_ignored(
    tmp_path: Path,
) -> None:
    """A rolling upgrade: a newer idempotently adds a column to the open journal; this
    process still finds and lists its operations (it reads the columns it knows)."""
    path = tmp_path / "ops.db"
    with Journal(path) as journal:
        insert(journal, new_operation())
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("ALTER TABLE operations ADD COLUMN from_the_future TEXT")
            other.execute("UPDATE operations SET from_the_future = 'x'")
        shown = journal.operation("op-1")
        listed = journal.operations()
    assert shown is not None and shown.operation_id == "op-1"
    assert ["op-1"] == [op.operation_id for op in listed]
