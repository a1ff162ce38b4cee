"""The smallest honest server for benchmarks: reads the body, answers 201 with JSON.

``BENCH_LATENCY_MS`` (environment) makes every answer wait that long first: a
stand-in for a LAN (1 ms) or a real API (20 ms).
"""

from __future__ import annotations

import os
from typing import Any

import anyio

BODY = b'{"id": "ch_bench", "object": "charge", "amount": 1000}'
LATENCY = float(os.environ.get("BENCH_LATENCY_MS", "0")) / 1000


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    if LATENCY:
        await anyio.sleep(LATENCY)
    await send(
        {
            "type": "http.response.start",
            "status": 201,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": BODY})
