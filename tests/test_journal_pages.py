"""What a call writes: the common call's key and answer cost few WAL pages (every page is
written, and with "fsync" flushed, on the hot path)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

import idempotently
from idempotently import Journal


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


@pytest.mark.parametrize("durability", ["os", "fsync"])
def test_a_call_writes_at_most_nine_wal_pages(tmp_path: Path, durability: str) -> None:
    """A named call's key (the row, its two unique indexes, operations_pending) and its
    answer (the row with its first attempt, both partial indexes, the counts row) cost at
    most 9 WAL pages (8.4 measured; the development schema 5 wrote 9.6 by this count)."""
    assert wal_pages_per_operation(tmp_path / "journal.db", durability) <= 9
