"""Every injected fault, programmatic and over the admin endpoint."""

from __future__ import annotations

import time

import httpx
import pytest

from idempotently.testing import REPLAY_HEADER, Fault, MockServer, MockServerConfig
from idempotently.testing.pytest_plugin import MockServerFactory

from .conftest import charge, post


def test_unavailable_is_503_before_any_work(idempotently_mock_server: MockServer) -> None:
    """Fault.unavailable answers 503 and stores nothing: the retry is a first request."""
    server = idempotently_mock_server
    server.faults.push(Fault.unavailable(retry_after=2))
    with httpx.Client(base_url=server.url) as client:
        refused = post(client, "k-1")
        assert ([], []) == (server.idempotency_keys(), server.charges())
        retried = post(client, "k-1")

    assert (503, "2") == (refused.status_code, refused.headers["retry-after"])
    assert "application/problem+json" == refused.headers["content-type"]
    assert 201 == retried.status_code
    assert REPLAY_HEADER.lower() not in retried.headers


def test_rate_limited_is_429_with_retry_after(idempotently_mock_server: MockServer) -> None:
    """Fault.rate_limited answers 429 with the given Retry-After and stores nothing."""
    server = idempotently_mock_server
    server.faults.push(Fault.rate_limited(retry_after=7))
    with httpx.Client(base_url=server.url) as client:
        response = post(client, "k-1")

    assert (429, "7") == (response.status_code, response.headers["retry-after"])
    assert ([], []) == (server.idempotency_keys(), server.charges())


def test_delay_holds_the_request(idempotently_mock_server: MockServer) -> None:
    """Fault.delay adds latency to one request, which then succeeds normally."""
    server = idempotently_mock_server
    server.faults.push(Fault.delay(0.2))
    with httpx.Client(base_url=server.url) as client:
        started = time.monotonic()
        slow = post(client, "k-1")
        slow_took = time.monotonic() - started
        fast = post(client, "k-2")

    assert (201, 201) == (slow.status_code, fast.status_code)
    assert slow_took >= 0.2
    # The fault met the first request only: none is left for the second.
    assert (["delay"], []) == ([f.fault.kind for f in server.faults.applied], server.faults.pending)


def test_provider_latency_keeps_the_key_in_progress(
    idempotently_mock_server_factory: MockServerFactory,
) -> None:
    """provider_latency makes every provider call take that long, during which the key is held."""
    server = idempotently_mock_server_factory(MockServerConfig(provider_latency=0.2))
    with httpx.Client(base_url=server.url) as client:
        started = time.monotonic()
        post(client, "k-1")

    assert time.monotonic() - started >= 0.2


def test_server_error_after_the_side_effect_is_stored(idempotently_mock_server: MockServer) -> None:
    """Fault.server_error: 500 after the charge, stored and replayed as is; one charge."""
    server = idempotently_mock_server
    server.faults.push(Fault.server_error())
    with httpx.Client(base_url=server.url) as client:
        first = post(client, "k-1")
        replayed = post(client, "k-1")

    assert (500, 500) == (first.status_code, replayed.status_code)
    assert first.content == replayed.content
    assert "true" == replayed.headers[REPLAY_HEADER]
    assert "application/problem+json" == replayed.headers["content-type"]
    assert 1 == len(server.charges())


def test_server_error_not_stored_lets_a_retry_run_again(
    idempotently_mock_server_factory: MockServerFactory,
) -> None:
    """With 5xx not stored the key is failed; a retry runs again and gets the same charge."""
    server = idempotently_mock_server_factory(MockServerConfig(store_server_errors=False))
    server.faults.push(Fault.server_error())
    with httpx.Client(base_url=server.url) as client:
        first = post(client, "k-1")
        [failed] = server.idempotency_keys()
        retried = post(client, "k-1")

    assert (500, "failed") == (first.status_code, failed.status)
    assert 201 == retried.status_code
    assert REPLAY_HEADER.lower() not in retried.headers
    assert [retried.json()["id"]] == [c.id for c in server.charges()]


def test_lose_response_charges_but_drops_the_connection(
    idempotently_mock_server: MockServer,
) -> None:
    """Fault.lose_response commits, then the client sees a transport error (not a 500)."""
    server = idempotently_mock_server
    server.faults.push(Fault.lose_response())
    with httpx.Client(base_url=server.url) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            post(client, "k-1")
        assert ["completed"] == [record.status for record in server.idempotency_keys()]
        retried = post(client, "k-1")

    assert (201, "true") == (retried.status_code, retried.headers[REPLAY_HEADER])
    assert [retried.json()["id"]] == [c.id for c in server.charges()]


def test_crash_leaves_the_key_in_progress(idempotently_mock_server: MockServer) -> None:
    """Fault.crash charges, commits nothing more, and drops the connection; retries get 409."""
    server = idempotently_mock_server
    server.faults.push(Fault.crash())
    with httpx.Client(base_url=server.url) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            post(client, "k-1")
        retried = post(client, "k-1")

    assert ["in_progress"] == [record.status for record in server.idempotency_keys()]
    assert 1 == len(server.charges())
    assert [] == server.app.keys.recorded_charges()
    assert 409 == retried.status_code


def test_faults_apply_in_order_one_per_request(idempotently_mock_server: MockServer) -> None:
    """push() scripts the next requests in order; each request meets at most one fault."""
    server = idempotently_mock_server
    server.faults.push(Fault.unavailable(), Fault.rate_limited(1), Fault.server_error())
    with httpx.Client(base_url=server.url) as client:
        statuses = [post(client, f"k-{n}").status_code for n in range(4)]

    assert [503, 429, 500, 201] == statuses
    assert [] == server.faults.pending
    assert 3 == server.stats().faults


def test_faults_target_a_key_or_an_order(idempotently_mock_server: MockServer) -> None:
    """for_key and for_order faults wait for their request and leave the others alone."""
    server = idempotently_mock_server
    server.faults.for_key("k-2", Fault.unavailable())
    server.faults.for_order("order-3", Fault.rate_limited(1))
    with httpx.Client(base_url=server.url) as client:
        statuses = [
            post(client, "k-1", charge("order-1")).status_code,
            post(client, "k-3", charge("order-3")).status_code,
            post(client, "k-2", charge("order-2")).status_code,
        ]

    assert [201, 429, 503] == statuses


def test_work_faults_wait_for_the_request_that_does_the_work(
    idempotently_mock_server: MockServer,
) -> None:
    """A replayed request does not consume a crash meant for a request that does the work."""
    server = idempotently_mock_server
    with httpx.Client(base_url=server.url) as client:
        post(client, "k-1")
        server.faults.push(Fault.crash())
        replayed = post(client, "k-1")
        assert [Fault.crash()] == [scheduled.fault for scheduled in server.faults.pending]
        with pytest.raises(httpx.RemoteProtocolError):
            post(client, "k-2")

    assert "true" == replayed.headers[REPLAY_HEADER]


def test_admin_endpoint_scripts_faults_from_another_process(
    idempotently_mock_server: MockServer,
) -> None:
    """POST /v1/_faults schedules faults over HTTP; GET lists them; DELETE clears them."""
    server = idempotently_mock_server
    with httpx.Client(base_url=server.url) as client:
        scheduled = client.post(
            "/v1/_faults",
            json={"faults": [{"kind": "rate_limited", "retry_after": 3}], "key": "k-1"},
        )
        client.post(
            "/v1/_faults", json={"faults": [{"kind": "crash"}, {"kind": "delay", "seconds": 0}]}
        )
        limited = post(client, "k-1")
        listed = client.get("/v1/_faults").json()
        cleared = client.delete("/v1/_faults").json()
        invalid = client.post("/v1/_faults", json={"faults": [{"kind": "meteor"}]})

    assert 200 == scheduled.status_code
    assert (429, "3") == (limited.status_code, limited.headers["retry-after"])
    assert ["crash", "delay"] == [fault["kind"] for fault in listed["pending"]]
    assert [("rate_limited", "k-1")] == [(f["kind"], f["key"]) for f in listed["applied"]]
    assert [] == cleared["pending"]
    assert 400 == invalid.status_code
    assert "meteor" in invalid.json()["detail"]


def test_admin_endpoints_move_the_clock_and_read_the_ledger(
    idempotently_mock_server: MockServer,
) -> None:
    """/v1/_clock moves the virtual clock; /v1/_ledger and /v1/_keys show every user's state."""
    server = idempotently_mock_server
    with httpx.Client(base_url=server.url) as client:
        before = client.get("/v1/_clock").json()["now"]
        after = client.post("/v1/_clock", json={"advance": 90}).json()["now"]
        post(client, "k-1", token="alice")
        ledger = client.get("/v1/_ledger").json()["data"]
        keys = client.get("/v1/_keys").json()["data"]
        swept = client.post("/v1/_sweep").json()

    assert 90 == after - before
    assert [("alice", "k-1")] == [(c["user"], c["idempotency_key"]) for c in ledger]
    assert [("alice", "k-1", "completed")] == [(k["user_id"], k["key"], k["status"]) for k in keys]
    assert {"deleted": 0} == swept
