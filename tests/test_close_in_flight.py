"""Closing the journal while a call is in flight: the error says what is true (the
request may have been delivered; resume finishes it) and names the operation and key."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

import idempotently
from tests.support import URL


def test_a_journal_closed_during_a_send_says_the_request_may_have_been_sent(
    tmp_path: Path,
) -> None:
    """close() while the request is on the wire: JournalError saying the attempt may have
    reached the server and how to finish it, with the operation id and key; a new journal
    finds the operation pending, and resume settles it with the same key."""
    path = tmp_path / "journal.db"
    journal = idempotently.Journal(path)
    keys: list[str] = []

    def close_mid_send(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["Idempotency-Key"])
        journal.close()
        return httpx.Response(201)

    with (
        idempotently.Session(journal, transport=httpx.MockTransport(close_mid_send)) as session,
        pytest.raises(idempotently.JournalError) as caught,
    ):
        session.post(URL, json={"amount": 1}, operation_id="order-1")
    message = str(caught.value)
    assert "may have been delivered" in message and "resume" in message
    assert "nothing was sent" not in message
    assert ("order-1", keys[0]) == (caught.value.operation_id, caught.value.key)
    with idempotently.Session(
        path,
        transport=httpx.MockTransport(
            lambda r: keys.append(r.headers["Idempotency-Key"]) or httpx.Response(201)
        ),
    ) as again:
        assert "pending" == again.journal.operation("order-1").status  # type: ignore[union-attr]
        assert ["succeeded"] == [result.status for result in again.resume()]
    assert [keys[0], keys[0]] == keys  # the resend carried the same key


@pytest.mark.anyio
async def test_an_async_journal_closed_during_a_send_says_so_too(
    tmp_path: Path, anyio_backend: str
) -> None:
    """The same on asyncio and trio: the answer's write finds the journal closed."""
    journal = idempotently.Journal(tmp_path / "journal.db")
    keys: list[str] = []

    async def close_mid_send(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["Idempotency-Key"])
        await anyio.to_thread.run_sync(journal.close)
        return httpx.Response(201)

    async with (
        httpx.AsyncClient(transport=httpx.MockTransport(close_mid_send)) as client,
        idempotently.AsyncSession(journal, client=client) as session,
    ):
        with pytest.raises(idempotently.JournalError) as caught:
            await session.post(URL, json={"amount": 1}, operation_id="order-1")
    assert "may have been delivered" in str(caught.value)
    assert ("order-1", keys[0]) == (caught.value.operation_id, caught.value.key)
