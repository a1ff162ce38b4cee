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
    """A snapshot of the mock server's health.

    - `requests`: `POST /v1/charges` requests received, refused ones included.
    - `created`: requests that did the work and answered 201.
    - `replays` / `replay_rate`: stored responses replayed, per request.
    - `conflicts` / `conflict_rate`: "in progress" answers (409, or 423), per request.
    - `mismatches`: keys reused with a different payload.
    - `rejected`: refused before any work (401, 400).
    - `faults`: injected faults that met a request.
    - `charges`: charges the provider made (the ledger).
    - `keys`: idempotency keys by status.
    - `stuck`: `in_progress` keys older than `stale_after`, the operations currently stuck.
    - `swept`: keys deleted by the sweeper since start.
    """

    requests: int
    created: int
    replays: int
    conflicts: int
    mismatches: int
    rejected: int
    faults: int
    charges: int
    keys: dict[str, int]
    stuck: int
    swept: int

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
