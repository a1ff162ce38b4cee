"""Reads through a Session: ``get``, ``head`` and ``options`` (and AsyncSession's), on a
real loopback server.

A read is never journaled and carries no key; it is retried as a Transport's reads
are (the engine's one read flow): after a network error, a 5xx, 408, 425 or 429 (not
before its Retry-After), under the session's policy and retry budget, an answer it
retries closed unread. Writes (``post``) are journaled as before.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx
import pytest

import idempotently
from tests.scripted_server import ENDLESS_BYTES, Answer, ScriptedApp
from tests.support import FakeTime

FAST = idempotently.RetryPolicy(initial_backoff=0.0, max_backoff=0.0)
AUTH = {"Authorization": "Bearer sk_test"}

Scripted = tuple[ScriptedApp, str]


def rows(journal: Path) -> int:
    """Operations in the journal."""
    with sqlite3.connect(journal) as conn:
        return int(conn.execute("SELECT count(*) FROM operations").fetchone()[0])


def test_a_get_retried_after_a_503_returns_the_200_and_journals_nothing(
    tmp_path: Path, scripted: Scripted
) -> None:
    """GET answered 503 then 200: the caller gets the 200 (read), both sent without a key
    and with the session's credentials; the journal holds nothing. A POST still journals."""
    app, url = scripted
    app.answer(Answer(status=503), Answer(status=200, body=b'{"id": "ch_1"}'))
    journal = tmp_path / "journal.db"
    with idempotently.Session(journal, base_url=url, headers=AUTH, policy=FAST) as session:
        response = session.get("/v1/charges/ch_1", params={"expand": "customer"})
        assert (200, {"id": "ch_1"}) == (response.status_code, response.json())
        assert [(None, "Bearer sk_test", b"expand=customer")] * 2 == [
            (arrival.key, arrival.authorization, arrival.query) for arrival in app.arrivals
        ]
        assert 0 == rows(journal)
        app.answer(Answer(status=201))
        assert 201 == session.post("/v1/charges", json={"amount": 1}).status_code
    assert app.arrivals[-1].key is not None
    assert 1 == rows(journal)


@pytest.mark.anyio
async def test_an_async_get_retried_after_a_503_returns_the_200_and_journals_nothing(
    tmp_path: Path, scripted: Scripted, anyio_backend: str
) -> None:
    """AsyncSession.get on asyncio and trio: 503 then 200 gives the 200, unjournaled and
    without a key; a POST through the same session still journals."""
    app, url = scripted
    app.answer(Answer(status=503), Answer(status=200, body=b'{"id": "ch_1"}'))
    journal = tmp_path / "journal.db"
    async with idempotently.AsyncSession(
        journal, base_url=url, headers=AUTH, policy=FAST
    ) as session:
        response = await session.get("/v1/charges/ch_1")
        assert (200, {"id": "ch_1"}) == (response.status_code, response.json())
        assert [None, None] == [arrival.key for arrival in app.arrivals]
        assert 0 == rows(journal)
        app.answer(Answer(status=201))
        assert 201 == (await session.post("/v1/charges", json={"amount": 1})).status_code
    assert app.arrivals[-1].key is not None
    assert 1 == rows(journal)


@pytest.mark.parametrize("method", ["head", "options"])
def test_head_and_options_are_reads_too(tmp_path: Path, scripted: Scripted, method: str) -> None:
    """HEAD and OPTIONS answered 502 then 200: retried, unjournaled, without a key."""
    app, url = scripted
    app.answer(Answer(status=502), Answer(status=200))
    journal = tmp_path / "journal.db"
    with idempotently.Session(journal, base_url=url, policy=FAST) as session:
        assert 200 == getattr(session, method)("/v1/charges").status_code
    assert [None, None] == [arrival.key for arrival in app.arrivals]
    assert 0 == rows(journal)


@pytest.mark.anyio
@pytest.mark.parametrize("method", ["head", "options"])
async def test_async_head_and_options_are_reads_too(
    tmp_path: Path, scripted: Scripted, anyio_backend: str, method: str
) -> None:
    """AsyncSession's HEAD and OPTIONS: retried after a 502, unjournaled."""
    app, url = scripted
    app.answer(Answer(status=502), Answer(status=200))
    journal = tmp_path / "journal.db"
    async with idempotently.AsyncSession(journal, base_url=url, policy=FAST) as session:
        assert 200 == (await getattr(session, method)("/v1/charges")).status_code
    assert 2 == len(app.arrivals)
    assert 0 == rows(journal)


def test_a_429_is_retried_after_its_retry_after(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime
) -> None:
    """A 429 with Retry-After: 7 is retried no sooner than 7 s later (the session's sleep)."""
    app, url = scripted
    app.answer(Answer(status=429, headers=(("retry-after", "7"),)), Answer(status=200))
    journal = tmp_path / "journal.db"
    with idempotently.Session(
        journal, base_url=url, clock=fake_time.clock, sleep=fake_time.sleep
    ) as session:
        assert 200 == session.get("/v1/charges/ch_1").status_code
    assert 2 == len(app.arrivals)
    # A wait on a pause is slept in slices of at most a second (so an unpause wakes it):
    # what counts is that the retry came no sooner than the Retry-After.
    assert sum(fake_time.sleeps) >= 7


@pytest.mark.parametrize("status", [400, 404, 409, 422])
def test_a_final_answer_is_returned_unretried(
    tmp_path: Path, scripted: Scripted, status: int
) -> None:
    """A 4xx other than 408, 425 and 429 is the read's final answer: sent once, returned."""
    app, url = scripted
    app.answer(Answer(status=status), Answer(status=200))
    with idempotently.Session(tmp_path / "journal.db", base_url=url, policy=FAST) as session:
        assert status == session.get("/v1/charges/ch_1").status_code
    assert 1 == len(app.arrivals)


def test_the_last_answer_comes_through_when_attempts_run_out(
    tmp_path: Path, scripted: Scripted
) -> None:
    """Three 503s under max_attempts=3: the third 503 is returned, as httpx would."""
    app, url = scripted
    app.answer(*[Answer(status=503, body=b"busy")] * 3)
    policy = idempotently.RetryPolicy(max_attempts=3, initial_backoff=0.0, max_backoff=0.0)
    with idempotently.Session(tmp_path / "journal.db", base_url=url, policy=policy) as session:
        response = session.get("/v1/charges/ch_1")
    assert (503, b"busy") == (response.status_code, response.content)
    assert 3 == len(app.arrivals)


def test_the_last_network_error_comes_through_when_attempts_run_out(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """Connection refused on every attempt: httpx's ConnectError after max_attempts."""
    sent: list[httpx.Request] = []

    def refuse(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        raise httpx.ConnectError("connection refused", request=request)

    policy = idempotently.RetryPolicy(max_attempts=3)
    client = httpx.Client(transport=httpx.MockTransport(refuse), base_url="https://api.test")
    with (
        idempotently.Session(
            tmp_path / "journal.db",
            client=client,
            policy=policy,
            clock=fake_time.clock,
            sleep=fake_time.sleep,
        ) as session,
        pytest.raises(httpx.ConnectError),
    ):
        session.get("/v1/charges/ch_1")
    assert 3 == len(sent)
    assert 0 == rows(tmp_path / "journal.db")


def test_a_retried_answer_is_closed_unread(tmp_path: Path, scripted: Scripted) -> None:
    """An endless 503 is closed without reading it to its end; the retry's 200 comes back."""
    app, url = scripted
    app.answer(Answer(status=503, endless=True), Answer(status=200))
    with idempotently.Session(tmp_path / "journal.db", base_url=url, policy=FAST) as session:
        assert 200 == session.get("/v1/charges/ch_1").status_code
    assert 2 == len(app.arrivals)
    assert all(streamed < ENDLESS_BYTES for streamed in app.streamed)


def test_a_session_has_no_unjournaled_writes() -> None:
    """put, patch and delete are not reads: a Session has no such shortcut (a write goes
    through `request`, journaled)."""
    for session_class in (idempotently.Session, idempotently.AsyncSession):
        assert [] == [m for m in ("put", "patch", "delete") if hasattr(session_class, m)]
