"""An outsider's acceptance checks of the fleet work (issue 10): the PostgreSQL journal,
leases across hosts, heartbeats and `resume --watch`, tried as users, careless operators
and hostile inputs would try them. Real processes, a real PostgreSQL server and the mock
payments server on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import psycopg
import pytest

import idempotently
from idempotently.testing import MockServerConfig, serve
from tests.test_fleet import (
    REPO,
    TOKEN_ENV,
    USER,
    WAIT,
    WatchWorker,
    assert_each_order_charged_once,
    drained,
    fleet,
    operation_id,
    seed,
    wait_until_at_the_server,
)

PASSWORD = "Tr0ub4dor-s3cret"
"""A password the test server ignores (trust authentication) and nothing may print."""


def sql(url: str, statement: str, params: Any = ()) -> list[tuple[Any, ...]]:
    """Run one statement on its own connection, as another process would; its rows."""
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(statement, params)
        return cursor.fetchall() if cursor.description else []


def with_password(url: str) -> str:
    return url.replace("postgres@", f"postgres:{PASSWORD}@", 1)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m idempotently ARGS` in a fresh process; its output, never raising."""
    return subprocess.run(
        [sys.executable, "-m", "idempotently", *args],
        capture_output=True,
        text=True,
        timeout=WAIT,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})},
    )


def body(order: int) -> dict[str, Any]:
    return {
        "amount": 100 + order,
        "currency": "usd",
        "customer": "cus_1",
        "metadata": {"order_id": f"order-{order}"},
    }


AUTH = {"Authorization": f"Bearer {USER}"}


# -- heartbeats on PostgreSQL -----------------------------------------------------------


@pytest.mark.postgres
def test_a_heartbeat_keeps_a_long_attempt_from_a_worker_on_another_host(
    tmp_path: Path, postgres_url: str
) -> None:
    """An attempt three times longer than its lease: the heartbeat renews the lease in
    PostgreSQL, so a watch worker of another host polling all along never resends it."""
    # Renewed every third of the lease, it survives a stall of two thirds of it (1.3 s).
    with serve(MockServerConfig(provider_latency=6.0, in_progress="409")) as server:
        with idempotently.Session(
            postgres_url,
            base_url=server.url,
            headers=AUTH,
            host_id="host-a",
            lease_duration=2.0,
            timeout=20,
        ) as session:
            session.journal.counts()  # the schema exists before the worker opens it
            with fleet(tmp_path, postgres_url, ["host-b"]) as [worker]:
                worker.wait_for(lambda event: event["event"] == "watch_started")
                response = session.post("/v1/charges", json=body(0), operation_id=operation_id(0))
                assert 201 == response.status_code
                assert 0 == worker.stop(signal.SIGTERM), worker.diagnosis()
        assert [] == worker.resumed()
        assert 1 == server.stats().requests
        assert_each_order_charged_once(server, postgres_url, 1)


# -- one operation, many callers: one request --------------------------------------------


@pytest.mark.postgres
def test_threads_sharing_a_postgres_session_send_one_operation_once(postgres_url: str) -> None:
    """Eight threads post one operation through one Session on PostgreSQL: the server gets
    one request and every thread gets its answer."""
    with (
        serve(MockServerConfig(provider_latency=0.3)) as server,
        idempotently.Session(postgres_url, base_url=server.url, headers=AUTH) as session,
    ):
        codes: list[int] = []
        barrier = threading.Barrier(8)

        def post() -> None:
            barrier.wait()
            response = session.post("/v1/charges", json=body(0), operation_id=operation_id(0))
            codes.append(response.status_code)

        threads = [threading.Thread(target=post) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT)
        assert [201] * 8 == codes
        assert 1 == server.stats().requests
        assert_each_order_charged_once(server, postgres_url, 1)


@pytest.mark.postgres
@pytest.mark.anyio
async def test_tasks_sharing_a_postgres_async_session_send_one_operation_once(
    postgres_url: str,
) -> None:
    """Eight tasks post one operation through one AsyncSession on PostgreSQL (asyncio and
    trio): one request to the server, the same answer for each task."""
    with serve(MockServerConfig(provider_latency=0.3)) as server:
        codes: list[int] = []
        async with idempotently.AsyncSession(
            postgres_url, base_url=server.url, headers=AUTH
        ) as session:

            async def post() -> None:
                response = await session.post(
                    "/v1/charges", json=body(0), operation_id=operation_id(0)
                )
                codes.append(response.status_code)

            async with anyio.create_task_group() as group:
                for _ in range(8):
                    group.start_soon(post)
        assert [201] * 8 == codes
        assert 1 == server.stats().requests
        assert_each_order_charged_once(server, postgres_url, 1)


# -- resume --watch ---------------------------------------------------------------------


@pytest.mark.postgres
def test_a_watch_worker_on_an_empty_journal_picks_up_later_work_never_printing_the_password(
    tmp_path: Path, postgres_url: str
) -> None:
    """A worker started on an empty PostgreSQL journal, its URL holding a password, resumes
    operations journaled after it started; neither it nor stats/list print the password."""
    url = with_password(postgres_url)
    idempotently.Journal(url).close()
    with serve() as server, fleet(tmp_path, url, ["host-a"]) as [worker]:
        worker.wait_for(lambda event: event["event"] == "watch_started")
        seed(url, server.url, 3)
        worker.wait_for(drained)
        assert 0 == worker.stop(signal.SIGTERM), worker.diagnosis()
        assert_each_order_charged_once(server, postgres_url, 3)
    assert sorted(operation_id(i) for i in range(3)) == sorted(worker.resumed())
    printed = [worker.stderr_path.read_text(), repr(worker.events)]
    for command in (("stats",), ("list",), ("show", operation_id(0))):
        result = cli("--journal", url, *command)
        assert 0 == result.returncode, result.stderr
        printed += [result.stdout, result.stderr]
    assert "postgres:***@" in printed[2]  # stats names the journal, redacted
    assert [] == [text for text in printed if PASSWORD in text]


@pytest.mark.postgres
def test_a_watch_worker_sends_only_what_may_be_sent(tmp_path: Path, postgres_url: str) -> None:
    """Of four pending operations a worker sends one: it does not claim one the server asked
    to wait for, abandons an at-most-once one whose sender died, and moves one whose key
    the server may have forgotten to needs_reconcile."""
    with serve() as server:
        seed(postgres_url, server.url, 3)  # order-0 is due
        with (
            idempotently.Session(
                postgres_url,
                base_url=server.url,
                transport=httpx.MockTransport(lambda request: httpx.Response(503)),
                policy=idempotently.RetryPolicy(max_attempts=1),
            ) as session,
            pytest.raises(idempotently.IdempotentlyError),
        ):
            session.post("/v1/charges", json=body(3), operation_id="once", delivery="at_most_once")
        now = time.time()
        table = "idempotently.operations"
        sql(
            postgres_url,
            f"UPDATE {table} SET not_before = %s WHERE operation_id = %s",
            (now + 3600, operation_id(1)),
        )
        sql(
            postgres_url,
            f"UPDATE {table} SET key_expires_at = created_at + 60 WHERE operation_id = %s",
            (operation_id(2),),
        )
        sql(
            postgres_url,
            f"UPDATE {table} SET lease_owner = 'dead-host:1:x', lease_until = %s "
            "WHERE operation_id = 'once'",
            (now - 1,),
        )
        with fleet(tmp_path, postgres_url, ["host-a"]) as [worker]:
            worker.wait_for(lambda event: event["event"] == "batch")
            assert 0 == worker.stop(signal.SIGTERM), worker.diagnosis()
        claimed = [
            id for e in worker.events if e["event"] == "claimed" for id in e["operation_ids"]
        ]
        assert operation_id(1) not in claimed
        assert 1 == server.stats().requests
        with idempotently.Journal(postgres_url, create=False) as journal:
            statuses = {op.operation_id: op.status for op in journal.operations()}
    assert {
        operation_id(0): "succeeded",
        operation_id(1): "pending",
        operation_id(2): "needs_reconcile",
        "once": "abandoned",
    } == statuses


@pytest.mark.postgres
@pytest.mark.parametrize("problem", ["server down", "no such database"])
def test_a_watch_worker_whose_journal_cannot_be_reached_says_so_in_one_line(
    postgres_url: str, problem: str
) -> None:
    """resume --watch on a URL whose server is down or whose database does not exist:
    exit 1, one line on stderr saying what to check, no traceback, no password."""
    url = with_password(postgres_url)
    if problem == "server down":
        url = url.replace("@127.0.0.1:", "@127.0.0.1:1", 1).rsplit(":", 1)[0] + ":1/postgres"
    else:
        url = url.rsplit("/", 1)[0] + "/no_such_database"
    result = cli("resume", "--watch", env={"IDEMPOTENTLY_JOURNAL": url})
    assert 1 == result.returncode
    assert "" == result.stdout
    assert 1 == len(result.stderr.splitlines()), result.stderr
    assert "Traceback" not in result.stderr and PASSWORD not in result.stderr
    advice = "cannot reach the server" if problem == "server down" else "does not exist"
    assert advice in result.stderr


@pytest.mark.postgres
def test_sigterm_lets_a_slow_attempt_finish_and_journals_its_answer(
    tmp_path: Path, postgres_url: str
) -> None:
    """SIGTERM while an attempt waits on a slow server: the worker waits for the answer,
    journals it (succeeded), releases its lease and exits 0."""
    with serve(MockServerConfig(provider_latency=2.0)) as server:
        seed(postgres_url, server.url, 1)
        with fleet(tmp_path, postgres_url, ["host-a"]) as [worker]:
            worker.wait_for(lambda event: event["event"] == "claimed")
            wait_until_at_the_server(server, worker)  # which answers in 2 s
            assert 0 == worker.stop(signal.SIGTERM), worker.diagnosis()
        assert [operation_id(0)] == worker.resumed()
        assert_each_order_charged_once(server, postgres_url, 1)


# -- host identity ----------------------------------------------------------------------


def test_an_empty_host_id_variable_means_the_hostname(tmp_path: Path) -> None:
    """IDEMPOTENTLY_HOST_ID set but empty (a blank line in an env file) counts as unset,
    for the command line and the library alike: no traceback, the hostname is used."""
    path = tmp_path / "journal.db"
    idempotently.Journal(path).close()
    result = cli("--journal", str(path), "resume", env={"IDEMPOTENTLY_HOST_ID": ""})
    assert (0, f"nothing to resume in {path}\n") == (result.returncode, result.stderr)
    os.environ["IDEMPOTENTLY_HOST_ID"] = ""
    try:
        with idempotently.Session(path) as session:
            assert session._engine.host_id
    finally:
        del os.environ["IDEMPOTENTLY_HOST_ID"]


@pytest.mark.parametrize(
    ("where", "bad"),
    [
        ("env", "a:b"),
        ("env", "a\x07b"),
        ("env", "h" * 10_000),
        ("cli", "a:b"),
        ("cli", "h" * 10_000),
    ],
)
def test_a_bad_host_id_is_a_usage_error(tmp_path: Path, where: str, bad: str) -> None:
    """A host id with ':', a control character or 10,000 characters, from the environment
    or the command line: exit 2 with a message naming --host-id, and no traceback."""
    path = tmp_path / "journal.db"
    idempotently.Journal(path).close()
    args = ["--journal", str(path), "resume", "--watch"]
    if where == "cli":
        result = cli(*args, "--host-id", bad)
    else:
        result = cli(*args, env={"IDEMPOTENTLY_HOST_ID": bad})
    assert 2 == result.returncode
    assert "--host-id" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr) < 1000


def test_a_worker_with_our_host_id_killed_mid_send_is_taken_over_at_once_safely(
    tmp_path: Path,
) -> None:
    """A worker SIGKILLed mid-send under the same host id as the next resume: its pid is
    gone, so `resume` takes the operation before the lease expires, sends the same key,
    and the server charges once."""
    path = str(tmp_path / "journal.db")
    with serve(MockServerConfig(provider_latency=1.0, in_progress="wait")) as server:
        seed(path, server.url, 1)
        victim = WatchWorker(tmp_path, path, "same", lease="600s")
        try:
            victim.wait_for(lambda event: event["event"] == "claimed")
            wait_until_at_the_server(server, victim)
            victim.proc.kill()
            victim.proc.wait(WAIT)
        finally:
            victim.close()
        with idempotently.Journal(path) as journal:
            held = journal.operation(operation_id(0))
        assert held is not None and held.lease_owner is not None
        result = cli(
            *("--journal", path, "resume", "--host-id", "same"),
            *("--header-env", f"Authorization={TOKEN_ENV}"),
            env={TOKEN_ENV: f"Bearer {USER}"},
        )
        assert 0 == result.returncode, result.stdout + result.stderr
        with idempotently.Journal(path) as journal:
            done = journal.operation(operation_id(0))
        assert done is not None
        # Its attempt started before the dead worker's 600 s lease would have expired.
        assert done.attempts[-1].started_at < held.lease_until
        assert 2 == server.stats().requests  # the same key twice ...
        assert_each_order_charged_once(server, path, 1)  # ... one charge


# -- URLs a careless operator types -----------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        f"POSTGRESQL://u:{PASSWORD}@127.0.0.1:1/db",
        f" postgresql://u:{PASSWORD}@127.0.0.1:1/db",
        Path(f"postgresql://u:{PASSWORD}@127.0.0.1:1/db"),
        f"mysql://u:{PASSWORD}@127.0.0.1:1/db",
    ],
)
def test_a_mistyped_url_is_refused_without_printing_its_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str | Path
) -> None:
    """A URL the PostgreSQL journal does not take (upper case, a space, a pathlib.Path,
    another database) is not a SQLite file name either: a JournalError that hides the
    password, from the library and the command line; no file is created."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(idempotently.JournalError, match="looks like a URL") as raised:
        idempotently.Journal(path)
    assert PASSWORD not in str(raised.value)
    result = cli("--journal", str(path), "stats")
    assert 1 == result.returncode
    assert "looks like a URL" in result.stderr and PASSWORD not in result.stderr
    assert [] == list(tmp_path.iterdir())


@pytest.mark.postgres
@pytest.mark.parametrize("url", ["postgresql://", "postgresql://127.0.0.1:1/" + "x" * 100_000])
def test_an_empty_or_huge_url_is_a_journal_error(url: str) -> None:
    """An empty URL, or one of 100,000 characters: a JournalError, not a hang or a crash."""
    with pytest.raises(idempotently.JournalError):
        idempotently.Journal(url, busy_timeout=2)


@pytest.mark.postgres
def test_a_read_only_role_reads_and_the_advice_names_the_table_privileges(
    postgres_url: str,
) -> None:
    """A role with SELECT only: Journal(url, readonly=True) reads; a write by the same role
    is a JournalWriteError whose advice names the privileges missing (INSERT, UPDATE...),
    not CREATE on the schema."""
    idempotently.Journal(postgres_url).close()
    sql(postgres_url, "DROP ROLE IF EXISTS reader")
    sql(postgres_url, f"CREATE ROLE reader LOGIN PASSWORD '{PASSWORD}'")
    try:
        sql(postgres_url, "GRANT USAGE ON SCHEMA idempotently TO reader")
        sql(postgres_url, "GRANT SELECT ON ALL TABLES IN SCHEMA idempotently TO reader")
        url = postgres_url.replace("postgres@", f"reader:{PASSWORD}@", 1)
        with idempotently.Journal(url, readonly=True) as journal:
            assert 0 == sum(journal.counts().values())
            assert [] == journal.operations()
        with (
            idempotently.Journal(url) as journal,
            pytest.raises(idempotently.JournalWriteError) as raised,
        ):
            journal.prune(older_than=0, now=time.time())
        assert "INSERT, UPDATE" in str(raised.value) and PASSWORD not in str(raised.value)
    finally:
        sql(postgres_url, "DROP OWNED BY reader")
        sql(postgres_url, "DROP ROLE reader")


# -- left as they are (strict xfail: each describes what a user would expect) -----------


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("url", "shown"),
    [("postgresql://", "postgresql://"), ("postgresql://127.0.0.1:1/" + "x" * 100_000, "...")],
)
def test_a_bad_url_is_shown_short_and_as_typed(url: str, shown: str) -> None:
    """The message for an empty or a 100,000-character URL fits a screen and shows the URL
    as typed (shortened)."""
    with pytest.raises(idempotently.JournalError) as raised:
        idempotently.Journal(url, busy_timeout=2)
    assert len(str(raised.value)) < 1000
    assert shown in str(raised.value)
