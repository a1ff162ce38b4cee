"""A clock and a sleep for sessions under test: retries that wait without waiting."""

from __future__ import annotations

import attrs

from idempotently.testing._clock import VirtualClock


@attrs.define
class FakeTime:
    """Time that moves only when the code under test sleeps.

    Pass `clock=fake.clock` and `sleep=fake.sleep` (or `sleep=fake.async_sleep`)
    to `Session`, `AsyncSession`, `Transport` or `AsyncTransport`: a retry
    after `Retry-After: 2` returns at once and `fake.sleeps == [2.0]`. Given a
    mock server's `VirtualClock` as `server_clock`, each sleep moves the
    server's time too, so both sides agree on what a Retry-After meant.
    """

    now: float = 1_800_000_000.0
    """The current time, in seconds since the epoch; each sleep adds to it."""
    sleeps: list[float] = attrs.field(factory=list)
    """Every sleep requested, in seconds, in order."""
    server_clock: VirtualClock | None = None
    """A mock server's `VirtualClock` that each sleep advances too, or None."""

    def clock(self) -> float:
        """The current fake time, seconds since the epoch."""
        return self.now

    def sleep(self, seconds: float) -> None:
        """Record the sleep and move the time on; returns at once."""
        self.sleeps.append(seconds)
        self.now += seconds
        if self.server_clock is not None:
            self.server_clock.advance(seconds)

    async def async_sleep(self, seconds: float) -> None:
        """The async twin of `sleep` (also returns at once)."""
        self.sleep(seconds)
