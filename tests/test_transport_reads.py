"""Reads through a Transport: retried under the policy and budget, never journaled.

An SDK whose own retries are off (as the recipes advise) would otherwise lose its
GETs to the first 503. GET, HEAD and OPTIONS (PUT and DELETE when asked) are
retried on network errors, 5xx, 408, 425 and 429, without a key or a journal row;
the last answer or error comes through as it came.
"""

from __future__ import annotations

import gzip
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

import idempotently
from tests.scripted_server import ENDLESS_BYTES, Answer, ScriptedApp
from tests.support import FakeTime
from tests.test_answer_bodies import MEMORY_BOUND, bomb_answer, memory_growth

try:
    import httpx2
except ImportError:  # the [httpx2] extra
    httpx2 = None

URL = "https://api.example.test/v1/charges/ch_1"
POLICY = idempotently.RetryPolicy(max_attempts=3, initial_backoff=0.5, max_backoff=0.5)

Step = Callable[[httpx.Request], httpx.Response]


def script(*steps: Step | int) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """A server answering each step in turn (a status, or a function that may raise)."""
    sent: list[httpx.Request] = []
    queue = list(steps)

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        step = queue.pop(0)
        return httpx.Response(step) if isinstance(step, int) else step(request)

    return httpx.MockTransport(handler), sent


def raises(error: type[httpx.TransportError]) -> Step:
    def step(request: httpx.Request) -> httpx.Response:
        raise error("scripted", request=request)

    return step


def client(
    tmp_path: Path, fake_time: FakeTime, transport: httpx.MockTransport, **options: Any
) -> httpx.Client:
    options.setdefault("policy", POLICY)
    wrapped = idempotently.Transport(
        tmp_path / "journal.db",
        transport=transport,
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        **options,
    )
    return httpx.Client(transport=wrapped)


def rows(tmp_path: Path) -> int:
    with sqlite3.connect(tmp_path / "journal.db") as conn:
        return int(conn.execute("SELECT count(*) FROM operations").fetchone()[0])


@pytest.mark.parametrize(
    "first",
    [raises(httpx.ConnectError), raises(httpx.ReadTimeout), raises(httpx.RemoteProtocolError),
     500, 502, 503, 408, 425, 429],
    ids=["connect", "read-timeout", "reset", "500", "502", "503", "408", "425", "429"],
)  # fmt: skip
def test_a_get_is_retried_after_what_a_retry_may_change(
    tmp_path: Path, fake_time: FakeTime, first: Step | int
) -> None:
    """A network error (sent or not: a read may be repeated), a 5xx, 408, 425 or 429 is
    retried; the retry's answer comes back; nothing is journaled and no key is sent."""
    transport, sent = script(first, 200)
    with client(tmp_path, fake_time, transport) as c:
        assert 200 == c.get(URL).status_code
    assert 2 == len(sent)
    assert not any("idempotency-key" in request.headers for request in sent)
    assert 0 == rows(tmp_path)


@pytest.mark.parametrize("status", [200, 304, 400, 401, 404, 409, 422])
def test_a_final_answer_is_not_retried(tmp_path: Path, fake_time: FakeTime, status: int) -> None:
    """A 2xx, 3xx or 4xx other than 408/425/429 is the read's answer, sent once."""
    transport, sent = script(status)
    with client(tmp_path, fake_time, transport) as c:
        assert status == c.get(URL).status_code
    assert 1 == len(sent)


@pytest.mark.parametrize("method", ["HEAD", "OPTIONS"])
def test_head_and_options_are_reads_too(tmp_path: Path, fake_time: FakeTime, method: str) -> None:
    """HEAD and OPTIONS are retried like GET."""
    transport, sent = script(503, 200)
    with client(tmp_path, fake_time, transport) as c:
        assert 200 == c.request(method, URL).status_code
    assert 2 == len(sent)


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
def test_put_and_delete_are_retried_only_when_asked(
    tmp_path: Path, fake_time: FakeTime, method: str
) -> None:
    """PUT and DELETE go once by default; with retry_idempotent_methods=True they are
    retried, still without a journal row."""
    transport, sent = script(503, 503, 200)
    with client(tmp_path, fake_time, transport) as c:
        assert 503 == c.request(method, URL, json={}).status_code
    assert 1 == len(sent)
    with client(tmp_path, fake_time, transport, retry_idempotent_methods=True) as c:
        assert 200 == c.request(method, URL, json={}).status_code
    assert 3 == len(sent)
    assert 0 == rows(tmp_path)


def test_a_journaled_method_is_never_a_read(tmp_path: Path, fake_time: FakeTime) -> None:
    """PUT listed in methods= is journaled (a key, a row), whatever the read flag says."""
    transport, sent = script(201)
    with client(
        tmp_path, fake_time, transport, methods={"POST", "PUT"}, retry_idempotent_methods=True
    ) as c:
        c.put(URL, json={})
    assert "idempotency-key" in sent[0].headers
    assert 1 == rows(tmp_path)


def test_the_last_answer_comes_through_when_attempts_run_out(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """max_attempts 503s: the last 503 is returned, not raised, as the server sent it."""
    transport, sent = script(503, 503, 503)
    with client(tmp_path, fake_time, transport) as c:
        assert 503 == c.get(URL).status_code
    assert 3 == len(sent)


def test_the_last_error_comes_through_when_attempts_run_out(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """max_attempts connect errors: the last httpx.ConnectError is raised as it is."""
    transport, sent = script(*[raises(httpx.ConnectError)] * 3)
    with client(tmp_path, fake_time, transport) as c, pytest.raises(httpx.ConnectError):
        c.get(URL)
    assert 3 == len(sent)


def test_retry_after_is_honoured(tmp_path: Path, fake_time: FakeTime) -> None:
    """A 429 with Retry-After: 2 waits 2 s (more than the backoff) before the retry."""
    transport, _ = script(lambda r: httpx.Response(429, headers={"Retry-After": "2"}), 200)
    with client(tmp_path, fake_time, transport) as c:
        assert 200 == c.get(URL).status_code
    assert 2.0 == sum(fake_time.sleeps)  # in slices: an unpause would end it early


def test_a_wait_beyond_max_retry_after_returns_the_429(tmp_path: Path, fake_time: FakeTime) -> None:
    """A Retry-After above max_retry_after is not slept: the 429 is the answer."""
    transport, sent = script(lambda r: httpx.Response(429, headers={"Retry-After": "3600"}))
    with client(tmp_path, fake_time, transport) as c:
        assert 429 == c.get(URL).status_code
    assert ([], 1) == (fake_time.sleeps, len(sent))


def test_a_no_retry_hint_is_final(tmp_path: Path, fake_time: FakeTime) -> None:
    """x-should-retry: false on a 503 makes it the answer."""
    transport, sent = script(lambda r: httpx.Response(503, headers={"x-should-retry": "false"}))
    with client(tmp_path, fake_time, transport) as c:
        assert 503 == c.get(URL).status_code
    assert 1 == len(sent)


def test_reads_spend_the_process_budget(tmp_path: Path, fake_time: FakeTime) -> None:
    """With one retry in reserve, the second GET to a dead origin is sent once: its last
    answer comes through; a POST journaled after it is refused its retry too."""
    policy = idempotently.RetryPolicy(
        max_attempts=3, initial_backoff=0.0, max_backoff=0.0,
        budget=idempotently.RetryBudget(ratio=0.0, min_per_second=0.1),
    )  # fmt: skip
    transport, sent = script(*[503] * 10)
    with client(tmp_path, fake_time, transport, policy=policy) as c:
        assert 503 == c.get(URL).status_code
        assert 2 == len(sent)  # the first attempt and the reserve's one retry
        assert 503 == c.get(URL).status_code
        assert 3 == len(sent)
        with pytest.raises(idempotently.RetryBudgetError):
            c.post(URL, json={})
        assert 4 == len(sent)


def test_reads_without_a_budget_retry_until_max_attempts(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """budget=None: max_attempts alone bounds a read."""
    policy = idempotently.RetryPolicy(max_attempts=3, initial_backoff=0.0, budget=None)
    transport, sent = script(*[503] * 9)
    with client(tmp_path, fake_time, transport, policy=policy) as c:
        for _ in range(3):
            c.get(URL)
    assert 9 == len(sent)


def test_a_read_on_a_real_server_is_retried_and_streams(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """End to end on loopback: a GET answered 503 then 200 is sent twice, and the final
    answer can still be streamed by the caller."""
    app, url = scripted
    app.answer(Answer(status=503), Answer(status=200, body=b"x" * 100_000))
    policy = idempotently.RetryPolicy(initial_backoff=0.0, max_backoff=0.0)
    transport = idempotently.Transport(tmp_path / "journal.db", policy=policy)
    with httpx.Client(transport=transport) as c, c.stream("GET", f"{url}/charges/ch_1") as response:
        assert 200 == response.status_code
        assert 100_000 == sum(len(chunk) for chunk in response.iter_bytes())
    assert [None, None] == [arrival.key for arrival in app.arrivals]
    assert 0 == rows(tmp_path)


@pytest.mark.anyio
async def test_an_async_transport_retries_reads(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncTransport on asyncio and trio: a GET answered 502 then 200 on a real socket is
    retried, unjournaled."""
    app, url = scripted
    app.answer(Answer(status=502), Answer(status=200))
    policy = idempotently.RetryPolicy(initial_backoff=0.0, max_backoff=0.0)
    transport = idempotently.AsyncTransport(tmp_path / "journal.db", policy=policy)
    async with httpx.AsyncClient(transport=transport) as c:
        assert 200 == (await c.get(f"{url}/charges/ch_1")).status_code
    assert 2 == len(app.arrivals)
    assert 0 == rows(tmp_path)


def test_retry_idempotent_methods_must_be_a_bool(tmp_path: Path) -> None:
    """A wrong type is a TypeError naming the option."""
    with pytest.raises(TypeError, match="retry_idempotent_methods"):
        idempotently.Transport(tmp_path / "journal.db", retry_idempotent_methods="yes")  # type: ignore[arg-type]


# -- an answer that is retried is closed unread -------------------------------------------

CHUNK = b"x" * 65536
ENDLESS_LIMIT = 32 * 1024 * 1024
"""Where the fake endless body stops, so a transport that reads it fails, not hangs."""


class Endless(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body that goes on (to ``ENDLESS_LIMIT``), counting what was read of it."""

    def __init__(self) -> None:
        self.read = 0
        self.closed = False

    def _chunks(self) -> Iterator[bytes]:
        while self.read < ENDLESS_LIMIT and not self.closed:
            self.read += len(CHUNK)
            yield CHUNK

    def __iter__(self) -> Iterator[bytes]:
        yield from self._chunks()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks():
            yield chunk

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


def endless_then_ok() -> tuple[httpx.MockTransport, list[Endless]]:
    bodies: list[Endless] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if bodies:
            return httpx.Response(200, content=b"ok")
        bodies.append(Endless())
        return httpx.Response(503, stream=bodies[-1])

    return httpx.MockTransport(handler), bodies


def test_a_retried_answer_is_closed_without_reading_its_body(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A 503 whose body never ends is closed unread, and the GET is retried: a hostile
    server cannot make the transport read (or hold in memory) an endless body."""
    transport, bodies = endless_then_ok()
    with client(tmp_path, fake_time, transport) as c:
        assert (200, b"ok") == (lambda r: (r.status_code, r.content))(c.get(URL))
    [body] = bodies
    assert (0, True) == (body.read, body.closed)


@pytest.mark.anyio
async def test_an_async_transport_closes_a_retried_answer_unread(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """AsyncTransport (asyncio and trio): the endless 503 is closed unread, the retry's
    answer comes back."""
    transport, bodies = endless_then_ok()
    wrapped = idempotently.AsyncTransport(
        tmp_path / "journal.db",
        transport=transport,
        policy=POLICY,
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
    )
    async with httpx.AsyncClient(transport=wrapped) as c:
        assert 200 == (await c.get(URL)).status_code
    [body] = bodies
    assert (0, True) == (body.read, body.closed)


def test_the_last_retryable_answer_comes_through_unread(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """When the attempts run out, the last 503 is the caller's as it came: unread, so a
    caller streaming it reads what it wants; the ones retried before it were closed."""
    bodies: list[Endless] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(Endless())
        return httpx.Response(503, stream=bodies[-1])

    with (
        client(tmp_path, fake_time, httpx.MockTransport(handler)) as c,
        c.stream("GET", URL) as response,
    ):
        assert 503 == response.status_code
        assert CHUNK == next(response.iter_raw(len(CHUNK)))
    assert [(0, True), (0, True)] == [(body.read, body.closed) for body in bodies[:2]]
    assert (len(CHUNK), 3) == (bodies[2].read, len(bodies))


@pytest.mark.parametrize(
    "lib",
    [
        pytest.param(httpx, id="httpx"),
        pytest.param(
            httpx2, id="httpx2", marks=pytest.mark.skipif(httpx2 is None, reason="needs httpx2")
        ),
    ],
)
def test_a_real_servers_endless_503_is_cut_off(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], lib: ModuleType
) -> None:
    """On loopback, uvicorn streaming a 503's body without end: the transport hangs up
    after the headers (the server sees the client go long before its 64 MiB), retries,
    and returns the 200, under an httpx or an httpx2 client."""
    app, url = scripted
    app.answer(Answer(status=503, endless=True), Answer(status=200, body=b"ok"))
    policy = idempotently.RetryPolicy(initial_backoff=0.0, max_backoff=0.0)
    transport = idempotently.Transport(tmp_path / "journal.db", policy=policy)
    with lib.Client(transport=transport, timeout=30) as c:
        response = c.get(f"{url}/charges/ch_1")
    assert (lib.Response, 200, b"ok") == (type(response), response.status_code, response.content)
    assert 2 == len(app.arrivals)
    [streamed] = app.streamed
    assert streamed < ENDLESS_BYTES // 4


@pytest.mark.anyio
async def test_an_async_transport_cuts_off_a_real_endless_503(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """The same on asyncio and trio with AsyncTransport."""
    app, url = scripted
    app.answer(Answer(status=503, endless=True), Answer(status=200, body=b"ok"))
    policy = idempotently.RetryPolicy(initial_backoff=0.0, max_backoff=0.0)
    transport = idempotently.AsyncTransport(tmp_path / "journal.db", policy=policy)
    async with httpx.AsyncClient(transport=transport, timeout=30) as c:
        response = await c.get(f"{url}/charges/ch_1")
    assert 200 == response.status_code
    [streamed] = app.streamed
    assert streamed < ENDLESS_BYTES // 4


def test_a_reads_503_bomb_is_closed_unread_and_the_gzip_answer_decodes(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A GET answered by a 503 that inflates (gzip, gzip) to 256 MiB is retried without
    its body being decoded (the process grows by far less than 100 MiB), and the retry's
    gzip 200 reaches the caller decoded; no journal row is written."""
    app, url = scripted
    app.answer(
        bomb_answer(503),
        Answer(status=200, headers=(("content-encoding", "gzip"),), body=gzip.compress(b"ok")),
    )
    policy = idempotently.RetryPolicy(initial_backoff=0.0, max_backoff=0.0)
    transport = idempotently.Transport(tmp_path / "journal.db", policy=policy)
    with httpx.Client(transport=transport, timeout=30) as c, memory_growth() as grew:
        response = c.get(f"{url}/charges/ch_1")
    assert grew[0] < MEMORY_BOUND
    assert (200, b"ok") == (response.status_code, response.content)
    assert 2 == len(app.arrivals)
    assert 0 == rows(tmp_path)
