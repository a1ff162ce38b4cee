"""Schema version 3: fewer WAL pages per operation, the same audits, and version-2
journals upgraded in one transaction (or read as they are, from a backup)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import httpx
import pytest

import idempotently
from idempotently import Journal
from idempotently._journal import _sqlite
from tests.test_journal_v2 import DAY, NOW, user_version, v1_journal


def v2_journal(path: Path) -> None:
    """A version-2 journal as the previous idempotently left it (from a version-1 one)."""
    v1_journal(path)
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN")
        for statement in _sqlite._split_statements(_sqlite._SCHEMA_V2):
            conn.execute(statement)
        conn.execute(_sqlite._RECOUNT)
        conn.execute("INSERT INTO journal_meta VALUES ('namespace', ?)", (str(NAMESPACE),))
        conn.execute("PRAGMA user_version = 2")
        conn.execute("COMMIT")


NAMESPACE = "8d6e3a56-2a1c-4a0f-9a57-6a3f1f9b0c11"


def audit(journal: Journal) -> tuple[object, ...]:
    """What an operator sees: counts, a stats figure, listings by status, a prune dry run."""
    return (
        journal.counts(),
        journal.stats(now=NOW + DAY).stuck,
        {
            status: sorted(op.operation_id for op in journal.operations(status=status))
            for status in ("pending", "succeeded", "failed", "needs_reconcile", "abandoned")
        },
        journal.prune(older_than=0, now=NOW + 10 * DAY, dry_run=True),
    )


def test_a_version_2_journal_is_upgraded_in_one_transaction_with_the_same_audits(
    tmp_path: Path,
) -> None:
    """Opened to write, a version-2 journal becomes current: operations_by_status and
    operations_finished give way to operations_settled, pending operations leave the
    counters, and every audit answers as before; its namespace is kept."""
    path = tmp_path / "ops.db"
    v2_journal(path)
    with Journal(path, readonly=True) as backup:
        before = audit(backup)
    with Journal(path) as journal:
        after = audit(journal)
        names = {row[0] for row in journal._conn.execute("SELECT name FROM sqlite_master")}
        pending_counter = journal._conn.execute("SELECT pending FROM journal_counts").fetchone()
        namespace = str(journal.namespace)
    assert _sqlite.SCHEMA_VERSION == user_version(path)
    assert before == after
    assert {"operations_settled", "operations_pending"} <= names
    assert not {"operations_by_status", "operations_finished"} & names
    assert (0,) == pending_counter
    assert NAMESPACE == namespace


def test_a_version_2_backup_opened_read_only_is_read_and_left_as_it_is(tmp_path: Path) -> None:
    """A version-2 file opened read-only (a backup restored to look at) answers every
    audit from its own indexes and is not modified."""
    path = tmp_path / "ops.db"
    v2_journal(path)
    stamp = os.stat(path).st_mtime_ns, path.read_bytes()
    with Journal(path, readonly=True) as backup:
        counts, _, listed, prunable = audit(backup)
        shown = backup.operation("op-0")
    assert 2 == user_version(path)
    assert stamp == (os.stat(path).st_mtime_ns, path.read_bytes())
    assert sum(counts.values()) == sum(len(ids) for ids in listed.values())  # type: ignore[attr-defined]
    assert shown is not None
    assert isinstance(prunable, int)


def test_a_failed_upgrade_leaves_the_version_2_journal_as_it_was(tmp_path: Path) -> None:
    """The upgrade is one transaction: if it cannot finish (here the disk fills up at its
    last step), the open fails with a JournalWriteError and the file is still a readable
    version-2 journal with all its operations."""
    path = tmp_path / "ops.db"
    v2_journal(path)
    real_upgrade = _sqlite.SqliteStore._upgrade

    def full_at_the_end(store: _sqlite.SqliteStore, version: int) -> None:
        real_upgrade(store, version)
        raise sqlite3.OperationalError("database or disk is full")

    _sqlite.SqliteStore._upgrade = full_at_the_end  # type: ignore[method-assign]
    try:
        with pytest.raises(idempotently.JournalWriteError, match="disk is full"):
            Journal(path)
    finally:
        _sqlite.SqliteStore._upgrade = real_upgrade  # type: ignore[method-assign]
    assert 2 == user_version(path)
    with Journal(path, readonly=True) as backup:
        assert len(backup.operations()) == sum(backup.counts().values())


def wal_pages_per_operation(path: Path, durability: str, count: int = 200) -> float:
    """WAL frames written per named Session.post answered 201 (checkpoints kept off)."""
    journal = Journal(path, durability=durability)  # type: ignore[arg-type]
    conn = journal._conn
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    transport = httpx.MockTransport(lambda request: httpx.Response(201, json={"id": "ch_1"}))
    charge = {"amount": 1000, "currency": "usd", "customer": "cus_42"}
    with idempotently.Session(journal, transport=transport) as session:
        for n in range(20):
            session.post("https://api.test/v1/charges", json=charge, operation_id=f"warm-{n}")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        for n in range(count):
            session.post("https://api.test/v1/charges", json=charge, operation_id=f"o-{n}")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        frames = (os.path.getsize(f"{path}-wal") - 32) / (page_size + 24)
    return frames / count


def test_a_call_writes_fewer_pages_than_version_2_did(tmp_path: Path) -> None:
    """A named call's key and answer cost at most 11 WAL pages in both durabilities
    (version 2: 13.4); each page is written and, with "fsync", flushed on the hot path."""
    assert wal_pages_per_operation(tmp_path / "os.db", "os") <= 11
    assert wal_pages_per_operation(tmp_path / "fsync.db", "fsync") <= 11
