"""What to watch, as Leach's article says: replay rate, 409 rate, and stuck keys."""

from __future__ import annotations

import threading
from typing import Any, Literal

import attrs

Counter = Literal[
    "requests", "created", "replays", "conflicts", "mismatches", "rejected", "faults", "swept"
]
_COUNTERS: tuple[Counter, ...] = (
    "requests",
    "created",
    "replays",
    "conflicts",
    "mismatches",
    "rejected",
    "faults",
    "swept",
)


class Tally:
    """Thread-safe counters of what the server answered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[Counter, int] = dict.fromkeys(_COUNTERS, 0)

    def count(self, counter: Counter, n: int = 1) -> None:
        with self._lock:
            self._counts[counter] += n

    def snapshot(self) -> dict[Counter, int]:
        with self._lock:
            return dict(self._counts)


@attrs.frozen(kw_only=True)
class Stats:
    """A snapshot of the mock server's health."""

    requests: int
    """`POST /v1/charges` requests received, refused ones included."""
    created: int
    """Requests that did the work and answered 201."""
    replays: int
    """Stored responses replayed (`replay_rate`: per request)."""
    conflicts: int
    """Answers saying "in progress", 409 or 423 (`conflict_rate`: per request)."""
    mismatches: int
    """Keys reused with a different payload."""
    rejected: int
    """Refused before any work (401, 400)."""
    faults: int
    """Injected faults that met a request."""
    charges: int
    """Charges the provider made (the ledger)."""
    keys: dict[str, int]
    """Idempotency keys by status."""
    stuck: int
    """`in_progress` keys older than `stale_after`, the operations currently stuck."""
    swept: int
    """Keys deleted by the sweeper since start."""

    @property
    def replay_rate(self) -> float:
        return self.replays / self.requests if self.requests else 0.0

    @property
    def conflict_rate(self) -> float:
        return self.conflicts / self.requests if self.requests else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            **attrs.asdict(self),
            "replay_rate": self.replay_rate,
            "conflict_rate": self.conflict_rate,
        }
