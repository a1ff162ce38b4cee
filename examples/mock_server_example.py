"""Prove exactly-once against the idempotently mock server, with plain httpx.

A client that keeps one key per operation and retries through a lost
response, a 503 and a 429 still charges once. Run it: `python
examples/mock_server_example.py` (needs `pip install 'idempotently[mock]'`).
"""

from __future__ import annotations

import uuid

import httpx

from idempotently.testing import Fault, MockServerConfig, VirtualClock, serve


def charge_once(client: httpx.Client, order_id: str) -> httpx.Response:
    """Charge an order, retrying with the same key until the server gives a final answer."""
    key = str(uuid.uuid4())  # one key per operation, reused on every attempt
    body = {
        "amount": 1000,
        "currency": "usd",
        "customer": "cus_42",
        "metadata": {"order_id": order_id},
    }
    for _ in range(10):
        try:
            response = client.post("/v1/charges", json=body, headers={"Idempotency-Key": key})
        except httpx.TransportError:
            continue  # the charge may have happened: the same key makes retrying safe
        if response.status_code in (409, 429, 503):
            continue  # a real client would wait for Retry-After or back off here
        return response
    raise RuntimeError(f"gave up on {order_id}")


def main() -> None:
    with serve(MockServerConfig(provider_latency=0.01), clock=VirtualClock()) as server:
        # The next three requests fail in three different ways.
        server.faults.push(Fault.lose_response(), Fault.unavailable(), Fault.rate_limited(1))
        with httpx.Client(
            base_url=server.url, headers={"Authorization": "Bearer shop_1"}
        ) as client:
            response = charge_once(client, "order-42")
            listed = client.get("/v1/charges", params={"metadata[order_id]": "order-42"}).json()

        assert response.status_code == 201, response.text
        assert response.headers["Idempotent-Replayed"] == "true"  # the lost response, replayed
        assert server.charge_count_by_order() == {("shop_1", "order-42"): 1}
        assert [charge["id"] for charge in listed["data"]] == [response.json()["id"]]
        stats = server.stats()
        print(f"1 charge for order-42 after {stats.requests} requests ({stats.replays} replayed)")


if __name__ == "__main__":
    main()
