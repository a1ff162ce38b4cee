"""A loopback server that keeps idempotency keys the way a given profile says.

It reads the key from the profile's header (in its format), charges once per key it
remembers, forgets a key ``lifetime`` seconds after it stored it (by the test's own
clock), replays a stored answer with the profile's replay marker, and can lose an
answer after charging (the connection dropped) or answer an error after charging and
release the key (a Lambda behind API Gateway under Powertools: 502). Its ``GET``
lists the charges made for an operation id (``metadata.operation_id``), for a lookup.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import attrs

import idempotently


@attrs.define
class KeyedServer:
    profile: idempotently.ServerProfile
    clock: Callable[[], float]
    lose_answers: int = 0
    """How many answers to drop after charging (the client sees a reset)."""
    error_after_charge: int | None = None
    """Answer this status after charging, and release the key (the handler raised)."""
    keys: dict[str, tuple[float, bytes]] = attrs.field(factory=dict)
    charges: list[dict[str, Any]] = attrs.field(factory=list)
    arrivals: int = 0

    def replay_header(self) -> list[tuple[bytes, bytes]]:
        if not self.profile.replay_headers:
            return []
        name, colon, value = self.profile.replay_headers[0].partition(":")
        return [(name.strip().encode(), value.strip().encode() if colon else b"true")]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "GET":
            wanted = parse_qs(scope["query_string"].decode()).get("operation_id", [""])[0]
            listed = [c for c in self.charges if c["metadata"].get("operation_id") == wanted]
            await self._answer(send, 200, json.dumps({"data": listed, "has_more": False}).encode())
            return
        self.arrivals += 1
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        key = self.profile.parse_key(headers[self.profile.key_header.lower()])
        now = self.clock()
        stored = self.keys.get(key)
        if stored is not None and now - stored[0] < self.profile.key_lifetime:
            await self._answer(send, 201, stored[1], self.replay_header())
            return
        sent = json.loads(body or b"{}")
        charge = {
            "id": f"ch_{len(self.charges) + 1}",
            "object": "charge",
            "metadata": sent.get("metadata", {}),
        }
        self.charges.append(charge)
        if self.error_after_charge is not None:
            # The handler raised after charging: the key is released, a gateway answers.
            await self._answer(send, self.error_after_charge, b'{"message": "Internal error"}')
            return
        answer = json.dumps(charge).encode()
        self.keys[key] = (now, answer)
        if self.lose_answers:
            self.lose_answers -= 1
            receive.__self__.transport.abort()  # uvicorn's request cycle holds the socket
            return
        await self._answer(send, 201, answer)

    async def _answer(
        self,
        send: Any,
        status: int,
        body: bytes,
        extra: list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
    ) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), *extra],
            }
        )
        await send({"type": "http.response.body", "body": body})
