"""The article's contract, over a real loopback socket."""

from __future__ import annotations

import json

import httpx

from idempotently.testing import REPLAY_HEADER, MockServer

from .conftest import charge, post


def test_first_request_creates_a_charge(idempotently_mock_server: MockServer) -> None:
    """A new key runs the request once: 201 with the charge, one ledger entry, one outbox event."""
    server = idempotently_mock_server
    with httpx.Client(base_url=server.url) as client:
        response = post(client, "k-1", charge("order-7", amount=1234))

    assert 201 == response.status_code
    assert "application/json" == response.headers["content-type"]
    assert REPLAY_HEADER.lower() not in response.headers
    body = response.json()
    assert {"id", "object", "amount", "currency", "customer", "metadata", "created"} <= set(body)
    assert ("charge", 1234, {"order_id": "order-7"}) == (
        body["object"],
        body["amount"],
        body["metadata"],
    )
    assert {("user_1", "k-1"): 1} == server.charge_count_by_key()
    assert [body["id"]] == [c["id"] for c in server.app.keys.recorded_charges()]
    assert [body["id"]] == [event["charge_id"] for event in server.app.keys.outbox()]


def test_replay_is_byte_identical_and_marked(idempotently_mock_server: MockServer) -> None:
    """A completed key replays status and body byte for byte with Idempotent-Replayed: true."""
    server = idempotently_mock_server
    with httpx.Client(base_url=server.url) as client:
        first = post(client, "k-1")
        second = post(client, "k-1")

    assert (first.status_code, first.content) == (second.status_code, second.content)
    assert "true" == second.headers[REPLAY_HEADER]
    assert first.headers["content-type"] == second.headers["content-type"]
    assert 1 == len(server.charges())


def test_semantically_equal_body_replays(idempotently_mock_server: MockServer) -> None:
    """The request hash is over canonical JSON: key order and whitespace change nothing."""
    server = idempotently_mock_server
    headers = {"Authorization": "Bearer user_1", "Idempotency-Key": "k-1"}
    compact = json.dumps(charge(), separators=(",", ":"))
    spaced = json.dumps(dict(reversed(list(charge().items()))), indent=4)
    with httpx.Client(base_url=server.url, headers=headers) as client:
        first = client.post("/v1/charges", content=compact)
        second = client.post("/v1/charges", content=spaced)

    assert (201, 201) == (first.status_code, second.status_code)
    assert "true" == second.headers[REPLAY_HEADER]
    assert 1 == len(server.charges())


def test_different_payload_is_422_and_charges_nothing(idempotently_mock_server: MockServer) -> None:
    """Reusing a key with another payload is a 422 mentioning the mismatch, never a replay."""
    server = idempotently_mock_server
    with httpx.Client(base_url=server.url) as client:
        post(client, "k-1", charge(amount=100))
        response = post(client, "k-1", charge(amount=100000))

    assert 422 == response.status_code
    assert "application/problem+json" == response.headers["content-type"]
    assert "different payload" in response.json()["detail"]
    assert [100] == [c.amount for c in server.charges()]
    assert 1 == server.stats().mismatches


def test_validation_failure_saves_nothing(idempotently_mock_server: MockServer) -> None:
    """A body refused before any work is a 400 that stores no key, so the key can be reused."""
    server = idempotently_mock_server
    with httpx.Client(base_url=server.url) as client:
        refused = [
            post(client, "k-1", charge(amount=-5)),
            post(client, "k-1", charge(amount=True)),
            post(client, "k-1", charge(currency="")),
            post(client, "k-1", charge(surprise="field")),
            post(client, "k-1", [1, 2]),
        ]
        assert [] == server.idempotency_keys()
        fixed = post(client, "k-1")

    assert [400] * 5 == [r.status_code for r in refused]
    assert all(r.json()["title"] == "Bad Request" for r in refused)
    assert 201 == fixed.status_code
    assert REPLAY_HEADER.lower() not in fixed.headers
    assert 1 == len(server.charges())


def test_invalid_json_is_400(idempotently_mock_server: MockServer) -> None:
    """A body that is not JSON is a 400 problem, and nothing is stored."""
    server = idempotently_mock_server
    headers = {"Authorization": "Bearer u", "Idempotency-Key": "k"}
    response = httpx.post(f"{server.url}/v1/charges", content=b"{nope", headers=headers)

    assert 400 == response.status_code
    assert "not valid JSON" in response.json()["detail"]
    assert [] == server.idempotency_keys()


def test_missing_key_is_400_problem(idempotently_mock_server: MockServer) -> None:
    """Without an Idempotency-Key the POST is refused with a problem+json 400."""
    server = idempotently_mock_server
    with httpx.Client(base_url=server.url) as client:
        response = post(client, None)

    assert 400 == response.status_code
    assert "application/problem+json" == response.headers["content-type"]
    assert "Idempotency-Key" in response.json()["detail"]
    assert [] == server.charges()


def test_key_longer_than_255_is_400(idempotently_mock_server: MockServer) -> None:
    """A 256-character key is refused; a 255-character one is accepted."""
    server = idempotently_mock_server
    with httpx.Client(base_url=server.url) as client:
        too_long = post(client, "k" * 256)
        longest = post(client, "k" * 255)

    assert (400, 201) == (too_long.status_code, longest.status_code)
    assert "256" in too_long.json()["detail"]


def test_missing_authorization_is_401(idempotently_mock_server: MockServer) -> None:
    """No bearer token is a 401 problem with WWW-Authenticate, for POST and GET."""
    server = idempotently_mock_server
    headers = {"Idempotency-Key": "k-1"}
    posted = httpx.post(f"{server.url}/v1/charges", json=charge(), headers=headers)
    listed = httpx.get(f"{server.url}/v1/charges")

    assert (401, 401) == (posted.status_code, listed.status_code)
    assert "Bearer" == posted.headers["www-authenticate"]
    assert "Unauthorized" == posted.json()["title"]
    assert [] == server.idempotency_keys()


def test_two_users_same_key_are_independent(idempotently_mock_server: MockServer) -> None:
    """Keys are per user: the same key from two users makes two charges and no replay."""
    server = idempotently_mock_server
    with httpx.Client(base_url=server.url) as client:
        alice = post(client, "shared", token="alice")
        bob = post(client, "shared", token="bob")

    assert (201, 201) == (alice.status_code, bob.status_code)
    assert REPLAY_HEADER.lower() not in bob.headers
    assert alice.json()["id"] != bob.json()["id"]
    assert {("alice", "shared"): 1, ("bob", "shared"): 1} == server.charge_count_by_key()


def test_list_charges_per_user_filtered_by_order(idempotently_mock_server: MockServer) -> None:
    """GET /v1/charges lists only the caller's charges and filters on metadata[order_id]."""
    server = idempotently_mock_server
    with httpx.Client(base_url=server.url) as client:
        post(client, "k-1", charge("order-1"), token="alice")
        post(client, "k-2", charge("order-2"), token="alice")
        post(client, "k-3", charge("order-1"), token="bob")
        everything = client.get("/v1/charges", headers={"Authorization": "Bearer alice"})
        order_1 = client.get(
            "/v1/charges",
            params={"metadata[order_id]": "order-1"},
            headers={"Authorization": "Bearer alice"},
        )

    assert "list" == everything.json()["object"]
    assert ["order-1", "order-2"] == [c["metadata"]["order_id"] for c in everything.json()["data"]]
    assert ["order-1"] == [c["metadata"]["order_id"] for c in order_1.json()["data"]]


def test_key_expires_after_24_hours_of_virtual_time(idempotently_mock_server: MockServer) -> None:
    """After key_ttl the sweeper forgets the key and its reuse is a new request (a new charge)."""
    server = idempotently_mock_server
    with httpx.Client(base_url=server.url) as client:
        first = post(client, "k-1")
        server.advance(23 * 3600)
        still_remembered = post(client, "k-1")
        server.advance(3600 + 1)
        reused = post(client, "k-1")

    assert "true" == still_remembered.headers[REPLAY_HEADER]
    assert 201 == reused.status_code
    assert REPLAY_HEADER.lower() not in reused.headers
    assert first.json()["id"] != reused.json()["id"]
    assert {("user_1", "k-1"): 2} == server.charge_count_by_key()
    assert 1 == server.stats().swept


def test_sweeper_deletes_only_expired_keys(idempotently_mock_server: MockServer) -> None:
    """sweep() runs DELETE … WHERE expires_at < now and leaves younger keys alone."""
    server = idempotently_mock_server
    with httpx.Client(base_url=server.url) as client:
        post(client, "old")
        server.advance(12 * 3600)
        post(client, "young")
        server.advance(12 * 3600 + 1)
        deleted = server.sweep()

    assert 1 == deleted
    assert ["young"] == [record.key for record in server.idempotency_keys()]


def test_unknown_route_is_a_problem(idempotently_mock_server: MockServer) -> None:
    """Routing errors are problem+json too, so a client never has to parse HTML or text."""
    response = httpx.delete(f"{idempotently_mock_server.url}/v1/charges")

    assert 405 == response.status_code
    assert "application/problem+json" == response.headers["content-type"]
