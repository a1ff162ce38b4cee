from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import respx

from tests.postgres_server import PostgresServer, PostgresUnavailable
from tests.scripted_server import ScriptedApp, serve
from tests.support import FakeTime

STORES = ("sqlite", pytest.param("postgres", marks=pytest.mark.postgres))
"""The journal stores a store-parametrised test runs on."""


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


@pytest.fixture(autouse=True)
def _fresh_retry_budgets() -> Iterator[None]:
    """Each test starts with empty retry ledgers: the process's budget per origin would
    otherwise carry one test's retries (under a fake clock) into the next."""
    from idempotently._budget import BUDGETS

    BUDGETS.clear()
    yield
    BUDGETS.clear()


@pytest.fixture
def fake_time() -> FakeTime:
    """A clock that moves only when the code under test sleeps."""
    return FakeTime()


@pytest.fixture
def router() -> Iterator[respx.MockRouter]:
    """respx in place of the network; unmatched requests fail the test."""
    with respx.mock(assert_all_called=False) as mock:
        yield mock


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL server for this test process (one per xdist worker).

    Stopped at the end of the session however the tests end. Where PostgreSQL
    cannot start, tests that need it are skipped with the reason, except under
    CI (CI=true), where that fails the run.
    """
    try:
        server = PostgresServer.start()
    except PostgresUnavailable as error:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL must run under CI but cannot start: {error}")
        pytest.skip(f"PostgreSQL cannot start here: {error}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _postgres_database(postgres: PostgresServer) -> str:
    return postgres.new_database()


@pytest.fixture
def postgres_url(_postgres_database: str) -> str:
    """The URL of a database holding no journal (its schema is dropped before each test)."""
    import psycopg

    with psycopg.connect(_postgres_database, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS idempotently CASCADE")
    return _postgres_database


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> str:
    """The journal store under test: ``sqlite`` or ``postgres``."""
    return str(request.param)


@pytest.fixture
def journal_target(store: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """Where a new, empty journal goes on that store: a file path or a PostgreSQL URL."""
    if store == "postgres":
        return str(request.getfixturevalue("postgres_url"))
    return str(tmp_path / "journal.db")
