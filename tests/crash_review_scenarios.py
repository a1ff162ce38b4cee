"""Scenarios for the review of `crash_points`: module level, so a child process finds them.

Each is a user's code as a demanding user or a careless one writes it: the
ways to send (outbox, transport, httpx2, own keys, threads, task groups), a
server that fails first, and the misuses the harness must refuse clearly.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

import idempotently
from idempotently.profiles import GENERIC
from tests.crash_scenarios import ORDERS, charge

BEARER = {"Authorization": "Bearer user_1"}


# -- ways to send that must hold ----------------------------------------------------


def enqueue_then_resume(session: idempotently.Session) -> None:
    """The client-side outbox: journal both, then send them with resume."""
    for order in ORDERS:
        session.enqueue("POST", "/v1/charges", operation_id=f"{order}:charge", json=charge(order))
    session.resume()


def enqueue_only(session: idempotently.Session) -> None:
    """Journals both and sends nothing (a worker elsewhere would): no charge to count."""
    for order in ORDERS:
        session.enqueue("POST", "/v1/charges", operation_id=f"{order}:charge", json=charge(order))


def own_keys(session: idempotently.Session) -> None:
    """Per-call keys from the order, as a payments SDK user passes them."""
    for order in ORDERS:
        session.post(
            "/v1/charges",
            operation_id=f"{order}:charge",
            idempotency_key=f"key-{order}",
            json=charge(order),
        )


def in_threads(session: idempotently.Session) -> None:
    """Both orders at once, from two threads sharing the session."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(
                session.post, "/v1/charges", operation_id=f"{order}:charge", json=charge(order)
            )
            for order in ORDERS
        ]
        for future in futures:
            future.result()


async def in_a_task_group(session: idempotently.AsyncSession) -> None:
    """Both orders at once, in one task group (asyncio or trio)."""

    async def place(order: str) -> None:
        await session.post("/v1/charges", operation_id=f"{order}:charge", json=charge(order))

    async with anyio.create_task_group() as group:
        for order in ORDERS:
            group.start_soon(place, order)


def unavailable_first(session: idempotently.Session) -> None:
    """The server answers order-1's first attempt 503; the retry charges."""
    session.client.post(
        "/v1/_faults",
        json={"faults": [{"kind": "unavailable"}], "order_id": "order-1"},
    ).raise_for_status()
    session.post("/v1/charges", operation_id="order-1:charge", json=charge("order-1"))


def noisy(session: idempotently.Session) -> None:
    """Prints a lot on both streams, as a debug-logging application does."""
    for index in range(20_000):
        print(f"line {index} of a chatty application", flush=False)
        print(f"warning {index}", file=sys.stderr)
    for order in ORDERS:
        session.post("/v1/charges", operation_id=f"{order}:charge", json=charge(order))


# -- careless code the harness must not pass ---------------------------------------


def charges_nothing(session: idempotently.Session) -> None:
    """Every call is refused (400): nothing moves, so every crash point "holds" vacuously."""
    session.post("/v1/charges", operation_id="order-1:charge", json=charge("order-1", -1))


# -- misuse: each a clear error, never a hang or a stray process ---------------------


def exits_early(session: idempotently.Session) -> None:
    session.post("/v1/charges", operation_id="order-1:charge", json=charge("order-1"))
    os._exit(0)


def forks_a_sleeper(session: idempotently.Session) -> None:
    """Leaves a grandchild process behind, holding everything the child inherited."""
    if os.fork() == 0:
        Path(os.environ["CRASH_REVIEW_PIDS"], str(os.getpid())).touch()
        time.sleep(3600)
        os._exit(0)
    for order in ORDERS:
        session.post("/v1/charges", operation_id=f"{order}:charge", json=charge(order))


def leaves_a_thread(session: idempotently.Session) -> None:
    """A non-daemon thread that outlives the scenario keeps the process alive."""
    import threading

    threading.Thread(target=time.sleep, args=(3600,)).start()
    session.post("/v1/charges", operation_id="order-1:charge", json=charge("order-1"))


def kills_itself(session: idempotently.Session) -> None:
    session.post("/v1/charges", operation_id="order-1:charge", json=charge("order-1"))
    os.kill(os.getpid(), signal.SIGKILL)


# -- session factories ---------------------------------------------------------------


def transport_session(journal: Path, base_url: str) -> idempotently.Session:
    """Not a Session: an httpx.Client on idempotently's Transport (it has no resume)."""
    return httpx.Client(  # type: ignore[return-value]
        base_url=base_url, headers=BEARER, transport=idempotently.Transport(journal)
    )


def httpx2_session(journal: Path, base_url: str) -> idempotently.Session:
    import httpx2

    return idempotently.Session(journal, client=httpx2.Client(base_url=base_url, headers=BEARER))


def encrypted_session(journal: Path, base_url: str) -> idempotently.Session:
    key = b"Zq0m7bq1vY0d3c9l3xgq3m2b8j1n6v5c4x3z2a1s0d8="
    return idempotently.Session(
        idempotently.Journal(journal, codec=idempotently.FernetCodec(key)),
        base_url=base_url,
        headers=BEARER,
    )


def bound_key_session(journal: Path, base_url: str) -> idempotently.Session:
    import attrs

    return idempotently.Session(
        journal,
        base_url=base_url,
        headers=BEARER,
        profile=attrs.evolve(GENERIC, key_bound_to_credentials=True),
    )


def hook_bound_key_session(journal: Path, base_url: str) -> idempotently.Session:
    """Keys bound to credentials that a request hook sets as each request leaves (the
    token-refresh pattern): the binding is journaled by the first send, after the key."""
    import attrs

    def set_token(request: httpx.Request) -> None:
        request.headers.update(BEARER)

    return idempotently.Session(
        journal,
        base_url=base_url,
        event_hooks={"request": [set_token]},
        profile=attrs.evolve(GENERIC, key_bound_to_credentials=True),
    )


class OwnTransport(httpx.BaseTransport):
    """A transport of the user's own (http.client underneath), which the harness cannot see."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        import http.client

        connection = http.client.HTTPConnection(request.url.host, request.url.port)
        try:
            connection.request(
                request.method,
                request.url.raw_path.decode("ascii"),
                body=request.read(),
                headers=dict(request.headers),
            )
            answer = connection.getresponse()
            return httpx.Response(answer.status, headers=answer.getheaders(), content=answer.read())
        finally:
            connection.close()


def session_on_its_own_transport(journal: Path, base_url: str) -> idempotently.Session:
    return idempotently.Session(
        journal,
        client=httpx.Client(base_url=base_url, headers=BEARER, transport=OwnTransport()),
    )


def reordered_on_restart(session: idempotently.Session) -> None:
    """Crash-safe ids, in an order that changes from one process to the next (rows
    read without ORDER BY, a dict of futures): each process notes itself in a file."""
    runs = Path(os.environ["CRASH_REVIEW_RUNS"])
    count = len(list(runs.iterdir()))
    (runs / str(os.getpid())).touch()
    for order in ORDERS if count % 2 == 0 else ORDERS[::-1]:
        session.post("/v1/charges", operation_id=f"{order}:charge", json=charge(order))


def async_session(journal: Path, base_url: str) -> idempotently.AsyncSession:
    return idempotently.AsyncSession(journal, base_url=base_url, headers=BEARER)


def does_less_when_crashed(session: idempotently.Session) -> None:
    """Careless: its second process (the one crashed) charges order-1 only, then returns."""
    runs = Path(os.environ["CRASH_REVIEW_RUNS"])
    count = len(list(runs.iterdir()))
    (runs / str(os.getpid())).touch()
    for order in ORDERS[:1] if count == 1 else ORDERS:
        session.post("/v1/charges", operation_id=f"{order}:charge", json=charge(order))


def leaves_one_pending(session: idempotently.Session) -> None:
    """Charges order-1, and journals order-2 for a worker that never comes."""
    session.post("/v1/charges", operation_id="order-1:charge", json=charge("order-1"))
    session.enqueue("POST", "/v1/charges", operation_id="order-2:charge", json=charge("order-2"))


def _logged(function: Any) -> Any:
    """A decorator as many are written: a plain function around an async one."""
    import functools

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return wrapper


@_logged
async def decorated_async(session: idempotently.AsyncSession) -> None:
    await session.post("/v1/charges", operation_id="order-1:charge", json=charge("order-1"))


class Checkout:
    def place(self, session: idempotently.Session) -> None:
        session.post("/v1/charges", operation_id="order-1:charge", json=charge("order-1"))


def places_orders_twice(session: idempotently.Session) -> None:
    """Crash-safe, and calls each operation again (a replay from the journal)."""
    for _ in range(2):
        for order in ORDERS:
            session.post("/v1/charges", operation_id=f"{order}:charge", json=charge(order))


def leaves_a_thread_that_ends_soon(session: idempotently.Session) -> None:
    """Like an event loop's worker threads: still running as it returns, ended a moment later."""
    import threading

    threading.Thread(target=time.sleep, args=(0.5,)).start()
    session.post("/v1/charges", operation_id="order-1:charge", json=charge("order-1"))
