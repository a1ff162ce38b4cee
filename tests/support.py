"""Shared test doubles: a fake clock and sleep, and a session wired to them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

import idempotently

URL = "https://api.example.test/v1/charges"


@attrs.define
class FakeTime:
    """A clock that only moves when the session sleeps."""

    now: float = 1_800_000_000.0
    sleeps: list[float] = attrs.field(factory=list)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)


def make_session(tmp_path: Path, fake_time: FakeTime, **options: Any) -> idempotently.Session:
    options.setdefault("headers", {"Authorization": "Bearer sk_test"})
    return idempotently.Session(
        tmp_path / "journal.db", clock=fake_time.clock, sleep=fake_time.sleep, **options
    )
