"""A lease never outlasts its length for a reader whose clock is behind its writer's,
and a live owner whose clock is ahead is never overtaken while it heartbeats.

A host whose clock is ten years fast takes an operation's lease and dies (a real second
process, ended by ``os._exit`` as its bytes leave) or keeps heartbeating; another host
id, whose clock is right, shares the journal (SQLite or PostgreSQL) and resumes, calls
or claims. The server is a real uvicorn app on 127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

import idempotently
from idempotently._commands import ClaimDue
from tests.scripted_server import ScriptedApp
from tests.support import FakeTime

TEN_YEARS = 10 * 365 * 86400.0
URL = "https://api.example.test/v1/charges"
LEASE = 30.0
POLICY = idempotently.RetryPolicy(
    max_attempts=1, budget=None, max_retry_after=3600.0, deadline=7200.0
)
TOKEN = {"Authorization": "Bearer tenant-a"}

DYING_HOST = """
import os, sys, httpx, idempotently

def dies(request):
    os._exit(0)  # as its bytes leave: nothing released, its lease stays journaled

with idempotently.Session(
    sys.argv[1], host_id="fast-host", clock=lambda: float(sys.argv[2]),
    lease_duration=float(sys.argv[4]), headers={"Authorization": "Bearer tenant-a"},
    transport=httpx.MockTransport(dies),
) as session:
    session.post(sys.argv[3], json={}, operation_id="charge")
"""


def fast_host_takes_the_lease_and_dies(journal: str, url: str, now: float) -> None:
    """A host ten years ahead of ``now`` journals "charge", leased for LEASE s, and dies."""
    subprocess.run(
        [sys.executable, "-c", DYING_HOST, journal, repr(now + TEN_YEARS), url, repr(LEASE)],
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def reader(journal: str, clock: FakeTime) -> idempotently.Session:
    return idempotently.Session(
        journal,
        host_id="right-host",
        headers=TOKEN,
        policy=POLICY,
        lease_duration=LEASE,
        clock=clock.clock,
        sleep=clock.sleep,
    )


def test_a_dead_hosts_lease_from_ten_years_ahead_is_resumed_after_its_length(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """Resume finds the dead host's lease held for its length (30 s) from when it first
    sees it, in the journal, and sends the operation once that has passed; not in ten
    years."""
    app, url = scripted
    fast_host_takes_the_lease_and_dies(journal_target, f"{url}/v1/charges", fake_time.now)
    first_seen = fake_time.now
    with reader(journal_target, fake_time) as session:
        early = [result.action for result in session.resume()]
        operation = session.journal.operation("charge")
        fake_time.sleep(LEASE - 1)
        still = [result.action for result in session.resume()]
        fake_time.sleep(1)
        due = [result.action for result in session.resume()]
    assert operation is not None
    assert (first_seen + LEASE, first_seen) == (operation.lease_until, operation.updated_at)
    assert (["leased"], ["leased"], ["succeeded"]) == (early, still, due)
    assert 1 == len(app.arrivals)


def test_a_call_with_the_id_of_a_dead_hosts_lease_from_ahead_waits_its_length(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """A call with the operation id of a lease a host ten years fast took before it died
    waits for the lease's length, then sends it with the journaled key; it does not end
    with OperationInProgressError after its deadline."""
    app, url = scripted
    fast_host_takes_the_lease_and_dies(journal_target, f"{url}/v1/charges", fake_time.now)
    with reader(journal_target, fake_time) as session:
        response = session.post(f"{url}/v1/charges", json={}, operation_id="charge")
        operation = session.journal.operation("charge")
    assert operation is not None
    assert (201, 1, operation.key) == (response.status_code, len(app.arrivals), app.arrivals[0].key)
    assert LEASE <= sum(fake_time.sleeps) <= 2 * LEASE


@pytest.mark.anyio
async def test_an_async_call_with_the_id_of_a_dead_hosts_lease_from_ahead_waits_its_length(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """AsyncSession (asyncio and trio) likewise: the call waits the lease's length, then
    sends it once with the journaled key."""
    app, url = scripted
    fast_host_takes_the_lease_and_dies(journal_target, f"{url}/v1/charges", fake_time.now)
    async with idempotently.AsyncSession(
        journal_target,
        host_id="right-host",
        headers=TOKEN,
        policy=POLICY,
        lease_duration=LEASE,
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
    ) as session:
        response = await session.post(f"{url}/v1/charges", json={}, operation_id="charge")
    assert (201, 1) == (response.status_code, len(app.arrivals))
    assert LEASE <= sum(fake_time.sleeps) <= 2 * LEASE


def test_a_watch_worker_claims_a_dead_hosts_lease_from_ahead_after_its_length(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """A watch worker's claim counts a lease written by a clock ahead from its own now:
    not claimable before the lease's length has passed, claimable then."""
    app, url = scripted
    fast_host_takes_the_lease_and_dies(journal_target, f"{url}/v1/charges", fake_time.now)
    with idempotently.Journal(journal_target) as journal:
        now = fake_time.now
        early = journal._execute(ClaimDue("worker", now, now + LEASE, 10))
        late = journal._execute(ClaimDue("worker", now + LEASE - 1, now + 2 * LEASE, 10))
        due = journal._execute(ClaimDue("worker", now + LEASE, now + 2 * LEASE, 10))
    assert ([], [], ["charge"]) == (early, late, [operation.operation_id for operation in due])
    assert [] == app.arrivals


def test_a_live_owner_ten_years_ahead_that_heartbeats_is_never_overtaken(
    journal_target: str, fake_time: FakeTime
) -> None:
    """While a host ten years fast sends a slow attempt and its heartbeat renews its lease
    every third of it, another host's resume finds it leased at every look, and the lease
    it finds ends at most one lease length after the look (so it is resumed that soon
    if the owner dies); the server sees one request."""
    fast = FakeTime(now=fake_time.now + TEN_YEARS)
    looks: list[tuple[str, float]] = []
    arrivals: list[str] = []
    lease = 9.0

    def slow_server(request: httpx.Request) -> httpx.Response:
        arrivals.append(request.headers["Idempotency-Key"])
        with idempotently.Session(
            journal_target,
            host_id="right-host",
            headers=TOKEN,
            clock=fake_time.clock,
            sleep=fake_time.sleep,
            transport=httpx.MockTransport(lambda request: httpx.Response(201)),
        ) as other:
            for _ in range(12):  # 36 s: four lease lengths
                [result] = other.resume()
                operation = other.journal.operation("slow")
                assert operation is not None
                looks.append((result.action, operation.lease_until - fake_time.now))
                fake_time.now += 3.0
                fast.now += 3.0
                owner.journal._heartbeat.beat()
        return httpx.Response(201)

    with idempotently.Session(
        journal_target,
        host_id="fast-host",
        headers=TOKEN,
        lease_duration=lease,
        clock=fast.clock,
        sleep=fast.sleep,
        transport=httpx.MockTransport(slow_server),
    ) as owner:
        assert 201 == owner.post(URL, json={}, operation_id="slow").status_code
    assert [("leased", lease)] * 12 == looks
    assert 1 == len(arrivals)
