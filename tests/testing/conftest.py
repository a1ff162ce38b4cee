"""Shared pieces of the mock server's own tests.

The fixtures come from the package's pytest plugin (the `pytest11` entry
point); importing them here keeps these tests running from a checkout that
is not installed.
"""

from __future__ import annotations

from typing import Any

import httpx

from idempotently.testing.pytest_plugin import (  # noqa: F401
    idempotently_mock_server,
    idempotently_mock_server_factory,
)


def charge(order_id: str = "order-1", amount: int = 1000, **changes: Any) -> dict[str, Any]:
    """A valid charge body."""
    return {
        "amount": amount,
        "currency": "usd",
        "customer": "cus_42",
        "metadata": {"order_id": order_id},
        **changes,
    }


def post(
    client: httpx.Client, key: str | None, body: Any = None, *, token: str = "user_1"
) -> httpx.Response:
    """POST /v1/charges with `key` (None sends no key) as the user `token`."""
    headers = {"Authorization": f"Bearer {token}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post("/v1/charges", json=charge() if body is None else body, headers=headers)


async def post_async(
    client: httpx.AsyncClient, key: str, body: Any = None, *, token: str = "user_1"
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": key}
    return await client.post(
        "/v1/charges", json=charge() if body is None else body, headers=headers
    )
