"""Heartbeats: a live sender's lease never expires while its attempt is in flight.

Each lease is written with ``lease_until = now + lease_duration``. An attempt can
take longer than that (a slow server, a long timeout); without a heartbeat
another process, on this host or another, would find the lease expired and send
the operation a second time. While a driver sends, or a resume worker holds
operations it claimed, their leases are registered here: one daemon thread per
store extends them every ``lease_duration / 3`` (one short transaction for all
of them), each time writing the row's ``updated_at`` with the same clock: the
lease's write time, from which a host whose clock is behind ours counts it
(`_commands.RebaseOperation`). The thread stops once nothing has been registered
for ``IDLE_LINGER`` seconds: starting a thread costs about a millisecond (the
caller waits for it to run), as much as the rest of a call's journal work, so
back-to-back calls reuse one thread instead of starting one each. A heartbeat that fails
(the journal is locked or gone) is logged and tried again; it never breaks a call:
at worst the lease expires, as it would have without a heartbeat.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING

import attrs

from idempotently._commands import ExtendLeases, Lease

if TYPE_CHECKING:
    from idempotently._journal import Journal

logger = logging.getLogger("idempotently")

MIN_INTERVAL = 0.05
"""The shortest wait between two heartbeats of one store (very short test leases)."""

IDLE_LINGER = 5.0
"""Seconds the heartbeat thread waits, with nothing registered, before it ends."""


@attrs.define
class _Entry:
    lease: Lease
    holders: int
    due: float
    """time.monotonic() when it is next extended."""


class Heartbeat:
    """The leases of one store kept alive by one background thread."""

    def __init__(self, store: Journal) -> None:
        self._store = weakref.ref(store)
        self._cond = threading.Condition()
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._thread: threading.Thread | None = None
        self._wake_at = math.inf
        """time.monotonic() when the thread next wakes by itself (inf: no thread)."""

    def add(self, lease: Lease) -> None:
        """Keep ``lease`` alive until as many `remove` calls as ``add`` calls."""
        key = (lease.operation_id, lease.owner)
        with self._cond:
            entry = self._entries.get(key)
            if entry is not None:
                entry.holders += 1
                return
            self._entries[key] = _Entry(lease, 1, time.monotonic() + _interval(lease))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="idempotently-heartbeat", daemon=True
                )
                self._thread.start()
            elif self._entries[key].due < self._wake_at:
                # Only a lease due before the thread's next wake-up needs to wake it:
                # waking it on every call would cost a thread switch per call.
                self._cond.notify_all()

    def remove(self, lease: Lease) -> None:
        key = (lease.operation_id, lease.owner)
        with self._cond:
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
        with self._cond:
            return [entry.lease for entry in self._entries.values()]

    def beat(self, *, all_leases: bool = True) -> int:
        """Extend the registered leases now (only those due, unless ``all_leases``);
        how many rows were extended. Never raises: a failure is logged."""
        now = time.monotonic()
        with self._cond:
            due = [entry for entry in self._entries.values() if all_leases or entry.due <= now]
            for entry in due:
                entry.due = now + _interval(entry.lease)
        store = self._store()
        if store is None or not due:
            return 0
        groups: dict[tuple[float, float], list[tuple[str, str]]] = {}
        try:
            for entry in due:
                lease = entry.lease
                now = lease.clock()
                groups.setdefault((now + lease.duration, now), []).append(
                    (lease.operation_id, lease.owner)
                )
            # Writes like any other: through the journal's one writer.
            return sum(
                int(store._execute(ExtendLeases(tuple(pairs), until, now)))
                for (until, now), pairs in groups.items()
            )
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

    def _run(self) -> None:
        idle_since: float | None = None
        while True:
            with self._cond:
                now = time.monotonic()
                if self._store() is None:
                    self._thread, self._wake_at = None, math.inf
                    return
                if not self._entries:
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since >= IDLE_LINGER:
                        self._thread, self._wake_at = None, math.inf
                        return
                    self._wake_at = idle_since + IDLE_LINGER
                    self._cond.wait(self._wake_at - now)
                    continue
                idle_since = None
                self._wake_at = min(entry.due for entry in self._entries.values())
                if self._wake_at > now:
                    self._cond.wait(self._wake_at - now)
                    continue
                self._wake_at = -math.inf  # beating: it looks at every entry again right after
            self.beat(all_leases=False)


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


_HEARTBEATS: weakref.WeakKeyDictionary[Journal, Heartbeat] = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def heartbeat_for(store: Journal) -> Heartbeat:
    """The one heartbeat of ``store`` in this process."""
    heartbeat = _HEARTBEATS.get(store)  # every send asks: no lock once it exists
    if heartbeat is not None:
        return heartbeat
    with _REGISTRY_LOCK:
        heartbeat = _HEARTBEATS.get(store)
        if heartbeat is None:
            heartbeat = _HEARTBEATS[store] = Heartbeat(store)
        return heartbeat


def _after_fork_in_child() -> None:
    """A child has none of its parent's threads: forget every heartbeat (and a registry
    lock the parent may have held at fork). The parent's journals are refused in the
    child anyway; a journal the child opens gets a heartbeat of its own."""
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.Lock()
    _HEARTBEATS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
