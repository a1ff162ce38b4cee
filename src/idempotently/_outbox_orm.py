"""The outbox in an ORM's transaction: a SQLAlchemy ``Session`` or ``Connection`` (sync
and async) and Django's connection, as the stores' outbox speaks to them.

The stores write their outbox once, as steps: statements in their own driver's
parameter style (``?`` for SQLite, ``%s``/``%(name)s`` for PostgreSQL) that a driver
runs and answers with ``(rows, rowcount)``. `OrmConnection` is that driver for an ORM:
each statement goes through the ORM's own public API (``Connection.execute(text(...))``,
Django's ``connection.cursor()``), so it runs on whatever driver the ORM sits on
(sqlite3, aiosqlite, psycopg, psycopg2, asyncpg). An async SQLAlchemy object runs the
same steps through its documented ``run_sync``: one path for both.

Neither ORM is ever imported here unless the application has imported it already: an
object of one means it is loaded (``sys.modules``), so a bare install pays nothing.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Literal, TypeVar, cast

from idempotently._exceptions import ErrorContext, JournalError

Steps = Generator[tuple[str, Any], tuple[list[dict[str, Any]], int], Any]
"""Statements to run: each yields (sql, params) and receives (rows, rowcount)."""

Style = Literal["qmark", "format"]
"""A store's parameter style: SQLite's ``?``; PostgreSQL's ``%s`` and ``%(name)s``."""

T = TypeVar("T")

_NOTHING = "nothing was journaled"


class StatementError(Exception):
    """A statement of the outbox failed on the application's ORM connection: the
    driver's own error (``driver_error``) and its SQLSTATE where the driver has one,
    whatever ORM wrapped it."""

    def __init__(self, driver_error: BaseException, sqlstate: str | None) -> None:
        super().__init__(str(driver_error))
        self.driver_error = driver_error
        self.sqlstate = sqlstate


def _loaded(module: str, *names: str) -> tuple[type, ...]:
    """The classes ``names`` of ``module`` if the application has imported it, else ()."""
    found = sys.modules.get(module)
    if found is None:
        return ()
    return tuple(getattr(found, name) for name in names if hasattr(found, name))


def _sync_sqlalchemy() -> tuple[type, ...]:
    return _loaded("sqlalchemy.orm", "Session") + _loaded("sqlalchemy.engine", "Connection")


def _async_sqlalchemy() -> tuple[type, ...]:
    return _loaded("sqlalchemy.ext.asyncio", "AsyncSession", "AsyncConnection")


def _django() -> tuple[type, ...]:
    # `django.db.connection` is a ConnectionProxy; `connections[alias]` a DatabaseWrapper.
    return _loaded("django.utils.connection", "ConnectionProxy") + _loaded(
        "django.db.backends.base.base", "BaseDatabaseWrapper"
    )


def _scoped() -> tuple[type, ...]:
    return _loaded("sqlalchemy.orm", "scoped_session") + _loaded(
        "sqlalchemy.ext.asyncio", "async_scoped_session"
    )


def _current(connection: object) -> object:
    """A ``scoped_session`` (Flask-SQLAlchemy's ``db.session``) as the Session it gives
    this thread or task now (calling it is its public API), else ``connection``."""
    return cast(Any, connection)() if isinstance(connection, _scoped()) else connection


def is_orm(connection: object) -> bool:
    """Whether ``connection`` is a SQLAlchemy or Django object this module drives."""
    kinds = _sync_sqlalchemy() + _async_sqlalchemy() + _django() + _scoped()
    return bool(kinds) and isinstance(connection, kinds)


def opened(connection: object, ids: ErrorContext) -> OrmConnection:
    """``connection`` (a SQLAlchemy Session or Connection, or Django's connection) as an
    `OrmConnection` inside its open transaction; else one clear error, nothing written."""
    connection = _current(connection)
    if isinstance(connection, _async_sqlalchemy()):
        raise TypeError(
            f"connection is a SQLAlchemy {type(connection).__name__}: it goes to "
            "AsyncSession.enqueue (await it there); Session.enqueue takes a sync Session or "
            f"Connection; {_NOTHING}"
        )
    if isinstance(connection, _django()):
        return _DjangoConnection(connection, ids)
    return _SqlAlchemyConnection(connection, ids)


async def run_async(connection: object, ids: ErrorContext, work: Callable[[OrmConnection], T]) -> T:
    """``work`` on an async SQLAlchemy ``connection``, through its ``run_sync`` (the
    statements are awaited on the application's event loop); a sync object is refused."""
    connection = _current(connection)
    if isinstance(connection, _django()):
        raise TypeError(
            "connection is Django's connection, which is synchronous: it goes to "
            "Session.enqueue (from async code, run your transaction and Session.enqueue "
            f"together in sync_to_async); {_NOTHING}"
        )
    if not isinstance(connection, _async_sqlalchemy()):
        raise TypeError(
            f"connection is a SQLAlchemy {type(connection).__name__}: it goes to "
            "Session.enqueue; AsyncSession.enqueue takes an AsyncSession or AsyncConnection; "
            f"{_NOTHING}"
        )
    run: Callable[[Callable[[Any], T]], Awaitable[T]] = cast(Any, connection).run_sync
    return await run(lambda sync: work(_SqlAlchemyConnection(sync, ids)))


def _closed(name: str) -> str:
    return (
        f"the {name} given to enqueue is closed; pass the open one your transaction runs on; "
        f"{_NOTHING}"
    )


class OrmConnection:
    """The application's ORM connection, checked usable, running a store's steps."""

    name: str
    """What it is, for messages ("SQLAlchemy Session", "Django connection")."""
    dialect: str
    """Its database: "sqlite", "postgresql", or another the stores refuse."""

    def run(self, steps: Steps, style: Style, *, savepoint: bool) -> Any:
        """Run ``steps`` (statements in ``style``) in the application's transaction, in a
        savepoint if asked (a failed statement then leaves the transaction as it was)."""
        with self._savepoint() if savepoint else nullcontext():
            reply: Any = None
            while True:
                try:
                    sql, params = steps.send(reply)
                except StopIteration as stop:
                    return stop.value
                reply = self.execute(sql, params, style)

    def rows(self, sql: str, params: Any, style: Style) -> list[dict[str, Any]]:
        return self.execute(sql, params, style)[0]

    def execute(self, sql: str, params: Any, style: Style) -> tuple[list[dict[str, Any]], int]:
        raise NotImplementedError

    def _savepoint(self) -> Any:
        raise NotImplementedError


def _plain(value: Any) -> Any:
    # psycopg2 reads bytea as memoryview; every other driver (and the stores) as bytes.
    return bytes(value) if isinstance(value, memoryview) else value


def _sqlstate(error: BaseException | None) -> str | None:
    """The SQLSTATE of a driver's error: psycopg's and asyncpg's ``sqlstate``, psycopg2's
    ``pgcode`` (SQLAlchemy's asyncpg adapter carries both)."""
    for name in ("sqlstate", "pgcode"):
        value = getattr(error, name, None)
        if isinstance(value, str) and value:
            return value
    return None


# SQLAlchemy's text() takes `:name` as a bind unless escaped; the stores' statements
# carry none, but a literal one must never become one.
_COLONS = re.compile(r"(?<![:\w\\]):(?=\w)")
_FORMAT = re.compile(r"%\((\w+)\)s|%s|%%")


def _as_text(sql: str, params: Any, style: Style) -> tuple[str, dict[str, Any]]:
    """A store's statement as SQLAlchemy ``text()`` and its named parameters. A bind is
    written ``(:name)``: a PostgreSQL cast right after it (``::text``) must not be read
    as part of its name."""
    sql = _COLONS.sub(r"\\:", sql)
    bound: dict[str, Any] = {}
    if style == "qmark":
        values = list(params)

        def positional(_: re.Match[str]) -> str:
            name = f"p{len(bound)}"
            bound[name] = values[len(bound)]
            return f"(:{name})"

        return re.sub(r"\?", positional, sql), bound
    given: Sequence[Any] = () if isinstance(params, Mapping) else list(params)

    def formatted(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        name = match.group(1)
        if name is None:
            name = f"p{len(bound)}"
            bound[name] = given[len(bound)]
        else:
            bound[name] = params[name]
        return f"(:{name})"

    return _FORMAT.sub(formatted, sql), bound


class _SqlAlchemyConnection(OrmConnection):
    def __init__(self, given: Any, ids: ErrorContext) -> None:
        import sqlalchemy.exc
        from sqlalchemy.engine import Connection

        self._ids = ids
        kind = type(given).__name__
        self.name = f"SQLAlchemy {kind}"
        if isinstance(given, _loaded("sqlalchemy.orm", "Session")):  # a Core app has no ORM
            session: Any = given
            try:
                connection = session.connection(bind_arguments=self._one_bind(session))
            except sqlalchemy.exc.PendingRollbackError:
                raise JournalError(
                    f"cannot enqueue on the {self.name} given: its transaction has already "
                    "failed (a flush or statement in it raised): roll it back and run it "
                    f"again; {_NOTHING}",
                    **ids,
                ) from None
            except sqlalchemy.exc.SQLAlchemyError as error:
                raise JournalError(
                    f"cannot enqueue on the {self.name} given: {_first_line(error)}; pass the "
                    f"Session your transaction runs in, bound to the journal's database; "
                    f"{_NOTHING}",
                    **ids,
                ) from None
        elif isinstance(given, Connection):
            connection = given
        else:  # pragma: no cover - `opened` gives only these
            raise TypeError(kind)
        if connection.closed:
            raise JournalError(_closed(self.name), **ids)
        if connection.invalidated:
            raise JournalError(
                f"the {self.name} given to enqueue lost its link to the database "
                f"(invalidated): roll back and run your transaction again; {_NOTHING}",
                **ids,
            )
        self._connection = connection
        self.dialect = connection.dialect.name
        if self._autocommit():
            raise JournalError(
                f"the {self.name} given to enqueue is in AUTOCOMMIT mode, so the operation "
                "would commit on its own, not with your writes: use a connection or Session "
                "without isolation_level='AUTOCOMMIT', or leave connection out to journal it "
                f"on its own; {_NOTHING}",
                **ids,
            )

    def _one_bind(self, session: Any) -> dict[str, Any] | None:
        """The Session's one database (``bind``, or ``binds`` naming only one), else a
        clear error: with several, the application's rows may commit on another
        database's transaction than the operation, and a crash between the two commits
        would keep one without the other."""
        named = [session.bind, *(getattr(session, "binds", None) or {}).values()]
        binds = list({id(bind): bind for bind in named if bind is not None}.values())
        if len(binds) > 1:
            raise JournalError(
                f"the {self.name} given to enqueue is bound to several databases (bind and "
                "binds), so the operation might not commit with your writes: pass the "
                "Connection your writes run on, "
                "session.connection(bind_arguments={'mapper': YourModel}); "
                f"{_NOTHING}",
                **self._ids,
            )
        return {"bind": binds[0]} if binds and session.bind is None else None

    def _autocommit(self) -> bool:
        connection = self._connection
        if connection.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            return True
        # The driver connection's own setting (an engine made with AUTOCOMMIT; a driver
        # set to autocommit by hand), where the dialect can tell (SQLAlchemy 2.1).
        detect = getattr(connection.dialect, "detect_autocommit_setting", None)
        if detect is None:
            return False
        dbapi = connection.connection.dbapi_connection
        try:
            autocommit = bool(detect(dbapi))
        except NotImplementedError:
            return False
        # SQLAlchemy's own SQLite recipe (the driver in autocommit, BEGIN emitted on the
        # "begin" event) has a transaction open: the statements join it.
        return autocommit and getattr(dbapi, "in_transaction", None) is not True

    def execute(self, sql: str, params: Any, style: Style) -> tuple[list[dict[str, Any]], int]:
        import sqlalchemy.exc
        from sqlalchemy import text

        statement, bound = _as_text(sql, params, style)
        try:
            result = self._connection.execute(text(statement), bound)
            rows = (
                [{k: _plain(v) for k, v in row.items()} for row in result.mappings()]
                if result.returns_rows
                else []
            )
            return rows, result.rowcount
        except sqlalchemy.exc.DBAPIError as error:
            raise StatementError(error.orig or error, _sqlstate(error.orig)) from error

    @contextmanager
    def _savepoint(self) -> Iterator[None]:
        import sqlalchemy.exc

        try:
            nested = self._connection.begin_nested()
        except sqlalchemy.exc.DBAPIError as error:
            raise StatementError(error.orig or error, _sqlstate(error.orig)) from error
        try:
            yield
        except BaseException:
            if nested.is_active:
                nested.rollback()
            raise
        nested.commit()


class _DjangoConnection(OrmConnection):
    def __init__(self, given: Any, ids: ErrorContext) -> None:
        from django.db import connections

        self.name = "Django connection"
        # `django.db.connection` is a proxy to this thread's connection of its alias.
        self._connection = connection = connections[given.alias]
        self.dialect = connection.vendor
        problem = None
        if not connection.in_atomic_block:
            problem = (
                "it is outside transaction.atomic() (in autocommit mode), so the operation "
                "would commit on its own, not with your writes: call enqueue inside "
                "`with transaction.atomic():`, or leave connection out to journal it on its own"
            )
        elif connection.get_rollback():
            problem = (
                "its atomic block is marked for rollback (a statement in it failed): let it "
                "roll back and run it again"
            )
        if problem is not None:
            raise JournalError(
                f"cannot enqueue on Django's connection ({connection.alias!r}): {problem}; "
                f"{_NOTHING}",
                **ids,
            )

    def execute(self, sql: str, params: Any, style: Style) -> tuple[list[dict[str, Any]], int]:
        import django.db

        if style == "qmark":  # Django speaks the format style on every backend
            sql = sql.replace("%", "%%").replace("?", "%s")
        try:
            with self._connection.cursor() as cursor:
                cursor.execute(sql, params)
                if cursor.description is None:
                    return [], cursor.rowcount
                names = [column[0] for column in cursor.description]
                rows = [
                    {name: _plain(value) for name, value in zip(names, row, strict=True)}
                    for row in cursor.fetchall()
                ]
                return rows, cursor.rowcount
        except django.db.DatabaseError as error:
            driver = error.__cause__ if error.__cause__ is not None else error
            raise StatementError(driver, _sqlstate(driver)) from error

    @contextmanager
    def _savepoint(self) -> Iterator[None]:
        import django.db
        from django.db import transaction

        # A nested atomic block is Django's savepoint: an error rolls back to it and
        # leaves the application's block as it was. Its own SAVEPOINT or RELEASE failing
        # (a transaction that already failed) is a statement's error too.
        try:
            with transaction.atomic(using=self._connection.alias):
                yield
        except django.db.DatabaseError as error:
            driver = error.__cause__ if error.__cause__ is not None else error
            raise StatementError(driver, _sqlstate(driver)) from error


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
