"""Concurrent requests with one key, over a real socket: the race the article is about."""

from __future__ import annotations

from collections import Counter

import anyio
import httpx
import pytest

from idempotently.testing import Fault, MockServer, MockServerConfig
from idempotently.testing.pytest_plugin import MockServerFactory

from .conftest import post, post_async

pytestmark = pytest.mark.anyio

# Long enough that ten requests sent at once all arrive while the first is
# inside the provider call; short enough to keep the suite fast.
OVERLAP = 0.3


async def send_together(url: str, key: str, n: int) -> list[httpx.Response]:
    """Send `n` identical first requests with one key, all at once."""
    responses: list[httpx.Response] = []
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=10) as client:

        async def one() -> None:
            responses.append(await post_async(client, key))

        async with anyio.create_task_group() as group:
            for _ in range(n):
                group.start_soon(one)
    return responses


async def test_ten_concurrent_first_requests_make_one_charge(
    idempotently_mock_server_factory: MockServerFactory,
) -> None:
    """10 concurrent first requests with one key: exactly one 201, nine 409, one charge."""
    server = idempotently_mock_server_factory(MockServerConfig(provider_latency=OVERLAP))

    responses = await send_together(server.url, "k-1", 10)

    assert {201: 1, 409: 9} == Counter(r.status_code for r in responses)
    assert all("in progress" in r.json()["detail"] for r in responses if r.status_code == 409)
    assert {("user_1", "k-1"): 1} == server.charge_count_by_key()
    assert (9, 0.9) == (server.stats().conflicts, server.stats().conflict_rate)


async def test_naive_select_then_insert_breaks_the_contract(
    idempotently_mock_server_factory: MockServerFactory,
) -> None:
    """The same test against SELECT-then-INSERT fails: losers get a 500, not a 409.

    This is the check that the concurrency test above can fail at all.
    """
    server = idempotently_mock_server_factory(
        MockServerConfig(provider_latency=OVERLAP, claim="naive", naive_gap=OVERLAP)
    )

    responses = await send_together(server.url, "k-1", 10)

    statuses = Counter(r.status_code for r in responses)
    assert {201: 1, 409: 9} != statuses
    assert statuses[500] >= 1
    losers = [r.json() for r in responses if r.status_code == 500]
    assert all(problem["type"].endswith("unique-violation") for problem in losers)
    # The primary key still saves the money, which is why this bug hides.
    assert {("user_1", "k-1"): 1} == server.charge_count_by_key()


async def test_crash_is_recovered_by_exactly_one_retry_after_stale_after(
    idempotently_mock_server_factory: MockServerFactory,
) -> None:
    """A crash mid-request is recovered after stale_after by exactly one of five retries."""
    server = idempotently_mock_server_factory(MockServerConfig(provider_latency=0.1))
    server.faults.push(Fault.crash())
    with httpx.Client(base_url=server.url) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            post(client, "k-1")
        [crashed] = server.idempotency_keys()
        charged = server.charges()
        too_early = post(client, "k-1")
    assert "in_progress" == crashed.status
    assert 409 == too_early.status_code
    assert 0 == server.stats().stuck

    server.advance(server.config.stale_after)
    assert 1 == server.stats().stuck
    responses = await send_together(server.url, "k-1", 5)

    assert {201: 1, 409: 4} == Counter(r.status_code for r in responses)
    [winner] = [r for r in responses if r.status_code == 201]
    assert [c.id for c in charged] == [winner.json()["id"]]
    assert {("user_1", "k-1"): 1} == server.charge_count_by_key()
    assert ["completed"] == [record.status for record in server.idempotency_keys()]
    assert 0 == server.stats().stuck


async def test_stale_lock_is_taken_over_only_by_compare_and_swap(
    idempotently_mock_server: MockServer,
) -> None:
    """Of two callers that read the same stale lock, only the first compare-and-swap wins."""
    server = idempotently_mock_server
    app = server.app
    assert app.keys.claim("u", "k", "hash", now=0.0, ttl=1e9)
    [stale] = app.keys.records("u")

    assert app.keys.take_over(stale, now=100.0)
    assert not app.keys.take_over(stale, now=100.0)
    assert [100.0] == [record.locked_at for record in app.keys.records("u")]
