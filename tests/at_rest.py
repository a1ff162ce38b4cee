"""What a journal holds at rest, read from the store itself (the file, or the database)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def stored_bytes(target: str) -> bytes:
    """Every byte of every operation and attempt row as the store keeps it: the SQLite file
    and its write-ahead log, or each PostgreSQL column's raw value."""
    if not target.startswith("postgresql://"):
        data = b""
        for suffix in ("", "-wal"):
            if os.path.exists(target + suffix):
                data += Path(target + suffix).read_bytes()
        return data
    import psycopg

    data = b""
    with psycopg.connect(target) as conn:
        for table in ("operations", "attempts"):
            for row in conn.execute(f"SELECT * FROM idempotently.{table}").fetchall():
                data += b"\0".join(_raw(value) for value in row)
    return data


def stored_column(target: str, operation_id: str, column: str) -> Any:
    """One column of one operation's row, as stored (bodies as bytes, encoded or not)."""
    if not target.startswith("postgresql://"):
        import sqlite3

        conn = sqlite3.connect(f"file:{target}?mode=ro", uri=True)
        try:
            row = conn.execute(
                f"SELECT {column} FROM operations WHERE operation_id = ?", (operation_id,)
            ).fetchone()
        finally:
            conn.close()
        return None if row is None else row[0]
    import psycopg

    with psycopg.connect(target) as conn:
        found = conn.execute(
            f"SELECT {column} FROM idempotently.operations WHERE operation_id = %s",
            (operation_id,),
        ).fetchone()
    value = None if found is None else found[0]
    return bytes(value) if isinstance(value, memoryview) else value


def _raw(value: object) -> bytes:
    if value is None:
        return b""
    if isinstance(value, (bytes, memoryview)):
        return bytes(value)
    return str(value).encode("utf-8")
