"""Issue 9 tried the way users, the sqlite3 shell and crashed processes would: durable
throughput must never cost an operation, a count, or a clear error."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

import idempotently
from idempotently._commands import Insert
from idempotently._journal import Durability, NewOperation, _sqlite
from idempotently._rows import Failed
from idempotently.cli import cli
from idempotently.testing import serve
from tests.journal_commands import execute_together
from tests.support import recount as support_recount

BASE = "https://api.example.test"
CHARGE = {"amount": 1000, "currency": "usd", "customer": "cus_1"}
SRC = str(Path(idempotently.__file__).resolve().parents[1])


def new_operation(operation_id: str, body: bytes) -> NewOperation:
    """An operation as the engine journals it before its first byte."""
    return NewOperation(
        operation_id=operation_id,
        key=f"key-{operation_id}",
        delivery="exactly_once",
        method="POST",
        url=f"{BASE}/v1/charges",
        request_headers=(("content-type", "application/json"),),
        request_body=body,
        fingerprint="f" * 64,
        profile="generic",
        key_header="Idempotency-Key",
        created_at=1_800_000_000.0,
        key_expires_at=1_800_086_400.0,
        deadline_at=None,
    )


# -- a row SQLite refuses ---------------------------------------------------------------


def test_a_body_over_sqlites_size_limit_is_a_journal_write_error_and_nothing_is_sent(
    tmp_path: Path,
) -> None:
    """A body SQLite refuses to store (over its 1 GB limit; lowered here) is a
    JournalWriteError naming the operation, never a raw sqlite3.DataError; nothing is sent."""
    sent: list[httpx.Request] = []
    journal = idempotently.Journal(tmp_path / "journal.db")
    journal._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 4096)
    with idempotently.Session(
        journal, transport=httpx.MockTransport(lambda r: sent.append(r) or httpx.Response(201))
    ) as session:
        with pytest.raises(idempotently.JournalWriteError, match="size limit") as raised:
            session.post(f"{BASE}/v1/charges", content=b"x" * 10_000, operation_id="big-1")
        assert "big-1" in str(raised.value)
        assert ([], None) == (sent, journal.operation("big-1"))


@pytest.mark.parametrize("durability", ["fsync", "os"])
def test_one_refused_row_in_a_shared_commit_fails_only_its_own_caller(
    tmp_path: Path, durability: Durability
) -> None:
    """Keys committed together (group commit, an async session's batch): a row SQLite
    refuses fails its own caller with a JournalWriteError; the others' keys are journaled."""
    with idempotently.Journal(tmp_path / "journal.db", durability=durability) as journal:
        journal._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 4096)
        items = [
            (new_operation("small-1", b"{}"), "me", 0.0),
            (new_operation("huge", b"x" * 10_000), "me", 0.0),
            (new_operation("small-2", b"{}"), "me", 0.0),
        ]
        first, refused, last = execute_together(journal, [Insert(*item) for item in items])
        assert (True, True) == (first, last)
        assert isinstance(refused, Failed)
        assert isinstance(refused.error, idempotently.JournalWriteError)
        assert ["small-2", "small-1"] == [op.operation_id for op in journal.operations()]


# -- the counts each batch keeps -----------------------------------------------------------


def fill_finished(path: Path, count: int) -> None:
    """``count`` succeeded operations idle since long ago, with an attempt each, plus a
    pending and a needs_reconcile one as old: what a prune must leave."""
    with idempotently.Journal(path) as journal, journal._store._write() as conn:
        rows = [(f"old-{n}", f"key-old-{n}", "succeeded", 1000.0 + n) for n in range(count)] + [
            ("old-pending", "key-p", "pending", 1.0),
            ("old-reconcile", "key-r", "needs_reconcile", 1.0),
        ]
        # Each with its first attempt, which lives in its row.
        conn.executemany(
            "INSERT INTO operations (operation_id, key, status, delivery, method, url,"
            " request_headers, request_body, fingerprint, profile, key_header, created_at,"
            " updated_at, key_expires_at, attempt_count, attempt1_started_at,"
            " attempt1_elapsed, attempt1_outcome, attempt1_status_code, attempt1_replayed)"
            " VALUES (?, ?, ?, 'exactly_once', 'POST', 'http://127.0.0.1/v1/charges', '[]',"
            " x'7b7d', 'f', 'generic', 'Idempotency-Key', ?4, ?4, ?4, 1, 1000.0, 0.001,"
            " 'answered', 201, 0)",
            rows,
        )
        conn.execute(_sqlite._RECOUNT)  # rows written by hand: counted from the rows


def recount(path: Path) -> tuple[dict[str, int], int]:
    """Operations per status and attempts, counted from the rows."""
    with contextlib.closing(sqlite3.connect(path)) as raw:
        truth = support_recount(raw, now=2e9)
    return truth.counts, truth.attempts


@pytest.mark.slow
def test_a_prune_killed_midway_while_a_session_writes_leaves_exact_counts(
    tmp_path: Path,
) -> None:
    """SIGKILL a prune of a large journal midway while a Session with a 2 s busy timeout
    journals keys: the Session never fails, the counts equal a recount, and pending and
    needs_reconcile operations are still there."""
    path = tmp_path / "journal.db"
    fill_finished(path, 60_000)
    prune = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, idempotently; "
            "idempotently.Journal(sys.argv[1]).prune(older_than=0, now=2e9)",
            str(path),
        ],
        env={**os.environ, "PYTHONPATH": SRC},
    )
    written, errors = 0, []
    with idempotently.Session(
        idempotently.Journal(path, busy_timeout=2.0),
        transport=httpx.MockTransport(lambda request: httpx.Response(201)),
    ) as session:
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    session.post(f"{BASE}/v1/charges", json={}, operation_id=f"new-{written}")
                    written += 1
                except idempotently.IdempotentlyError as error:
                    errors.append(error)
                left = session.journal.counts()["succeeded"]
                if left < 60_000 - 10_000 + written:
                    break  # the prune is deleting: kill it mid-batch
            assert prune.poll() is None, "the prune finished before it could be killed"
        finally:
            prune.send_signal(signal.SIGKILL)
            prune.wait()
        counts, attempts = session.journal.counts(), session.journal.stats(now=2e9).attempts
    assert [] == errors
    assert recount(path) == (counts, attempts)
    assert (1, 1) == (counts["pending"], counts["needs_reconcile"])
    assert 0 < written <= counts["succeeded"]


def test_counts_follow_the_journals_writes_and_a_recount_follows_a_replace_by_hand(
    tmp_path: Path,
) -> None:
    """INSERT OR REPLACE and UPDATE from the sqlite3 shell (sqlite-utils upsert does the
    same) are not the journal's writes: `idempotently migrate --recount` makes counts()
    equal the rows."""
    path = tmp_path / "journal.db"
    fill_finished(path, 3)
    with sqlite3.connect(path) as raw:
        raw.execute("INSERT OR REPLACE INTO operations SELECT * FROM operations WHERE rowid = 1")
        raw.execute("UPDATE operations SET status = 'failed' WHERE rowid = 2")
    with idempotently.Journal(path) as journal:
        drifted = journal.counts()
    recounted = CliRunner().invoke(cli, ["--journal", str(path), "migrate", "--recount"])
    with idempotently.Journal(path) as journal:
        assert recount(path)[0] == journal.counts()
    assert recount(path)[0] != drifted  # the hand edit was not counted until then
    said = f"recounted {path}: pending 1, succeeded 2, failed 1, needs_reconcile 1,"
    assert (0, said) == (recounted.exit_code, recounted.output[: len(said)])


# -- resume at scale, from the command line ---------------------------------------------


@pytest.mark.slow
def test_two_cli_resumers_with_concurrency_8_charge_each_operation_once(
    tmp_path: Path,
) -> None:
    """Two `idempotently resume --concurrency 8` processes on one journal at once, against
    the mock payments server: every pending operation is charged exactly once and ends
    succeeded."""
    path = tmp_path / "journal.db"
    count = 40
    with serve() as server:

        def refuse(request: httpx.Request) -> httpx.Response:
            raise httpx.ConnectError("down", request=request)

        with idempotently.Session(
            path,
            transport=httpx.MockTransport(refuse),
            base_url=server.url,
            policy=idempotently.RetryPolicy(max_attempts=1),
        ) as session:
            for n in range(count):
                with pytest.raises(idempotently.OperationPendingError):
                    session.post(
                        "/v1/charges",
                        json={**CHARGE, "metadata": {"order_id": f"order-{n}"}},
                        operation_id=f"order-{n}",
                    )
        command = [
            sys.executable,
            "-m",
            "idempotently",
            "--journal",
            str(path),
            "resume",
            "--concurrency",
            "8",
            "--header-env",
            "Authorization=REVIEW9_AUTH",
            "--json",
        ]
        env = {**os.environ, "PYTHONPATH": SRC, "REVIEW9_AUTH": "Bearer user_1"}
        go = threading.Barrier(2)

        def resumer(out: list[subprocess.CompletedProcess[str]]) -> None:
            go.wait()
            out.append(subprocess.run(command, env=env, capture_output=True, text=True))

        results: list[subprocess.CompletedProcess[str]] = []
        threads = [threading.Thread(target=resumer, args=(results,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        charges = server.charge_count_by_order()
    # A resumer exits 1 when the other one held some leases: those it left to it.
    assert [0, 0] == [
        ("Traceback" in result.stderr) + (result.returncode > 1) for result in results
    ]
    assert {f"order-{n}" for n in range(count)} == {order for _, order in charges}
    assert {1} == set(charges.values())
    with idempotently.Journal(path) as journal:
        assert count == journal.counts()["succeeded"]


# -- derived keys, on both stores ---------------------------------------------------------


def test_a_pruned_operation_run_again_sends_the_same_derived_key_on_either_store(
    journal_target: str,
) -> None:
    """On SQLite and PostgreSQL: the key of operation_id is uuid5(journal.namespace, id);
    a prune that deleted the row and a reopen leave the namespace alone, so running the
    operation again sends the very same key (the server replays)."""
    keys: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers["Idempotency-Key"])
        return httpx.Response(201)

    with idempotently.Session(journal_target, transport=httpx.MockTransport(answer)) as session:
        session.post(f"{BASE}/v1/charges", json={"n": 1}, operation_id="order-7")
        namespace = session.journal.namespace
        assert 1 == session.journal.prune(older_than=0, now=time.time() + 60)
    with idempotently.Session(journal_target, transport=httpx.MockTransport(answer)) as session:
        assert namespace == session.journal.namespace
        session.post(f"{BASE}/v1/charges", json={"n": 1}, operation_id="order-7")
    assert [str(uuid.uuid5(namespace, "order-7"))] * 2 == keys
