"""The PostgreSQL journal: its schema, durability, errors and fleet operations.

Behaviour both stores share is tested once, parametrised over the store
(tests/test_journal.py, tests/test_contract.py); this file holds what only
PostgreSQL has: URLs and passwords, the schema in the database, the
synchronous_commit of each write, claiming due operations across connections.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import attrs
import httpx
import psycopg
import pytest

import idempotently
from idempotently import (
    Journal,
    JournalCorruptError,
    JournalError,
    JournalMissingError,
    JournalVersionError,
    JournalWriteError,
)
from idempotently._commands import Record
from idempotently._journal import AttemptRecord, _postgres
from idempotently._journal._postgres import SCHEMA_VERSION, PostgresStore, redact_url
from idempotently._rows import Failed
from tests.journal_commands import record_attempt, set_status, take_lease
from tests.postgres_server import PostgresServer, postgres_server
from tests.scripted_server import Answer
from tests.test_claims import due_and_not_due
from tests.test_journal import NOW, insert, new_operation

pytestmark = pytest.mark.postgres


def sql(url: str, statement: str, params: Any = ()) -> list[tuple[Any, ...]]:
    """Run one statement on its own connection (as another process would); its rows."""
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


@pytest.fixture
def journal(postgres_url: str) -> Iterator[Journal]:
    with Journal(postgres_url) as opened:
        yield opened


# -- the URL ---------------------------------------------------------------------------


def test_a_postgresql_url_opens_a_postgresql_journal(postgres_url: str) -> None:
    """Journal(url) is a Journal (so Session and the CLI take it) backed by PostgreSQL."""
    with Journal(postgres_url.replace("postgresql://", "postgres://")) as journal:
        assert isinstance(journal, Journal)
        assert isinstance(journal._store, PostgresStore)
        assert insert(journal, new_operation())


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:s3cr%40t@db:5432/pay", "postgresql://app:***@db:5432/pay"),
        ("postgresql://app@db/pay?password=s3cr3t&sslmode=require", None),
        ("postgres://db/pay", "postgres://db/pay"),
        ("postgresql://app:s3cr3t@h1:5432,h2:5433/pay", "postgresql://app:***@h1:5432,h2:5433/pay"),
    ],
)
def test_the_password_is_redacted_from_the_url(url: str, shown: str | None) -> None:
    """A URL's password (user info or password= parameter) is shown as ***."""
    redacted = redact_url(url)

    assert "s3cr" not in redacted
    if shown is not None:
        assert shown == redacted
    else:
        assert "password=***" in redacted


def test_the_password_is_never_in_a_message_or_repr(postgres: PostgresServer) -> None:
    """path, repr and the error for a missing database never hold the password."""
    database = postgres.new_database().rsplit("/", 1)[1]
    with Journal(postgres.url(database, password="hunter2-secret")) as journal:
        assert "hunter2" not in repr(journal) + journal.path
        assert "postgresql://postgres:***@" in journal.path
    missing = postgres.url("no_such_db", password="hunter2-secret")

    with pytest.raises(JournalError) as caught:
        Journal(missing)

    message = str(caught.value)
    assert "hunter2" not in message
    assert "postgresql://postgres:***@127.0.0.1" in message
    assert "createdb" in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_an_unreachable_server_is_a_clear_error() -> None:
    """A server that is not there: one line naming the URL (no password) and what to check."""
    with socket_nobody_listens_on() as port, pytest.raises(JournalError) as caught:
        Journal(f"postgresql://app:pw-secret@127.0.0.1:{port}/pay", busy_timeout=1)

    message = str(caught.value)
    assert f"postgresql://app:***@127.0.0.1:{port}/pay" in message
    assert "pw-secret" not in message
    assert "check it is running" in message


@contextmanager
def socket_nobody_listens_on() -> Iterator[int]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]  # bound, never listening: connections are refused


def test_without_psycopg_the_error_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the postgres extra, opening a URL says which pip command installs it."""
    monkeypatch.setitem(sys.modules, "psycopg", None)

    with pytest.raises(JournalError, match=r"pip install 'idempotently\[postgres\]'"):
        Journal("postgresql://app:pw@127.0.0.1:1/pay")


# -- the schema --------------------------------------------------------------------------


def test_the_tables_live_in_their_own_schema(journal: Journal, postgres_url: str) -> None:
    """A journal adds tables to schema idempotently only: the app's public schema is untouched."""
    tables = sql(
        postgres_url,
        "SELECT table_schema, table_name FROM information_schema.tables "
        "WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 2",
    )

    assert [
        ("idempotently", "attempts"),
        ("idempotently", "journal_counts"),
        ("idempotently", "journal_meta"),
        ("idempotently", "operation_audit"),
        ("idempotently", "operations"),
        ("idempotently", "origin_pauses"),
    ] == tables
    assert [(str(SCHEMA_VERSION),)] == sql(
        postgres_url,
        "SELECT value FROM idempotently.journal_meta WHERE name = 'schema_version'",
    )


def test_a_newer_schema_is_refused_and_left_untouched(postgres_url: str) -> None:
    """A journal from a newer idempotently: JournalVersionError, and not one row changes."""
    with Journal(postgres_url) as journal:
        insert(journal, new_operation())
    sql(
        postgres_url,
        "UPDATE idempotently.journal_meta SET value = %s WHERE name = 'schema_version'",
        (str(SCHEMA_VERSION + 1),),
    )
    before = sql(postgres_url, "SELECT * FROM idempotently.journal_meta ORDER BY name")

    for options in ({}, {"readonly": True}, {"create": False}):
        with pytest.raises(JournalVersionError, match="upgrade idempotently"):
            Journal(postgres_url, **options)

    assert before == sql(postgres_url, "SELECT * FROM idempotently.journal_meta ORDER BY name")
    assert [(1,)] == sql(postgres_url, "SELECT count(*) FROM idempotently.operations")


@pytest.mark.parametrize("options", [{"create": False}, {"readonly": True}])
def test_a_database_without_a_journal_is_not_given_one(
    postgres_url: str, options: dict[str, bool]
) -> None:
    """create=False (and readonly) on a database without the schema: a clear error, no schema."""
    with pytest.raises(JournalMissingError, match="no journal in postgresql://"):
        Journal(postgres_url, **options)

    assert [] == sql(postgres_url, "SELECT 1 FROM pg_namespace WHERE nspname = 'idempotently'")


def test_a_read_only_journal_never_writes(postgres_url: str) -> None:
    """readonly=True reads, and any write is a JournalWriteError (the server refuses it too)."""
    with Journal(postgres_url) as journal:
        insert(journal, new_operation("op-1"))

    with Journal(postgres_url, readonly=True) as reader:
        assert ["op-1"] == [operation.operation_id for operation in reader.operations()]
        with pytest.raises(JournalWriteError, match="read-only"):
            insert(reader, new_operation("op-2"))
        reader._store.readonly = False  # past our own check: the server's setting refuses it
        with pytest.raises(JournalWriteError, match="read-only"):
            insert(reader, new_operation("op-2"))

    assert [(1,)] == sql(postgres_url, "SELECT count(*) FROM idempotently.operations")


def test_openers_of_a_fresh_database_create_the_schema_once(postgres_url: str) -> None:
    """Eight processes opening one empty database at once: one schema, one namespace."""
    start = threading.Barrier(8)
    namespaces: list[uuid.UUID] = []
    errors: list[BaseException] = []

    def open_it() -> None:
        start.wait()
        try:
            with Journal(postgres_url) as journal:
                namespaces.append(journal.namespace)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=open_it) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert [] == errors
    assert 8 == len(namespaces)
    assert 1 == len(set(namespaces))


def test_the_namespace_is_made_once_per_database(
    postgres_url: str, postgres: PostgresServer
) -> None:
    """Reopening keeps the namespace; another database gets its own."""
    with Journal(postgres_url) as journal:
        first = journal.namespace
    with Journal(postgres_url, readonly=True) as reopened:
        again = reopened.namespace
    with Journal(postgres.new_database()) as other:
        elsewhere = other.namespace

    assert first == again
    assert first != elsewhere


# -- durability ----------------------------------------------------------------------------


@contextmanager
def synchronous_commit_seen(url: str) -> Iterator[list[tuple[str, str]]]:
    """(statement, synchronous_commit) in force in each write to operations and attempts."""
    sql(
        url,
        """
        CREATE TABLE public.seen (id serial, what text, setting text);
        CREATE FUNCTION public.see() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO public.seen (what, setting)
            VALUES (TG_TABLE_NAME || ' ' || TG_OP, current_setting('synchronous_commit'));
            RETURN NULL;
        END $$;
        CREATE TRIGGER see AFTER INSERT OR UPDATE ON idempotently.operations
            FOR EACH ROW EXECUTE FUNCTION public.see();
        CREATE TRIGGER see AFTER INSERT ON idempotently.attempts
            FOR EACH ROW EXECUTE FUNCTION public.see();
        """,
    )
    seen: list[tuple[str, str]] = []
    try:
        yield seen
    finally:
        seen += [
            (what, setting)
            for what, setting in sql(url, "SELECT what, setting FROM public.seen ORDER BY id")
        ]
        sql(url, "DROP TABLE public.seen; DROP FUNCTION public.see() CASCADE")


def the_flow_writes(journal: Journal) -> None:
    """Insert a key, take the lease back, record an attempt."""
    insert(journal, new_operation(), lease_until=NOW - 1)
    operation = journal.operation("op-1")
    assert operation is not None
    assert take_lease(journal, operation, owner="resumer", lease_until=NOW + 30, now=NOW)
    record_attempt(
        journal,
        "op-1",
        AttemptRecord(
            started_at=NOW, elapsed=0.1, outcome="answered", status_code=201, status="succeeded"
        ),
        now=NOW,
        owner="resumer",
    )


@pytest.mark.parametrize(
    ("durability", "server_default", "key_commit"),
    [("fsync", "off", "on"), ("os", "on", "off")],
)
def test_the_key_commits_with_the_durability_asked_for(
    postgres_url: str, durability: str, server_default: str, key_commit: str
) -> None:
    """The key's row commits with synchronous_commit on for "fsync", off for "os", whatever
    the database's default; the lease with on; the attempt with off."""
    Journal(postgres_url).close()
    database = postgres_url.rsplit("/", 1)[1]
    sql(postgres_url, f"ALTER DATABASE {database} SET synchronous_commit = {server_default}")
    try:
        with (
            synchronous_commit_seen(postgres_url) as seen,
            Journal(postgres_url, durability=durability) as journal,  # type: ignore[arg-type]
        ):
            the_flow_writes(journal)
    finally:
        sql(postgres_url, f"ALTER DATABASE {database} RESET synchronous_commit")

    assert [
        ("operations INSERT", key_commit),
        ("operations UPDATE", "on"),
        ("operations UPDATE", "off"),  # the first attempt: in the operation's row
    ] == seen


# -- round trips -----------------------------------------------------------------------------


def round_trips_in(trace: str) -> int:
    """Round trips in a libpq protocol trace: each run of client (F) messages that the
    server (B) answers is one; a pipeline's many statements are one run."""
    directions = [line.split("\t", 1)[0] for line in trace.splitlines() if line[:1] in "FB"]
    return sum(
        1 for before, after in itertools.pairwise(directions) if (before, after) == ("F", "B")
    )


@contextmanager
def round_trips_per_call(journal: Journal) -> Iterator[list[tuple[str, int]]]:
    """(store method, round trips) for each find and commit: every connection the store
    takes from its pools is traced at the protocol level (libpq's PQtrace) while it holds it."""
    store = journal._store
    calls: list[tuple[str, int]] = []
    counted: list[int] = []

    def traced(pool: Any) -> Any:
        real = pool.connection

        @contextmanager
        def connection(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with real(*args, **kwargs) as conn, tempfile.TemporaryFile("w+") as trace:
                conn.pgconn.trace(trace.fileno())
                conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
                try:
                    yield conn
                finally:
                    conn.pgconn.untrace()
                    trace.seek(0)
                    counted.append(round_trips_in(trace.read()))

        return connection

    def calling(name: str, method: Any) -> Any:
        def call(*args: Any) -> Any:
            del counted[:]
            try:
                return method(*args)
            finally:
                calls.append((name, sum(counted)))

        return call

    def before_commit(writes: Any, durable: bool) -> None:
        del counted[:]

    def after_commit(writes: Any, outcomes: Any) -> None:
        calls.append(("commit", sum(counted)))

    stop = journal.observe_commits(before=before_commit, after=after_commit)
    try:
        with (
            mock.patch.object(store._pool, "connection", traced(store._pool)),
            mock.patch.object(store._flushed_pool, "connection", traced(store._flushed_pool)),
            mock.patch.object(store, "find", calling("find", store.find)),
            # A test that hands a batch to the store itself (the writer's commits are
            # seen by the observer above).
            mock.patch.object(store, "commit", calling("commit", store.commit)),
        ):
            yield calls
    finally:
        stop()


@pytest.mark.parametrize("durability", ["fsync", "os"])
def test_a_named_post_costs_two_round_trips(postgres_url: str, durability: str) -> None:
    """A named POST answered 201: one round trip to insert its key (insert first: a new
    operation needs no lookup), one to record the answer. Each write is one
    autocommitted statement on a connection whose synchronous_commit is already right."""

    def created(request: httpx.Request) -> httpx.Response:
        return httpx.Response(201, json={"id": "ch_1"})

    with (
        Journal(postgres_url, durability=durability) as journal,  # type: ignore[arg-type]
        idempotently.Session(journal=journal, transport=httpx.MockTransport(created)) as session,
    ):
        session.post("https://api.example.com/charges", json={"amount": 1}, operation_id="warm")
        with round_trips_per_call(journal) as calls:
            response = session.post(
                "https://api.example.com/charges", json={"amount": 1}, operation_id="o-1"
            )

    assert 201 == response.status_code
    assert [("commit", 1), ("commit", 1)] == calls  # insert first: no lookup
    assert sum(trips for name, trips in calls if name == "commit") <= 2


def test_a_batch_of_writes_is_one_round_trip(journal: Journal) -> None:
    """Several writes in one batch: one transaction, each write in a savepoint, all sent as
    one pipeline."""
    for number in range(1, 4):
        insert(journal, new_operation(f"op-{number}"))
    answered = AttemptRecord(
        started_at=NOW, elapsed=0.1, outcome="answered", status_code=201, status="succeeded"
    )

    with round_trips_per_call(journal) as calls:
        outcomes = journal._store.commit(
            [Record(f"op-{number}", answered, NOW, None) for number in range(1, 4)], False
        )

    assert [None, None, None] == outcomes
    assert [("commit", 1)] == calls
    assert {"succeeded"} == {operation.status for operation in journal.operations()}


def test_a_write_refused_in_a_pipelined_batch_fails_alone(journal: Journal) -> None:
    """A write the server refuses (a status code out of integer range) and one psycopg
    cannot send (a NUL in text) fail alone: the writes around them commit, in one
    transaction, a round trip more for each refusal; the connections go back to their
    pools idle, with the synchronous_commit each pool promises."""
    for number in range(1, 5):
        insert(journal, new_operation(f"op-{number}"))

    def answer(**changes: Any) -> AttemptRecord:
        return AttemptRecord(
            **{
                "started_at": NOW,
                "elapsed": 0.1,
                "outcome": "answered",
                "status_code": 201,
                "status": "succeeded",
                **changes,
            }
        )

    writes = [
        Record("op-1", answer(), NOW, None),
        Record("op-2", answer(status_code=2**40), NOW, None),
        Record("op-3", answer(error="nul \x00 byte"), NOW, None),
        Record("op-4", answer(), NOW, None),
    ]
    with round_trips_per_call(journal) as calls:
        outcomes = journal._store.commit(writes, True)

    assert [None, None] == [outcomes[0], outcomes[3]]
    assert all(isinstance(outcome, Failed) for outcome in outcomes[1:3])
    assert "integer out of range" in str(outcomes[1].error)
    assert "NUL" in str(outcomes[2].error)
    # One round, then one more per refusal (2); libpq's trace can show an answer that
    # arrived in two pieces on a loaded machine as one more.
    assert 1 == len(calls) and "commit" == calls[0][0] and 3 <= calls[0][1] <= 4
    assert {"op-1": "succeeded", "op-2": "pending", "op-3": "pending", "op-4": "succeeded"} == {
        operation.operation_id: operation.status for operation in journal.operations()
    }
    store = journal._store
    for pool, setting in ((store._pool, "off"), (store._flushed_pool, "on")):  # type: ignore[attr-defined]
        with pool.connection() as conn:
            assert psycopg.pq.TransactionStatus.IDLE == conn.pgconn.transaction_status
            assert {"synchronous_commit": setting} == conn.execute(
                "SHOW synchronous_commit"
            ).fetchone()


def test_a_write_after_a_failed_one_finds_its_connection_idle(journal: Journal) -> None:
    """A lone write that fails leaves no transaction open: the next write on the same
    pooled connection commits as if nothing had happened."""
    insert(journal, new_operation("op-1"))
    broken = AttemptRecord(
        started_at=NOW, elapsed=0.1, outcome="answered", status_code=2**40, status="succeeded"
    )
    with pytest.raises(JournalWriteError, match="integer out of range"):
        record_attempt(journal, "op-1", broken, now=NOW)

    record_attempt(journal, "op-1", attrs.evolve(broken, status_code=201), now=NOW)

    operation = journal.operation("op-1")
    assert operation is not None
    assert ("succeeded", [201]) == (
        operation.status,
        [attempt.status_code for attempt in operation.attempts],
    )


# -- damage and failures ---------------------------------------------------------------------


def test_a_damaged_row_is_a_corrupt_error_naming_the_operation(
    journal: Journal, postgres_url: str
) -> None:
    """Headers that are not JSON: JournalCorruptError naming the operation, not a crash."""
    insert(journal, new_operation("op-1"))
    sql(postgres_url, "UPDATE idempotently.operations SET request_headers = 'not json'")

    with pytest.raises(JournalCorruptError, match="request_headers is not valid JSON") as caught:
        journal.operation("op-1")

    assert ("op-1", "key-op-1") == (caught.value.operation_id, caught.value.key)


def test_a_lock_held_past_busy_timeout_is_a_write_error(postgres_url: str) -> None:
    """A row locked by a stuck session: JournalWriteError saying so, and the row stands."""
    with Journal(postgres_url, busy_timeout=0.1) as journal:
        insert(journal, new_operation(), lease_until=NOW - 1)
        operation = journal.operation("op-1")
        assert operation is not None
        with psycopg.connect(postgres_url) as blocker:
            blocker.execute("SELECT * FROM idempotently.operations FOR UPDATE")
            with pytest.raises(JournalWriteError, match="busy_timeout"):
                take_lease(journal, operation, owner="me", lease_until=NOW + 30, now=NOW)
            blocker.rollback()

        assert take_lease(journal, operation, owner="me", lease_until=NOW + 30, now=NOW)


# -- audits ------------------------------------------------------------------------------------


def test_prune_deletes_in_short_batches_and_keeps_what_needs_work(journal: Journal) -> None:
    """prune removes finished operations (and attempts) in batches; pending and
    needs_reconcile stay."""
    for number in range(5):
        insert(journal, new_operation(f"done-{number}"))
        record_attempt(
            journal,
            f"done-{number}",
            AttemptRecord(started_at=NOW, elapsed=0.1, outcome="answered", status="succeeded"),
            now=NOW,
        )
    insert(journal, new_operation("pending"))
    insert(journal, new_operation("reconcile"))
    set_status(journal, "reconcile", "needs_reconcile", reason=None, now=NOW)
    transactions = 0
    real = journal._store._transaction  # type: ignore[attr-defined]

    @contextmanager
    def counted(**options: Any) -> Iterator[Any]:
        nonlocal transactions
        transactions += 1
        with real(**options) as conn:
            yield conn

    with (
        mock.patch.object(_postgres, "_PRUNE_BATCH", 2),
        mock.patch.object(journal._store, "_transaction", counted),
    ):
        assert 5 == journal.prune(older_than=0, now=NOW + 1, dry_run=True)
        assert 5 == journal.prune(older_than=0, now=NOW + 1)

    assert 3 == transactions  # 2 + 2 + 1
    assert ["reconcile", "pending"] == [
        operation.operation_id for operation in journal.operations()
    ]
    assert 0 == journal.stats(now=NOW + 1).attempts


def test_stats_counts_by_status(journal: Journal) -> None:
    """stats() on PostgreSQL: counts, attempts, stuck, from the rows."""
    due_and_not_due(journal)
    stats = journal.stats(now=NOW + 100, stuck_after=0)

    assert {
        "pending": 42,
        "succeeded": 1,
        "failed": 0,
        "needs_reconcile": 1,
        "abandoned": 1,
    } == stats.counts
    assert (1, 0, 42) == (stats.attempts, stats.in_progress_attempts, stats.stuck)
    assert NOW - 50 == stats.oldest_pending_created_at


# -- sessions ------------------------------------------------------------------------------------


def test_a_session_takes_the_url(postgres_url: str, scripted: Any) -> None:
    """Session("postgresql://...") journals to PostgreSQL and closes its pool."""
    app, url = scripted
    app.answer(Answer(201))
    with idempotently.Session(postgres_url) as session:
        response = session.post(f"{url}/charges", json={"amount": 1}, operation_id="o-1")
        journal = session.journal

    assert 201 == response.status_code
    assert isinstance(journal._store, PostgresStore)
    with Journal(postgres_url, readonly=True) as reader:
        operation = reader.operation("o-1")
    assert operation is not None and "succeeded" == operation.status


@pytest.mark.anyio
async def test_an_async_session_takes_the_url(
    postgres_url: str, scripted: Any, anyio_backend: str
) -> None:
    """AsyncSession("postgresql://...") works on asyncio and trio alike (the pool is sync,
    used from worker threads)."""
    app, url = scripted
    app.answer(Answer(201))
    async with idempotently.AsyncSession(postgres_url) as session:
        response = await session.post(f"{url}/charges", json={"amount": 1}, operation_id="o-1")

    assert 201 == response.status_code
    with Journal(postgres_url, readonly=True) as reader:
        operation = reader.operation("o-1")
    assert operation is not None and "succeeded" == operation.status


def test_a_server_gone_mid_run_is_a_write_error_naming_the_url() -> None:
    """The server stops under an open journal: JournalWriteError with the URL (no password)
    and what to check, never a psycopg traceback; nothing is sent on it."""
    with postgres_server() as own:
        journal = Journal(own.url(password="gone-secret"), busy_timeout=1)
        insert(journal, new_operation("op-1"))
        own.stop()
        try:
            errors = []
            for attempt in ("op-2", "op-3"):  # a broken pooled connection, then no connection
                with pytest.raises(JournalWriteError) as caught:
                    insert(journal, new_operation(attempt))
                errors.append(caught.value)
        finally:
            journal.close()

    for error in errors:
        message = str(error)
        assert "gone-secret" not in message
        assert f"postgresql://postgres:***@127.0.0.1:{own.port}/postgres" in message
        assert "check" in message
        assert error.__suppress_context__


@pytest.mark.parametrize("name", ["_INSERT_OPERATION", "_RECORD_ATTEMPT", "_TAKE_LEASE"])
def test_a_calls_statements_fit_psycopgs_cache_of_parsed_statements(name: str) -> None:
    """psycopg parses a statement's placeholders again at every execute when it is longer
    than 4 KB (it caches shorter ones): the statements of every call stay under it (a
    Record 1.5 KB over cost 900,000 more instructions a call, measured by bench_counts)."""
    from psycopg import _queries

    statement = getattr(_postgres, name).encode()
    assert len(statement) <= _queries.MAX_CACHED_STATEMENT_LENGTH
