"""The commands the operation flow yields, and the store interface that runs them.

The flow (``_flow.py``) never touches a socket, a clock-driven sleep or the
journal: it yields one of these values and receives the result. Journal
commands run against a :class:`Store` (a :class:`~idempotently.Journal`, SQLite or PostgreSQL
today); the sync driver runs them inline, the async driver in a worker thread
so that no lock wait and no fsync ever blocks the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import httpx

from idempotently._vocabulary import Status

if TYPE_CHECKING:
    from idempotently._events import AsyncHook, Event
    from idempotently._journal import AttemptRecord, NewOperation, Operation


class Store(Protocol):
    """What the flow needs from a journal. Every method is one short transaction."""

    def _check_still_there(self) -> None: ...

    def _find(self, operation_id: str | None, key: str | None) -> Operation | None: ...

    def _insert_operation(self, new: NewOperation, *, owner: str, lease_until: float) -> bool: ...

    def _take_lease(
        self, operation: Operation, *, owner: str, lease_until: float, now: float
    ) -> bool: ...

    def _record_attempt(
        self, operation_id: str, record: AttemptRecord, *, now: float, owner: str | None = None
    ) -> None: ...

    def _set_status(
        self, operation_id: str, status: Status, *, reason: str | None, now: float
    ) -> bool: ...

    def _release_lease(self, operation_id: str, *, owner: str) -> None: ...

    def _settle(
        self,
        operation_id: str,
        status: Status,
        *,
        reason: str,
        now: float,
        response_status: int | None = None,
        response_headers: Sequence[tuple[str, str]] | None = None,
        response_body: bytes | None = None,
    ) -> bool: ...

    def _claim_due(
        self, *, owner: str, now: float, lease_until: float, limit: int
    ) -> list[Operation]:
        """Atomically lease up to ``limit`` pending operations that are due.

        Due: status 'pending' AND lease_until <= now AND coalesce(not_before, 0)
        <= now, oldest (created_at) first; sets lease_owner=owner,
        lease_until=lease_until, updated_at=now; returns them with their
        attempts (like _find). N workers never claim one operation twice.
        """
        ...

    def _extend_leases(self, leases: Sequence[tuple[str, str]], *, lease_until: float) -> int:
        """Heartbeat: for each (operation_id, owner) whose row is pending and still
        leased by owner, set lease_until = greatest(lease_until, given). Returns how
        many rows were extended. One short transaction."""
        ...

    def operations(
        self,
        *,
        status: Status | Sequence[Status] | None = None,
        since: float | None = None,
        limit: int | None = None,
        newest_first: bool = True,
    ) -> list[Operation]: ...


# -- journal commands ---------------------------------------------------------------------


@attrs.frozen
class Find:
    """The operation with this id (else this key), with its attempts; or None."""

    operation_id: str | None
    key: str | None

    def run(self, store: Store) -> Operation | None:
        return store._find(self.operation_id, self.key)


@attrs.frozen
class Insert:
    """Make the new operation's key durable (before its first byte is sent); False if taken."""

    new: NewOperation
    owner: str
    lease_until: float

    def run(self, store: Store) -> bool:
        return store._insert_operation(self.new, owner=self.owner, lease_until=self.lease_until)


@attrs.frozen
class TakeLease:
    """Compare-and-swap the lease read in ``operation``; True for the one winner."""

    operation: Operation
    owner: str
    lease_until: float
    now: float

    def run(self, store: Store) -> bool:
        store._check_still_there()
        return store._take_lease(
            self.operation, owner=self.owner, lease_until=self.lease_until, now=self.now
        )


@attrs.frozen
class Record:
    """One attempt and the operation's state after it, in one transaction."""

    operation_id: str
    record: AttemptRecord
    now: float
    owner: str | None = None
    """The lease holder writing it: its new state applies only while it holds the lease."""

    def run(self, store: Store) -> None:
        store._record_attempt(self.operation_id, self.record, now=self.now, owner=self.owner)


@attrs.frozen
class SetStatus:
    """Move a pending operation to ``status`` without an attempt (releases any lease)."""

    operation_id: str
    status: Status
    reason: str
    now: float

    def run(self, store: Store) -> bool:
        return store._set_status(self.operation_id, self.status, reason=self.reason, now=self.now)


@attrs.frozen
class Release:
    """Give up a lease this caller holds (a call cancelled or crashed mid-flight)."""

    operation_id: str
    owner: str

    def run(self, store: Store) -> None:
        store._release_lease(self.operation_id, owner=self.owner)


@attrs.frozen
class Settle:
    """Record a reconciler's verdict on a needs_reconcile operation."""

    operation_id: str
    status: Status
    reason: str
    now: float
    response_status: int | None
    response_headers: Sequence[tuple[str, str]] | None
    response_body: bytes | None

    def run(self, store: Store) -> bool:
        return store._settle(
            self.operation_id,
            self.status,
            reason=self.reason,
            now=self.now,
            response_status=self.response_status,
            response_headers=self.response_headers,
            response_body=self.response_body,
        )


@attrs.frozen
class Queue:
    """Operations with these statuses, oldest first (what resume works through)."""

    statuses: tuple[Status, ...]

    def run(self, store: Store) -> list[Operation]:
        return store.operations(status=list(self.statuses), newest_first=False)


JournalCommand = Find | Insert | TakeLease | Record | SetStatus | Release | Settle | Queue

# -- commands for the driver ------------------------------------------------------------------


@attrs.frozen
class Lease:
    """A lease a sender holds, and how to renew it: until ``clock() + duration``."""

    operation_id: str
    owner: str
    duration: float
    clock: Callable[[], float] = attrs.field(eq=False, repr=False)


@attrs.frozen
class Send:
    """Send one attempt; the reply is the response (body read) or the error that ended it."""

    request: httpx.Request
    lease: Lease | None = None
    """The lease held while it is in flight: the driver's heartbeat keeps it alive."""


@attrs.frozen
class Sleep:
    """Wait this many seconds before the next step."""

    seconds: float


@attrs.frozen
class Reconcile:
    """Ask the user's reconciler about a needs_reconcile operation; reply: its Settlement."""

    operation: Operation


@attrs.frozen
class Report:
    """One operation's resume result, as soon as it is known; reply: None."""

    result: Any


@attrs.frozen
class Emit:
    """Call the session's hooks with this event (yielded only when it has hooks); reply:
    None. A hook that raises is logged, never ends the call."""

    event: Event
    hooks: tuple[AsyncHook, ...]


Command = JournalCommand | Send | Sleep | Reconcile | Report | Emit
