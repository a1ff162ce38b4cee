"""The app driven in-process through httpx.ASGITransport, on asyncio and trio."""

from __future__ import annotations

import httpx
import pytest

from idempotently.testing import REPLAY_HEADER, Fault, VirtualClock, create_app

from .conftest import post_async

pytestmark = pytest.mark.anyio


async def test_in_process_charge_and_replay() -> None:
    """Through ASGITransport the app creates once and replays, with no socket at all."""
    app = create_app(clock=VirtualClock())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://mock") as client:
        first = await post_async(client, "k-1")
        second = await post_async(client, "k-1")

    assert (201, first.content) == (second.status_code, second.content)
    assert "true" == second.headers[REPLAY_HEADER]
    assert 1 == len(app.ledger)


async def test_in_process_lost_response_is_a_transport_error() -> None:
    """In-process, a dropped connection raises httpx.RemoteProtocolError, as on a socket."""
    app = create_app()
    app.faults.push(Fault.lose_response())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://mock") as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await post_async(client, "k-1")
        retried = await post_async(client, "k-1")

    assert "true" == retried.headers[REPLAY_HEADER]
    assert 1 == len(app.ledger)
