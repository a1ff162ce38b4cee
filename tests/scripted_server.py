"""A plain ASGI app on a real uvicorn socket, scripted per test.

It records what reached it (key, body bytes, whether the key was already in
the client's journal file) and answers from a script: a status, or a
connection reset after it has read the whole request.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import uvicorn


@attrs.frozen
class Answer:
    status: int = 201
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b'{"id": "ch_1", "object": "charge"}'
    reset: bool = False
    """Drop the connection after reading the request: the response is lost."""
    endless: bool = False
    """Stream the body on and on (``ENDLESS_BYTES`` at most, so a client that reads it
    all ends, slowly) until the client hangs up."""
    trickle: float = 0.0
    """With ``endless``: one byte every ``trickle`` seconds instead of 64 KiB at once
    (each byte well within a read timeout), until the client hangs up."""
    prefix: bytes = b""
    """With ``endless``: bytes sent before the endless ones (a gzip header, say)."""


ENDLESS_BYTES = 64 * 1024 * 1024
"""The most an endless answer streams: far more than any client should read."""


RESET = Answer(reset=True)


@attrs.frozen
class Arrival:
    key: str | None
    body: bytes
    authorization: str | None
    key_in_journal: bool | None
    at: float
    query: bytes = b""
    """The raw query string as it reached the server."""
    method: str = ""
    path: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    """Every request header as it arrived (names lowercased), in order."""


@attrs.define
class ScriptedApp:
    journal_path: str | None = None
    script: collections.deque[Answer] = attrs.field(factory=collections.deque)
    arrivals: list[Arrival] = attrs.field(factory=list)
    streamed: list[int] = attrs.field(factory=list)
    """The body bytes each endless answer sent before the client hung up."""

    def answer(self, *answers: Answer) -> None:
        self.script.extend(answers)

    def reset(self) -> None:
        self.script.clear()
        self.arrivals.clear()
        self.streamed.clear()
        self.journal_path = None

    def _key_in_journal(self, key: str | None) -> bool | None:
        if self.journal_path is None or key is None:
            return None
        conn = sqlite3.connect(f"file:{self.journal_path}?mode=ro", uri=True)
        try:
            row = conn.execute("SELECT 1 FROM operations WHERE key = ?", (key,)).fetchone()
        finally:
            conn.close()
        return row is not None

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
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        key = headers.get("idempotency-key")
        self.arrivals.append(
            Arrival(
                key=key,
                body=body,
                authorization=headers.get("authorization"),
                key_in_journal=self._key_in_journal(key),
                at=time.monotonic(),
                query=scope.get("query_string", b""),
                method=scope.get("method", ""),
                path=scope.get("path", ""),
                headers=tuple((k.decode().lower(), v.decode()) for k, v in scope["headers"]),
            )
        )
        answer = self.script.popleft() if self.script else Answer()
        if answer.reset:
            # uvicorn hides the socket; its request cycle holds the transport.
            receive.__self__.transport.abort()
            return
        await send(
            {
                "type": "http.response.start",
                "status": answer.status,
                "headers": [(k.encode(), v.encode()) for k, v in answer.headers]
                + [(b"content-type", b"application/json")],
            }
        )
        if answer.endless:
            cycle, sent = receive.__self__, 0
            if answer.prefix:
                await send({"type": "http.response.body", "body": answer.prefix, "more_body": True})
            chunk = b"x" if answer.trickle else b"x" * 65536
            while sent < ENDLESS_BYTES and not cycle.disconnected:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                sent += len(chunk)
                await asyncio.sleep(answer.trickle)  # and let a hang-up reach the cycle
            self.streamed.append(sent)
        await send({"type": "http.response.body", "body": answer.body})


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run ``app`` with uvicorn on a free 127.0.0.1 port; yield its base URL."""
    # IPPROTO_TCP so asyncio sets TCP_NODELAY (else ~40 ms delayed-ACK stalls).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
