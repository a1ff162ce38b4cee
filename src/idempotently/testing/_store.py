"""Leach's `idempotency_key` table and the statements that move a key between states.

```
in_progress ──success──> completed  (replay stored)
     │
     └────── failure ──> failed     (a retry may run again)
```
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any, Literal

import attrs

from idempotently.testing._database import Database

KeyStatus = Literal["in_progress", "completed", "failed"]


@attrs.frozen
class IdempotencyRecord:
    """One row of `idempotency_key`."""

    user_id: str
    """Whose key it is."""
    key: str
    """The idempotency key."""
    request_hash: str
    """A digest of the first request's payload; a different one is a mismatch."""
    status: KeyStatus
    """`in_progress`, `completed` or `failed`."""
    response_code: int | None
    """The stored response's status, or None while in progress."""
    response_body: str | None
    """The stored response's body, or None while in progress."""
    locked_at: float
    """When the request doing the work claimed it (stale after `stale_after`)."""
    expires_at: float
    """When the sweeper may delete it."""

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> IdempotencyRecord:
        return cls(**{name: row[name] for name in row.keys()})  # noqa: SIM118


@attrs.frozen
class StoredCharge:
    """What the API records beside the completed key, in the same transaction."""

    id: str
    amount: int
    currency: str
    customer: str
    metadata: dict[str, str]
    created: int


class KeyStore:
    """The idempotency keys of one mock server."""

    def __init__(self, database: Database) -> None:
        self._db = database

    def claim(self, user_id: str, key: str, request_hash: str, *, now: float, ttl: float) -> bool:
        """Create the key `in_progress`; True only for the one caller whose insert made the row.

        One statement decides ownership: no SELECT before it, so there is no
        window in which two first requests both see an empty table.
        """
        row = self._db.fetch_one(
            """
            INSERT INTO idempotency_key
                (user_id, key, request_hash, status, locked_at, expires_at)
            VALUES (?, ?, ?, 'in_progress', ?, ?)
            ON CONFLICT (user_id, key) DO NOTHING
            RETURNING key
            """,
            (user_id, key, request_hash, now, now + ttl),
        )
        return row is not None

    def insert_naively(
        self, user_id: str, key: str, request_hash: str, *, now: float, ttl: float
    ) -> None:
        """The INSERT of the naive SELECT-then-INSERT; raises `sqlite3.IntegrityError` on a race."""
        self._db.execute(
            """
            INSERT INTO idempotency_key
                (user_id, key, request_hash, status, locked_at, expires_at)
            VALUES (?, ?, ?, 'in_progress', ?, ?)
            """,
            (user_id, key, request_hash, now, now + ttl),
        )

    def get(self, user_id: str, key: str) -> IdempotencyRecord | None:
        row = self._db.fetch_one(
            "SELECT * FROM idempotency_key WHERE user_id = ? AND key = ?", (user_id, key)
        )
        return None if row is None else IdempotencyRecord.from_row(row)

    def take_over(self, record: IdempotencyRecord, *, now: float) -> bool:
        """Re-lock a stale `in_progress` (or a `failed`) key; only one caller wins.

        `locked_at = <the value we read>` is the compare-and-swap: once a
        caller has re-locked the row, every other caller's update matches nothing.
        """
        row = self._db.fetch_one(
            """
            UPDATE idempotency_key
            SET status = 'in_progress', locked_at = ?, response_code = NULL, response_body = NULL
            WHERE user_id = ? AND key = ? AND status = ? AND locked_at = ?
            RETURNING key
            """,
            (now, record.user_id, record.key, record.status, record.locked_at),
        )
        return row is not None

    def complete(
        self,
        user_id: str,
        key: str,
        *,
        locked_at: float,
        response_code: int,
        response_body: str,
        charge: StoredCharge | None,
        now: float,
    ) -> bool:
        """Store the response, the charge row and its outbox event in one transaction.

        Returns False (and writes nothing) if another request took the lock
        over meanwhile: that request now owns the key and will commit.
        """
        with self._db.transaction() as db:
            changed = db.execute(
                """
                UPDATE idempotency_key
                SET status = 'completed', response_code = ?, response_body = ?
                WHERE user_id = ? AND key = ? AND status = 'in_progress' AND locked_at = ?
                """,
                (response_code, response_body, user_id, key, locked_at),
            )
            if not changed:
                return False
            if charge is not None:
                db.execute(
                    """
                    INSERT INTO charges
                        (id, user_id, idempotency_key, amount, currency, customer,
                         metadata, created)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?)
                    ON CONFLICT (id) DO NOTHING
                    """,
                    (
                        charge.id,
                        user_id,
                        key,
                        charge.amount,
                        charge.currency,
                        charge.customer,
                        json.dumps(charge.metadata, sort_keys=True),
                        charge.created,
                    ),
                )
                db.execute(
                    """
                    INSERT INTO outbox (event_type, charge_id, payload, created)
                    VALUES ('charge.created', ?, ?, ?)
                    """,
                    (charge.id, response_body, now),
                )
            return True

    def fail(
        self, user_id: str, key: str, *, locked_at: float, response_code: int, response_body: str
    ) -> bool:
        """Mark the key `failed`: the response is kept for inspection, never replayed."""
        changed = self._db.execute(
            """
            UPDATE idempotency_key
            SET status = 'failed', response_code = ?, response_body = ?
            WHERE user_id = ? AND key = ? AND status = 'in_progress' AND locked_at = ?
            """,
            (response_code, response_body, user_id, key, locked_at),
        )
        return changed > 0

    def sweep(self, *, now: float) -> int:
        """Leach's retention statement; returns how many keys it deleted."""
        return self._db.execute("DELETE FROM idempotency_key WHERE expires_at < ?", (now,))

    def records(self, user_id: str | None = None) -> list[IdempotencyRecord]:
        if user_id is None:
            rows = self._db.fetch_all("SELECT * FROM idempotency_key ORDER BY user_id, key")
        else:
            rows = self._db.fetch_all(
                "SELECT * FROM idempotency_key WHERE user_id = ? ORDER BY key", (user_id,)
            )
        return [IdempotencyRecord.from_row(row) for row in rows]

    def count_stuck(self, *, now: float, stale_after: float) -> int:
        """`in_progress` keys older than `stale_after`: the operations currently stuck."""
        row = self._db.fetch_one(
            "SELECT count(*) FROM idempotency_key"
            " WHERE status = 'in_progress' AND locked_at + ? <= ?",
            (stale_after, now),
        )
        return int(row[0]) if row is not None else 0

    def count_by_status(self) -> dict[str, int]:
        rows = self._db.fetch_all(
            "SELECT status, count(*) AS n FROM idempotency_key GROUP BY status"
        )
        counts = {"in_progress": 0, "completed": 0, "failed": 0}
        counts.update({row["status"]: row["n"] for row in rows})
        return counts

    def recorded_charges(self) -> list[dict[str, Any]]:
        """The API's own `charges` rows (committed with their keys)."""
        rows = self._db.fetch_all("SELECT * FROM charges ORDER BY created, id")
        return [{**dict(row), "metadata": json.loads(row["metadata"])} for row in rows]

    def outbox(self) -> list[dict[str, Any]]:
        rows = self._db.fetch_all("SELECT * FROM outbox ORDER BY id")
        return [dict(row) for row in rows]
