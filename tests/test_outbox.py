"""The client-side outbox: ``Session.enqueue(..., connection=...)`` and its relay.

An enqueued operation is journaled exactly as ``post`` would journal it, sends
nothing, commits or rolls back with the application's own transaction (a
sqlite3 connection on the journal's file, a psycopg connection on the journal's
PostgreSQL database), and is sent once by ``resume``. Until its first send
begins it is provably undelivered, and its key's lifetime starts at that send.
Against the mock server on 127.0.0.1, real SQLite files and a real PostgreSQL.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlite_utils
from click.testing import CliRunner

import idempotently
from idempotently._journal import migration_sql
from idempotently._keys import derived_key
from idempotently._policy import may_have_been_delivered
from idempotently.cli import cli
from idempotently.testing import MockServer, serve
from tests.faults import commits
from tests.journal_commands import take_lease

ORDERS_TABLE = "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, amount INTEGER)"


@pytest.fixture(scope="module")
def api() -> Iterator[MockServer]:
    with serve() as server:
        yield server


@pytest.fixture
def user() -> str:
    """A user of its own for each test: the server's ledger is per user."""
    return f"shop_{uuid.uuid4().hex[:8]}"


def charge(order: str, amount: int = 500) -> dict[str, Any]:
    return {
        "amount": amount,
        "currency": "usd",
        "customer": "cus_7",
        "metadata": {"order_id": order},
    }


def session(
    journal: str | idempotently.Journal, api: MockServer, user: str, **options: Any
) -> idempotently.Session:
    return idempotently.Session(
        journal, base_url=api.url, headers={"Authorization": f"Bearer {user}"}, **options
    )


def requests_of(api: MockServer, user: str) -> list[Any]:
    return [request for request in api.requests if request.user == user]


def sqlite_app(path: str) -> sqlite3.Connection:
    """The application's own connection on the journal's file, with its orders table."""
    conn = sqlite3.connect(path)
    conn.execute(ORDERS_TABLE)
    conn.commit()
    return conn


def pg_app(url: str) -> Any:
    import psycopg

    conn = psycopg.connect(url)
    conn.execute("CREATE TABLE IF NOT EXISTS public.orders (id text PRIMARY KEY, amount integer)")
    conn.commit()
    return conn


def drop_app_tables(url: str) -> None:
    """Drop the orders tables the shop made in the test database: it outlives one test,
    and other tests look at its tables."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        names = conn.execute(
            "SELECT tablename FROM pg_catalog.pg_tables "
            "WHERE schemaname = 'public' AND tablename LIKE 'orders%'"
        ).fetchall()
        for (name,) in names:
            conn.execute(f'DROP TABLE public."{name}"')


@pytest.fixture
def app_connection(journal_target: str, store: str) -> Iterator[Any]:
    """The journal (created) and the application's own connection to its database."""
    idempotently.Journal(journal_target).close()
    conn = pg_app(journal_target) if store == "postgres" else sqlite_app(journal_target)
    try:
        yield conn
    finally:
        conn.close()
        if store == "postgres":
            drop_app_tables(journal_target)


def order_rows(conn: Any, store: str) -> list[str]:
    table = "public.orders" if store == "postgres" else "orders"
    rows = conn.execute(f"SELECT id FROM {table} ORDER BY id").fetchall()
    conn.commit()
    return [row[0] for row in rows]


# -- what is journaled ------------------------------------------------------------------


def test_enqueue_journals_the_request_exactly_as_post_would(
    journal_target: str, api: MockServer, user: str
) -> None:
    """The same headers, body bytes, fingerprint, profile and URL as the operation ``post``
    journals for the same call, its key derived from the operation id as a call's is;
    pending, unleased, enqueued and never sent."""
    call: dict[str, Any] = {
        "json": charge("o-1"),
        "headers": {"X-Trace": "1", "Idempotency-Key": "k-same-1"},
    }
    with session(journal_target, api, user, profile=idempotently.profiles.STRIPE) as s:
        enqueued = s.enqueue("POST", "/v1/charges?expand=x", operation_id="queued", **call)
        named = s.enqueue("POST", "/v1/charges", json=charge("o-1"), operation_id="named")
        s.post(
            "/v1/charges?expand=x",
            operation_id="posted",
            **{**call, "headers": {"X-Trace": "1", "Idempotency-Key": "k-same-2"}},
        )
        journaled = s.journal.operation("queued")
        posted = s.journal.operation("posted")
        assert named.key == derived_key(s.journal.namespace, "named")
    assert journaled is not None and posted is not None
    assert (enqueued.operation_id, enqueued.key) == (journaled.operation_id, journaled.key)
    assert ("pending", 0, None, 0.0) == (
        journaled.status,
        journaled.attempt_count,
        journaled.lease_owner,
        journaled.lease_until,
    )
    assert journaled.enqueued_at is not None and journaled.first_send_at is None
    same = ("method", "url", "request_body", "fingerprint", "profile", "key_header")
    assert [getattr(posted, name) for name in same] == [getattr(journaled, name) for name in same]
    assert [
        (name, "k-same-1" if name == "Idempotency-Key" else value)
        for name, value in posted.request_headers
    ] == list(journaled.request_headers)
    assert (None, posted.created_at) == (posted.enqueued_at, posted.first_send_at)


def test_enqueue_sends_nothing_and_resume_sends_it_once(
    journal_target: str, api: MockServer, user: str
) -> None:
    """Without a connection the enqueue is its own durable write: nothing goes on the
    wire until resume, which sends it once; a second resume finds nothing to do."""
    with session(journal_target, api, user) as s:
        operation = s.enqueue("POST", "/v1/charges", json=charge("o-2"), operation_id="o-2:charge")
        assert [] == requests_of(api, user)
        results = s.resume()
        again = s.resume()
        stored = s.journal.operation("o-2:charge")
    assert [("o-2:charge", "succeeded")] == [(r.operation_id, r.action) for r in results]
    assert [] == again
    assert 1 == len(api.charges(user))
    assert [operation.key] == [request.key for request in requests_of(api, user)]
    assert stored is not None and stored.first_send_at is not None


def test_the_resume_worker_relays_enqueued_operations_once(
    journal_target: str, api: MockServer, user: str
) -> None:
    """`resume --watch`'s worker claims what was enqueued and sends each operation once;
    its next round finds nothing to claim."""
    with session(journal_target, api, user) as s:
        for n in range(3):
            s.enqueue("POST", "/v1/charges", json=charge(f"w-{n}"), operation_id=f"w-{n}:charge")
        stop = threading.Event()
        batches: list[idempotently.WatchBatch] = []

        def after(batch: idempotently.WatchBatch) -> None:
            batches.append(batch)
            stop.set()

        results: list[idempotently.ResumeResult] = []
        s.watch(
            stop,
            interval=0.01,
            concurrency=2,
            on_result=results.append,
            on_batch=after,
        )
        left = s.journal.operations(status="pending")
    assert [3] == [batch.claimed for batch in batches]
    assert ["succeeded"] * 3 == [result.action for result in results]
    assert [] == left
    assert ["w-0", "w-1", "w-2"] == sorted(str(c.order_id) for c in api.charges(user))


def test_without_a_connection_the_enqueue_is_its_own_durable_write(
    tmp_path: Path, api: MockServer, user: str
) -> None:
    """Through the journal's one writer, flushed as a call's key is (durability "fsync")."""
    journal = idempotently.Journal(tmp_path / "journal.db")
    batches = commits(journal)
    with session(journal, api, user) as s:
        s.enqueue("POST", "/v1/charges", json=charge("d-1"), operation_id="d-1:charge")
    assert [(1, True)] == [(len(batch.writes), batch.durable) for batch in batches]
    journal.close()


def test_enqueue_again_returns_the_journaled_operation(
    journal_target: str, api: MockServer, user: str
) -> None:
    """An application transaction that runs again enqueues the same operation: the first
    one comes back, unchanged; another request under that id is a KeyReuseError."""
    with session(journal_target, api, user) as s:
        first = s.enqueue("POST", "/v1/charges", json=charge("o-3"), operation_id="o-3:charge")
        second = s.enqueue("POST", "/v1/charges", json=charge("o-3"), operation_id="o-3:charge")
        with pytest.raises(idempotently.KeyReuseError) as raised:
            s.enqueue("POST", "/v1/charges", json=charge("o-3", 9999), operation_id="o-3:charge")
        assert 1 == len(s.journal.operations())
    assert (first.operation_id, first.key, first.created_at) == (
        second.operation_id,
        second.key,
        second.created_at,
    )
    assert ("o-3:charge", first.key) == (raised.value.operation_id, raised.value.key)


def test_enqueue_needs_an_operation_id(tmp_path: Path, api: MockServer, user: str) -> None:
    """An anonymous enqueue could not be enqueued again by a transaction that runs again."""
    with session(str(tmp_path / "j.db"), api, user) as s:
        with pytest.raises(TypeError, match="operation_id"):
            s.enqueue("POST", "/v1/charges", json=charge("x"), operation_id=None)  # type: ignore[arg-type]
        assert [] == s.journal.operations()


# -- in the application's own transaction ------------------------------------------------


def test_committed_with_the_order_and_sent_once(
    app_connection: Any, store: str, journal_target: str, api: MockServer, user: str
) -> None:
    """The order row and its charge commit together; resume sends the charge once."""
    conn = app_connection
    table = "public.orders" if store == "postgres" else "orders"
    marker = "%s" if store == "postgres" else "?"
    with session(journal_target, api, user) as s:
        conn.execute(f"INSERT INTO {table} VALUES ({marker}, {marker})", ("o-4", 500))
        s.enqueue(
            "POST", "/v1/charges", json=charge("o-4"), operation_id="o-4:charge", connection=conn
        )
        conn.commit()
        results = s.resume()
    assert "o-4" in order_rows(conn, store)
    assert [("o-4:charge", "succeeded")] == [(r.operation_id, r.action) for r in results]
    assert 1 == len(api.charges(user))


def test_rolled_back_it_never_existed(
    app_connection: Any, store: str, journal_target: str, api: MockServer, user: str
) -> None:
    """A rolled-back order never sends its charge: no row, nothing to resume, no request."""
    conn = app_connection
    table = "public.orders" if store == "postgres" else "orders"
    marker = "%s" if store == "postgres" else "?"
    with session(journal_target, api, user) as s:
        conn.execute(f"INSERT INTO {table} VALUES ({marker}, {marker})", ("o-5", 500))
        s.enqueue(
            "POST", "/v1/charges", json=charge("o-5"), operation_id="o-5:charge", connection=conn
        )
        conn.rollback()
        assert s.journal.operation("o-5:charge") is None
        assert [] == s.resume()
    assert "o-5" not in order_rows(conn, store)
    assert [] == requests_of(api, user)


def test_uncommitted_is_invisible_to_the_relay(
    app_connection: Any, store: str, journal_target: str, api: MockServer, user: str
) -> None:
    """Before the application commits, a relay (another connection) sees nothing to send."""
    conn = app_connection
    with session(journal_target, api, user) as s:
        s.enqueue(
            "POST", "/v1/charges", json=charge("o-6"), operation_id="o-6:charge", connection=conn
        )
        if store == "postgres":
            assert [] == s.resume()
        else:
            # The relay's own read runs under the application's write lock: a snapshot
            # from before the uncommitted row.
            assert [] == idempotently.Journal(journal_target, readonly=True).operations()
        conn.commit()
        assert ["o-6:charge"] == [r.operation_id for r in s.resume()]
    assert 1 == len(api.charges(user))


def test_enqueue_in_the_same_transaction_twice_finds_the_first(
    app_connection: Any, journal_target: str, api: MockServer, user: str
) -> None:
    """The row taken by this very transaction (not yet committed) is found on its own
    connection, so a second enqueue of the id returns it rather than failing."""
    conn = app_connection
    with session(journal_target, api, user) as s:
        first = s.enqueue(
            "POST", "/v1/charges", json=charge("o-7"), operation_id="o-7:charge", connection=conn
        )
        again = s.enqueue(
            "POST", "/v1/charges", json=charge("o-7"), operation_id="o-7:charge", connection=conn
        )
        with pytest.raises(idempotently.KeyReuseError):
            s.enqueue(
                "POST",
                "/v1/charges",
                json=charge("o-7", 1),
                operation_id="o-7:charge",
                connection=conn,
            )
        conn.commit()
    assert first.key == again.key


def test_the_applications_row_factory_does_not_matter(
    tmp_path: Path, api: MockServer, user: str
) -> None:
    """A connection with sqlite3.Row (or a dict factory) rows: enqueued and found again."""
    path = str(tmp_path / "journal.db")
    with session(path, api, user) as s:
        conn = sqlite_app(path)
        conn.row_factory = lambda cursor, row: dict(
            zip([c[0] for c in cursor.description], row, strict=True)
        )
        first = s.enqueue(
            "POST", "/v1/charges", json=charge("r"), operation_id="r", connection=conn
        )
        again = s.enqueue(
            "POST", "/v1/charges", json=charge("r"), operation_id="r", connection=conn
        )
        conn.commit()
    assert first.key == again.key


def test_sqlite_utils_database_wrapping_the_connection(
    tmp_path: Path, api: MockServer, user: str
) -> None:
    """An application on sqlite-utils passes its Database, which wraps its connection."""
    path = str(tmp_path / "shop.db")
    with session(path, api, user) as s:
        db = sqlite_utils.Database(sqlite_app(path))
        db.conn.execute("BEGIN")
        db["orders"].insert({"id": "o-8", "amount": 500})
        s.enqueue(
            "POST", "/v1/charges", json=charge("o-8"), operation_id="o-8:charge", connection=db
        )
        db.conn.execute("COMMIT")
        assert ["o-8:charge"] == [r.operation_id for r in s.resume()]


# -- a wrong connection: a clear error, nothing journaled ------------------------------------


def refused(
    s: idempotently.Session, connection: Any, error: type[Exception], match: str
) -> Exception:
    with pytest.raises(error, match=match) as raised:
        s.enqueue(
            "POST",
            "/v1/charges",
            json=charge("bad"),
            operation_id="bad:charge",
            connection=connection,
        )
    assert s.journal.operation("bad:charge") is None
    return raised.value


def test_sqlite_connection_to_another_file_is_refused(
    tmp_path: Path, api: MockServer, user: str
) -> None:
    """Another file (even another journal) could never commit with the journal."""
    path = str(tmp_path / "journal.db")
    with session(path, api, user) as s:
        other = sqlite_app(str(tmp_path / "shop.db"))
        error = refused(s, other, idempotently.JournalError, "not on the journal's file")
        assert ("bad:charge", s.journal.operation is not None) == (error.operation_id, True)  # type: ignore[attr-defined]
        assert error.key  # type: ignore[attr-defined]
        memory = sqlite3.connect(":memory:")
        refused(s, memory, idempotently.JournalError, "in-memory database")


def test_sqlite_connection_closed_autocommit_or_of_another_kind_is_refused(
    tmp_path: Path, api: MockServer, user: str
) -> None:
    """Closed; autocommit with no transaction open (it would commit alone); not a
    sqlite3 connection at all: each a clear error saying what to do."""
    path = str(tmp_path / "journal.db")
    with session(path, api, user) as s:
        closed = sqlite_app(path)
        closed.close()
        refused(s, closed, idempotently.JournalError, "must be open")
        autocommit = sqlite3.connect(path, isolation_level=None)
        refused(s, autocommit, idempotently.JournalError, "autocommit mode")
        refused(s, object(), TypeError, "sqlite3.Connection")
        autocommit.execute("BEGIN")  # an explicit transaction is fine
        s.enqueue(
            "POST", "/v1/charges", json=charge("ok"), operation_id="ok", connection=autocommit
        )
        autocommit.execute("ROLLBACK")
        assert s.journal.operation("ok") is None


def test_postgres_wrong_connections_are_refused_and_leave_the_transaction_usable(
    postgres_url: str, postgres: Any, api: MockServer, user: str
) -> None:
    """Another journal's database, one without journal tables (the application's
    transaction is still usable afterwards), autocommit, a failed transaction, a
    closed connection, a sqlite3 connection: each refused, nothing journaled."""
    import psycopg

    with session(postgres_url, api, user) as s:
        other_url = postgres.new_database()
        with psycopg.connect(other_url) as bare:
            bare.execute("CREATE TABLE public.orders (id text)")
            refused(s, bare, idempotently.JournalError, "without the journal's tables")
            bare.execute("INSERT INTO public.orders VALUES ('still usable')")
            bare.commit()
        idempotently.Journal(other_url).close()
        with psycopg.connect(other_url) as another:
            error = refused(s, another, idempotently.JournalError, "another journal's database")
            assert ("bad:charge", True) == (error.operation_id, bool(error.key))  # type: ignore[attr-defined]
        with psycopg.connect(postgres_url, autocommit=True) as autocommit:
            refused(s, autocommit, idempotently.JournalError, "autocommit mode")
            with autocommit.transaction():
                s.enqueue(
                    "POST",
                    "/v1/charges",
                    json=charge("ok"),
                    operation_id="ok",
                    connection=autocommit,
                )
        assert s.journal.operation("ok") is not None
        with psycopg.connect(postgres_url) as failed:
            with pytest.raises(psycopg.errors.DivisionByZero):
                failed.execute("SELECT 1 / 0")
            refused(s, failed, idempotently.JournalError, "already failed")
        closed = psycopg.connect(postgres_url)
        closed.close()
        refused(s, closed, idempotently.JournalError, "closed")
        refused(s, sqlite3.connect(":memory:"), TypeError, "psycopg.Connection")


# -- not maybe-delivered until a send begins -------------------------------------------------


def test_enqueued_is_not_maybe_delivered_until_its_lease_to_send_is_taken(
    journal_target: str, api: MockServer, user: str
) -> None:
    """No attempt and no first send: nothing can have reached the server. The write that
    takes the lease to send sets first_send_at: from then on, maybe delivered."""
    with session(journal_target, api, user) as s:
        s.enqueue("POST", "/v1/charges", json=charge("o-9"), operation_id="o-9:charge")
        operation = s.journal.operation("o-9:charge")
        assert operation is not None and not may_have_been_delivered(operation)
        now = operation.created_at + 1
        assert take_lease(s.journal, operation, owner="someone:1:x", lease_until=now + 60, now=now)
        taken = s.journal.operation("o-9:charge")
    assert taken is not None and (now, True) == (
        taken.first_send_at,
        may_have_been_delivered(taken),
    )


def test_a_final_4xx_on_the_first_send_of_an_enqueued_operation_is_failed(
    journal_target: str, api: MockServer, user: str
) -> None:
    """Resume's first send is the server's first and only word on the key: its 400 proves
    nothing happened (failed), as for a new call; not kept pending as a maybe-delivered
    operation's would be."""
    with session(journal_target, api, user) as s:
        s.enqueue("POST", "/v1/charges", json=charge("o-10", amount=-5), operation_id="o-10:charge")
        (result,) = s.resume()
    assert ("failed", 400) == (result.status, result.status_code)


def test_a_call_with_the_id_of_an_enqueued_operation_sends_it_as_unsent(
    journal_target: str, api: MockServer, user: str
) -> None:
    """A call made with an enqueued operation's id (instead of the relay) sends it, with
    its key, as its first send: a final 4xx then settles it failed and is returned."""
    with session(journal_target, api, user) as s:
        queued = s.enqueue(
            "POST", "/v1/charges", json=charge("o-15", amount=-5), operation_id="o-15:charge"
        )
        response = s.post("/v1/charges", json=charge("o-15", amount=-5), operation_id="o-15:charge")
        settled = s.journal.operation("o-15:charge")
    assert 400 == response.status_code
    assert settled is not None and ("failed", 1) == (settled.status, settled.attempt_count)
    assert [queued.key] == [request.key for request in requests_of(api, user)]


def test_the_key_lifetime_starts_at_the_first_send(
    journal_target: str, api: MockServer, user: str
) -> None:
    """A relay down for two days (key lifetime one day) still sends what was enqueued,
    and the key then lives a lifetime from that send."""
    now = [1_800_000_000.0]
    profile = idempotently.ServerProfile(name="day", key_lifetime=86400.0)
    with session(journal_target, api, user, clock=lambda: now[0], profile=profile) as s:
        s.enqueue("POST", "/v1/charges", json=charge("o-11"), operation_id="o-11:charge")
        now[0] += 2 * 86400
        stats = s.journal.stats(now=now[0], expiring_within=3600)
        (result,) = s.resume()
        sent = s.journal.operation("o-11:charge")
    assert 0 == stats.expiring
    assert "succeeded" == result.action
    assert sent is not None
    assert (now[0], now[0] + 86400) == (sent.first_send_at, sent.key_expires_at)


def test_show_says_an_enqueued_operation_was_not_sent(
    tmp_path: Path, api: MockServer, user: str
) -> None:
    """The audit tells an unsent enqueued operation from one whose first send was cut off."""
    path = str(tmp_path / "journal.db")
    with session(path, api, user) as s:
        s.enqueue("POST", "/v1/charges", json=charge("o-12"), operation_id="o-12:charge")
    runner = CliRunner()
    text = runner.invoke(cli, ["--journal", path, "show", "o-12:charge"])
    shown = runner.invoke(cli, ["--journal", path, "show", "o-12:charge", "--json"])
    assert 0 == text.exit_code and "enqueued and not sent yet" in text.output
    assert "not yet" in text.output
    document = json.loads(shown.output)
    assert (False, None) == (document["may_have_been_delivered"], document["first_send_at"])


# -- the application's write transaction and the Session's writes ------------------------------


def test_a_call_waits_for_the_applications_open_sqlite_transaction(
    tmp_path: Path, api: MockServer, user: str
) -> None:
    """SQLite has one writer: while the application's write transaction is open, a call
    cannot journal its key (here it gives up at a short busy timeout, sending nothing);
    once the application commits, the call goes through."""
    path = str(tmp_path / "journal.db")
    journal = idempotently.Journal(path, busy_timeout=0.2)
    with session(journal, api, user) as s:
        conn = sqlite_app(path)
        conn.execute("INSERT INTO orders VALUES ('o-13', 500)")
        s.enqueue(
            "POST", "/v1/charges", json=charge("o-13"), operation_id="o-13:charge", connection=conn
        )
        with pytest.raises(idempotently.JournalWriteError, match=r"busy timeout|locked"):
            s.post("/v1/charges", json=charge("o-14"), operation_id="o-14:charge")
        assert [] == requests_of(api, user)
        conn.commit()
        assert (
            201
            == s.post("/v1/charges", json=charge("o-14"), operation_id="o-14:charge").status_code
        )
    journal.close()


def test_enqueue_from_another_thread_than_the_connections_is_refused(
    tmp_path: Path, api: MockServer, user: str
) -> None:
    """A sqlite3 connection belongs to the thread that made it: a clear error, not
    sqlite3's ProgrammingError."""
    path = str(tmp_path / "journal.db")
    with session(path, api, user) as s:
        conn = sqlite_app(path)
        errors: list[BaseException] = []

        def enqueue() -> None:
            try:
                s.enqueue(
                    "POST", "/v1/charges", json=charge("t"), operation_id="t", connection=conn
                )
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=enqueue)
        thread.start()
        thread.join()
    assert [idempotently.JournalError] == [type(error) for error in errors]
    assert "thread" in str(errors[0])


# -- migrate ---------------------------------------------------------------------------------


def test_migrate_creates_the_tables_in_an_application_database(
    journal_target: str, store: str
) -> None:
    """`idempotently migrate` makes the journal in a database (or file) that has none;
    run again, it has nothing to do."""
    runner = CliRunner()
    created = runner.invoke(cli, ["--journal", journal_target, "migrate"])
    again = runner.invoke(cli, ["--journal", journal_target, "migrate"])
    assert 0 == created.exit_code, created.output
    assert "created the journal's tables" in created.output
    assert "nothing to do" in again.output
    with idempotently.Journal(journal_target, create=False, readonly=True) as journal:
        assert [] == journal.operations()


def test_migrate_sql_is_what_opening_the_journal_runs(journal_target: str, store: str) -> None:
    """The printed script, applied by the application's own migration, makes a journal
    the library opens as its own (same tables, a namespace of its own) and changes
    nothing by being printed."""
    runner = CliRunner()
    printed = runner.invoke(cli, ["--journal", journal_target, "migrate", "--sql"])
    assert 0 == printed.exit_code, printed.output
    if store == "postgres":
        import psycopg

        with psycopg.connect(journal_target, autocommit=True) as conn:
            present = conn.execute("SELECT to_regclass('idempotently.operations')").fetchone()
            assert present is not None and present[0] is None  # printing changed nothing
            conn.execute(printed.output)
    else:
        assert not Path(journal_target).exists()
        conn = sqlite3.connect(journal_target, isolation_level=None)
        conn.executescript(printed.output)
        conn.close()
    with idempotently.Journal(journal_target) as journal:
        namespace = journal.namespace
        assert journal.schema_version == 10
    assert "nothing to do" in migration_sql(journal_target)
    assert namespace.version == 4


def test_migrate_sql_from_a_version_reads_no_database() -> None:
    """--from-version prints the script for a database it never connects to (nothing
    listens at this URL); a development version is refused with its one line; a version
    out of range, or without --sql, is a usage error."""
    runner = CliRunner()
    url = "postgresql://ci@127.0.0.1:1/shop"
    printed = runner.invoke(cli, ["--journal", url, "migrate", "--sql", "--from-version", "0"])
    assert 0 == printed.exit_code, printed.output
    assert "CREATE TABLE idempotently.operations" in printed.output
    assert "gen_random_uuid()" in printed.output
    development = runner.invoke(cli, ["--journal", url, "migrate", "--sql", "--from-version", "1"])
    assert 1 == development.exit_code
    assert "CREATE TABLE" not in development.output
    assert "development journal (PostgreSQL schema version 1)" in development.output
    too_far = runner.invoke(cli, ["--journal", url, "migrate", "--sql", "--from-version", "11"])
    alone = runner.invoke(cli, ["--journal", url, "migrate", "--from-version", "0"])
    assert (2, 2) == (too_far.exit_code, alone.exit_code)


def test_an_application_connection_with_text_factory_bytes_enqueues(
    tmp_path: Path, api: MockServer, user: str
) -> None:
    """A connection whose text_factory is bytes is the journal's file all the same: the
    enqueue commits with the order, is found again, the relay sends it once, and the
    application's text_factory is still bytes."""
    path = str(tmp_path / "shop.db")
    with session(path, api, user) as s:
        conn = sqlite_app(path)
        conn.text_factory = bytes
        conn.execute("INSERT INTO orders VALUES (?, ?)", ("o-9", 500))
        first = s.enqueue(
            "POST", "/v1/charges", json=charge("o-9"), operation_id="o-9:charge", connection=conn
        )
        again = s.enqueue(
            "POST", "/v1/charges", json=charge("o-9"), operation_id="o-9:charge", connection=conn
        )
        conn.commit()
        results = s.resume()
        order = conn.execute("SELECT id FROM orders").fetchall()
    conn.close()
    assert (first.key, [(b"o-9",)]) == (again.key, order)
    assert [("o-9:charge", "succeeded")] == [(r.operation_id, r.action) for r in results]
    assert 1 == len(api.charges(user))


def test_the_documented_sqlite_utils_idiom_commits_or_rolls_back_both(
    tmp_path: Path, api: MockServer, user: str
) -> None:
    """docs/outbox.md's `with db.atomic():` around `db["orders"].insert(...)` and the
    enqueue: an exception rolls back the order and the charge alike; without one both
    commit and the relay sends the charge once."""
    path = str(tmp_path / "shop.db")
    with session(path, api, user) as s:
        db = sqlite_utils.Database(sqlite_app(path))
        with pytest.raises(RuntimeError), db.atomic():
            db["orders"].insert({"id": "o-10", "amount": 500})
            s.enqueue(
                "POST", "/v1/charges", json=charge("o-10"), operation_id="o-10", connection=db
            )
            raise RuntimeError("the request handler failed")
        rolled_back = ([row["id"] for row in db["orders"].rows], s.journal.operation("o-10"))
        with db.atomic():
            db["orders"].insert({"id": "o-11", "amount": 500})
            s.enqueue(
                "POST", "/v1/charges", json=charge("o-11"), operation_id="o-11", connection=db
            )
        committed = [row["id"] for row in db["orders"].rows]
        results = s.resume()
    db.close()
    assert ([], None) == rolled_back
    assert ["o-11"] == committed
    assert [("o-11", "succeeded")] == [(r.operation_id, r.action) for r in results]
    assert 1 == len(api.charges(user))


# -- adopting an application's SQLite database ------------------------------------------------


def shop_database(path: Path, *, user_version: int = 7, application_id: int = 0) -> None:
    """An existing application's SQLite database: its orders table, its own user_version
    (its migrations' counter) and application_id, and no journal."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(ORDERS_TABLE)
    conn.execute("INSERT INTO orders VALUES ('o-0', 100)")
    conn.execute(f"PRAGMA user_version = {user_version}")
    conn.execute(f"PRAGMA application_id = {application_id}")
    conn.close()


def pragmas(path: Path) -> tuple[int, int]:
    conn = sqlite3.connect(path)
    try:
        return (
            conn.execute("PRAGMA user_version").fetchone()[0],
            conn.execute("PRAGMA application_id").fetchone()[0],
        )
    finally:
        conn.close()


def names_in(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return sorted(row[0] for row in conn.execute("SELECT name FROM sqlite_master"))
    finally:
        conn.close()


def test_migrate_adopts_an_application_database_and_leaves_its_pragmas(
    tmp_path: Path, api: MockServer, user: str
) -> None:
    """`idempotently migrate` creates the journal's tables in a shop.db with user_version
    7, which stays 7 (application_id stays 0); the app then enqueues on its own
    connection and the relay sends the charge once."""
    path = tmp_path / "shop.db"
    shop_database(path)
    migrated = CliRunner().invoke(cli, ["--journal", str(path), "migrate"])
    again = CliRunner().invoke(cli, ["--journal", str(path), "migrate"])
    with session(str(path), api, user) as s:
        conn = sqlite3.connect(path)
        conn.execute("INSERT INTO orders VALUES (?, ?)", ("o-12", 500))
        s.enqueue("POST", "/v1/charges", json=charge("o-12"), operation_id="o-12", connection=conn)
        conn.commit()
        conn.close()
        results = s.resume()
    assert 0 == migrated.exit_code, migrated.output
    assert "created the journal's tables" in migrated.output
    assert "nothing to do" in again.output
    assert [("o-12", "succeeded")] == [(r.operation_id, r.action) for r in results]
    assert 1 == len(api.charges(user))
    assert (7, 0) == pragmas(path)


def test_a_session_on_an_application_database_says_to_run_migrate(tmp_path: Path) -> None:
    """Session(...) or Journal(...) on a file of other tables (a typo in journal=, say)
    refuses with one line saying to run `migrate`, and writes nothing to it; so does a
    command."""
    path = tmp_path / "shop.db"
    shop_database(path)
    before = (names_in(path), path.read_bytes())
    with pytest.raises(idempotently.JournalMissingError) as raised:
        idempotently.Session(str(path))
    with pytest.raises(idempotently.JournalMissingError):
        idempotently.Journal(path, readonly=True)
    listed = CliRunner().invoke(cli, ["--journal", str(path), "list"])
    assert f"idempotently --journal {path} migrate" in str(raised.value)
    assert 1 == len(str(raised.value).splitlines())
    assert (1, 1) == (listed.exit_code, len(listed.output.strip().splitlines()))
    assert "migrate" in listed.output
    assert before == (names_in(path), path.read_bytes())


def test_migrate_refuses_a_database_whose_application_id_is_another_programs(
    tmp_path: Path,
) -> None:
    """A file whose application_id is non-zero and not the journal's is not adopted."""
    path = tmp_path / "other.db"
    shop_database(path, application_id=0x12345678)
    before = path.read_bytes()
    migrated = CliRunner().invoke(cli, ["--journal", str(path), "migrate"])
    printed = CliRunner().invoke(cli, ["--journal", str(path), "migrate", "--sql"])
    assert (1, 1) == (migrated.exit_code, printed.exit_code)
    assert "another program" in migrated.output
    assert before == path.read_bytes()


def test_migrate_sql_on_an_application_database_leaves_its_pragmas_alone(
    tmp_path: Path, api: MockServer, user: str
) -> None:
    """`migrate --sql` on shop.db prints statements that set neither user_version nor
    application_id; applied by the app's own migration, the library opens the journal
    in it and sends what the app enqueues."""
    path = tmp_path / "shop.db"
    shop_database(path)
    printed = CliRunner().invoke(cli, ["--journal", str(path), "migrate", "--sql"])
    assert 0 == printed.exit_code, printed.output
    assert "user_version" not in printed.output
    assert "application_id" not in printed.output
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript(printed.output)
    conn.close()
    assert "nothing to do" in migration_sql(str(path))
    with session(str(path), api, user) as s:
        s.enqueue("POST", "/v1/charges", json=charge("o-13"), operation_id="o-13")
        results = s.resume()
    assert [("o-13", "succeeded")] == [(r.operation_id, r.action) for r in results]
    assert (7, 0) == pragmas(path)


@pytest.mark.parametrize(
    "table",
    [
        "CREATE TABLE journal_meta (id INTEGER PRIMARY KEY, note TEXT)",
        "CREATE TABLE journal_meta (name TEXT PRIMARY KEY, value TEXT)",
    ],
    ids=["other-columns", "name-value"],
)
def test_an_apps_own_journal_meta_is_refused_as_named_like_the_journals(
    tmp_path: Path, table: str
) -> None:
    """An application's own `journal_meta` table (any columns): `migrate`, `migrate --sql`
    and `Session` refuse the file, naming the table and saying to give the journal a
    file of its own; the file is left as it is (before: "no such column: name; check the
    file and its directory are readable and writable", a false lead)."""
    path = tmp_path / "shop.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA user_version = 7")
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    conn.execute(table)
    conn.close()
    before = path.read_bytes()
    for args in (["migrate"], ["migrate", "--sql"]):
        migrated = CliRunner().invoke(cli, ["--journal", str(path), *args])
        said = " ".join(migrated.output.split())
        assert (1, True, True) == (
            migrated.exit_code,
            "named like the journal's (journal_meta)" in said,
            "a file of its own" in said,
        ), migrated.output
    with pytest.raises(
        idempotently.JournalError, match=r"named like the journal's \(journal_meta\)"
    ):
        idempotently.Session(path)
    assert before == path.read_bytes()


def test_a_file_with_a_table_named_like_the_journals_is_not_adopted(tmp_path: Path) -> None:
    """An application table called `operations` is never taken for the journal's, nor
    adopted beside: `migrate` refuses and the file is left as it is."""
    path = tmp_path / "shop.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE operations (id INTEGER PRIMARY KEY)")
    conn.close()
    before = path.read_bytes()
    migrated = CliRunner().invoke(cli, ["--journal", str(path), "migrate"])
    assert 1 == migrated.exit_code
    assert "not an idempotently journal" in migrated.output
    assert before == path.read_bytes()
