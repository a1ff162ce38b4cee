"""RetryPolicy(max_total_attempts=N): a cap on attempts across restarts, from the journal.

Only attempts that reached the server count (answered or maybe delivered), whichever
call, process, resume or watch worker made them; at the cap the operation goes to
needs_reconcile (failed when no attempt can have acted) with its cap_reason, and is
never sent again.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

import idempotently
from idempotently.cli import cli
from tests.scripted_server import RESET, Answer, ScriptedApp
from tests.support import FakeTime

UNAVAILABLE = Answer(status=503)


def capped(cap: int | None, **options: Any) -> idempotently.RetryPolicy:
    """Two attempts a call, no waits, no budget, and the cap ``cap``."""
    options.setdefault("max_attempts", 2)
    return idempotently.RetryPolicy(
        initial_backoff=0.0, budget=None, max_total_attempts=cap, **options
    )


def session(
    journal: str | Path, fake_time: FakeTime, policy: idempotently.RetryPolicy, **options: Any
) -> idempotently.Session:
    return idempotently.Session(
        journal, policy=policy, clock=fake_time.clock, sleep=fake_time.sleep, **options
    )


def operation(journal: str | Path, operation_id: str) -> idempotently.Operation:
    with idempotently.Journal(journal) as j:
        found = j.operation(operation_id)
    assert found is not None
    return found


# -- the policy field ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        (10**400, ValueError),
        (1_000_001, ValueError),
        (True, TypeError),
        (False, TypeError),
        (2.0, TypeError),
        (-0.0, TypeError),
        (float("nan"), TypeError),
        (float("inf"), TypeError),
        (float("-inf"), TypeError),
        ("3", TypeError),
    ],
)
def test_a_cap_that_is_no_count_of_attempts_is_refused(value: object, error: type) -> None:
    """max_total_attempts is None or an int from 1 to 1,000,000; anything else is a clear
    one-line error naming the field."""
    with pytest.raises(error) as raised:
        idempotently.RetryPolicy(max_total_attempts=value)  # type: ignore[arg-type]
    message = str(raised.value)
    assert "max_total_attempts must be an int from 1 to 1000000 or None" in message
    assert "\n" not in message and len(message) < 200


def test_the_cap_is_off_by_default_and_takes_one() -> None:
    """None by default; 1 is the smallest cap."""
    assert None is idempotently.RetryPolicy().max_total_attempts
    assert 1 == idempotently.RetryPolicy(max_total_attempts=1).max_total_attempts


def test_a_refused_cap_on_a_call_journals_nothing(tmp_path: Path, fake_time: FakeTime) -> None:
    """A bad cap is refused as the policy is built, before a call can journal anything."""
    with (
        session(tmp_path / "j.db", fake_time, capped(None)) as s,
        pytest.raises(ValueError, match="max_total_attempts"),
    ):
        s.post("http://127.0.0.1:9/x", json={}, policy=capped(0))
        assert [] == list(s.journal.operations())


# -- the count across restarts -------------------------------------------------------------


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_ten_resumes_of_a_503_stop_at_the_cap(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime, store: str
) -> None:
    """The issue's example: an operation answered 503 at every attempt, resumed ten
    times with two attempts a run, reaches the server 5 times in all (not 22), then is
    needs_reconcile with the reason shown, and no resume sends it again."""
    app, url = scripted
    app.answer(*[UNAVAILABLE] * 40)
    with session(journal_target, fake_time, capped(5)) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(f"{url}/charges", json={"n": 1}, operation_id="order-1")
        results = [s.resume() for _ in range(10)]
    assert 5 == len(app.arrivals)
    # The call's two, the first resume's two, the second resume's one: at the cap.
    assert [["still_pending"], ["needs_reconcile"]] + [[]] * 8 == [
        [result.action for result in run] for run in results
    ]
    row = operation(journal_target, "order-1")
    assert ("needs_reconcile", 5) == (row.status, row.attempt_count)
    assert row.cap_reason is not None and "max_total_attempts=5 reached" in row.cap_reason
    assert row.reason is not None and "max_total_attempts=5 reached" in row.reason


def test_the_call_raises_the_cap_error_naming_what_to_do(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """A call that brings its operation to the cap raises AttemptsCapError: the cap was
    reached, the operation may have been delivered, its id and key, and reconcile/settle;
    a call again with its id raises the same, sending nothing."""
    app, url = scripted
    app.answer(UNAVAILABLE, UNAVAILABLE, UNAVAILABLE)
    with session(tmp_path / "j.db", fake_time, capped(2, max_attempts=5)) as s:
        with pytest.raises(idempotently.AttemptsCapError) as raised:
            s.post(f"{url}/charges", json={}, operation_id="order-1")
        with pytest.raises(idempotently.AttemptsCapError) as again:
            s.post(f"{url}/charges", json={}, operation_id="order-1")
    error = raised.value
    assert 2 == len(app.arrivals)
    assert ("needs_reconcile", 2, 2) == (error.status, error.attempts, error.max_total_attempts)
    text = str(error)
    for said in (
        "reached its cap on attempts",
        "max_total_attempts=2",
        "may have been delivered",
        "settle",
        "order-1",
        str(error.key),
    ):
        assert said in text
    assert ("needs_reconcile", error.key) == (again.value.status, again.value.key)


def test_a_cap_failed_only_when_nothing_can_have_acted(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """An operation answered 429 at every attempt (the server says it did not act) is
    failed at the cap; one answered 503 once among them is needs_reconcile."""
    app, url = scripted
    limited = Answer(status=429)
    app.answer(limited, limited, limited, UNAVAILABLE, limited)
    with session(tmp_path / "j.db", fake_time, capped(2)) as s:
        with pytest.raises(idempotently.AttemptsCapError) as failed:
            s.post(f"{url}/charges", json={"n": 1}, operation_id="limited")
        with pytest.raises(idempotently.AttemptsCapError) as unknown:
            s.post(f"{url}/charges", json={"n": 2}, operation_id="mixed")
    assert ("failed", "needs_reconcile") == (failed.value.status, unknown.value.status)
    assert "no attempt can have been acted on" in str(failed.value)
    assert ("failed", "needs_reconcile") == (
        operation(tmp_path / "j.db", "limited").status,
        operation(tmp_path / "j.db", "mixed").status,
    )


def _refused_port() -> int:
    """A loopback port nothing listens on: a connection to it is refused before any byte."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_an_outage_never_dead_letters_an_outbox_order(
    journal_target: str, fake_time: FakeTime, store: str
) -> None:
    """Connections refused before any byte (not_sent) never count: an enqueued order
    resumed through an outage many times more than its cap stays pending."""
    url = f"http://127.0.0.1:{_refused_port()}/orders"
    with session(journal_target, fake_time, capped(2)) as s:
        s.enqueue("POST", url, json={"sku": 1}, operation_id="order-1")
        for _ in range(5):
            s.resume()
    row = operation(journal_target, "order-1")
    assert ("pending", None) == (row.status, row.cap_reason)
    assert row.attempt_count >= 5
    assert {"not_sent"} == {attempt.outcome for attempt in row.attempts}


def test_a_lost_answer_counts(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """An attempt whose connection broke after the request was read (maybe delivered)
    counts like an answered one."""
    app, url = scripted
    app.answer(RESET, RESET, RESET)
    with (
        session(tmp_path / "j.db", fake_time, capped(2, max_attempts=5)) as s,
        pytest.raises(idempotently.AttemptsCapError) as raised,
    ):
        s.post(f"{url}/charges", json={}, operation_id="lost")
    assert (2, "needs_reconcile") == (len(app.arrivals), raised.value.status)


# -- per call, journaled; a resume applies the stricter -------------------------------------


def test_a_call_cap_is_journaled_and_applied_by_resume(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """policy=RetryPolicy(max_total_attempts=3) on one call is journaled in overrides; a
    resume by a session without a cap applies it."""
    app, url = scripted
    app.answer(*[UNAVAILABLE] * 10)
    path = tmp_path / "j.db"
    with (
        session(path, fake_time, capped(None)) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(f"{url}/charges", json={}, operation_id="op", policy=capped(3))
    assert 3 == json.loads(str(operation(path, "op").overrides))["policy"]["max_total_attempts"]
    with session(path, fake_time, capped(None, max_attempts=5)) as s:
        [result] = s.resume()
    assert ("needs_reconcile", 3) == (result.action, len(app.arrivals))


@pytest.mark.parametrize(
    ("journaled", "given", "sent"),
    [(4, 2, 2), (2, 4, 2), (None, 3, 3), (3, None, 3)],
)
def test_a_resume_applies_the_stricter_cap(
    tmp_path: Path,
    scripted: tuple[ScriptedApp, str],
    fake_time: FakeTime,
    journaled: int | None,
    given: int | None,
    sent: int,
) -> None:
    """The journaled cap (a call's) and the resume's own: the smaller one stops it."""
    app, url = scripted
    app.answer(*[UNAVAILABLE] * 10)
    path = tmp_path / "j.db"
    with (
        session(path, fake_time, capped(None, max_attempts=1)) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(
            f"{url}/charges",
            json={},
            operation_id="op",
            policy=capped(journaled, max_attempts=1),
        )
    with session(path, fake_time, capped(given, max_attempts=10)) as s:
        # The journaled policy allows one attempt a run (the stricter max_attempts too).
        actions = [[result.action for result in s.resume()] for _ in range(5)]
    assert ["needs_reconcile"] == actions[sent - 2]
    assert (sent, "needs_reconcile") == (len(app.arrivals), operation(path, "op").status)


def test_a_resume_stricter_than_the_count_sends_nothing(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """An operation with three attempts counted, resumed under a cap of 2: nothing is
    sent, it moves to needs_reconcile with the reason."""
    app, url = scripted
    app.answer(*[UNAVAILABLE] * 3)
    path = tmp_path / "j.db"
    with (
        session(path, fake_time, capped(None, max_attempts=3)) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(f"{url}/charges", json={}, operation_id="op")
    with session(path, fake_time, capped(2)) as s:
        [result] = s.resume()
    row = operation(path, "op")
    assert (3, "needs_reconcile", "needs_reconcile") == (
        len(app.arrivals),
        result.action,
        row.status,
    )
    assert (
        row.cap_reason == "max_total_attempts=2 reached: 3 attempts reached the server, "
        "counted from the journal across every call, process and resume"
    )


# -- what the operator sees -----------------------------------------------------------------


def _invoke(journal: str, *args: str) -> str:
    result = CliRunner().invoke(cli, ["--journal", journal, *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.output


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_show_list_and_stats_say_the_cap(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime, store: str
) -> None:
    """show (text and --json) gives the cap's reason; list --status needs_reconcile marks
    it (and --json gives the reason); stats (text, --json, Prometheus) counts it; a
    prune of a capped failed operation and a recount keep that count true."""
    app, url = scripted
    app.answer(UNAVAILABLE, UNAVAILABLE, Answer(status=429), Answer(status=429))
    with session(journal_target, fake_time, capped(2)) as s:
        for operation_id in ("capped", "limited"):
            with pytest.raises(idempotently.AttemptsCapError):
                s.post(f"{url}/charges", json={"n": operation_id}, operation_id=operation_id)
        app.answer(Answer(status=201))
        s.post(f"{url}/charges", json={}, operation_id="fine")
    reason = operation(journal_target, "capped").cap_reason
    assert reason is not None and reason.startswith("max_total_attempts=2 reached: 2 attempts")
    shown = json.loads(_invoke(journal_target, "show", "capped", "--json"))
    assert (reason, "needs_reconcile") == (shown["cap_reason"], shown["status"])
    assert f"attempts cap\t{reason}" in _invoke(journal_target, "show", "capped")
    listed = json.loads(_invoke(journal_target, "list", "--status", "needs_reconcile", "--json"))
    assert [("capped", reason)] == [(row["operation_id"], row["cap_reason"]) for row in listed]
    with idempotently.Journal(journal_target) as journal:
        from idempotently._cli_format import operations_table

        table = operations_table(journal.operations(status="needs_reconcile"), fake_time.now)
        assert "needs_reconcile (attempts cap)" in "\n".join(table)
        assert 2 == journal.stats(now=fake_time.now).capped
    assert 2 == json.loads(_invoke(journal_target, "stats", "--json"))["capped"]
    assert "attempts cap\t2 (operations that reached max_total_attempts)" in _invoke(
        journal_target, "stats"
    )
    prometheus = _invoke(journal_target, "stats", "--format", "prometheus")
    assert f'idempotently_capped_operations{{journal="{journal_target}"}} 2' in prometheus
    with idempotently.Journal(journal_target) as journal:
        assert 2 == journal.prune(older_than=0.0, now=fake_time.now + 10)  # limited and fine
        assert 1 == journal.stats(now=fake_time.now).capped
    _invoke(journal_target, "migrate", "--recount")
    with idempotently.Journal(journal_target) as journal:
        assert 1 == journal.stats(now=fake_time.now).capped


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_damaged_count_of_capped_operations_names_the_recount(
    journal_target: str, fake_time: FakeTime, store: str
) -> None:
    """A count of capped operations edited by hand into no number makes stats a clear
    error saying to recount, and the recount repairs it."""
    with idempotently.Journal(journal_target) as journal:
        journal.stats(now=fake_time.now)  # created
    table = "journal_meta" if store == "sqlite" else "idempotently.journal_meta"
    sql = f"INSERT INTO {table} (name, value) VALUES ('capped_operations', 'x')"
    if store == "sqlite":
        import sqlite3

        with sqlite3.connect(journal_target) as conn:
            conn.execute(sql)
    else:
        import psycopg

        with psycopg.connect(journal_target, autocommit=True) as conn:
            conn.execute(sql)
    with (
        idempotently.Journal(journal_target) as journal,
        pytest.raises(idempotently.JournalCorruptError, match="migrate --recount"),
    ):
        journal.stats(now=fake_time.now)
    assert "recounted" in _invoke(journal_target, "migrate", "--recount")
    with idempotently.Journal(journal_target) as journal:
        assert 0 == journal.stats(now=fake_time.now).capped


def _set_capped_count(journal_target: str, store: str, value: str) -> None:
    """The count of capped operations edited by hand into ``value``."""
    table = "journal_meta" if store == "sqlite" else "idempotently.journal_meta"
    sql = f"INSERT INTO {table} (name, value) VALUES ('capped_operations', %s)"
    if store == "sqlite":
        import sqlite3

        with sqlite3.connect(journal_target) as conn:
            conn.execute(sql.replace("%s", "?"), (value,))
    else:
        import psycopg

        with psycopg.connect(journal_target, autocommit=True) as conn:
            conn.execute(sql, (value,))


@pytest.mark.parametrize("damaged", ["9" * 20, "12abc", "5.5"])
@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_damaged_count_never_stops_a_cap_nor_a_prune_and_is_never_made_a_number(
    journal_target: str,
    scripted: tuple[ScriptedApp, str],
    fake_time: FakeTime,
    store: str,
    damaged: str,
) -> None:
    """A count of capped operations edited by hand (past any count, or no number) leaves
    the write that caps an operation and a prune of a capped one journaled as ever; the
    count keeps its damage for stats to name (never read as a number by one store and
    not the other), and a recount repairs it."""
    app, url = scripted
    with idempotently.Journal(journal_target) as journal:
        journal.stats(now=fake_time.now)  # created
    _set_capped_count(journal_target, store, damaged)
    app.answer(UNAVAILABLE, UNAVAILABLE, Answer(status=429), Answer(status=429))
    with session(journal_target, fake_time, capped(2)) as s:
        for operation_id in ("capped", "limited"):
            with pytest.raises(idempotently.AttemptsCapError):
                s.post(f"{url}/charges", json={"n": operation_id}, operation_id=operation_id)
    assert [("needs_reconcile", True), ("failed", True)] == [
        (row.status, row.cap_reason is not None)
        for row in (operation(journal_target, "capped"), operation(journal_target, "limited"))
    ]
    with idempotently.Journal(journal_target) as journal:
        assert 1 == journal.prune(older_than=0.0, now=fake_time.now + 10)  # limited
        with pytest.raises(idempotently.JournalCorruptError, match="migrate --recount"):
            journal.stats(now=fake_time.now)
    assert "recounted" in _invoke(journal_target, "migrate", "--recount")
    with idempotently.Journal(journal_target) as journal:
        assert 1 == journal.stats(now=fake_time.now).capped


@pytest.mark.parametrize(
    ("act", "said"),
    [
        (("settle", "--failed", "--note", "not on the server"), "settled failed by"),
        (("fork", "--note", "lost: send again"), "when forking it as"),
    ],
)
def test_an_operator_who_settles_a_capped_operation_has_the_last_word(
    tmp_path: Path,
    scripted: tuple[ScriptedApp, str],
    fake_time: FakeTime,
    act: tuple[str, ...],
    said: str,
) -> None:
    """A capped needs_reconcile operation an operator settled failed (or forked) keeps
    its cap_reason, but a call again with its id says what the operator did, as for any
    settled operation: not an AttemptsCapError claiming each attempt was answered 408,
    425 or 429 (they were 503s)."""
    app, url = scripted
    app.answer(UNAVAILABLE, UNAVAILABLE)
    journal = tmp_path / "j.db"
    with (
        session(journal, fake_time, capped(2)) as s,
        pytest.raises(idempotently.AttemptsCapError),
    ):
        s.post(f"{url}/charges", json={}, operation_id="order-1")
    _invoke(str(journal), *act[:1], "order-1", *act[1:], "--actor", "ops")
    with (
        session(journal, fake_time, capped(2)) as s,
        pytest.raises(idempotently.RequestNotSentError) as again,
    ):
        s.post(f"{url}/charges", json={}, operation_id="order-1")
    assert not isinstance(again.value, idempotently.AttemptsCapError)
    assert said in str(again.value)
    assert "408, 425 or 429" not in str(again.value)
    row = operation(journal, "order-1")
    assert ("failed", True) == (row.status, row.cap_reason is not None)
    assert 2 == len(app.arrivals)


# -- every caller shares the count -----------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_async_tasks_stop_at_the_cap_a_sync_call_counted_towards(
    journal_target: str,
    scripted: tuple[ScriptedApp, str],
    fake_time: FakeTime,
    anyio_backend: str,
    store: str,
) -> None:
    """asyncio and trio: attempts a sync Session made count for an AsyncSession's call
    of the same operation, which stops at the cap and raises AttemptsCapError; tasks
    running at once each stop at their own operation's cap."""
    app, url = scripted
    app.answer(*[UNAVAILABLE] * 20)
    with (
        session(journal_target, fake_time, capped(3)) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(f"{url}/charges", json={"n": 0}, operation_id="shared")
    errors: dict[str, idempotently.AttemptsCapError] = {}
    async with idempotently.AsyncSession(
        journal_target,
        policy=capped(3, max_attempts=5),
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
    ) as a:

        async def work(n: int) -> None:
            try:
                await a.post(f"{url}/charges", json={"n": n}, operation_id=names[n])
            except idempotently.AttemptsCapError as error:
                errors[names[n]] = error

        names = ["shared", "task-1", "task-2"]
        async with anyio.create_task_group() as group:
            for n in range(3):
                group.start_soon(work, n)
    assert {"shared": 3, "task-1": 3, "task-2": 3} == {
        name: error.attempts for name, error in errors.items()
    }
    assert 2 + 1 + 3 + 3 == len(app.arrivals)


CHILD = textwrap.dedent(
    """
    import json, sys
    import idempotently
    journal, url, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
    policy = idempotently.RetryPolicy(max_attempts=5, initial_backoff=0.0, budget=None,
                                      max_total_attempts=cap)
    with idempotently.Session(journal, policy=policy) as s:
        try:
            s.post(url, json={"n": 1}, operation_id="order-1")
            print(json.dumps({"sent": True}))
        except idempotently.AttemptsCapError as error:
            print(json.dumps({"status": error.status, "attempts": error.attempts}))
        except idempotently.OperationPendingError:
            print(json.dumps({"pending": True}))
    """
)


def run_child(journal: str, url: str, cap: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, journal, url, str(cap)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
    )
    assert 0 == done.returncode, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_two_processes_on_one_journal_share_the_count(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime, store: str
) -> None:
    """This process makes two attempts of an operation; another process on the same
    journal (SQLite or PostgreSQL) calling it again under a cap of 3 sends once more,
    then stops: three reached the server in all."""
    app, url = scripted
    app.answer(*[UNAVAILABLE] * 10)
    with (
        session(journal_target, fake_time, capped(None)) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(f"{url}/charges", json={"n": 1}, operation_id="order-1")
    assert {"status": "needs_reconcile", "attempts": 3} == run_child(
        journal_target, f"{url}/charges", 3
    )
    assert 3 == len(app.arrivals)
    assert {"status": "needs_reconcile", "attempts": 3} == run_child(
        journal_target, f"{url}/charges", 3
    )
    assert 3 == len(app.arrivals)


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_watch_worker_honours_the_cap(
    journal_target: str, scripted: tuple[ScriptedApp, str], store: str
) -> None:
    """A `resume --watch` worker (Session.watch) resuming an operation answered 503 round
    after round stops at the cap: needs_reconcile, and nothing more is sent."""
    app, url = scripted
    app.answer(*[UNAVAILABLE] * 20)
    fake = FakeTime()
    with (
        session(journal_target, fake, capped(4, max_attempts=1)) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(f"{url}/charges", json={}, operation_id="order-1")
    stop = threading.Event()
    results: list[idempotently.ResumeResult] = []

    def on_result(result: idempotently.ResumeResult) -> None:
        results.append(result)
        # A round claims nothing once the operation is settled; a bound on a bug.
        if result.action == "needs_reconcile" or len(results) > 10:
            stop.set()

    def on_batch(batch: idempotently.WatchBatch) -> None:
        fake.now += 3600  # past any park: the next round takes it again

    with session(journal_target, fake, capped(4, max_attempts=1), host_id="worker-1") as s:
        s.watch(stop, interval=1.0, on_result=on_result, on_batch=on_batch)
        assert [] == s.resume()  # nothing left to send
    assert ["still_pending", "still_pending", "needs_reconcile"] == [
        result.action for result in results
    ]
    assert 4 == len(app.arrivals)
    assert "needs_reconcile" == operation(journal_target, "order-1").status


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_resume_max_total_attempts_on_the_command_line(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime, store: str
) -> None:
    """`idempotently resume --max-total-attempts 3` counts the attempts already journaled:
    one more is sent, then the operation is needs_reconcile (exit 1, the reason shown);
    0 or a word is a usage error, nothing sent."""
    app, url = scripted
    app.answer(*[UNAVAILABLE] * 10)
    with (
        session(journal_target, fake_time, capped(None)) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(f"{url}/charges", json={}, operation_id="order-1")
    for bad in ("0", "-1", "1.5", "x", str(10**400)):
        result = CliRunner().invoke(
            cli, ["--journal", journal_target, "resume", "--max-total-attempts", bad]
        )
        assert 2 == result.exit_code, result.output
        assert "--max-total-attempts" in result.output
    assert 2 == len(app.arrivals)
    result = CliRunner().invoke(
        cli,
        ["--journal", journal_target, "resume", "--max-total-attempts", "3", "--format", "json"],
    )
    assert 1 == result.exit_code, result.output
    [line], _ = json.JSONDecoder().raw_decode(result.output)
    assert "needs_reconcile" == line["action"]
    assert "max_total_attempts=3 reached" in line["detail"]
    assert 3 == len(app.arrivals)


@pytest.mark.parametrize("stored", ["0", "true", "2.5", '"3"', "1" + "0" * 400])
def test_a_damaged_journaled_cap_keeps_its_operation_and_the_resume_goes_on(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], fake_time: FakeTime, stored: str
) -> None:
    """A journaled cap that is no count (edited by hand, or written by no version of
    ours) leaves its operation pending and unsent, says why, and the next one is resumed."""
    app, url = scripted
    app.answer(UNAVAILABLE, UNAVAILABLE)
    path = tmp_path / "j.db"
    with session(path, fake_time, capped(None, max_attempts=1)) as s:
        for operation_id in ("damaged", "sound"):
            with pytest.raises(idempotently.OperationPendingError):
                s.post(
                    f"{url}/charges",
                    json={"n": operation_id},
                    operation_id=operation_id,
                    policy=capped(5, max_attempts=1),
                )
    import sqlite3

    with sqlite3.connect(path) as conn:
        conn.execute(
            "UPDATE operations SET overrides = replace(overrides, "
            "'\"max_total_attempts\":5', ?) WHERE operation_id = 'damaged'",
            (f'"max_total_attempts":{stored}',),
        )
    app.answer(Answer(status=201))
    with session(path, fake_time, capped(None)) as s:
        results = {result.operation_id: result for result in s.resume()}
    assert ("not_sent", "succeeded") == (results["damaged"].action, results["sound"].action)
    assert "its journaled policy is not valid (max_total_attempts must be" in str(
        results["damaged"].detail
    )
    assert 3 == len(app.arrivals)


def test_a_call_again_applies_the_journaled_cap(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """An operation whose call journaled max_total_attempts=3, called again with its id by
    a session without a cap, stops at 3 attempts in all."""
    app, url = scripted
    app.answer(*[UNAVAILABLE] * 10)
    with session(tmp_path / "j.db", fake_time, capped(None, max_attempts=5)) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(f"{url}/charges", json={}, operation_id="op", policy=capped(3, max_attempts=2))
        with pytest.raises(idempotently.AttemptsCapError) as raised:
            s.post(f"{url}/charges", json={}, operation_id="op")
    assert (3, 3, 3) == (len(app.arrivals), raised.value.attempts, raised.value.max_total_attempts)


@pytest.mark.parametrize(
    ("find", "put"),
    [
        ('"max_total_attempts":2', '"max_total_attempts":true'),  # the cap damaged
        ('"max_total_attempts":2', '"max_total_attempts":2,"hedge":1'),  # a newer version's
    ],
)
def test_a_call_again_never_sends_past_a_journaled_cap_it_cannot_read(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], fake_time: FakeTime, find: str, put: str
) -> None:
    """A call again with the id of an operation whose journaled overrides cannot be read
    (edited by hand, or written by a newer version) sends nothing, as a resume does: they
    may hold a cap it would send past. The error names the operation, key and why; the
    operation stays pending with its lease free."""
    app, url = scripted
    app.answer(*[UNAVAILABLE] * 10)
    path = tmp_path / "j.db"
    with (
        session(path, fake_time, capped(None)) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(f"{url}/charges", json={}, operation_id="op", policy=capped(2, max_attempts=1))
    import sqlite3

    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE operations SET overrides = replace(overrides, ?, ?)", (find, put))
    with (
        session(path, fake_time, capped(None)) as s,
        pytest.raises(idempotently.JournalCorruptError) as raised,
    ):
        s.post(f"{url}/charges", json={}, operation_id="op")
    assert 1 == len(app.arrivals)
    text = str(raised.value)
    assert ("op", operation(path, "op").key) == (raised.value.operation_id, raised.value.key)
    assert "its journaled policy" in text and "nothing was sent" in text
    row = operation(path, "op")
    assert ("pending", None) == (row.status, row.lease_owner)


KILLED_MID_SEND = textwrap.dedent(
    """
    import sys
    import idempotently
    journal, url = sys.argv[1], sys.argv[2]
    policy = idempotently.RetryPolicy(max_attempts=3, initial_backoff=0.0, budget=None)
    with idempotently.Session(journal, policy=policy) as s:
        s.post(url, json={"amount": 100}, operation_id="order-1")
    """
)


def _killed_mid_send(journal_target: str, app: ScriptedApp, url: str) -> None:
    """A child process sends order-1, is answered 429, sends it again (the server acts:
    its answer never comes) and is killed (SIGKILL) before journaling that attempt."""
    import time

    app.answer(Answer(status=429), Answer(status=201, endless=True, trickle=0.5))
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_SEND, journal_target, f"{url}/charges"],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")},
    )
    try:
        for _ in range(1200):  # the second attempt reached the server: at most 2 min
            if len(app.arrivals) >= 2 or child.poll() is not None:
                break
            time.sleep(0.1)
        assert 2 == len(app.arrivals)
    finally:
        child.kill()
        child.wait(timeout=60)
    row = operation(journal_target, "order-1")
    assert ("pending", 1, 429) == (row.status, row.attempt_count, row.attempts[0].status_code)


@pytest.mark.slow
@pytest.mark.parametrize("cap", [1, 2])
@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_cap_never_fails_an_operation_whose_holder_died_mid_send(
    journal_target: str,
    scripted: tuple[ScriptedApp, str],
    fake_time: FakeTime,
    store: str,
    cap: int,
) -> None:
    """A process sends an operation, is answered 429, sends it again (the server acts:
    its answer never comes) and is killed (SIGKILL) before journaling that attempt. The
    journal shows one 429 and a lease its holder never gave back: a resume at the cap
    (now, or after a resend answered 429) may not call it failed (the promise that
    nothing happened): needs_reconcile."""
    import time

    app, url = scripted
    _killed_mid_send(journal_target, app, url)
    app.answer(Answer(status=429))
    fake_time.now = time.time() + 3600  # the dead holder's lease is long past
    with session(journal_target, fake_time, capped(cap)) as s:
        results = s.resume()
    assert [("order-1", "needs_reconcile")] == [(r.operation_id, r.action) for r in results]
    assert 1 + cap == len(app.arrivals)
    row = operation(journal_target, "order-1")
    assert ("needs_reconcile", True) == (row.status, row.cap_reason is not None)


@pytest.mark.slow
def test_a_watch_worker_never_fails_an_operation_whose_holder_died_mid_send(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """As a resume: a `resume --watch` worker that takes over an operation whose holder
    was killed mid-send, under a cap of 1, moves it to needs_reconcile, never failed."""
    import time

    app, url = scripted
    journal = str(tmp_path / "j.db")
    _killed_mid_send(journal, app, url)
    fake = FakeTime(now=time.time() + 3600)  # the dead holder's lease is long past
    stop = threading.Event()
    results: list[idempotently.ResumeResult] = []

    def on_result(result: idempotently.ResumeResult) -> None:
        results.append(result)
        stop.set()

    with session(journal, fake, capped(1), host_id="worker-1") as s:
        s.watch(stop, interval=1.0, on_result=on_result)
    assert ["needs_reconcile"] == [result.action for result in results]
    assert 2 == len(app.arrivals)
