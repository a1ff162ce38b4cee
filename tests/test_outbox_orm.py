"""The outbox in an ORM's transaction: ``enqueue(connection=...)`` takes a SQLAlchemy
``Session`` or ``Connection`` (sync and async) and Django's connection inside
``transaction.atomic()``, on SQLite and PostgreSQL, whatever driver is underneath.

The operation commits or rolls back with the application's own writes and is sent
once by ``resume``; a connection that could not commit with the journal (another
database, a closed one, autocommit, outside an atomic block, the wrong kind) is
refused in one line and nothing is journaled. Against the mock server on 127.0.0.1,
real SQLite files and a real PostgreSQL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from sqlalchemy import text
from sqlalchemy.ext.asyncio import (
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    scoped_session,
    sessionmaker,
)

import idempotently
from idempotently.testing import MockServer, serve
from tests.orm_apps import (
    async_sqlalchemy_engine,
    django_alias,
    is_postgres,
    orders_table,
    sqlalchemy_engine,
    sqlalchemy_url,
)
from tests.test_outbox import charge, drop_app_tables, session

KINDS = ("session", "connection")


@pytest.fixture(scope="module")
def api() -> Iterator[MockServer]:
    with serve() as server:
        yield server


@pytest.fixture
def user() -> str:
    """A user of its own for each test: the server's ledger is per user."""
    return f"shop_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def orders(journal_target: str) -> Iterator[str]:
    """The journal (created) and the application's orders table beside it."""
    idempotently.Journal(journal_target).close()
    table = orders_table(journal_target)
    engine = sqlalchemy_engine(journal_target)
    with engine.begin() as db:
        db.execute(text(f"CREATE TABLE IF NOT EXISTS {table} (id text PRIMARY KEY)"))
    engine.dispose()
    try:
        yield table
    finally:
        if is_postgres(journal_target):
            drop_app_tables(journal_target)


@contextlib.contextmanager
def transaction(engine: Any, kind: str) -> Iterator[Any]:
    """One transaction of the application, on a Session or on a Connection."""
    if kind == "session":
        with Session(engine) as db, db.begin():
            yield db
    else:
        with engine.begin() as db:
            yield db


@contextlib.asynccontextmanager
async def atransaction(engine: Any, kind: str) -> AsyncIterator[Any]:
    if kind == "session":
        async with AsyncSession(engine) as db, db.begin():
            yield db
    else:
        async with engine.begin() as db:
            yield db


def enqueue(s: idempotently.Session, order: str, connection: Any) -> idempotently.Operation:
    return s.enqueue(
        "POST",
        "/v1/charges",
        json=charge(order),
        operation_id=f"{order}:charge",
        connection=connection,
    )


async def aenqueue(
    s: idempotently.AsyncSession, order: str, connection: Any
) -> idempotently.Operation:
    return await s.enqueue(
        "POST",
        "/v1/charges",
        json=charge(order),
        operation_id=f"{order}:charge",
        connection=connection,
    )


def order_ids(target: str) -> list[str]:
    engine = sqlalchemy_engine(target)
    with engine.connect() as db:
        ids = [row[0] for row in db.execute(text(f"SELECT id FROM {orders_table(target)}"))]
    engine.dispose()
    return sorted(ids)


def refused(s: idempotently.Session, connection: Any, error: type[Exception], match: str) -> Any:
    with pytest.raises(error, match=match) as raised:
        enqueue(s, "bad", connection)
    assert s.journal.operation("bad:charge") is None
    assert "\n" not in str(raised.value)
    return raised.value


# -- SQLAlchemy, sync ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_sqlalchemy_transaction_commits_the_charge_with_its_order_or_neither(
    journal_target: str, orders: str, api: MockServer, user: str, kind: str
) -> None:
    """A Session or Connection in its transaction: the committed order's charge is sent
    once by resume; the rolled-back order's never existed; enqueued again in the same
    transaction, the id returns the first operation."""
    engine = sqlalchemy_engine(journal_target)
    with session(journal_target, api, user) as s:
        with transaction(engine, kind) as db:
            db.execute(text(f"INSERT INTO {orders} VALUES ('o-1')"))
            first = enqueue(s, "o-1", db)
            again = enqueue(s, "o-1", db)
        with pytest.raises(RuntimeError), transaction(engine, kind) as db:
            db.execute(text(f"INSERT INTO {orders} VALUES ('o-2')"))
            enqueue(s, "o-2", db)
            raise RuntimeError("the order failed")
        assert s.journal.operation("o-2:charge") is None
        results = s.resume()
        assert [] == s.resume()
    engine.dispose()
    assert (first.operation_id, first.key) == (again.operation_id, again.key)
    assert [("o-1:charge", "succeeded")] == [(r.operation_id, r.action) for r in results]
    assert ["o-1"] == [c.order_id for c in api.charges(user)]
    assert ["o-1"] == order_ids(journal_target)


@pytest.mark.postgres
@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
def test_sqlalchemy_on_either_postgres_driver(
    postgres_url: str, api: MockServer, user: str, driver: str
) -> None:
    """psycopg 3 or psycopg2 under SQLAlchemy: the same statements, the same outcome."""
    orders = "public.orders"
    idempotently.Journal(postgres_url).close()
    engine = sqlalchemy_engine(postgres_url, driver)
    try:
        with engine.begin() as db:
            db.execute(text(f"CREATE TABLE {orders} (id text PRIMARY KEY)"))
        with session(postgres_url, api, user) as s:
            with Session(engine) as db, db.begin():
                db.execute(text(f"INSERT INTO {orders} VALUES ('p-1')"))
                enqueue(s, "p-1", db)
                enqueue(s, "p-1", db)  # found in the same transaction
            results = s.resume()
    finally:
        engine.dispose()
        drop_app_tables(postgres_url)
    assert [("p-1:charge", "succeeded")] == [(r.operation_id, r.action) for r in results]
    assert ["p-1"] == [c.order_id for c in api.charges(user)]


# -- SQLAlchemy, async ---------------------------------------------------------------------


def asyncio_only(anyio_backend: str) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("SQLAlchemy's asyncio extension runs on asyncio only")


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_an_async_sqlalchemy_transaction_commits_the_charge_with_its_order_or_neither(
    journal_target: str, orders: str, api: MockServer, user: str, kind: str, anyio_backend: str
) -> None:
    """An AsyncSession or AsyncConnection (aiosqlite, asyncpg) in AsyncSession.enqueue:
    committed is sent once, rolled back never existed, enqueued twice is one operation."""
    asyncio_only(anyio_backend)
    engine = async_sqlalchemy_engine(journal_target, "asyncpg")
    async with idempotently.AsyncSession(
        journal_target, base_url=api.url, headers={"Authorization": f"Bearer {user}"}
    ) as s:
        async with atransaction(engine, kind) as db:
            await db.execute(text(f"INSERT INTO {orders} VALUES ('a-1')"))
            first = await aenqueue(s, "a-1", db)
            again = await aenqueue(s, "a-1", db)
        with pytest.raises(RuntimeError):
            async with atransaction(engine, kind) as db:
                await db.execute(text(f"INSERT INTO {orders} VALUES ('a-2')"))
                await aenqueue(s, "a-2", db)
                raise RuntimeError("the order failed")
        assert s.journal.operation("a-2:charge") is None
        results = await s.resume()
    await engine.dispose()
    assert first.key == again.key
    assert [("a-1:charge", "succeeded")] == [(r.operation_id, r.action) for r in results]
    assert ["a-1"] == [c.order_id for c in api.charges(user)]
    assert ["a-1"] == order_ids(journal_target)


@pytest.mark.anyio
@pytest.mark.postgres
async def test_async_sqlalchemy_on_psycopg(
    postgres_url: str, api: MockServer, user: str, anyio_backend: str
) -> None:
    """psycopg's async driver under SQLAlchemy: the same outcome as asyncpg's."""
    asyncio_only(anyio_backend)
    idempotently.Journal(postgres_url).close()
    engine = async_sqlalchemy_engine(postgres_url, "psycopg")
    try:
        async with idempotently.AsyncSession(
            postgres_url, base_url=api.url, headers={"Authorization": f"Bearer {user}"}
        ) as s:
            async with AsyncSession(engine) as db, db.begin():
                await aenqueue(s, "a-3", db)
            results = await s.resume()
    finally:
        await engine.dispose()
    assert ["a-3"] == [c.order_id for c in api.charges(user)]
    assert ["succeeded"] == [r.action for r in results]


# -- Django ----------------------------------------------------------------------------------


def test_a_django_atomic_block_commits_the_charge_with_its_order_or_neither(
    journal_target: str, orders: str, api: MockServer, user: str
) -> None:
    """Django's connection (a `connections[alias]` or the `connection` proxy) inside
    transaction.atomic(): committed is sent once, rolled back never existed."""
    from django.db import connections, transaction
    from django.utils.connection import ConnectionProxy

    alias = django_alias(journal_target)
    proxy = ConnectionProxy(connections, alias)  # what `django.db.connection` is
    try:
        with session(journal_target, api, user) as s:
            with transaction.atomic(using=alias):
                with connections[alias].cursor() as cursor:
                    cursor.execute(f"INSERT INTO {orders} VALUES (%s)", ["d-1"])
                first = enqueue(s, "d-1", connections[alias])
                again = enqueue(s, "d-1", proxy)
            with pytest.raises(RuntimeError), transaction.atomic(using=alias):
                with connections[alias].cursor() as cursor:
                    cursor.execute(f"INSERT INTO {orders} VALUES (%s)", ["d-2"])
                enqueue(s, "d-2", proxy)
                raise RuntimeError("the order failed")
            assert s.journal.operation("d-2:charge") is None
            results = s.resume()
    finally:
        connections[alias].close()
    assert first.key == again.key
    assert [("d-1:charge", "succeeded")] == [(r.operation_id, r.action) for r in results]
    assert ["d-1"] == [c.order_id for c in api.charges(user)]
    assert ["d-1"] == order_ids(journal_target)


# -- refusals: one line each, nothing journaled ------------------------------------------------


def test_django_outside_an_atomic_block_or_marked_for_rollback_is_refused(
    journal_target: str, orders: str, api: MockServer, user: str
) -> None:
    """Outside transaction.atomic() the operation would commit on its own; in a block
    marked for rollback it would be rolled back: both refused, and the block's own
    writes are as they were."""
    from django.db import connections, transaction

    alias = django_alias(journal_target)
    try:
        with session(journal_target, api, user) as s:
            refused(
                s, connections[alias], idempotently.JournalError, r"outside transaction\.atomic"
            )
            with transaction.atomic(using=alias):
                transaction.set_rollback(True, using=alias)
                refused(s, connections[alias], idempotently.JournalError, "marked for rollback")
    finally:
        connections[alias].close()


def test_a_sqlalchemy_session_on_another_database_is_refused(
    journal_target: str,
    orders: str,
    api: MockServer,
    user: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """A Session bound to another database than the journal's could never commit with
    it: refused by the same proof as a driver connection (the file's identity on SQLite,
    the journal's tables and namespace on PostgreSQL); the transaction stays usable."""
    if is_postgres(journal_target):
        other = request.getfixturevalue("postgres").new_database()
        match = "without the journal's tables"
    else:
        other = str(tmp_path / "shop.db")
        match = "not on the journal's file"
    engine = sqlalchemy_engine(other)
    with engine.begin() as db:
        db.execute(text("CREATE TABLE orders (id text)"))
    with session(journal_target, api, user) as s:
        with Session(engine) as db, db.begin():
            error = refused(s, db, idempotently.JournalError, match)
            db.execute(text("INSERT INTO orders VALUES ('still usable')"))
        assert ("bad:charge", True) == (error.operation_id, bool(error.key))
    with engine.connect() as db:
        assert [("still usable",)] == db.execute(text("SELECT id FROM orders")).fetchall()
    engine.dispose()


class Base(DeclarativeBase):
    pass


class OrderRow(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(primary_key=True)


def test_a_sqlalchemy_session_whose_flush_failed_is_refused(
    journal_target: str, orders: str, api: MockServer, user: str
) -> None:
    """A Session whose flush failed has rolled its transaction back: refused until the
    application rolls it back too, saying so."""
    engine = sqlalchemy_engine(journal_target)
    with session(journal_target, api, user) as s, Session(engine) as db:
        db.add(OrderRow(id="o-9"))
        db.flush()
        db.add(OrderRow(id="o-9"))
        with pytest.raises(sqlalchemy.exc.IntegrityError):
            db.flush()
        refused(s, db, idempotently.JournalError, "already failed")
    engine.dispose()


def test_a_scoped_session_commits_the_charge_with_its_order_or_neither(
    journal_target: str, orders: str, api: MockServer, user: str
) -> None:
    """A ``scoped_session`` (Flask-SQLAlchemy's ``db.session``) is the Session it gives
    this thread: the charge commits or rolls back with the order."""
    engine = sqlalchemy_engine(journal_target)
    db = scoped_session(sessionmaker(engine))
    with session(journal_target, api, user) as s:
        with db.begin():
            db.add(OrderRow(id="o-1"))
            enqueue(s, "o-1", db)
        with pytest.raises(RuntimeError), db.begin():
            db.add(OrderRow(id="o-2"))
            enqueue(s, "o-2", db)
            raise RuntimeError("the order failed")
        assert s.journal.operation("o-2:charge") is None
        assert ["o-1:charge"] == [r.operation_id for r in s.resume()]
    db.remove()
    engine.dispose()
    assert ["o-1"] == order_ids(journal_target)
    assert ["o-1"] == [c.order_id for c in api.charges(user)]


@pytest.mark.anyio
async def test_an_async_scoped_session_commits_the_charge_with_its_order(
    journal_target: str, orders: str, api: MockServer, user: str, anyio_backend: str
) -> None:
    """An ``async_scoped_session`` is the AsyncSession it gives this task."""
    asyncio_only(anyio_backend)
    engine = async_sqlalchemy_engine(journal_target)
    db = async_scoped_session(async_sessionmaker(engine), scopefunc=asyncio.current_task)
    async with idempotently.AsyncSession(
        journal_target, base_url=api.url, headers={"Authorization": f"Bearer {user}"}
    ) as s:
        async with db.begin():
            db.add(OrderRow(id="o-1"))
            await aenqueue(s, "o-1", db)
        assert ["o-1:charge"] == [r.operation_id for r in await s.resume()]
    await db.remove()
    await engine.dispose()
    assert ["o-1"] == order_ids(journal_target)


def test_a_sqlalchemy_session_bound_to_several_databases_is_refused(
    journal_target: str,
    orders: str,
    api: MockServer,
    user: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """A Session with a bind on the journal's database and its orders bound to another
    would commit them in two transactions (a crash between keeps one without the
    other): refused, naming the Connection to pass; the transaction stays usable."""
    if is_postgres(journal_target):
        other = request.getfixturevalue("postgres").new_database()
    else:
        other = str(tmp_path / "shop.db")
    engine, shop = sqlalchemy_engine(journal_target), sqlalchemy_engine(other)
    with shop.begin() as db:
        db.execute(text("CREATE TABLE orders (id text PRIMARY KEY)"))
    with session(journal_target, api, user) as s:
        with Session(bind=engine, binds={OrderRow: shop}) as db, db.begin():
            db.add(OrderRow(id="o-1"))
            refused(s, db, idempotently.JournalError, "bound to several databases")
        assert s.journal.operation("o-1:charge") is None
    with shop.connect() as db:
        assert [("o-1",)] == db.execute(text("SELECT id FROM orders")).fetchall()
    engine.dispose()
    shop.dispose()


def test_a_sqlalchemy_session_bound_through_binds_alone_commits_with_its_order(
    journal_target: str, orders: str, api: MockServer, user: str
) -> None:
    """A Session whose one database is named in ``binds`` (no ``bind``) is that
    database's: the charge commits with the order."""
    engine = sqlalchemy_engine(journal_target)
    with session(journal_target, api, user) as s:
        with Session(binds={Base: engine}) as db, db.begin():
            db.add(OrderRow(id="o-1"))
            enqueue(s, "o-1", db)
        assert "pending" == s.journal.operation("o-1:charge").status
    engine.dispose()
    assert ["o-1"] == order_ids(journal_target)


def test_a_closed_or_autocommit_sqlalchemy_connection_is_refused(
    journal_target: str, orders: str, api: MockServer, user: str
) -> None:
    """Closed; AUTOCOMMIT set on the connection or on its engine (the operation would
    commit on its own): each refused, saying what to do."""
    engine = sqlalchemy_engine(journal_target)
    autocommit_engine = sqlalchemy.create_engine(
        sqlalchemy_url(journal_target), isolation_level="AUTOCOMMIT"
    )
    with session(journal_target, api, user) as s:
        closed = engine.connect()
        closed.close()
        refused(s, closed, idempotently.JournalError, "is closed")
        with engine.connect() as db:
            autocommit = db.execution_options(isolation_level="AUTOCOMMIT")
            refused(s, autocommit, idempotently.JournalError, "AUTOCOMMIT mode")
        with autocommit_engine.begin() as db:
            refused(s, db, idempotently.JournalError, "AUTOCOMMIT mode")
    engine.dispose()
    autocommit_engine.dispose()


def test_sqlalchemys_sqlite_recipe_with_begin_commits_the_charge_with_its_order(
    tmp_path: Path, api: MockServer, user: str
) -> None:
    """SQLAlchemy's documented SQLite recipe (the driver in autocommit, BEGIN emitted on
    the "begin" event) has its transaction open: the charge commits or rolls back with
    the order; without the BEGIN it is still refused as autocommit."""
    path = str(tmp_path / "journal.db")
    idempotently.Journal(path).close()
    plain = sqlalchemy.create_engine(f"sqlite:///{path}", connect_args={"isolation_level": None})
    engine = sqlalchemy.create_engine(f"sqlite:///{path}", connect_args={"isolation_level": None})
    sqlalchemy.event.listen(engine, "begin", lambda db: db.exec_driver_sql("BEGIN"))
    with engine.begin() as db:
        db.execute(text("CREATE TABLE orders (id text PRIMARY KEY)"))
    with session(path, api, user) as s:
        with Session(engine) as db, db.begin():
            db.add(OrderRow(id="o-1"))
            enqueue(s, "o-1", db)
        with pytest.raises(RuntimeError), Session(engine) as db, db.begin():
            db.add(OrderRow(id="o-2"))
            enqueue(s, "o-2", db)
            raise RuntimeError("the order failed")
        with Session(plain) as db, db.begin():
            refused(s, db, idempotently.JournalError, "AUTOCOMMIT mode")
        assert ["o-1:charge"] == [r.operation_id for r in s.resume()]
    with engine.connect() as db:
        assert [("o-1",)] == db.execute(text("SELECT id FROM orders")).fetchall()
    engine.dispose()
    plain.dispose()
    assert ["o-1"] == [c.order_id for c in api.charges(user)]


@pytest.mark.postgres
def test_a_failed_postgres_transaction_is_refused(
    postgres_url: str, api: MockServer, user: str
) -> None:
    """A SQLAlchemy transaction, or a Django atomic block, whose statement already failed
    (caught by the application) cannot commit anything: refused, saying to roll it back."""
    from django.db import DatabaseError, connections, transaction

    idempotently.Journal(postgres_url).close()
    engine = sqlalchemy_engine(postgres_url)
    alias = django_alias(postgres_url)
    with session(postgres_url, api, user) as s:
        with engine.begin() as db:
            with pytest.raises(sqlalchemy.exc.DBAPIError):
                db.execute(text("SELECT 1 / 0"))
            refused(s, db, idempotently.JournalError, "already failed")
        with transaction.atomic(using=alias):  # its COMMIT rolls back: no error either
            with pytest.raises(DatabaseError), connections[alias].cursor() as cursor:
                cursor.execute("SELECT 1 / 0")
            refused(s, connections[alias], idempotently.JournalError, "already failed")
    connections[alias].close()
    engine.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("kind", ["sqlalchemy", "psycopg"])
def test_a_connection_on_a_copy_of_the_journals_database_is_refused(
    postgres: Any, api: MockServer, user: str, kind: str
) -> None:
    """A copy of the journal's database (``CREATE DATABASE ... TEMPLATE``, as test
    suites clone theirs) has the journal's tables and namespace, but the operation
    would commit where this journal never reads: refused, naming both databases."""
    import psycopg

    journal = postgres.new_database()
    idempotently.Journal(journal).close()
    name = journal.rsplit("/", 1)[1]
    with psycopg.connect(postgres.url(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}_copy TEMPLATE {name}")
    copy = postgres.url(f"{name}_copy")
    with session(journal, api, user) as s:
        if kind == "psycopg":
            with psycopg.connect(copy) as db:
                error = refused(s, db, idempotently.JournalError, "a copy of the journal's")
        else:
            engine = sqlalchemy_engine(copy)
            with Session(engine) as db, db.begin():
                error = refused(s, db, idempotently.JournalError, "a copy of the journal's")
            engine.dispose()
    assert f"'{name}_copy'" in str(error)


@pytest.mark.postgres
def test_a_connection_on_the_other_kind_of_database_is_refused(
    journal_target: str,
    orders: str,
    api: MockServer,
    user: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """A SQLAlchemy Session on PostgreSQL for a SQLite journal, or on SQLite for a
    PostgreSQL one: a TypeError naming both."""
    postgres = request.getfixturevalue("postgres")
    other = str(tmp_path / "shop.db") if is_postgres(journal_target) else postgres.url()
    engine = sqlalchemy_engine(other)
    with session(journal_target, api, user) as s, Session(engine) as db:
        refused(s, db, TypeError, "not on the journal's")
    engine.dispose()


@pytest.mark.anyio
async def test_sync_and_async_objects_go_to_their_own_enqueue(
    tmp_path: Path, api: MockServer, user: str, anyio_backend: str
) -> None:
    """An AsyncSession or AsyncConnection given to Session.enqueue, a sync Session or
    Django's connection given to AsyncSession.enqueue: a TypeError saying which one."""
    path = str(tmp_path / "journal.db")
    idempotently.Journal(path).close()
    async_engine = create_async_engine(sqlalchemy_url(path, asynchronous=True))
    engine = sqlalchemy_engine(path)
    from django.db import connections

    alias = django_alias(path)
    with session(path, api, user) as s:
        refused(s, AsyncSession(async_engine), TypeError, r"goes to AsyncSession\.enqueue")
        refused(s, async_engine.connect(), TypeError, r"goes to AsyncSession\.enqueue")
    async with idempotently.AsyncSession(path, base_url=api.url) as a:
        with Session(engine) as db, engine.connect() as conn:
            for connection, match in (
                (db, r"goes to Session\.enqueue"),
                (conn, r"goes to Session\.enqueue"),
                (connections[alias], "synchronous"),
            ):
                with pytest.raises(TypeError, match=match):
                    await aenqueue(a, "bad", connection)
        assert a.journal.operation("bad:charge") is None
    engine.dispose()


def test_a_driver_connections_enqueue_imports_no_orm(tmp_path: Path) -> None:
    """An application without SQLAlchemy or Django never loads them: ORM objects are told
    apart by what the application has already imported."""
    path = tmp_path / "journal.db"
    probe = f"""
import sqlite3, sys
import idempotently
session = idempotently.Session({str(path)!r}, base_url="http://shop.invalid")
db = sqlite3.connect({str(path)!r})
with db:
    session.enqueue("POST", "/v1/charges", json={{}}, operation_id="o-1", connection=db)
    session.enqueue("POST", "/v1/charges", json={{}}, operation_id="o-1", connection=db)
try:
    session.enqueue("POST", "/v1/charges", json={{}}, operation_id="o-2", connection=object())
except TypeError:
    pass
print(sorted(m for m in sys.modules if m.split(".")[0] in ("sqlalchemy", "django")))
"""
    shown = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert "[]\n" == shown.stdout


@pytest.mark.anyio
async def test_a_closed_async_sqlalchemy_connection_is_refused(
    tmp_path: Path, api: MockServer, user: str, anyio_backend: str
) -> None:
    """A closed AsyncConnection given to AsyncSession.enqueue: refused in one line."""
    asyncio_only(anyio_backend)
    path = str(tmp_path / "journal.db")
    engine = create_async_engine(sqlalchemy_url(path, asynchronous=True))
    async with idempotently.AsyncSession(path, base_url=api.url) as a:
        closed = await engine.connect()
        await closed.close()
        with pytest.raises(idempotently.JournalError, match="is closed") as raised:
            await aenqueue(a, "bad", closed)
        assert a.journal.operation("bad:charge") is None
    await engine.dispose()
    assert "bad:charge" == raised.value.operation_id
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("kind", KINDS)
def test_a_group_step_enqueued_through_sqlalchemy_keeps_its_group_and_place(
    journal_target: str, orders: str, api: MockServer, user: str, kind: str
) -> None:
    """``g.enqueue(..., step=, connection=)`` on a SQLAlchemy Session or Connection journals
    the step in its group, at its place, as a driver connection does: resume sends the
    steps in their order, each once."""
    engine = sqlalchemy_engine(journal_target)
    with session(journal_target, api, user) as s:
        group = s.group("o-7")
        with transaction(engine, kind) as db:
            db.execute(text(f"INSERT INTO {orders} VALUES ('o-7')"))
            group.enqueue("POST", "/v1/charges", json=charge("o-7"), step="charge", connection=db)
            group.enqueue(
                "POST", "/v1/charges", json=charge("o-7", 700), step="ship", connection=db
            )
        steps = [(o.operation_id, o.group_id, o.step) for o in s.journal.group("o-7")]
        results = s.resume()
    engine.dispose()
    assert [("o-7/charge", "o-7", 1), ("o-7/ship", "o-7", 2)] == steps
    assert [("o-7/charge", "succeeded"), ("o-7/ship", "succeeded")] == [
        (r.operation_id, r.action) for r in results
    ]
    assert [500, 700] == [c.amount for c in api.charges(user)]
