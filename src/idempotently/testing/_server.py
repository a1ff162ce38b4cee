"""The mock server on a real loopback socket, served by uvicorn."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn
from starlette.types import Receive, Scope, Send

from idempotently.testing._app import ConnectionDropped, MockApp
from idempotently.testing._clock import Clock, VirtualClock
from idempotently.testing._config import MockServerConfig
from idempotently.testing._faults import Faults
from idempotently.testing._log import LoggedRequest
from idempotently.testing._provider import Charge, Ledger
from idempotently.testing._stats import Stats
from idempotently.testing._store import IdempotencyRecord

DEFAULT_STARTUP_TIMEOUT = 10.0
# uvicorn waits this long for requests in flight when asked to stop, then cancels them.
_GRACEFUL_SHUTDOWN_SECONDS = 5
_DROPPED_MESSAGE = "ASGI callable returned without completing response."


class _SocketApp:
    """Turns `ConnectionDropped` into an incomplete response, which uvicorn answers by closing.

    Over a socket the client then sees the headers and a truncated body (an
    `httpx.RemoteProtocolError`), never a 500.
    """

    def __init__(self, app: MockApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(ConnectionDropped):
            await self.app(scope, receive, send)


class _QuietDrops(logging.Filter):
    """uvicorn logs every dropped connection as an error; here they are on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _DROPPED_MESSAGE


class MockServer:
    """A running mock server: its URL and everything a test asserts on.

    Made by `serve()`; the attributes are live (the ledger reads the database
    on each call), and safe to use from the test's thread while the server
    answers on its own.
    """

    def __init__(
        self, app: MockApp, url: str, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.app = app
        self.url = url
        self.transport = transport
        """For an in-process server (`in_process()`), the `httpx.ASGITransport` to reach it."""

    @property
    def config(self) -> MockServerConfig:
        return self.app.config

    @property
    def clock(self) -> Clock:
        return self.app.clock

    @property
    def faults(self) -> Faults:
        return self.app.faults

    @property
    def ledger(self) -> Ledger:
        return self.app.ledger

    def charges(self, user: str | None = None, *, order_id: str | None = None) -> list[Charge]:
        """Charges the provider made (money that moved), oldest first."""
        return self.app.ledger.charges(user, order_id=order_id)

    def charge_count_by_key(self) -> dict[tuple[str, str], int]:
        """Charges per (user, idempotency key)."""
        return self.app.ledger.count_by_key()

    def charge_count_by_order(self) -> dict[tuple[str, str], int]:
        """Charges per (user, `metadata.order_id`)."""
        return self.app.ledger.count_by_order()

    def idempotency_keys(self, user: str | None = None) -> list[IdempotencyRecord]:
        """The rows of `idempotency_key`, to see what is `in_progress`, `completed` or `failed`."""
        return self.app.keys.records(user)

    def stats(self) -> Stats:
        return self.app.stats()

    @property
    def requests(self) -> list[LoggedRequest]:
        """Every `POST /v1/charges` that reached the server, in the order they were answered."""
        return self.app.requests

    def sweep(self) -> int:
        """Run the sweeper now; returns how many expired keys it deleted."""
        return self.app.sweep()

    def advance(self, seconds: float) -> float:
        """Move the server's virtual clock forward; returns the new time."""
        if not isinstance(self.app.clock, VirtualClock):
            raise TypeError("this server runs on the wall clock; serve(clock=VirtualClock())")
        return self.app.clock.advance(seconds)

    def client(self, token: str | None = "user_1", **kwargs: Any) -> httpx.Client:
        """An `httpx.Client` on this server, authenticated as `token` unless it is None."""
        headers = dict(kwargs.pop("headers", {}))
        if token is not None:
            headers.setdefault("Authorization", f"Bearer {token}")
        return httpx.Client(base_url=self.url, headers=headers, **kwargs)

    def async_client(self, token: str | None = "user_1", **kwargs: Any) -> httpx.AsyncClient:
        """An `httpx.AsyncClient` on this server (in-process ones included), as `token`."""
        headers = dict(kwargs.pop("headers", {}))
        if token is not None:
            headers.setdefault("Authorization", f"Bearer {token}")
        if self.transport is not None:
            kwargs.setdefault("transport", self.transport)
        return httpx.AsyncClient(base_url=self.url, headers=headers, **kwargs)

    def __repr__(self) -> str:
        return f"MockServer(url={self.url!r})"


IN_PROCESS_URL = "http://mock-server.in-process"


@contextlib.contextmanager
def in_process(
    config: MockServerConfig | None = None,
    *,
    clock: Clock | None = None,
    db: str | os.PathLike[str] = ":memory:",
) -> Iterator[MockServer]:
    """The mock server without a socket: async clients reach it through `server.transport`.

    `httpx.ASGITransport` is async only, so this serves `AsyncSession`,
    `AsyncTransport` and `server.async_client()`; a lost response arrives as
    the same `httpx.RemoteProtocolError` as over a socket. No thread, no port.

    Args:
        config: How the server behaves (`MockServerConfig()`: Leach's server).
        clock: Its clock (`SystemClock()`; a `VirtualClock` stands still until advanced).
        db: The SQLite file for its keys, charges and ledger (`":memory:"`: none).
    """
    app = MockApp(config, clock=clock, db=db)
    try:
        yield MockServer(app, IN_PROCESS_URL, transport=httpx.ASGITransport(app=app))
    finally:
        app.database.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio only sets TCP_NODELAY on sockets
    # whose proto says TCP, and without it every keep-alive request waits ~40 ms
    # for a delayed ACK between the response's header and body writes.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _uvicorn_server(app: MockApp, log_level: str) -> uvicorn.Server:
    config = uvicorn.Config(
        _SocketApp(app),
        log_level=log_level,
        access_log=False,
        lifespan="off",
        # h11 is always installed with uvicorn; pinning it keeps how a dropped
        # connection looks on the wire the same everywhere.
        http="h11",
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_SECONDS,
    )
    return uvicorn.Server(config)


@contextlib.contextmanager
def serve(
    config: MockServerConfig | None = None,
    *,
    clock: Clock | None = None,
    db: str | os.PathLike[str] = ":memory:",
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
) -> Iterator[MockServer]:
    """Run the mock server on a loopback socket in a background thread.

    ```python
    with serve(MockServerConfig(provider_latency=0.2), clock=VirtualClock()) as server:
        httpx.post(f"{server.url}/v1/charges", ...)
        assert server.charge_count_by_key() == {("user_1", "k-1"): 1}
    ```

    `port=0` picks a free port (see `server.url`). The server keeps running
    whatever its clients do (a client process killed mid-request leaves the
    request to finish or to stay claimed); leaving the block stops it.

    Args:
        config: How the server behaves (`MockServerConfig()`: Leach's server).
        clock: Its clock (`SystemClock()`; a `VirtualClock` stands still until advanced).
        db: The SQLite file for its keys, charges and ledger (`":memory:"`: none).
        host: The loopback address to listen on.
        port: The port (0: a free one; a fixed one keeps `server.url` the same
            from run to run).
        log_level: uvicorn's log level.
        startup_timeout: Seconds to wait for the server to listen before an error.
    """
    app = MockApp(config, clock=clock, db=db)
    sock = _bind(host, port)
    server = _uvicorn_server(app, log_level)
    quiet = _QuietDrops()
    logging.getLogger("uvicorn.error").addFilter(quiet)
    thread = threading.Thread(
        target=server.run,
        kwargs={"sockets": [sock]},
        name=f"idempotently-mock-server-{sock.getsockname()[1]}",
        daemon=True,
    )
    thread.start()
    try:
        _wait_until(lambda: bool(server.started) or not thread.is_alive(), startup_timeout)
        if not server.started:
            raise RuntimeError(f"the mock server did not start within {startup_timeout} s")
        yield MockServer(app, _url(sock))
    finally:
        server.should_exit = True
        thread.join(timeout=_GRACEFUL_SHUTDOWN_SECONDS + 5)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout=5)
        logging.getLogger("uvicorn.error").removeFilter(quiet)
        sock.close()
        app.database.close()


def run(
    app: MockApp,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve `app` in the foreground until interrupted (the `mock-server` command)."""
    sock = _bind(host, port)
    try:
        if on_ready is not None:
            on_ready(_url(sock))
        logging.getLogger("uvicorn.error").addFilter(_QuietDrops())
        _uvicorn_server(app, log_level).run(sockets=[sock])
    finally:
        sock.close()
        app.database.close()


def _wait_until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
