"""An origin pause never outlasts its length for a reader whose clock is behind its
writer's, and a call sleeping on a pause wakes within a second of an unpause.

Two "hosts" share one journal (SQLite or PostgreSQL), each with its own injected
clock; the server is a real uvicorn app on 127.0.0.1.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import attrs
import pytest

import idempotently
from tests.scripted_server import Answer, ScriptedApp
from tests.support import FakeTime

TEN_YEARS = 10 * 365 * 86400.0
POLICY = idempotently.RetryPolicy(
    max_attempts=1, budget=None, max_retry_after=3600.0, deadline=7200.0
)
TOKEN = {"Authorization": "Bearer tenant-a"}


def limited(seconds: str) -> Answer:
    return Answer(status=429, headers=(("Retry-After", seconds),))


def host(journal: str, clock: FakeTime, **options: Any) -> idempotently.Session:
    options.setdefault("policy", POLICY)
    return idempotently.Session(
        journal, headers=TOKEN, clock=clock.clock, sleep=clock.sleep, **options
    )


def fast_host_pauses(journal: str, url: str, app: ScriptedApp, seconds: str) -> None:
    """A host whose clock is ten years fast is answered 429 with Retry-After ``seconds``."""
    fast = FakeTime(now=FakeTime().now + TEN_YEARS)
    app.answer(limited(seconds))
    with host(journal, fast) as writer, pytest.raises(idempotently.RetryLaterError):
        writer.post(f"{url}/v1/charges", json={}, operation_id="fast")


def test_a_pause_written_by_a_clock_ten_years_ahead_lasts_its_length(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """A reader whose clock is ten years behind the pause's writer waits its length (5 s),
    not ten years, then sends; the journal's pause is counted from the reader's now."""
    app, url = scripted
    fast_host_pauses(journal_target, url, app, "5")
    with host(journal_target, fake_time) as reader:
        assert 201 == reader.post(f"{url}/v1/charges", json={}, operation_id="r").status_code
        [pause] = reader.journal.origin_pauses(now=0.0)
    assert (5.0, 2) == (sum(fake_time.sleeps), len(app.arrivals))
    started = fake_time.now - 5.0
    assert (started, started + 5.0) == (pause.set_at, pause.until)


def test_a_second_reader_behind_the_first_still_waits_no_longer_than_the_length(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """Rebasing only ever shortens: a reader whose clock is a minute behind the one that
    counted the pause from its now waits at most the pause's length, never a minute more."""
    app, url = scripted
    fast_host_pauses(journal_target, url, app, "30")
    first_seen = fake_time.now
    with host(journal_target, fake_time) as first:
        [seen] = first.journal.origin_pauses(now=fake_time.now)
        first.journal.close()
    behind = FakeTime(now=fake_time.now - 60.0)
    with host(journal_target, fake_time) as reader:
        assert 201 == reader.post(f"{url}/v1/charges", json={}).status_code
    with host(journal_target, behind) as later:
        assert 201 == later.post(f"{url}/v1/charges", json={}).status_code
    assert TEN_YEARS + 30.0 == seen.until - first_seen  # as written: ten years away
    assert 30.0 == sum(fake_time.sleeps)
    assert 30.0 >= sum(behind.sleeps)
    assert 3 == len(app.arrivals)


def test_stats_shows_a_pause_written_by_a_clock_ahead(
    tmp_path: Any, scripted: tuple[ScriptedApp, str]
) -> None:
    """`stats` (text and JSON) says a pause was written by a clock ahead of this host's."""
    import json
    import time

    from click.testing import CliRunner

    from idempotently.cli import cli

    app, url = scripted
    journal = str(tmp_path / "j.db")
    fast = FakeTime(now=time.time() + TEN_YEARS)
    app.answer(limited("5"))
    with host(journal, fast) as writer, pytest.raises(idempotently.RetryLaterError):
        writer.post(f"{url}/v1/charges", json={})
    runner = CliRunner()
    text = runner.invoke(cli, ["--journal", journal, "stats"])
    data = json.loads(runner.invoke(cli, ["--journal", journal, "stats", "--json"]).output)
    assert 0 == text.exit_code, text.output
    said = " ".join(text.output.split())
    assert "written by a clock 3650d ahead of this host's" in said
    [pause] = data["paused_origins"]
    assert pause["clock_ahead"] > TEN_YEARS - 60
    assert 5.0 == pause["length"]


# -- unpause wakes a call sleeping on the pause -------------------------------------------


def unpausing(fake_time: FakeTime, lift: Any, after: int) -> Any:
    """An injected sleep that lifts the pause during its ``after``-th slice."""

    def sleep(seconds: float) -> None:
        fake_time.sleep(seconds)
        if len(fake_time.sleeps) == after:
            lift()

    return sleep


def lift_in_sql(journal: str) -> None:
    """Another process's `idempotently unpause`: the row gone from the journal file."""
    with sqlite3.connect(journal) as conn:
        conn.execute("DELETE FROM origin_pauses")
    conn.close()


def test_unpause_wakes_a_call_waiting_out_a_pause(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """A call waiting out a 600 s pause sends within a second of `Journal.unpause`."""
    app, url = scripted
    app.answer(limited("600"))
    with host(journal_target, fake_time) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(f"{url}/v1/charges", json={}, operation_id="first")
        with idempotently.Journal(journal_target) as operator:
            sleep = unpausing(fake_time, lambda: operator.unpause(url), after=3)
            with idempotently.Session(
                journal_target, headers=TOKEN, policy=POLICY, clock=fake_time.clock, sleep=sleep
            ) as waiting:
                response = waiting.post(f"{url}/v1/charges", json={}, operation_id="second")
        second = s.journal.operation("second")
        pauses = s.journal.origin_pauses(now=fake_time.now)
    assert (201, "succeeded", []) == (response.status_code, second and second.status, pauses)
    assert 2 == len(app.arrivals)
    assert 4.0 >= sum(fake_time.sleeps)


def test_a_pause_lifted_by_another_process_wakes_the_call(
    tmp_path: Any, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """The pause's row deleted behind the session's back (another process's unpause) is
    seen within a second: the journal is read again after every slice of the wait."""
    app, url = scripted
    journal = str(tmp_path / "j.db")
    app.answer(limited("600"))
    with host(journal, fake_time) as s, pytest.raises(idempotently.RetryLaterError):
        s.post(f"{url}/v1/charges", json={}, operation_id="first")
    sleep = unpausing(fake_time, lambda: lift_in_sql(journal), after=2)
    with idempotently.Session(
        journal, headers=TOKEN, policy=POLICY, clock=fake_time.clock, sleep=sleep
    ) as waiting:
        assert 201 == waiting.post(f"{url}/v1/charges", json={}).status_code
    assert 2 == len(app.arrivals)
    assert 3.0 >= sum(fake_time.sleeps)


def test_unpause_wakes_the_call_that_was_answered_the_pause(
    tmp_path: Any, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """The call whose 429 paused the origin, sleeping on its Retry-After before it
    retries, sends again within a second of the unpause, with the same key."""
    app, url = scripted
    journal = str(tmp_path / "j.db")
    app.answer(limited("600"))
    policy = attrs.evolve(POLICY, max_attempts=2)
    with idempotently.Journal(journal) as operator:
        sleep = unpausing(fake_time, lambda: operator.unpause(url), after=2)
        with idempotently.Session(
            journal, headers=TOKEN, policy=policy, clock=fake_time.clock, sleep=sleep
        ) as s:
            response = s.post(f"{url}/v1/charges", json={}, operation_id="charge")
            charge = s.journal.operation("charge")
    assert (201, "succeeded") == (response.status_code, charge and charge.status)
    assert [app.arrivals[0].key] * 2 == [arrival.key for arrival in app.arrivals]
    assert 3.0 >= sum(fake_time.sleeps)


@pytest.mark.anyio
async def test_unpause_wakes_an_async_call_waiting_out_a_pause(
    tmp_path: Any, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """AsyncSession (asyncio and trio): a call waiting out a pause sends within a second
    of the unpause."""
    app, url = scripted
    journal = str(tmp_path / "j.db")
    app.answer(limited("600"))
    with host(journal, fake_time) as s, pytest.raises(idempotently.RetryLaterError):
        s.post(f"{url}/v1/charges", json={}, operation_id="first")
    with idempotently.Journal(journal) as operator:
        lift = unpausing(fake_time, lambda: operator.unpause(url), after=3)

        async def sleep(seconds: float) -> None:
            lift(seconds)

        async with idempotently.AsyncSession(
            journal, headers=TOKEN, policy=POLICY, clock=fake_time.clock, sleep=sleep
        ) as waiting:
            response = await waiting.post(f"{url}/v1/charges", json={}, operation_id="second")
    with idempotently.Journal(journal) as reader:
        second = reader.operation("second")
    assert (201, "succeeded") == (response.status_code, second and second.status)
    assert 2 == len(app.arrivals)
    assert 4.0 >= sum(fake_time.sleeps)


# -- a not_before likewise ------------------------------------------------------------------

PER_RESOURCE = attrs.evolve(idempotently.profiles.GENERIC, pause_origin=False)


def test_a_not_before_written_by_a_clock_ahead_is_counted_from_the_readers_now(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """An operation told `Retry-After: 5` by a host ten years fast: a call with its id on
    a host whose clock is right waits 5 s from when it first sees it, then the resume
    sends it, with the same key; not ten years."""
    app, url = scripted
    fast = FakeTime(now=fake_time.now + TEN_YEARS)
    app.answer(limited("5"))
    with (
        host(journal_target, fast, profile=PER_RESOURCE) as writer,
        pytest.raises(idempotently.RetryLaterError),
    ):
        writer.post(f"{url}/v1/charges", json={}, operation_id="charge")
    with host(journal_target, fake_time, profile=PER_RESOURCE) as reader:
        with pytest.raises(idempotently.RetryLaterError) as raised:
            reader.post(f"{url}/v1/charges", json={}, operation_id="charge")
        fake_time.sleep(5.0)
        results = reader.resume()
    assert fake_time.now == raised.value.not_before
    assert [("charge", "succeeded")] == [(r.operation_id, r.action) for r in results]
    assert [app.arrivals[0].key] * 2 == [arrival.key for arrival in app.arrivals]


def test_a_watch_worker_claims_an_operation_a_clock_ahead_deferred_after_its_length(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """A watch worker's claim counts a not_before written by a clock ahead from its own
    now: nothing is due before the length has passed, and it is due then."""
    from idempotently._commands import ClaimDue

    app, url = scripted
    fast = FakeTime(now=fake_time.now + TEN_YEARS)
    app.answer(limited("5"))
    with (
        host(journal_target, fast, profile=PER_RESOURCE) as writer,
        pytest.raises(idempotently.RetryLaterError),
    ):
        writer.post(f"{url}/v1/charges", json={}, operation_id="charge")
    with idempotently.Journal(journal_target) as journal:
        now = fake_time.now
        early = journal._execute(ClaimDue("worker", now, now + 30, 10))
        due = journal._execute(ClaimDue("worker", now + 5, now + 35, 10))
    assert ([], ["charge"]) == (early, [operation.operation_id for operation in due])


def test_a_clock_that_sleeping_does_not_move_never_makes_the_wait_endless(
    tmp_path: Any, scripted: tuple[ScriptedApp, str]
) -> None:
    """An injected clock that stands still while the session sleeps (a test's frozen
    clock): the sliced waits on a pause still end after the pause's length in slices,
    for the call answered the 429 and for the next call to the paused origin."""
    app, url = scripted
    now, sleeps = 1_800_000_000.0, []
    app.answer(limited("3"))
    policy = attrs.evolve(POLICY, max_attempts=2, initial_backoff=0.0, max_backoff=0.0)
    with idempotently.Session(
        str(tmp_path / "j.db"), headers=TOKEN, policy=policy, clock=lambda: now, sleep=sleeps.append
    ) as s:
        assert 201 == s.post(f"{url}/v1/charges", json={}).status_code
        assert 201 == s.post(f"{url}/v1/charges", json={}).status_code
    assert (6.0, 3) == (sum(sleeps), len(app.arrivals))


# -- a poisoned pause row ------------------------------------------------------------------


def poison_pauses(journal: str, set_at: float, until: float) -> None:
    """Every pause row's times overwritten by hand (or by a damaged disk)."""
    if journal.startswith("postgresql"):
        import psycopg

        with psycopg.connect(journal, autocommit=True) as conn:
            conn.execute(
                "UPDATE idempotently.origin_pauses SET set_at = %s, until = %s", (set_at, until)
            )
        return
    with sqlite3.connect(journal) as conn:
        conn.execute("UPDATE origin_pauses SET set_at = ?, until = ?", (set_at, until))
    conn.close()


INF = float("inf")


@pytest.mark.parametrize(
    ("set_at", "until"), [(INF, INF), (INF, 4e9)], ids=["inf-inf", "inf-finite"]
)
def test_a_pause_row_of_infinite_times_is_refused_naming_unpause_and_stats_reports_it(
    journal_target: str,
    scripted: tuple[ScriptedApp, str],
    fake_time: FakeTime,
    set_at: float,
    until: float,
) -> None:
    """A pause whose write time is infinite (its length unknowable): a call to its origin
    sends nothing and says the origin is paused and how to lift the pause (before: the
    rebase wrote NaN, a "damaged operation" JournalCorruptError on SQLite, or the pause was
    dropped and the call sent); `stats` still reports it (before: an OverflowError
    traceback)."""
    from click.testing import CliRunner

    from idempotently.cli import cli

    app, url = scripted
    fast_host_pauses(journal_target, url, app, "5")
    poison_pauses(journal_target, set_at, until)
    with (
        host(journal_target, fake_time) as reader,
        pytest.raises(idempotently.RetryLaterError, match="unpause"),
    ):
        reader.post(f"{url}/v1/charges", json={}, operation_id="r")
    assert 1 == len(app.arrivals)
    stats = CliRunner().invoke(cli, ["--journal", journal_target, "stats"])
    assert (0, True) == (stats.exit_code, "paused origins\t1" in stats.output), stats.output


@pytest.mark.postgres
def test_a_reader_that_loses_the_rebase_race_sees_the_rebased_pause(
    postgres_url: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """Two readers behind the writer rebase one pause at once on PostgreSQL: the one
    whose clock is ahead of the other's finds it rebased already and is replied the
    pause as it now stands, its length from the first reader's now (before: the
    statement's snapshot, the pause still ten years away, so its call was refused
    with "paused until 2036")."""
    import threading
    import time

    import psycopg

    from idempotently._commands import RebasePause

    app, url = scripted
    fast_host_pauses(postgres_url, url, app, "30")
    with idempotently.Journal(postgres_url) as journal:
        [written] = journal.origin_pauses(now=0.0)
        first = fake_time.now  # the first reader's now: it rebases, holding the row
        with psycopg.connect(postgres_url) as holder:
            holder.execute(
                "UPDATE idempotently.origin_pauses SET set_at = %s, until = %s",
                (first, first + 30.0),
            )
            replied: list[Any] = []
            second = threading.Thread(
                target=lambda: replied.extend(
                    journal._store.commit(
                        [RebasePause(written.origin, written.credentials, first + 5.0)], True
                    )
                )
            )
            second.start()
            with psycopg.connect(postgres_url, autocommit=True) as watcher:
                while not watcher.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                ).fetchone():
                    time.sleep(0.01)
            holder.commit()
            second.join(timeout=60)
    [pause] = replied
    assert (first, first + 30.0) == (pause.set_at, pause.until)
