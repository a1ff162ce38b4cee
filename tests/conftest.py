from __future__ import annotations

from collections.abc import Iterator

import pytest
import respx

from tests.scripted_server import ScriptedApp, serve
from tests.support import FakeTime


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs on asyncio and on trio."""
    return str(request.param)


@pytest.fixture(scope="session")
def _scripted() -> Iterator[tuple[ScriptedApp, str]]:
    app = ScriptedApp()
    with serve(app) as url:
        yield app, url


@pytest.fixture
def scripted(_scripted: tuple[ScriptedApp, str]) -> Iterator[tuple[ScriptedApp, str]]:
    """A real uvicorn server on 127.0.0.1 answering from a per-test script."""
    app, url = _scripted
    app.reset()
    yield app, url
    app.reset()


@pytest.fixture
def fake_time() -> FakeTime:
    """A clock that moves only when the code under test sleeps."""
    return FakeTime()


@pytest.fixture
def router() -> Iterator[respx.MockRouter]:
    """respx in place of the network; unmatched requests fail the test."""
    with respx.mock(assert_all_called=False) as mock:
        yield mock
