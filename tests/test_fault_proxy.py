"""The fault proxy the wire tests rely on: it forwards, loses chosen answers, and holds."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from idempotently.testing import MockServer, serve
from tests.fault_proxy import FaultProxy

CHARGE = {"amount": 100, "currency": "usd", "customer": "cus_1", "metadata": {"order_id": "o"}}


@pytest.fixture
def server() -> Iterator[MockServer]:
    with serve() as running:
        yield running


def post(client: httpx.Client, key: str) -> httpx.Response:
    return client.post("/v1/charges", json=CHARGE, headers={"Idempotency-Key": key})


def client_for(proxy: FaultProxy) -> httpx.Client:
    return httpx.Client(base_url=proxy.url, headers={"Authorization": "Bearer shop_1"})


def test_answers_pass_through_on_one_keep_alive_connection(server: MockServer) -> None:
    """Without faults the proxy is transparent, several requests on one client connection."""
    with FaultProxy(server.url) as proxy, client_for(proxy) as client:
        answers = [post(client, f"k-{i}") for i in range(3)]
        assert [201, 201, 201] == [answer.status_code for answer in answers]
        assert 1 == len({answer.extensions["network_stream"] for answer in answers})
        assert (3, 0, []) == (proxy.requests, proxy.resets, proxy.errors)
    assert 3 == len(server.charges())


def test_the_chosen_answer_is_lost_after_the_server_acted(server: MockServer) -> None:
    """Every 2nd request is charged by the server and its client connection reset."""
    with FaultProxy(server.url, reset_every=2) as proxy, client_for(proxy) as client:
        assert 201 == post(client, "k-1").status_code
        with pytest.raises(httpx.TransportError):
            post(client, "k-2")
        replay = post(client, "k-2")
        assert (201, "true") == (replay.status_code, replay.headers["idempotent-replayed"])
        assert (3, 1, []) == (proxy.requests, proxy.resets, proxy.errors)
    assert ["k-1", "k-2"] == [charge.key for charge in server.charges()]


def test_held_requests_reach_the_server_only_when_released(server: MockServer) -> None:
    """hold_first keeps requests at the proxy, unforwarded, until release()."""
    answers: list[int] = []
    with FaultProxy(server.url, hold_first=1) as proxy, client_for(proxy) as client:
        sender = threading.Thread(target=lambda: answers.append(post(client, "k-1").status_code))
        sender.start()
        [held] = proxy.wait_until_held(1, timeout=10)
        assert b"idempotency-key: k-1" in held.lower()
        assert 0 == server.stats().requests
        proxy.release()
        sender.join(timeout=10)
    assert [201] == answers
    assert 1 == len(server.charges())
