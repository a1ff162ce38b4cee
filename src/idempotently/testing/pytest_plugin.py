"""pytest fixtures for the mock server (registered through the `pytest11` entry point).

The server modules import starlette and uvicorn (the `[mock]` extra) inside
the fixtures, so merely having idempotently installed never breaks pytest.

A fault scheduled on a fixture's server that no request met fails the test at
teardown (the scenario did not happen as written); mark a test
`@pytest.mark.idempotently_allow_unused_faults` or pass
`allow_unused_faults=True` to the factory to allow it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import pytest

from idempotently.testing._clock import Clock, VirtualClock
from idempotently.testing._config import MockServerConfig
from idempotently.testing._crash_points import CrashPointResult, CrashReport, CrashStep
from idempotently.testing._fake_time import FakeTime

if TYPE_CHECKING:
    from idempotently import Session
    from idempotently.testing._server import MockServer

ALLOW_UNUSED_FAULTS_MARKER = "idempotently_allow_unused_faults"

MOCK_EXTRA_MESSAGE = (
    "the idempotently mock-server fixtures need the [mock] extra (starlette, uvicorn):"
    " pip install 'idempotently[mock]'"
)


@contextlib.contextmanager
def _needs_the_mock_extra() -> Iterator[None]:
    """Turn a missing starlette or uvicorn into a test failure that names the extra."""
    try:
        yield
    except ImportError as error:
        if (error.name or "").partition(".")[0] in ("starlette", "uvicorn"):
            pytest.fail(MOCK_EXTRA_MESSAGE, pytrace=False)
        raise


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{ALLOW_UNUSED_FAULTS_MARKER}: scheduled mock-server faults that never fired"
        " do not fail this test",
    )


class MockServerFactory(Protocol):
    """Starts a mock server; every server it started stops when the test ends."""

    def __call__(
        self,
        config: MockServerConfig | None = None,
        *,
        clock: Clock | None = None,
        db: str | os.PathLike[str] = ":memory:",
        allow_unused_faults: bool = False,
    ) -> MockServer: ...


def _fail_on_unused_faults(request: pytest.FixtureRequest, servers: list[MockServer]) -> None:
    if request.node.get_closest_marker(ALLOW_UNUSED_FAULTS_MARKER) is not None:
        return
    unused = [(server, server.faults.pending) for server in servers if server.faults.pending]
    if unused:
        listed = "; ".join(
            f"{server.url}: {', '.join(repr(fault) for fault in pending)}"
            for server, pending in unused
        )
        pytest.fail(
            f"scheduled faults never met a request ({listed}): the test did not exercise"
            f" them; fix the scenario, or mark the test @pytest.mark.{ALLOW_UNUSED_FAULTS_MARKER}",
            pytrace=False,
        )


@pytest.fixture
def idempotently_mock_server_factory(
    request: pytest.FixtureRequest,
) -> Iterator[MockServerFactory]:
    """A function that starts mock servers with the switches you want, on free loopback ports.

    Servers default to a `VirtualClock`: time stands still unless the test advances it.
    """
    with _needs_the_mock_extra():
        from idempotently.testing._server import serve

    checked: list[MockServer] = []
    with contextlib.ExitStack() as stack:

        def start(
            config: MockServerConfig | None = None,
            *,
            clock: Clock | None = None,
            db: str | os.PathLike[str] = ":memory:",
            allow_unused_faults: bool = False,
        ) -> MockServer:
            clock = clock if clock is not None else VirtualClock()
            server = stack.enter_context(serve(config, clock=clock, db=db))
            if not allow_unused_faults:
                checked.append(server)
            return server

        yield start
        _fail_on_unused_faults(request, checked)


@pytest.fixture
def idempotently_mock_server(
    idempotently_mock_server_factory: MockServerFactory,
) -> MockServer:
    """A fresh mock server with the default configuration and a virtual clock, for one test."""
    return idempotently_mock_server_factory()


@pytest.fixture
def idempotently_in_process_mock_server(request: pytest.FixtureRequest) -> Iterator[MockServer]:
    """The mock server without a socket or thread, reached through `server.transport`.

    For async clients (`httpx.ASGITransport` is async only): `server.async_client()`,
    or `AsyncSession(path, client=server.async_client())`. Virtual clock, unused
    faults checked, as for `idempotently_mock_server`.
    """
    with _needs_the_mock_extra():
        from idempotently.testing._server import in_process

    with in_process(clock=VirtualClock()) as server:
        yield server
        _fail_on_unused_faults(request, [server])


@pytest.fixture
def idempotently_fake_time() -> FakeTime:
    """A `FakeTime`: pass `clock=`/`sleep=` from it and retries never really wait."""
    return FakeTime()


class CrashPoints(Protocol):
    """`idempotently.testing.crash_points`, with the runs kept in the test's `tmp_path`."""

    def __call__(
        self,
        scenario: Callable[..., Any],
        *,
        session: Callable[[Path, str], Any] | None = None,
        config: MockServerConfig | None = None,
        steps: Sequence[CrashStep] = ...,
        operations: Sequence[int] | None = None,
        rerun: bool = True,
        backend: Literal["asyncio", "trio"] = "asyncio",
        timeout: float = 60.0,
        on_point: Callable[[CrashPointResult], object] | None = None,
    ) -> CrashReport: ...


@pytest.fixture
def idempotently_crash_points(tmp_path: Path) -> CrashPoints:
    """Kill a scenario at every journal step of every operation; see `crash_points`.

    ```python
    def test_checkout_survives_crashes(idempotently_crash_points):
        idempotently_crash_points(place_orders).assert_exactly_once()
    ```

    `place_orders(session)` must be defined at the top level of a module (the
    test module will do): it runs in child processes. Each run's journal and
    logs stay under `tmp_path / "crash-points"` for a failing test to show.
    """
    from idempotently.testing._crash_points import crash_points

    return functools.partial(crash_points, directory=tmp_path / "crash-points")


@pytest.fixture
def idempotently_session(
    idempotently_mock_server: MockServer,
    idempotently_fake_time: FakeTime,
    tmp_path: Path,
) -> Iterator[Session]:
    """A `Session` on `idempotently_mock_server`, authenticated as `user_1`, that never sleeps.

    Its journal is `tmp_path / "journal.db"`; its clock and sleep come from
    `idempotently_fake_time`, whose sleeps also advance the server's virtual
    clock (a `Retry-After: 2` costs no real time and shows in `.sleeps`).
    """
    from idempotently import Session

    server = idempotently_mock_server
    if isinstance(server.clock, VirtualClock):
        idempotently_fake_time.server_clock = server.clock
    session = Session(
        tmp_path / "journal.db",
        base_url=server.url,
        headers={"Authorization": "Bearer user_1"},
        clock=idempotently_fake_time.clock,
        sleep=idempotently_fake_time.sleep,
    )
    with session:
        yield session
