"""pytest fixtures for the mock server (registered through the `pytest11` entry point).

The server modules import starlette and uvicorn (the `[mock]` extra) inside
the fixtures, so merely having idempotently installed never breaks pytest.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import pytest

from idempotently.testing._clock import Clock, VirtualClock
from idempotently.testing._config import MockServerConfig

if TYPE_CHECKING:
    from idempotently.testing._server import MockServer


class MockServerFactory(Protocol):
    """Starts a mock server; every server it started stops when the test ends."""

    def __call__(
        self,
        config: MockServerConfig | None = None,
        *,
        clock: Clock | None = None,
        db: str | os.PathLike[str] = ":memory:",
    ) -> MockServer: ...


@pytest.fixture
def idempotently_mock_server_factory() -> Iterator[MockServerFactory]:
    """A function that starts mock servers with the switches you want, on free loopback ports.

    Servers default to a `VirtualClock`: time stands still unless the test advances it.
    """
    from idempotently.testing._server import serve

    with contextlib.ExitStack() as stack:

        def start(
            config: MockServerConfig | None = None,
            *,
            clock: Clock | None = None,
            db: str | os.PathLike[str] = ":memory:",
        ) -> MockServer:
            clock = clock if clock is not None else VirtualClock()
            return stack.enter_context(serve(config, clock=clock, db=db))

        yield start


@pytest.fixture
def idempotently_mock_server(
    idempotently_mock_server_factory: MockServerFactory,
) -> MockServer:
    """A fresh mock server with the default configuration and a virtual clock, for one test."""
    return idempotently_mock_server_factory()
