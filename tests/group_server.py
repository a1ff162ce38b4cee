"""A loopback app that logs when each request starts and ends (holding each a moment),
so a test can assert from the server's side that no two steps of a group overlapped."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import attrs


@attrs.define
class StepLog:
    hold: float = 0.05
    """How long each request is held open at the server: a window in which a second
    step sent at the same time would be seen overlapping."""
    statuses: dict[str, list[int]] = attrs.field(factory=dict)
    """Scripted statuses per path, popped in order (201 when none is left)."""
    events: list[tuple[str, str, str | None]] = attrs.field(factory=list)
    gates: dict[str, threading.Event] = attrs.field(factory=dict)
    """Paths whose requests are held at the server until their event is set."""
    """("start" | "end", path, key), in the order the server saw them."""
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def reset(self) -> None:
        with self._lock:
            for gate in self.gates.values():
                gate.set()
            self.gates.clear()
            self.events.clear()
            self.statuses.clear()

    def answer(self, path: str, *statuses: int) -> None:
        self.statuses.setdefault(path, []).extend(statuses)

    def started(self) -> list[tuple[str, str | None]]:
        """(path, key) of every request that reached the server, in order."""
        with self._lock:
            return [(path, key) for event, path, key in self.events if event == "start"]

    def most_in_flight(self) -> int:
        """The most requests the server held at once."""
        most = now = 0
        with self._lock:
            for event, _, _ in self.events:
                now += 1 if event == "start" else -1
                most = max(most, now)
        return most

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        while (await receive()).get("more_body"):
            pass
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        path, key = scope["path"], headers.get("idempotency-key")
        with self._lock:
            self.events.append(("start", path, key))
            script = self.statuses.get(path)
            status = script.pop(0) if script else 201
        await asyncio.sleep(self.hold)
        gate = self.gates.get(path)
        while gate is not None and not gate.is_set():
            await asyncio.sleep(0.01)
        with self._lock:
            self.events.append(("end", path, key))
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"path": "%s"}' % path.encode()})
