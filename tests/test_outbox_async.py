"""``AsyncSession.enqueue``: the outbox from async code, on asyncio and trio.

On PostgreSQL the application's transaction runs on psycopg's AsyncConnection,
awaited on the loop (psycopg runs it on asyncio only, so those cases skip trio);
on SQLite on the application's sqlite3 connection, used where the application
uses it; without a connection, the write goes off the loop as every journal
write does.
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import idempotently
from idempotently.testing import MockServer, serve
from tests.test_loop_never_blocks import LOCK_HELD, MAX_GAP, TICK, heartbeat, write_lock_held
from tests.test_outbox import charge, drop_app_tables, sqlite_app

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def api() -> Iterator[MockServer]:
    with serve() as server:
        yield server


@pytest.fixture
def user() -> str:
    return f"shop_{uuid.uuid4().hex[:8]}"


def async_session(journal: str, api: MockServer, user: str) -> idempotently.AsyncSession:
    return idempotently.AsyncSession(
        journal, base_url=api.url, headers={"Authorization": f"Bearer {user}"}
    )


def asyncio_only(anyio_backend: str) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("psycopg's AsyncConnection runs on asyncio only")


async def test_async_enqueue_is_sent_once_by_resume(
    journal_target: str, api: MockServer, user: str, anyio_backend: str
) -> None:
    """Without a connection: its own durable write, nothing sent until resume, once."""
    async with async_session(journal_target, api, user) as s:
        operation = await s.enqueue(
            "POST", "/v1/charges", json=charge("a-1"), operation_id="a-1:charge"
        )
        assert [] == api.charges(user)
        results = await s.resume()
        assert [] == await s.resume()
    assert [(operation.operation_id, "succeeded")] == [(r.operation_id, r.action) for r in results]
    assert 1 == len(api.charges(user))


async def test_async_enqueue_in_a_psycopg_async_transaction(
    postgres_url: str, api: MockServer, user: str, anyio_backend: str
) -> None:
    """Committed with the order: sent once; rolled back: never existed, never sent."""
    asyncio_only(anyio_backend)
    import psycopg

    idempotently.Journal(postgres_url).close()
    async with async_session(postgres_url, api, user) as s:
        conn = await psycopg.AsyncConnection.connect(postgres_url)
        try:
            await conn.execute("CREATE TABLE IF NOT EXISTS public.orders (id text PRIMARY KEY)")
            await conn.commit()
            async with conn.transaction():
                await conn.execute("INSERT INTO public.orders VALUES ('a-2')")
                await s.enqueue(
                    "POST",
                    "/v1/charges",
                    json=charge("a-2"),
                    operation_id="a-2:charge",
                    connection=conn,
                )
            with pytest.raises(RuntimeError):
                async with conn.transaction():
                    await conn.execute("INSERT INTO public.orders VALUES ('a-3')")
                    await s.enqueue(
                        "POST",
                        "/v1/charges",
                        json=charge("a-3"),
                        operation_id="a-3:charge",
                        connection=conn,
                    )
                    raise RuntimeError("the order failed")
            assert s.journal.operation("a-3:charge") is None
            results = await s.resume()
        finally:
            await conn.close()
            drop_app_tables(postgres_url)
    assert ["a-2:charge"] == [r.operation_id for r in results]
    assert ["a-2"] == [c.order_id for c in api.charges(user)]


async def test_async_enqueue_refuses_a_sync_psycopg_connection(
    postgres_url: str, api: MockServer, user: str, anyio_backend: str
) -> None:
    """A psycopg.Connection in async code would block the loop: refused, saying which."""
    import psycopg

    async with async_session(postgres_url, api, user) as s:
        with (
            psycopg.connect(postgres_url) as conn,
            pytest.raises(TypeError, match=r"goes to Session\.enqueue"),
        ):
            await s.enqueue(
                "POST", "/v1/charges", json=charge("a-4"), operation_id="a-4", connection=conn
            )
        assert s.journal.operation("a-4") is None


async def test_sync_enqueue_refuses_a_psycopg_async_connection(
    postgres_url: str, api: MockServer, user: str, anyio_backend: str
) -> None:
    """And the other way round: an AsyncConnection belongs to AsyncSession.enqueue."""
    asyncio_only(anyio_backend)
    import psycopg

    conn = await psycopg.AsyncConnection.connect(postgres_url)
    try:
        with (
            idempotently.Session(postgres_url, base_url=api.url) as s,
            pytest.raises(TypeError, match=r"goes to AsyncSession\.enqueue"),
        ):
            s.enqueue(
                "POST", "/v1/charges", json=charge("a-5"), operation_id="a-5", connection=conn
            )
    finally:
        await conn.close()


async def test_async_enqueue_on_the_applications_sqlite_connection(
    tmp_path: Path, api: MockServer, user: str, anyio_backend: str
) -> None:
    """On SQLite, the application's sqlite3 connection in async code: committed is sent
    once, rolled back never existed."""
    path = str(tmp_path / "journal.db")
    async with async_session(path, api, user) as s:
        conn: Any = sqlite_app(path)
        with conn:
            conn.execute("INSERT INTO orders VALUES ('a-6', 500)")
            await s.enqueue(
                "POST", "/v1/charges", json=charge("a-6"), operation_id="a-6", connection=conn
            )
        conn.execute("INSERT INTO orders VALUES ('a-7', 500)")
        await s.enqueue(
            "POST", "/v1/charges", json=charge("a-7"), operation_id="a-7", connection=conn
        )
        conn.rollback()
        results = await s.resume()
        conn.close()
    assert ["a-6"] == [r.operation_id for r in results]
    assert ["a-6"] == [c.order_id for c in api.charges(user)]
    assert [("a-6",)] == sqlite3.connect(path).execute("SELECT id FROM orders").fetchall()


async def test_async_enqueue_without_a_connection_never_stalls_the_loop(
    tmp_path: Path, anyio_backend: str
) -> None:
    """Its own write waits ~1 s for another process's write lock off the loop: a task on
    the loop keeps ticking."""
    path = tmp_path / "journal.db"
    idempotently.Journal(path).close()
    gaps: list[float] = []
    journal = idempotently.Journal(path, busy_timeout=5)
    async with (
        idempotently.AsyncSession(journal, base_url="http://shop.invalid") as s,
        write_lock_held(path),
        anyio.create_task_group() as group,
    ):
        await group.start(heartbeat, gaps)
        started = time.monotonic()
        await s.enqueue("POST", "/v1/charges", json=charge("a-8"), operation_id="a-8")
        waited = time.monotonic() - started
        await anyio.sleep(3 * TICK)  # a stalled heartbeat wakes and records its stall
        group.cancel_scope.cancel()
    journal.close()
    assert waited > LOCK_HELD / 2, "the enqueue never waited for the lock: nothing was measured"
    assert max(gaps) < MAX_GAP
