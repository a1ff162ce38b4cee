"""What a request does with a key that already exists (pure: no I/O, no clock)."""

from __future__ import annotations

from typing import Literal

from idempotently.testing._store import IdempotencyRecord

Step = Literal["replay", "mismatch", "take_over", "in_progress"]


def is_stale(locked_at: float, *, now: float, stale_after: float) -> bool:
    """Whether a lock taken at `locked_at` is `stale_after` old.

    Written as `locked_at + stale_after <= now`, like the stuck count's SQL, so
    that a clock advanced by exactly `stale_after` is stale in both places.
    """
    return locked_at + stale_after <= now


def next_step(
    record: IdempotencyRecord, request_hash: str, *, now: float, stale_after: float
) -> Step:
    """Decide between replaying, refusing and taking the key over.

    - a different payload is refused whatever the state: replaying the stored
      answer would tell the client a different request succeeded;
    - `completed` replays; `failed` may run again (nothing was replayed from it);
    - `in_progress` is trusted only for `stale_after`, after which its owner
      is presumed dead and one caller may take it over.
    """
    if record.request_hash != request_hash:
        return "mismatch"
    if record.status == "completed":
        return "replay"
    if record.status == "failed" or is_stale(record.locked_at, now=now, stale_after=stale_after):
        return "take_over"
    return "in_progress"
