"""The smallest honest server for benchmarks: reads the body, answers 201 with JSON."""

from __future__ import annotations

from typing import Any

BODY = b'{"id": "ch_bench", "object": "charge", "amount": 1000}'


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send(
        {
            "type": "http.response.start",
            "status": 201,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": BODY})
