"""Exponential backoff with full jitter: the one formula of a retry's wait (`_waits`,
through tenacity) and of a lookup's (`_flow/_reconcile`). Pure, and free of tenacity, so
the reconciler does not load it."""

from __future__ import annotations

from collections.abc import Callable


def jittered(initial: float, maximum: float, number: int, rand: Callable[[], float]) -> float:
    """The ``number``-th (from 1) exponential backoff with full jitter: uniform in
    ``[0, min(maximum, initial * 2**(number-1))]`` (retries and lookups alike)."""
    exponent = min(max(number, 1) - 1, 62)  # 2**62 is past any cap
    ceiling = min(maximum, initial * (2.0**exponent))
    return ceiling * rand()
