"""The retry budget: how many retries one process may send to one origin.

An outage answered by every operation retrying on its own is a retry storm:
against a dead server, each operation sends ``max_attempts`` requests. A
budget (the shape of Finagle's and gRPC's) bounds the retries of a whole
process per origin (scheme, host, port): within a sliding window of
`WINDOW` seconds, retries may number at most ``ratio`` times the first
attempts seen in that window plus ``min_per_second`` times the window (a
reserve, so a process that sends little can still retry).

The ledger of one origin is a ring of one-second buckets guarded by a plain
lock: a first attempt and a retry cost one lock and a few integer operations,
no journal statement. The lock is held only for that arithmetic, never across
an ``await``, so the same ledger serves threads and every event loop's tasks.
Nothing here does I/O; the time comes from the caller's clock.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import attrs
import httpx

from idempotently._numbers import as_float

WINDOW = 10
"""Seconds of history a budget weighs (whole seconds: one bucket each)."""

DEFAULT_RATIO = 0.1
DEFAULT_MIN_PER_SECOND = 10.0


def _finite(low: float) -> Callable[[object, attrs.Attribute[float], float], None]:
    def check(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
        if not (low <= value < math.inf):
            raise ValueError(
                f"RetryBudget {attribute.name} must be a finite number >= {low:g}, not {value!r}"
            )

    return check


def _ratio(value: float) -> float:
    return as_float(value, "RetryBudget ratio")


def _min_per_second(value: float) -> float:
    return as_float(value, "RetryBudget min_per_second")


@attrs.frozen
class RetryBudget:
    """At most ``ratio`` retries per first attempt, plus ``min_per_second`` retries a
    second, per process and origin, over a sliding 10-second window.

    ``RetryPolicy(budget=RetryBudget())`` is the default; ``budget=None`` turns it off.
    With the defaults, 1,000 operations sent to a dead origin within 10 seconds may
    retry ``0.1 * 1000 + 10 * 10 = 200`` times between them, not 4,000: the retry the
    budget refuses is not sent, its operation stays pending (resumable with its key) and
    `idempotently.RetryBudgetError` names the origin.
    """

    ratio: float = attrs.field(default=DEFAULT_RATIO, converter=_ratio, validator=_finite(0.0))
    """Retries allowed per first attempt sent to the origin in the window."""
    min_per_second: float = attrs.field(
        default=DEFAULT_MIN_PER_SECOND,
        converter=_min_per_second,
        validator=_finite(0.0),
    )
    """Retries allowed per second of the window whatever the traffic (a reserve, so a
    quiet process can still retry)."""

    def allowance(self, first_attempts: int) -> float:
        """The retries a window with ``first_attempts`` first attempts allows."""
        return self.ratio * first_attempts + self.min_per_second * WINDOW


class _Ledger:
    """One origin's first attempts and retries, per second, over the last WINDOW seconds."""

    __slots__ = ("firsts", "lock", "retries", "seconds")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds = [-1] * WINDOW
        """The second (since the epoch) each bucket counts; -1: never used."""
        self.firsts = [0] * WINDOW
        self.retries = [0] * WINDOW

    def _bucket(self, now: float) -> int:
        """The bucket of ``now``'s second, emptied if it last counted another second
        (the lock is held)."""
        second = int(now)
        index = second % WINDOW
        if self.seconds[index] != second:
            self.seconds[index] = second
            self.firsts[index] = 0
            self.retries[index] = 0
        return index

    def _window(self, now: float) -> tuple[int, int]:
        """First attempts and retries of the last WINDOW seconds (the lock is held)."""
        oldest = int(now) - WINDOW
        firsts = retries = 0
        for index in range(WINDOW):
            if self.seconds[index] > oldest:
                firsts += self.firsts[index]
                retries += self.retries[index]
        return firsts, retries


class RetryBudgets:
    """The ledgers of one process, one per origin: every Session, AsyncSession and
    Transport of the process shares `BUDGETS` (a test gives its own)."""

    def __init__(self) -> None:
        self._ledgers: dict[str, _Ledger] = {}
        self._lock = threading.Lock()
        self.refusals: dict[str, int] = {}
        """Retries refused so far, per origin, in this process."""

    def _ledger(self, origin: str) -> _Ledger:
        ledger = self._ledgers.get(origin)
        if ledger is None:
            with self._lock:
                ledger = self._ledgers.setdefault(origin, _Ledger())
        return ledger

    def first_attempt(self, origin: str, now: float) -> None:
        """A first attempt of an operation is about to be sent to ``origin``."""
        ledger = self._ledger(origin)
        with ledger.lock:
            ledger.firsts[ledger._bucket(now)] += 1

    def try_retry(self, budget: RetryBudget, origin: str, now: float) -> bool:
        """Whether a retry to ``origin`` may be sent now; if so, it is counted."""
        ledger = self._ledger(origin)
        with ledger.lock:
            index = ledger._bucket(now)
            firsts, retries = ledger._window(now)
            if retries + 1 > budget.allowance(firsts):
                refused = True
            else:
                ledger.retries[index] += 1
                refused = False
        if refused:
            with self._lock:
                self.refusals[origin] = self.refusals.get(origin, 0) + 1
        return not refused

    def spent(self, budget: RetryBudget, origin: str, now: float) -> bool:
        """Whether ``origin``'s budget would refuse a retry now (nothing is counted)."""
        ledger = self._ledgers.get(origin)
        if ledger is None:
            return False
        with ledger.lock:
            firsts, retries = ledger._window(now)
        return retries + 1 > budget.allowance(firsts)

    def clear(self) -> None:
        """Forget every ledger and count (tests)."""
        with self._lock:
            self._ledgers.clear()
            self.refusals.clear()


BUDGETS = RetryBudgets()
"""This process's retry ledgers, shared by every Session, AsyncSession and Transport."""


def origin_of(url: httpx.URL) -> str:
    """``scheme://host:port`` of a URL, the port spelt out (the default one too)."""
    port = url.port
    if port is None:
        port = {"http": 80, "https": 443}.get(url.scheme, 0)
    host = url.host
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"{url.scheme}://{host}:{port}"
