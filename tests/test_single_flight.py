"""One operation in flight at most once: callers sharing one Session, AsyncSession or
Transport, on threads, asyncio and trio, against a real loopback server that counts
what it receives (DESIGN §3.3: "a second caller of the same operation waits for the
first or gets OperationInProgressError, never a second send and never a raw database
error")."""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import httpx
import pytest

import idempotently
from idempotently.testing import Fault, MockServer, MockServerConfig, serve

CALLERS = 20
LATENCY = 0.6
"""Seconds the server's provider takes: long enough for every caller to arrive while
the first request is still in flight."""
CHARGE = {"amount": 1000, "currency": "usd", "customer": "cus_1"}
AUTHORIZATION = {"Authorization": "Bearer user_1"}

Outcome = httpx.Response | Exception


@pytest.fixture
def server() -> Iterator[MockServer]:
    """The mock payments server on 127.0.0.1, each charge taking LATENCY seconds."""
    with serve(MockServerConfig(provider_latency=LATENCY)) as running:
        yield running


def on_threads(call: Callable[[int], httpx.Response], n: int = CALLERS) -> list[Outcome]:
    """Run ``call(i)`` on n threads released together; every answer or exception."""
    barrier = threading.Barrier(n)

    def one(i: int) -> Outcome:
        barrier.wait()
        try:
            return call(i)
        except Exception as error:
            return error

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


async def on_tasks(call: Callable[[int], Awaitable[httpx.Response]]) -> list[Outcome]:
    """Run ``call(i)`` in CALLERS tasks of one task group; every answer or exception."""
    outcomes: list[Outcome] = []
    go = anyio.Event()

    async def one(i: int) -> None:
        await go.wait()
        try:
            outcomes.append(await call(i))
        except Exception as error:
            outcomes.append(error)

    async with anyio.create_task_group() as group:
        for i in range(CALLERS):
            group.start_soon(one, i)
        go.set()
    return outcomes


def assert_sent_once(server: MockServer, outcomes: list[Outcome]) -> None:
    """One request reached the server; every caller got its 201 (stored or live)."""
    stats = server.stats()
    assert (1, 1) == (stats.requests, stats.charges)
    unexpected = [o for o in outcomes if not isinstance(o, httpx.Response)]
    assert [] == [f"{type(o).__module__}.{type(o).__name__}: {o}" for o in unexpected]
    responses = [o for o in outcomes if isinstance(o, httpx.Response)]
    assert CALLERS == len(responses)
    assert {201} == {response.status_code for response in responses}
    assert 1 == len({response.content for response in responses})
    # One live answer; every other caller waited and got the journal's copy.
    assert [False] + [True] * (CALLERS - 1) == sorted(
        response.extensions["idempotently"].replayed_locally for response in responses
    )


def test_threads_sharing_one_session_send_one_operation_once(
    tmp_path: Path, server: MockServer
) -> None:
    """20 threads post one operation_id through one Session: one send, twenty 201s."""
    with idempotently.Session(
        tmp_path / "journal.db", base_url=server.url, headers=AUTHORIZATION
    ) as session:
        outcomes = on_threads(
            lambda _: session.post("/v1/charges", json=CHARGE, operation_id="same")
        )
        operation = session.journal.operation("same")
    assert_sent_once(server, outcomes)
    assert operation is not None
    assert ("succeeded", 1, None) == (
        operation.status,
        operation.attempt_count,
        operation.lease_owner,
    )


@pytest.mark.anyio
async def test_tasks_sharing_one_async_session_send_one_operation_once(
    tmp_path: Path, server: MockServer
) -> None:
    """20 tasks post one operation_id through one AsyncSession: one send, twenty 201s."""
    async with idempotently.AsyncSession(
        tmp_path / "journal.db", base_url=server.url, headers=AUTHORIZATION
    ) as session:
        outcomes = await on_tasks(
            lambda _: session.post("/v1/charges", json=CHARGE, operation_id="same")
        )
        operation = session.journal.operation("same")
    assert_sent_once(server, outcomes)
    assert operation is not None and ("succeeded", 1) == (
        operation.status,
        operation.attempt_count,
    )


def test_threads_sharing_one_transport_send_one_key_once(
    tmp_path: Path, server: MockServer
) -> None:
    """20 threads post one Idempotency-Key through one Transport: one send, twenty 201s."""
    transport = idempotently.Transport(tmp_path / "journal.db")
    headers = {**AUTHORIZATION, "Idempotency-Key": "k-same"}
    with httpx.Client(transport=transport, base_url=server.url, headers=headers) as client:
        outcomes = on_threads(lambda _: client.post("/v1/charges", json=CHARGE))
        operation = transport.journal.operation("key:k-same")
    assert_sent_once(server, outcomes)
    assert {("user_1", "k-same"): 1} == server.charge_count_by_key()
    assert operation is not None and ("succeeded", 1) == (
        operation.status,
        operation.attempt_count,
    )


@pytest.mark.anyio
async def test_tasks_sharing_one_async_transport_send_one_key_once(
    tmp_path: Path, server: MockServer
) -> None:
    """20 tasks post one Idempotency-Key through one AsyncTransport: one send, twenty 201s."""
    transport = idempotently.AsyncTransport(tmp_path / "journal.db")
    headers = {**AUTHORIZATION, "Idempotency-Key": "k-same"}
    async with httpx.AsyncClient(
        transport=transport, base_url=server.url, headers=headers
    ) as client:
        outcomes = await on_tasks(lambda _: client.post("/v1/charges", json=CHARGE))
    assert_sent_once(server, outcomes)
    assert {("user_1", "k-same"): 1} == server.charge_count_by_key()


def test_distinct_operations_from_threads_are_each_sent_once(
    tmp_path: Path, server: MockServer
) -> None:
    """20 threads, 20 operation ids, one Session: 20 sends, 20 charges, none lost."""
    with idempotently.Session(
        tmp_path / "journal.db", base_url=server.url, headers=AUTHORIZATION
    ) as session:
        outcomes = on_threads(
            lambda i: session.post(
                "/v1/charges",
                json={**CHARGE, "metadata": {"order_id": f"order-{i}"}},
                operation_id=f"order-{i}",
            )
        )
        counts = session.journal.counts()
        journaled = {
            f"order-{i}": getattr(session.journal.operation(f"order-{i}"), "key", None)
            for i in range(CALLERS)
        }
    assert [201] * CALLERS == [getattr(o, "status_code", repr(o)) for o in outcomes]
    stats = server.stats()
    assert (CALLERS, CALLERS) == (stats.requests, stats.charges)
    assert {("user_1", f"order-{i}"): 1 for i in range(CALLERS)} == server.charge_count_by_order()
    charged = {charge.metadata["order_id"]: charge.key for charge in server.charges()}
    assert charged == journaled  # each operation findable by its id, with the key charged
    assert CALLERS == counts["succeeded"] == sum(counts.values())


HELD = 3.0
"""Seconds the server holds the first caller's request in the waiter tests (within httpx's
5 s timeout): however loaded the machine, a waiter with a 0.2 s deadline gives up long
before it ends."""


def wait_for_arrival(server: MockServer) -> None:
    """Until the first request has reached the server (its answer is HELD away)."""
    deadline = time.monotonic() + 30
    while server.stats().requests < 1:
        assert time.monotonic() < deadline, "the first request never reached the server"
        time.sleep(0.005)


def test_a_waiter_past_its_deadline_gets_in_progress_and_nothing_is_sent_twice(
    tmp_path: Path, server: MockServer
) -> None:
    """A second caller whose deadline (0.2 s) ends first gets OperationInProgressError."""
    with (
        idempotently.Journal(tmp_path / "journal.db") as journal,
        idempotently.Session(journal, base_url=server.url, headers=AUTHORIZATION) as first,
        idempotently.Session(
            journal,
            base_url=server.url,
            headers=AUTHORIZATION,
            policy=idempotently.RetryPolicy(deadline=0.2),
        ) as impatient,
        ThreadPoolExecutor(1) as pool,
    ):
        server.faults.push(Fault.delay(HELD))
        sending = pool.submit(first.post, "/v1/charges", json=CHARGE, operation_id="same")
        wait_for_arrival(server)
        started = time.monotonic()
        with pytest.raises(idempotently.OperationInProgressError) as caught:
            impatient.post("/v1/charges", json=CHARGE, operation_id="same")
        waited = time.monotonic() - started
        still_in_flight = not sending.done()
        response = sending.result()
    assert still_in_flight, f"the first call ended before the waiter gave up ({waited:.3f}s)"
    assert 201 == response.status_code
    assert ("same", response.extensions["idempotently"].key) == (
        caught.value.operation_id,
        caught.value.key,
    )
    assert 1 == server.stats().requests


@pytest.mark.anyio
async def test_an_async_waiter_past_its_deadline_gets_in_progress(
    tmp_path: Path, server: MockServer
) -> None:
    """The same on asyncio and trio: the impatient task gives up, one request is sent."""
    responses: list[httpx.Response] = []
    with idempotently.Journal(tmp_path / "journal.db") as journal:
        async with (
            idempotently.AsyncSession(journal, base_url=server.url, headers=AUTHORIZATION) as first,
            idempotently.AsyncSession(
                journal,
                base_url=server.url,
                headers=AUTHORIZATION,
                policy=idempotently.RetryPolicy(deadline=0.2),
            ) as impatient,
            anyio.create_task_group() as group,
        ):

            async def send_first() -> None:
                responses.append(await first.post("/v1/charges", json=CHARGE, operation_id="same"))

            server.faults.push(Fault.delay(HELD))
            group.start_soon(send_first)
            with anyio.fail_after(30):
                while server.stats().requests < 1:
                    await anyio.sleep(0.005)
            with pytest.raises(idempotently.OperationInProgressError) as caught:
                await impatient.post("/v1/charges", json=CHARGE, operation_id="same")
            still_in_flight = not responses
    assert still_in_flight
    assert [201] == [response.status_code for response in responses]
    assert responses[0].extensions["idempotently"].key == caught.value.key
    assert 1 == server.stats().requests
