"""The circuit breaker's settings: `idempotently.Breaker`, loaded when first named.

The breaker itself (counting failures, opening the pause, the probe) lives with the
origin pauses it is built on (`_pauses.py`); this module holds only the settings a
policy carries, so that `import idempotently` does not make their class.
"""

from __future__ import annotations

import math

import attrs

from idempotently._numbers import as_float

MAX_FAILURES = 1_000_000
"""More failures in a row than any window sees: a larger count is a mistake."""


def _breaker_seconds(name: str, value: object) -> float:
    """A Breaker's number as a float above 0, or a clear error naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Breaker {name} must be a number, not {type(value).__name__} ({value!r})")
    number = as_float(value, f"Breaker {name}")
    if not (0 < number < math.inf):
        raise ValueError(f"Breaker {name} must be a finite number above 0, not {value!r}")
    return number


def _failures(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"Breaker failures must be a whole number, not {type(value).__name__} ({value!r})"
        )
    if not 1 <= value <= MAX_FAILURES:
        shown = value if value < 10**20 else f"an integer of {value.bit_length()} bits"
        raise ValueError(f"Breaker failures must be from 1 to {MAX_FAILURES:,}, not {shown}")
    return value


def _window(value: object) -> float:
    return _breaker_seconds("window", value)


def _min_open(value: object) -> float:
    return _breaker_seconds("min_open", value)


def _max_open(value: object) -> float:
    return _breaker_seconds("max_open", value)


@attrs.frozen
class Breaker:
    """A circuit breaker per origin and credentials, journaled as an origin pause.

    ``failures`` network errors or 5xx answers without Retry-After in a row from one
    origin (for one set of credentials), all within ``window`` seconds, open it: the
    origin is paused for ``min_open`` seconds for every thread, process and resume
    sharing the journal. When that ends, one caller across them all takes the probe
    (a compare-and-swap on the pause's row) while the others keep waiting: answered,
    the breaker closes; failed, it opens again for twice as long, up to ``max_open``
    and never longer than the policy's ``max_retry_after``. ``idempotently unpause
    ORIGIN`` closes it at once.
    """

    failures: int = attrs.field(default=5, converter=_failures)
    """Failures in a row that open it."""
    window: float = attrs.field(default=30.0, converter=_window)
    """Seconds those failures must fall within."""
    min_open: float = attrs.field(default=5.0, converter=_min_open)
    """Seconds it stays open the first time."""
    max_open: float = attrs.field(default=300.0, converter=_max_open)
    """Seconds it stays open at most, however many probes failed."""

    def __attrs_post_init__(self) -> None:
        if self.min_open > self.max_open:
            raise ValueError(
                f"Breaker min_open ({self.min_open:g}s) must not exceed max_open "
                f"({self.max_open:g}s)"
            )
