"""A raw HTTP/1.1 server on 127.0.0.1 that records every request byte for byte.

uvicorn decodes headers as UTF-8 and refuses malformed answers; a hostile
suite needs neither: this server keeps the raw request (latin-1 header bytes
included) and sends whatever bytes the test scripts, however wrong.
"""

from __future__ import annotations

import collections
import gzip
import socket
import socketserver
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs

RESET = b"<reset>"
"""Close the connection after reading the whole request: the answer is lost."""

Headers = Sequence[tuple[bytes, bytes]]


def reply(
    status: int = 201,
    headers: Headers = (),
    body: bytes = b'{"id": "ch_1", "object": "charge"}',
    *,
    reason: bytes = b"OK",
    content_length: bool = True,
) -> bytes:
    """The raw bytes of one answer; ``headers`` are sent exactly as given."""
    lines = [b"HTTP/1.1 %d %s" % (status, reason)]
    lines += [name + b": " + value for name, value in headers]
    names = {name.lower() for name, _ in headers}
    if b"content-type" not in names:
        lines.append(b"Content-Type: application/json")
    if content_length and not names & {b"content-length", b"transfer-encoding"}:
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


OK = reply()
GZIP_GARBAGE = reply(200, [(b"Content-Encoding", b"gzip")], b"this is not gzip at all")
DEFLATE_GARBAGE = reply(200, [(b"Content-Encoding", b"deflate")], b"\x00\x01not deflate")
GZIP_TRUNCATED = reply(200, [(b"Content-Encoding", b"gzip")], gzip.compress(b'{"id": 1}')[:-6])


@attrs.frozen
class Arrival:
    """One request as it reached the server."""

    method: bytes
    target: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def header(self, name: str) -> bytes | None:
        wanted = name.lower().encode("latin-1")
        for key, value in self.headers:
            if key.lower() == wanted:
                return value
        return None

    @property
    def key(self) -> bytes | None:
        return self.header("Idempotency-Key")

    @property
    def identity(self) -> tuple[bytes, bytes, tuple[tuple[bytes, bytes], ...], bytes]:
        """What must not change between attempts: method, target, headers, body.

        Content-Length and Transfer-Encoding are framing (httpx recomputes them);
        Host is derived from the URL.
        """
        kept = tuple(
            (key.lower(), value)
            for key, value in self.headers
            if key.lower() not in (b"content-length", b"transfer-encoding", b"host")
        )
        return self.method, self.target, tuple(sorted(kept)), self.body


@attrs.define
class Wire:
    """What the server answers (in order, then ``default``) and what reached it."""

    script: collections.deque[bytes] = attrs.field(factory=collections.deque)
    default: bytes = OK
    arrivals: list[Arrival] = attrs.field(factory=list)
    url: str = ""
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def answer(self, *replies: bytes) -> None:
        self.script.extend(replies)

    def reset(self) -> None:
        with self.lock:
            self.script.clear()
            self.arrivals.clear()
            self.default = OK

    def next_reply(self, arrival: Arrival) -> bytes:
        with self.lock:
            self.arrivals.append(arrival)
            return self.script.popleft() if self.script else self.default

    def keys(self) -> list[bytes | None]:
        return [arrival.key for arrival in self.arrivals]


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        while True:
            arrival = self._read_request()
            if arrival is None:
                return
            raw = self.server.wire.next_reply(arrival)
            if raw == RESET:
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(raw)
            self.wfile.flush()
            if b"\r\nconnection: close" in raw.partition(b"\r\n\r\n")[0].lower():
                return

    def _read_request(self) -> Arrival | None:
        line = self.rfile.readline(65537)
        if not line.strip():
            return None
        method, target, _ = line.split(b" ", 2)
        headers = []
        while True:
            header_line = self.rfile.readline(65537)
            if header_line in (b"\r\n", b"\n", b""):
                break
            name, _, value = header_line.rstrip(b"\r\n").partition(b":")
            headers.append((name, value.strip(b" \t")))
        lowered = {name.lower(): value for name, value in headers}
        if lowered.get(b"transfer-encoding", b"").lower() == b"chunked":
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                body += self.rfile.read(size)
                self.rfile.readline()
                if size == 0:
                    break
        else:
            body = self.rfile.read(int(lowered.get(b"content-length", b"0")))
        return Arrival(method, target, tuple(headers), body)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, wire: Wire) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.wire = wire

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client hanging up mid-answer is what these tests make it do. Printed, the
        # traceback would land in whatever captures stderr just then (a CLI run the
        # test parses as JSON).
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


@contextmanager
def serve() -> Iterator[Wire]:
    """A raw server on a free loopback port for as long as the block runs."""
    wire = Wire()
    server = _Server(wire)
    wire.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield wire
    finally:
        server.shutdown()
        server.server_close()
