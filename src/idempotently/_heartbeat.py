"""Heartbeats: a live sender's lease never expires while its attempt is in flight.

Each lease is written with ``lease_until = now + lease_duration``. An attempt can
take longer than that (a slow server, a long timeout); without a heartbeat
another process, on this host or another, would find the lease expired and send
the operation a second time. While a driver sends, or a resume worker holds
operations it claimed, their leases are registered here, in the journal's one
`Writer` (``_journal/_writer.py``): its thread extends them every
``lease_duration / 3`` (one write for all of them, joining whatever batch the
writer commits), each time writing the row's ``updated_at`` with the same clock:
the lease's write time, from which a host whose clock is behind ours counts it
(`_commands.RebaseOperation`). A heartbeat that fails (the journal is locked or
gone) is logged and tried again; it never breaks a call: at worst the lease
expires, as it would have without a heartbeat.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from idempotently._commands import ExtendLeases, Lease
from idempotently._rows import Failed

if TYPE_CHECKING:
    import threading

logger = logging.getLogger("idempotently")

MIN_INTERVAL = 0.05
"""The shortest wait between two heartbeats of one journal (very short test leases)."""


class _Writer(Protocol):
    """What a heartbeat needs of the journal's writer (``_journal/_writer.py``)."""

    _lock: threading.Lock

    def wake_for(self, due: float) -> None: ...

    def write_many(self, writes: Sequence[Any]) -> list[Any]: ...


@attrs.define
class _Entry:
    lease: Lease
    holders: int
    due: float
    """time.monotonic() when it is next extended."""


class Heartbeat:
    """The leases of one journal kept alive by its writer's thread."""

    def __init__(self, writer: _Writer) -> None:
        self._writer = writer
        self._entries: dict[tuple[str, str], _Entry] = {}

    def add(self, lease: Lease) -> None:
        """Keep ``lease`` alive until as many `remove` calls as ``add`` calls."""
        key = (lease.operation_id, lease.owner)
        with self._writer._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.holders += 1
                return
            due = time.monotonic() + _interval(lease)
            self._entries[key] = _Entry(lease, 1, due)
            self._writer.wake_for(due)

    def remove(self, lease: Lease) -> None:
        key = (lease.operation_id, lease.owner)
        with self._writer._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.holders -= 1
            if entry.holders <= 0:
                # The thread finds out at its next wake-up; nothing is extended meanwhile
                # that is not registered then.
                del self._entries[key]

    def holding(self, lease: Lease | None) -> _Holding:
        """Keep ``lease`` alive while the block runs (nothing for None)."""
        return _Holding(self, lease)

    def leases(self) -> list[Lease]:
        """The leases kept alive now."""
        with self._writer._lock:
            return [entry.lease for entry in self._entries.values()]

    def next_due(self) -> float:
        """time.monotonic() when the next lease is due (inf: none); under the writer's lock."""
        return min((entry.due for entry in self._entries.values()), default=math.inf)

    def beat(self, *, all_leases: bool = True) -> int:
        """Extend the registered leases now (only those due, unless ``all_leases``);
        how many rows were extended. Never raises: a failure is logged."""
        now = time.monotonic()
        with self._writer._lock:
            due = [entry for entry in self._entries.values() if all_leases or entry.due <= now]
            for entry in due:
                entry.due = now + _interval(entry.lease)
        if not due:
            return 0
        groups: dict[tuple[float, float], list[tuple[str, str]]] = {}
        try:
            for entry in due:
                lease = entry.lease
                now = lease.clock()
                groups.setdefault((now + lease.duration, now), []).append(
                    (lease.operation_id, lease.owner)
                )
            # Writes like any other: one batch of the journal's one writer.
            outcomes = self._writer.write_many(
                [ExtendLeases(tuple(pairs), until, now) for (until, now), pairs in groups.items()]
            )
            failed = next((each.error for each in outcomes if isinstance(each, Failed)), None)
            if failed is not None:
                raise failed
            return sum(int(each) for each in outcomes)
        except Exception as error:  # any failure: the lease may expire, the call goes on
            logger.warning(
                "heartbeat: could not extend %d lease(s) (%s: %s); they expire unless a "
                "later heartbeat succeeds",
                len(due),
                type(error).__name__,
                error,
                extra={"idempotently": {"event": "heartbeat_failed", "leases": len(due)}},
            )
            return 0

    def after_fork(self) -> None:
        """A child keeps alive none of its parent's leases."""
        self._entries = {}


class _Holding:
    """``with heartbeat.holding(lease):`` (a plain class: it runs around every send, and
    a ``@contextmanager`` generator costs several times more)."""

    __slots__ = ("_heartbeat", "_lease")

    def __init__(self, heartbeat: Heartbeat, lease: Lease | None) -> None:
        self._heartbeat = heartbeat
        self._lease = lease

    def __enter__(self) -> None:
        if self._lease is not None:
            self._heartbeat.add(self._lease)

    def __exit__(self, *exc_info: object) -> None:
        if self._lease is not None:
            self._heartbeat.remove(self._lease)


def _interval(lease: Lease) -> float:
    return max(MIN_INTERVAL, lease.duration / 3)
