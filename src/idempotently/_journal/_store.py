"""The interface every journal store implements: SQLite and PostgreSQL, side by side.

A store owns the storage (a file, a connection pool) and nothing else: it
neither queues nor batches. The journal's one writer (``_writer.py``) hands it
batches of writes (`Store.commit`); reads go to it directly. The row
types it reads and writes (``idempotently._rows``) belong to no store.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from idempotently._rows import (
    Durability,
    NewOperation,
    Operation,
    OriginPause,
)
from idempotently._vocabulary import Status

if TYPE_CHECKING:
    from idempotently._commands_rare import Write
    from idempotently._rows_audit import AuditEntry, JournalStats


class Store(Protocol):
    """One journal's storage. Every method is safe to call from several threads."""

    path: str
    """What messages show: the file's path, or the URL with its password as ``***``."""
    durability: Durability
    readonly: bool

    @property
    def namespace(self) -> uuid.UUID:
        """The journal's own random namespace: named operations' keys derive from it."""
        ...

    @property
    def schema_version(self) -> int:
        """The version of the journal's tables (0: none yet, an application's SQLite file
        that `idempotently migrate` has not adopted)."""
        ...

    def check_identity(self) -> None:
        """Raise JournalMovedError unless the journal is still the one opened (a file
        deleted or replaced under its path); nothing for a database."""
        ...

    def commit(self, writes: Sequence[Write], durable: bool) -> list[Any]:
        """Run ``writes`` in one transaction (durable: flushed before it returns); each
        write's result, or a ``Failed`` for one that failed alone (the others commit).
        Raises if the transaction itself fails: then none was written."""
        ...

    def enqueue_on(self, connection: object, new: NewOperation) -> bool:
        """Insert ``new``, enqueued, on the application's own ``connection`` inside its
        transaction (no commit); False if its id or key is taken. A connection that is
        not the journal's database, closed, or in autocommit is a clear error."""
        ...

    def find_on(
        self, connection: object, operation_id: str | None, key: str | None
    ) -> Operation | None:
        """`find`, read on the application's ``connection``."""
        ...

    async def aenqueue_on(self, connection: object, new: NewOperation) -> bool:
        """`enqueue_on` for an async session (an async connection where the database
        driver has one)."""
        ...

    async def afind_on(
        self, connection: object, operation_id: str | None, key: str | None
    ) -> Operation | None:
        """`find_on` for an async session."""
        ...

    def find(self, operation_id: str | None, key: str | None) -> Operation | None:
        """The operation with this id, else the one with this key, with its attempts."""
        ...

    def operation(self, operation_id_or_key: str, *, damaged: bool = False) -> Operation | None:
        """One operation with all its attempts, by operation id or by key. ``damaged``:
        a row that cannot be decoded is its stand-in (`Operation.damaged`), not an error
        (for an operator's settle or abandon)."""
        ...

    def operations(
        self,
        *,
        status: Status | Sequence[Status] | None = None,
        since: float | None = None,
        limit: int | None = None,
        newest_first: bool = True,
    ) -> list[Operation]:
        """Operations (without their attempts), filtered by status and age."""
        ...

    def group(self, group_id: str) -> list[Operation]:
        """The steps of a group (without their attempts), in their order: by ``step``,
        a fork after the step it replaces. A row that cannot be decoded is its stand-in."""
        ...

    def queue(self, statuses: Sequence[Status]) -> list[Operation]:
        """What resume works through: the operations with these statuses, oldest first,
        each with its attempts (a row that cannot be decoded is its damaged stand-in).
        Resume sends from these rows as read, without reading each again: its lease's
        compare-and-swap (`TakeLease`) fails on a row changed since."""
        ...

    def audit(self, operation_id: str) -> list[AuditEntry]:
        """The operation's audit entries, oldest first (none in a journal from before
        audit trails, opened read-only)."""
        ...

    def stats(
        self, *, now: float, stuck_after: float = 60.0, expiring_within: float | None = None
    ) -> JournalStats:
        """Counts, rates and the stuck count."""
        ...

    def counts(self) -> dict[str, int]:
        """Operations per status; every status is present, zero included."""
        ...

    def recount(self) -> None:
        """Count the operations and attempts again from the rows, in one transaction
        (`idempotently migrate --recount`: the counts follow the journal's own writes)."""
        ...

    def origin_pauses(self, *, now: float) -> list[OriginPause]:
        """The origin pauses still running at ``now`` and the circuit breakers' not yet
        closed, soonest over first (none in a journal from before they were kept)."""
        ...

    def prune(self, *, older_than: float, now: float, dry_run: bool = False) -> int:
        """Delete finished operations idle for ``older_than`` seconds, in short batches."""
        ...

    def after_fork(self) -> None:
        """In a forked child: drop the locks the parent may have held at fork."""
        ...

    def close(self) -> None:
        """Release the file or the pool; later use raises JournalError."""
        ...
