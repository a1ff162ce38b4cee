"""The tenacity side of a retry policy: the default backoff strategy, and the
``tenacity.RetryCallState`` a wait or stop strategy reads.

Loaded when a call first decides whether to retry, not by ``import idempotently``:
a call answered on its first attempt never computes a wait, and tenacity (with the
``concurrent.futures`` and ``dataclasses`` it brings) is a fifth of the package's
import cost.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import tenacity as _t

from idempotently._backoff import jittered


class full_jitter(_t.wait.wait_base):
    """Exponential backoff with full jitter: uniform in ``[0, min(maximum, initial * 2**(n-1))]``.

    A tenacity wait strategy (it composes with ``+``) whose randomness is
    injectable, so tests can fix it.
    """

    def __init__(
        self, initial: float, maximum: float, rand: Callable[[], float] = random.random
    ) -> None:
        self.initial = initial
        self.maximum = maximum
        self.rand = rand

    def __call__(self, retry_state: _t.RetryCallState) -> float:
        return jittered(self.initial, self.maximum, retry_state.attempt_number, self.rand)


def stop_after(max_attempts: int, deadline: float) -> Callable[[_t.RetryCallState], bool]:
    """The default stop strategy: ``max_attempts`` made, or the next wait ends past
    ``deadline`` seconds into the call."""
    return _t.stop_after_attempt(max_attempts) | _t.stop_before_delay(deadline)


def retry_call_state(attempts: int, elapsed: float, upcoming_sleep: float) -> _t.RetryCallState:
    """tenacity's view of a call: its strategies read only these fields."""
    state = _t.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = attempts
    state.start_time = 0.0
    state.outcome_timestamp = elapsed
    state.upcoming_sleep = upcoming_sleep
    return state
