"""The fake payment provider behind the API, and the ledger of money it moved.

The provider is idempotent on its own key, as real ones are: the API passes
`f"{key}:charge"`, so a retry that re-runs the side effect after a crash gets
the charge already made instead of a second one. The ledger is therefore the
ground truth a test asserts exactly-once against.
"""

from __future__ import annotations

import collections
import json
import secrets
import sqlite3
from typing import Any

import attrs

from idempotently.testing._database import Database

PROVIDER_KEY_SUFFIX = ":charge"


def provider_key_for(key: str) -> str:
    """The provider idempotency key derived from the API's key (Leach's `f"{key}:charge"`)."""
    return f"{key}{PROVIDER_KEY_SUFFIX}"


@attrs.frozen
class Charge:
    """A charge the provider made: money that moved."""

    id: str
    """The charge's id (`ch_…`)."""
    user: str
    """Whose charge it is (the bearer token's user)."""
    key: str
    """The idempotency key of the request that made it."""
    amount: int
    """The amount, in the currency's smallest unit."""
    currency: str
    """The three-letter currency code."""
    customer: str
    """The customer charged."""
    metadata: dict[str, str]
    """The request's metadata (string values), e.g. `order_id`."""
    created: int
    """When it was made (seconds since the epoch, by the server's clock)."""

    @property
    def order_id(self) -> str | None:
        return self.metadata.get("order_id")

    def to_json(self) -> dict[str, Any]:
        """The API's rendering of the charge."""
        return {
            "id": self.id,
            "object": "charge",
            "amount": self.amount,
            "currency": self.currency,
            "customer": self.customer,
            "metadata": self.metadata,
            "created": self.created,
        }

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Charge:
        provider_key: str = row["provider_key"]
        return cls(
            id=row["id"],
            user=row["account"],
            key=provider_key.removesuffix(PROVIDER_KEY_SUFFIX),
            amount=row["amount"],
            currency=row["currency"],
            customer=row["customer"],
            metadata=json.loads(row["metadata"]),
            created=row["created"],
        )


class FakeProvider:
    """Makes charges, at most one per (account, provider key) while the key lives."""

    def __init__(self, database: Database) -> None:
        self._db = database

    def charge(
        self,
        *,
        account: str,
        provider_key: str,
        amount: int,
        currency: str,
        customer: str,
        metadata: dict[str, str],
        now: float,
        ttl: float,
    ) -> Charge:
        # Its own transaction: the provider commits whether or not the API
        # later commits, which is what makes a crash in between interesting.
        with self._db.transaction() as db:
            db.execute(
                "DELETE FROM provider_keys"
                " WHERE account = ? AND provider_key = ? AND expires_at < ?",
                (account, provider_key, now),
            )
            known = db.fetch_one(
                """
                SELECT provider_charges.* FROM provider_keys
                JOIN provider_charges ON provider_charges.id = provider_keys.charge_id
                WHERE provider_keys.account = ? AND provider_keys.provider_key = ?
                """,
                (account, provider_key),
            )
            if known is not None:
                return Charge.from_row(known)
            charge_id = "ch_" + secrets.token_hex(12)
            db.execute(
                """
                INSERT INTO provider_charges
                    (id, account, provider_key, amount, currency, customer, metadata,
                     order_id, created)
                VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
                """,
                (
                    charge_id,
                    account,
                    provider_key,
                    amount,
                    currency,
                    customer,
                    json.dumps(metadata, sort_keys=True),
                    metadata.get("order_id"),
                    int(now),
                ),
            )
            db.execute(
                "INSERT INTO provider_keys (account, provider_key, charge_id, expires_at) "
                "VALUES (?, ?, ?, ?)",
                (account, provider_key, charge_id, now + ttl),
            )
        row = self._db.fetch_one("SELECT * FROM provider_charges WHERE id = ?", (charge_id,))
        assert row is not None
        return Charge.from_row(row)

    def sweep(self, *, now: float) -> int:
        return self._db.execute("DELETE FROM provider_keys WHERE expires_at < ?", (now,))


class Ledger:
    """Read-only view of every charge the provider made, to assert exactly-once."""

    def __init__(self, database: Database) -> None:
        self._db = database

    def charges(self, user: str | None = None, *, order_id: str | None = None) -> list[Charge]:
        """Charges in the order they were made, optionally for one user and/or one order id."""
        clauses, parameters = [], []
        if user is not None:
            clauses.append("account = ?")
            parameters.append(user)
        if order_id is not None:
            clauses.append("order_id = ?")
            parameters.append(order_id)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._db.fetch_all(
            f"SELECT * FROM provider_charges {where} ORDER BY rowid",
            parameters,
        )
        return [Charge.from_row(row) for row in rows]

    def count_by_key(self) -> dict[tuple[str, str], int]:
        """Charges per (user, idempotency key)."""
        return dict(collections.Counter((c.user, c.key) for c in self.charges()))

    def count_by_order(self) -> dict[tuple[str, str], int]:
        """Charges per (user, `metadata.order_id`), for charges that carry one."""
        return dict(collections.Counter((c.user, c.order_id) for c in self.charges() if c.order_id))

    def duplicates(self) -> dict[tuple[str, str], int]:
        """Orders charged more than once: empty when exactly-once held."""
        return {order: n for order, n in self.count_by_order().items() if n > 1}

    def __len__(self) -> int:
        row = self._db.fetch_one("SELECT count(*) FROM provider_charges")
        return int(row[0]) if row is not None else 0
