"""Clocks the mock server reads its time from.

The server never calls `time.time()` directly: lock ages and key expiry are
measured on an injected clock, so a test can jump past `stale_after` or a
day of `key_ttl` without sleeping.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """Anything that tells the time in seconds since the epoch."""

    def now(self) -> float: ...


class SystemClock:
    """The wall clock (`time.time()`)."""

    def now(self) -> float:
        return time.time()

    def __repr__(self) -> str:
        return "SystemClock()"


class VirtualClock:
    """A clock that only moves when told to.

    It starts at the wall-clock time of its creation (so `created` timestamps
    look plausible) unless `start` is given. Thread-safe: the server reads it
    on its event-loop thread while a test advances it from its own.
    """

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock forward by `seconds` and return the new time."""
        if seconds < 0:
            raise ValueError(f"a clock only moves forward; cannot advance by {seconds!r}")
        with self._lock:
            self._now += seconds
            return self._now

    def __repr__(self) -> str:
        return f"VirtualClock(start={self.now()!r})"
