"""The client contract against a real uvicorn server on 127.0.0.1 and a real journal file."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

import idempotently
from tests.scripted_server import RESET, Answer, ScriptedApp

TOKEN = "sk_live_do_not_store_me_4242"

Scripted = tuple[ScriptedApp, str]


def session(tmp_path: Path, url: str, **options: object) -> idempotently.Session:
    options.setdefault("policy", idempotently.RetryPolicy(initial_backoff=0.01, max_backoff=0.05))
    return idempotently.Session(
        tmp_path / "journal.db",
        base_url=url,
        headers={"Authorization": f"Bearer {TOKEN}"},
        **options,  # type: ignore[arg-type]
    )


def test_key_is_in_the_journal_file_before_the_first_request_arrives(
    tmp_path: Path, scripted: Scripted
) -> None:
    """(a) The server sees a key that another connection can already read in the journal."""
    app, url = scripted
    app.journal_path = str(tmp_path / "journal.db")
    with session(tmp_path, url) as s:
        response = s.post("/v1/charges", json={"amount": 1000}, operation_id="order-1")
    assert 201 == response.status_code
    assert [True] == [arrival.key_in_journal for arrival in app.arrivals]


def test_every_attempt_carries_the_same_key_and_identical_bytes(
    tmp_path: Path, scripted: Scripted
) -> None:
    """(b) Retries after 503 and 500 resend the first key and the first body bytes."""
    app, url = scripted
    app.answer(Answer(503), Answer(500), Answer(201))
    with session(tmp_path, url) as s:
        response = s.post("/v1/charges", json={"amount": 1000, "currency": "usd"})
    assert 201 == response.status_code
    assert 3 == len(app.arrivals)
    assert 1 == len({arrival.key for arrival in app.arrivals})
    assert 1 == len({arrival.body for arrival in app.arrivals})
    assert response.extensions["idempotently"].key == app.arrivals[0].key


def test_connection_reset_after_the_server_read_the_request_is_retried_with_the_same_key(
    tmp_path: Path, scripted: Scripted
) -> None:
    """(c) A lost response (maybe delivered) is retried with the same key and bytes."""
    app, url = scripted
    app.answer(RESET, Answer(201))
    with session(tmp_path, url) as s:
        response = s.post("/v1/charges", json={"amount": 1000}, operation_id="order-c")
        operation = s.journal.operation("order-c")
    assert 201 == response.status_code
    assert 2 == len(app.arrivals)
    assert app.arrivals[0].key == app.arrivals[1].key
    assert app.arrivals[0].body == app.arrivals[1].body
    assert operation is not None
    assert ["maybe_delivered", "answered"] == [a.outcome for a in operation.attempts]


def test_422_is_attempted_exactly_once(tmp_path: Path, scripted: Scripted) -> None:
    """(d) A 422 is final: returned, journaled as failed, never retried."""
    app, url = scripted
    app.answer(Answer(422, body=b'{"error": "amount must be positive"}'))
    with session(tmp_path, url) as s:
        response = s.post("/v1/charges", json={"amount": -1}, operation_id="bad")
        operation = s.journal.operation("bad")
    assert 422 == response.status_code
    assert 1 == len(app.arrivals)
    assert operation is not None
    assert "failed" == operation.status


def test_429_with_retry_after_one_waits_at_least_a_second(
    tmp_path: Path, scripted: Scripted
) -> None:
    """(e) The retry after 429 + Retry-After: 1 reaches the server a second later or more."""
    app, url = scripted
    app.answer(Answer(429, headers=(("retry-after", "1"),)), Answer(201))
    with session(tmp_path, url) as s:
        response = s.post("/v1/charges", json={"amount": 5})
    assert 201 == response.status_code
    assert 2 == len(app.arrivals)
    assert app.arrivals[1].at - app.arrivals[0].at >= 1.0


def test_huge_retry_after_raises_retry_later_at_once(tmp_path: Path, scripted: Scripted) -> None:
    """(f) Retry-After: 86400 raises RetryLaterError without sleeping; not_before is durable."""
    app, url = scripted
    app.answer(Answer(429, headers=(("retry-after", "86400"),)))
    started = time.monotonic()
    with session(tmp_path, url) as s, pytest.raises(idempotently.RetryLaterError) as caught:
        s.post("/v1/charges", json={"amount": 5}, operation_id="slow-down")
    assert time.monotonic() - started < 60  # far from 86400, however loaded the machine
    assert 1 == len(app.arrivals)
    with idempotently.Journal(tmp_path / "journal.db") as journal:
        operation = journal.operation("slow-down")
    assert operation is not None
    assert "pending" == operation.status
    assert operation.not_before == pytest.approx(caught.value.not_before)
    assert caught.value.not_before > time.time() + 86000
    assert "slow-down" == caught.value.operation_id


def test_bearer_token_never_reaches_the_journal_or_its_wal(
    tmp_path: Path, scripted: Scripted
) -> None:
    """(g) The Authorization value is sent but appears in neither the journal nor the WAL."""
    app, url = scripted
    app.answer(Answer(503), RESET, Answer(201))
    with session(tmp_path, url, redact_headers=["X-Partner-Secret"]) as s:
        s.post(
            "/v1/charges",
            json={"amount": 5},
            headers={"X-Partner-Secret": "partner-secret-77", "Cookie": "sid=cookie-secret-99"},
        )
        on_disk = b"".join(path.read_bytes() for path in tmp_path.glob("journal.db*"))
        wal = tmp_path / "journal.db-wal"
        assert wal.exists() and wal.stat().st_size > 0
    assert all(arrival.authorization == f"Bearer {TOKEN}" for arrival in app.arrivals)
    for secret in (TOKEN, "partner-secret-77", "cookie-secret-99"):
        assert secret.encode() not in on_disk


@pytest.mark.anyio
async def test_async_session_retries_a_reset_with_the_same_key(
    tmp_path: Path, scripted: Scripted
) -> None:
    """AsyncSession (asyncio and trio) journals first and retries a lost response."""
    app, url = scripted
    app.journal_path = str(tmp_path / "journal.db")
    app.answer(RESET, Answer(503), Answer(201))
    async with idempotently.AsyncSession(
        tmp_path / "journal.db",
        base_url=url,
        policy=idempotently.RetryPolicy(initial_backoff=0.01),
    ) as s:
        response = await s.post("/v1/charges", json={"amount": 7}, operation_id="async-1")
    assert 201 == response.status_code
    assert [True, True, True] == [arrival.key_in_journal for arrival in app.arrivals]
    assert 1 == len({(arrival.key, arrival.body) for arrival in app.arrivals})


def test_wrapping_an_existing_client_keeps_its_settings(tmp_path: Path, scripted: Scripted) -> None:
    """Session(client=...) sends through the caller's client, with its base URL and headers."""
    app, url = scripted
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"})
    with idempotently.Session(tmp_path / "journal.db", client=client) as s:
        assert 201 == s.post("/v1/charges", json={"amount": 1}).status_code
    assert f"Bearer {TOKEN}" == app.arrivals[0].authorization
    assert not client.is_closed  # the caller's client is the caller's to close
    client.close()
