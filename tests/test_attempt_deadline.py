"""The remaining deadline caps each attempt's timeouts: no attempt runs past it.

A call's policy ``deadline`` (and the operation's own ``deadline_at``) bounds the
whole call, waits and attempts alike. An attempt cut short by it after the request
went out may have been delivered: the operation stays pending with its key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

import idempotently
from tests.scripted_server import serve
from tests.support import FakeTime

URL = "https://api.example.test/v1/charges"


def capturing(*statuses: int) -> tuple[httpx.MockTransport, list[dict[str, Any]]]:
    """A server answering ``statuses`` in turn, and the timeouts each request carried."""
    seen: list[dict[str, Any]] = []
    answers = list(statuses)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(dict(request.extensions["timeout"]))
        return httpx.Response(answers.pop(0))

    return httpx.MockTransport(handler), seen


def test_each_attempt_gets_at_most_the_time_left(tmp_path: Path, fake_time: FakeTime) -> None:
    """With deadline=5 and a 30 s client timeout, the first attempt waits at most 5 s for
    each phase and the retry 2 s after it at most 3 s."""
    transport, seen = capturing(503, 201)
    policy = idempotently.RetryPolicy(deadline=5.0, initial_backoff=4.0, max_backoff=4.0)
    with idempotently.Session(
        tmp_path / "journal.db",
        transport=transport,
        timeout=30.0,
        policy=policy,
        clock=fake_time.clock,
        sleep=fake_time.sleep,
    ) as s:
        s._engine.rand = lambda: 0.5  # the retry waits 2 s
        assert 201 == s.post(URL, json={}).status_code
    phases = ("connect", "read", "write", "pool")
    assert [dict.fromkeys(phases, 5.0), dict.fromkeys(phases, 3.0)] == [
        {phase: pytest.approx(t[phase]) for phase in phases} for t in seen
    ]


def test_a_shorter_timeout_is_kept(tmp_path: Path, fake_time: FakeTime) -> None:
    """A phase whose own timeout is shorter than the time left keeps it; one without a
    timeout (None) gets the time left."""
    transport, seen = capturing(201)
    with idempotently.Session(
        tmp_path / "journal.db",
        transport=transport,
        timeout=httpx.Timeout(1.0, read=None),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
    ) as s:
        s.post(URL, json={})
    assert {"connect": 1.0, "read": 60.0, "write": 1.0, "pool": 1.0} == seen[0]


def test_the_operations_own_deadline_caps_too(tmp_path: Path, fake_time: FakeTime) -> None:
    """deadline_at two seconds away caps every phase at 2 s, though the policy allows 60."""
    transport, seen = capturing(201)
    with idempotently.Session(
        tmp_path / "journal.db", transport=transport, clock=fake_time.clock, sleep=fake_time.sleep
    ) as s:
        s.post(URL, json={}, deadline_at=fake_time.now + 2.0)
    assert {2.0} == set(seen[0].values())


def test_a_custom_stop_leaves_the_timeouts_to_the_client(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """stop= replaces the policy's deadline: the client's own timeouts go out unchanged."""
    import tenacity

    transport, seen = capturing(201)
    policy = idempotently.RetryPolicy(stop=tenacity.stop_after_attempt(2))
    with idempotently.Session(
        tmp_path / "journal.db",
        transport=transport,
        timeout=90.0,
        policy=policy,
        clock=fake_time.clock,
        sleep=fake_time.sleep,
    ) as s:
        s.post(URL, json={})
    assert {90.0} == set(seen[0].values())


class SlowApp:
    """Reads the request, then takes ``delay`` seconds to answer (a charge in progress)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.arrivals = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        while (await receive()).get("more_body"):
            pass
        self.arrivals += 1
        await anyio.sleep(self.delay)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def test_a_slow_server_cannot_hold_a_call_past_its_deadline(tmp_path: Path) -> None:
    """Against a real server that takes 2.5 s, a call with deadline=0.5 and a 30 s client
    timeout is cut short at its deadline: the attempt is maybe_delivered (an attempt
    left to run would have had the server's 201) and the operation stays pending."""
    app = SlowApp(delay=2.5)
    policy = idempotently.RetryPolicy(deadline=0.5)
    with (
        serve(app) as url,
        idempotently.Session(tmp_path / "journal.db", timeout=30.0, policy=policy) as s,
    ):
        with pytest.raises(idempotently.OperationPendingError) as raised:
            s.post(f"{url}/charges", json={}, operation_id="slow")
        operation = s.journal.operation("slow")
    assert 1 == app.arrivals
    assert "pending" == operation.status
    assert ["maybe_delivered"] == [attempt.outcome for attempt in operation.attempts]
    assert isinstance(raised.value.__cause__, httpx.ReadTimeout)


@pytest.mark.anyio
async def test_an_async_call_is_capped_the_same(tmp_path: Path, fake_time: FakeTime) -> None:
    """AsyncSession (asyncio and trio): the same cap on each attempt's timeouts."""
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(dict(request.extensions["timeout"]))
        return httpx.Response(201)

    async with idempotently.AsyncSession(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(handler),
        timeout=30.0,
        policy=idempotently.RetryPolicy(deadline=4.0),
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
    ) as s:
        await s.post(URL, json={})
    assert {4.0} == set(seen[0].values())
