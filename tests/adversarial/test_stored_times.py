"""No stored time outlasts its length for a reader whose clock is behind its writer's.

The class behind "a host ten years fast pauses everyone for ten years": every time the
journal stores for others to wait on (an origin pause, an operation's not_before, a
dead host's lease) is written with the writer's clock. Whatever the skew, a reader
waits at most the length the server asked for (or the lease ran), counted from when it
first sees it, and never sends earlier than that length by its own clock when the
writer's clock is behind or right.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

import idempotently
from idempotently import profiles
from tests.journal_commands import take_lease
from tests.support import FakeTime

URL = "https://api.example.test/v1/charges"
LENGTH = 7.0
POLICY = idempotently.RetryPolicy(
    max_attempts=1, budget=None, max_retry_after=3600.0, deadline=7200.0
)
SKEWS = [10 * 365 * 86400.0, 86400.0, 3600.0, 60.0, 1.0, 0.0, -3.0]
"""How far the writer's clock is ahead of the reader's (negative: behind)."""


def server() -> tuple[httpx.MockTransport, list[httpx.Request]]:
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        if len(sent) == 1:
            return httpx.Response(429, headers={"Retry-After": f"{LENGTH:g}"})
        return httpx.Response(201)

    return httpx.MockTransport(answer), sent


def host(path: Path, clock: FakeTime, transport: httpx.MockTransport, **options: Any) -> Any:
    return idempotently.Session(
        path,
        transport=transport,
        policy=POLICY,
        headers={"Authorization": "Bearer t"},
        clock=clock.clock,
        sleep=clock.sleep,
        **options,
    )


@pytest.mark.parametrize("skew", SKEWS)
def test_an_origin_pause_lasts_at_most_its_length_for_the_reader(
    scratch: Path, skew: float
) -> None:
    """A pause written `skew` seconds ahead of the reader holds the reader's next call
    for at most its length, and for its length when the writer was not behind."""
    transport, sent = server()
    reader = FakeTime()
    writer = FakeTime(now=reader.now + skew)
    path = scratch / f"pause-{skew:g}.db"
    with host(path, writer, transport) as s, pytest.raises(idempotently.RetryLaterError):
        s.post(URL, json={})
    with host(path, reader, transport) as s:
        assert 201 == s.post(URL, json={}).status_code
    waited = sum(reader.sleeps)
    assert (2, True) == (len(sent), waited <= LENGTH)
    assert waited == (LENGTH if skew >= 0 else LENGTH + skew)


@pytest.mark.parametrize("skew", SKEWS)
def test_a_not_before_lasts_at_most_its_length_for_the_reader(scratch: Path, skew: float) -> None:
    """An operation's not_before written `skew` seconds ahead of the reader is due for the
    reader's resume after at most its length, and not before its length when the writer
    was not behind."""
    per_resource = attrs.evolve(profiles.GENERIC, pause_origin=False)
    transport, sent = server()
    reader = FakeTime()
    writer = FakeTime(now=reader.now + skew)
    path = scratch / f"not-before-{skew:g}.db"
    with (
        host(path, writer, transport, profile=per_resource) as s,
        pytest.raises(idempotently.RetryLaterError),
    ):
        s.post(URL, json={}, operation_id="charge")
    with host(path, reader, transport, profile=per_resource) as s:
        early = [result.action for result in s.resume()] if skew >= 0 else []
        reader.sleep(LENGTH)
        due = [result.action for result in s.resume()]
    assert ([] if skew < 0 else ["waiting"]) == early
    assert (["succeeded"], 2) == (due, len(sent))


@pytest.mark.parametrize("skew", SKEWS)
def test_a_dead_hosts_lease_lasts_at_most_its_length_for_the_reader(
    scratch: Path, skew: float
) -> None:
    """A lease of LENGTH s taken `skew` seconds ahead of the reader by another host that
    then died is taken over by the reader's resume after at most its length, and not
    before its length when the writer was not behind."""
    sent: list[httpx.Request] = []
    transport = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(201))
    reader = FakeTime()
    writer = FakeTime(now=reader.now + skew)
    path = scratch / f"lease-{skew:g}.db"
    with host(path, writer, transport) as s:
        s.enqueue("POST", URL, json={}, operation_id="charge")
        read = s.journal.operation("charge")
        assert read is not None
        assert take_lease(
            s.journal, read, owner="dead-host:1:t", lease_until=writer.now + LENGTH, now=writer.now
        )
    actions = []
    start = reader.now
    with host(path, reader, transport) as s:
        for after in (0.0, LENGTH - 1, LENGTH):
            reader.now = start + after
            actions += [result.action for result in s.resume()]
    expected = ["leased", "leased"] if skew >= 0 else ["leased"]
    assert ([*expected, "succeeded"], 1) == (actions, len(sent))
