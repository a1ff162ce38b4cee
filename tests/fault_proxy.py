"""A loopback TCP proxy that loses HTTP answers on purpose, after the server acted.

``FaultProxy`` sits between a client and an HTTP/1.1 server on 127.0.0.1. It
reads each request off the client connection (keep-alive included: messages
are delimited by ``Content-Length``), forwards it on a connection of its own,
waits for the server's whole answer, and then either passes the answer on or, for the requests its
``reset_every`` picks, resets the client connection (``SO_LINGER`` 0, so the
client gets an RST) instead: the server processed the request, the client
never hears about it. Requests are numbered from 1 in the order they arrive,
so with one client at a time the faults land on the same requests every run.

``hold_first=n`` keeps the first ``n`` requests at the proxy, unforwarded,
until :meth:`FaultProxy.release`: a test can see several requests in flight
at one moment without guessing at timing.

Only what the mock server speaks is supported: no chunked bodies, no HEAD,
no ``Expect: 100-continue``.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable

import httpx

_HEADER_END = b"\r\n\r\n"
_READ_SIZE = 65536
_NO_BODY_STATUSES = frozenset({204, 304})


class ProxyProtocolError(Exception):
    """A message the proxy cannot delimit (chunked, malformed)."""


class FaultProxy:
    """Forwards HTTP/1.1 to ``upstream`` and resets the client after chosen answers.

    ```python
    with FaultProxy(server.url, reset_every=7) as proxy:
        httpx.post(f"{proxy.url}/v1/charges", ...)  # every 7th answer is lost
    ```
    """

    def __init__(self, upstream: str, *, reset_every: int = 0, hold_first: int = 0) -> None:
        target = httpx.URL(upstream)
        if target.host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"the fault proxy only forwards to loopback, not {target.host!r}")
        assert target.port is not None
        self._target = (target.host, target.port)
        self._reset_every = reset_every
        self._hold_first = hold_first
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Condition()
        self._released = threading.Event()
        self._closing = False
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self.requests = 0
        """Requests read from clients so far."""
        self.resets = 0
        """Client connections reset after the server had answered."""
        self.held: list[bytes] = []
        """The held requests (head and body), in arrival order."""
        self.errors: list[BaseException] = []
        """What went wrong inside the proxy; a test asserts it stays empty."""

    # -- lifetime --------------------------------------------------------------

    def __enter__(self) -> FaultProxy:
        self._spawn(self._accept_loop, "fault-proxy-accept")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            sockets = list(self._sockets)
        self._released.set()
        # close() alone does not wake a thread blocked in accept() or recv(); shutdown() does.
        for sock in [self._listener, *sockets]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        _close_quietly(self._listener)
        for thread in list(self._threads):
            thread.join(timeout=5)

    # -- what a test drives ----------------------------------------------------

    def wait_until_held(self, count: int, timeout: float) -> list[bytes]:
        """Block until ``count`` requests are held; raise TimeoutError after ``timeout`` s."""
        with self._lock:
            if not self._lock.wait_for(lambda: len(self.held) >= count, timeout):
                raise TimeoutError(f"{len(self.held)} request(s) held after {timeout} s")
            return list(self.held)

    def release(self) -> None:
        """Forward the held requests, and every later one at once."""
        self._released.set()

    # -- the proxy ---------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._track(client):
                _close_quietly(client)
                return
            self._spawn(self._serve_connection, "fault-proxy-connection", client)

    def _track(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._closing:
                return False
            self._sockets.add(sock)
            return True

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        _close_quietly(sock)

    def _serve_connection(self, client: socket.socket) -> None:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        from_client = _Reader(client)
        try:
            while True:
                request = from_client.message(response_to=None)
                if request is None:
                    return  # the client closed its connection
                number = self._arrived(request)
                if number <= self._hold_first:
                    self._released.wait()
                response = self._exchange(request)
                if response is None:
                    return  # the server hung up without answering: so does the proxy
                if self._reset_every and number % self._reset_every == 0:
                    self._reset(client)
                    return
                client.sendall(response)
                if _wants_close(request) or _wants_close(response):
                    return
        except OSError:
            return  # a peer went away, or the proxy is closing
        except Exception as error:  # reported to the test, which asserts there is none
            with self._lock:
                self.errors.append(error)
        finally:
            self._forget(client)

    def _exchange(self, request: bytes) -> bytes | None:
        """The server's whole answer to ``request``, on a connection of its own.

        A fresh connection per request: the server can never have closed it
        for idling, so a missing answer always means the server hung up on
        this very request.
        """
        upstream = socket.create_connection(self._target)
        try:
            if not self._track(upstream):
                return None
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream.sendall(request)
            return _Reader(upstream).message(response_to=request)
        finally:
            self._forget(upstream)

    def _arrived(self, request: bytes) -> int:
        with self._lock:
            self.requests += 1
            number = self.requests
            if number <= self._hold_first:
                self.held.append(request)
                self._lock.notify_all()
            return number

    def _reset(self, client: socket.socket) -> None:
        # Linger on, timeout 0: close() sends RST and drops anything unsent.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with self._lock:
            self.resets += 1


class _Reader:
    """Reads whole HTTP/1.1 messages off one socket, keeping what follows them."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buffer = b""

    def message(self, *, response_to: bytes | None) -> bytes | None:
        """The next message's bytes; None if the peer closed before one began."""
        while _HEADER_END not in self._buffer:
            if not self._fill():
                if self._buffer:
                    raise ProxyProtocolError("the peer closed in the middle of a message head")
                return None
        head_length = self._buffer.index(_HEADER_END) + len(_HEADER_END)
        length = _body_length(self._buffer[:head_length], response_to=response_to)
        while len(self._buffer) < head_length + length:
            if not self._fill():
                raise ProxyProtocolError("the peer closed in the middle of a message body")
        end = head_length + length
        message, self._buffer = self._buffer[:end], self._buffer[end:]
        return message

    def _fill(self) -> bool:
        chunk = self._sock.recv(_READ_SIZE)
        self._buffer += chunk
        return bool(chunk)


def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    start, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return start, headers


def _body_length(head: bytes, *, response_to: bytes | None) -> int:
    start, headers = _headers(head)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise ProxyProtocolError("chunked bodies are not supported")
    if response_to is not None:
        status = int(start.split(" ")[1])
        if status < 200 or status in _NO_BODY_STATUSES:
            return 0
    return int(headers.get("content-length", "0"))


def _wants_close(message: bytes) -> bool:
    _, headers = _headers(message[: message.index(_HEADER_END)])
    return headers.get("connection", "").lower() == "close"


def _close_quietly(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
