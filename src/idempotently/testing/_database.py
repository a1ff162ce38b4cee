"""One SQLite database shared by the request handlers and the test thread.

A single connection behind a lock: the server's event loop and the test that
inspects the ledger run on different threads, and the point of the mock is
correctness, not throughput. Statements run in autocommit mode; multi-statement
writes take `BEGIN IMMEDIATE` so they are one transaction.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS idempotency_key (
    user_id       TEXT    NOT NULL,
    key           TEXT    NOT NULL,
    request_hash  TEXT    NOT NULL,
    status        TEXT    NOT NULL
        CHECK (status IN ('in_progress', 'completed', 'failed')),
    response_code INTEGER,
    response_body TEXT,
    locked_at     REAL    NOT NULL,
    expires_at    REAL    NOT NULL,
    PRIMARY KEY (user_id, key)
);
CREATE INDEX IF NOT EXISTS idempotency_key_expires_at ON idempotency_key (expires_at);

CREATE TABLE IF NOT EXISTS charges (
    id              TEXT    PRIMARY KEY,
    user_id         TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL,
    amount          INTEGER NOT NULL,
    currency        TEXT    NOT NULL,
    customer        TEXT    NOT NULL,
    metadata        TEXT    NOT NULL,
    created         INTEGER NOT NULL
);

CREATE TABLE IF NOT EXISTS outbox (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    event_type TEXT    NOT NULL,
    charge_id  TEXT    NOT NULL,
    payload    TEXT    NOT NULL,
    created    REAL    NOT NULL
);

-- The fake payment provider: a separate system that happens to share the file.
-- provider_charges is money that moved (never deleted); provider_keys is the
-- provider's own idempotency window, which expires like ours.
CREATE TABLE IF NOT EXISTS provider_charges (
    id           TEXT    PRIMARY KEY,
    account      TEXT    NOT NULL,
    provider_key TEXT    NOT NULL,
    amount       INTEGER NOT NULL,
    currency     TEXT    NOT NULL,
    customer     TEXT    NOT NULL,
    metadata     TEXT    NOT NULL,
    order_id     TEXT,
    created      INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS provider_charges_order ON provider_charges (account, order_id);

CREATE TABLE IF NOT EXISTS provider_keys (
    account      TEXT NOT NULL,
    provider_key TEXT NOT NULL,
    charge_id    TEXT NOT NULL,
    expires_at   REAL NOT NULL,
    PRIMARY KEY (account, provider_key)
);
"""


class Database:
    """The mock server's SQLite file (or `:memory:`)."""

    def __init__(self, path: str | os.PathLike[str] = ":memory:") -> None:
        self.path = os.fspath(path)
        self._lock = threading.RLock()
        self._connection = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None, timeout=5.0
        )
        self._connection.row_factory = sqlite3.Row
        if self.path != ":memory:":
            self._connection.execute("PRAGMA journal_mode=WAL")
            self._connection.execute("PRAGMA synchronous=NORMAL")
        self._connection.executescript(_SCHEMA)

    def fetch_one(self, sql: str, parameters: Sequence[Any] = ()) -> sqlite3.Row | None:
        with self._lock:
            row: sqlite3.Row | None = self._connection.execute(sql, parameters).fetchone()
            return row

    def fetch_all(self, sql: str, parameters: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return list(self._connection.execute(sql, parameters).fetchall())

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> int:
        """Run one statement and return the number of rows it changed."""
        with self._lock:
            return self._connection.execute(sql, parameters).rowcount

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Database]:
        """Hold the lock and one `BEGIN IMMEDIATE … COMMIT` around the block."""
        with self._lock:
            self._connection.execute("BEGIN IMMEDIATE")
            try:
                yield self
            except BaseException:
                self._connection.execute("ROLLBACK")
                raise
            self._connection.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._connection.close()
