"""Origin pauses: a 429 or 503 with Retry-After makes every caller wait, not only its operation.

The pause lives in the journal (SQLite or PostgreSQL), scoped to the origin and a
keyed digest of the credentials it was answered to, so every thread, process and
resume worker sharing the journal waits it out, or, when it is longer than it may
wait, raises RetryLaterError without journaling or sending anything.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from click.testing import CliRunner

import idempotently
from idempotently import profiles
from idempotently.cli import cli
from tests.scripted_server import Answer, ScriptedApp
from tests.support import FakeTime

URL = "https://api.example.test/v1/charges"
ORIGIN = "https://api.example.test:443"
POLICY = idempotently.RetryPolicy(max_attempts=1, budget=None)


def server(*answers: httpx.Response) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    sent: list[httpx.Request] = []
    queue = list(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return queue.pop(0) if queue else httpx.Response(201)

    return httpx.MockTransport(handler), sent


def limited(seconds: str) -> httpx.Response:
    return httpx.Response(429, headers={"Retry-After": seconds})


def session(
    journal: Path | str, fake_time: FakeTime, transport: httpx.MockTransport, **options: Any
) -> idempotently.Session:
    options.setdefault("policy", POLICY)
    options.setdefault("headers", {"Authorization": "Bearer tenant-a"})
    return idempotently.Session(
        journal, transport=transport, clock=fake_time.clock, sleep=fake_time.sleep, **options
    )


def test_a_429_with_retry_after_makes_the_next_operation_wait(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """Another operation to the same origin waits the pause out before its first send."""
    transport, sent = server(limited("5"))
    with session(tmp_path / "j.db", fake_time, transport) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="first")
        [pause] = s.journal.origin_pauses(now=fake_time.now)
        assert (ORIGIN, fake_time.now + 5, "429 with Retry-After 5s") == (
            pause.origin,
            pause.until,
            pause.reason,
        )
        assert 201 == s.post(URL, json={}, operation_id="second").status_code
    assert 5.0 == sum(fake_time.sleeps)
    assert 2 == len(sent)


def test_a_pause_beyond_max_retry_after_raises_before_journaling(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A pause longer than the call may wait: RetryLaterError with the pause's end, the
    new operation not journaled and nothing sent."""
    transport, sent = server(limited("600"))
    with session(tmp_path / "j.db", fake_time, transport) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="first")
        with pytest.raises(idempotently.RetryLaterError) as raised:
            s.post(URL, json={}, operation_id="second")
        assert ["first"] == [operation.operation_id for operation in s.journal.operations()]
    assert 1 == len(sent)
    assert fake_time.now + 600 == raised.value.not_before
    assert "second" == raised.value.operation_id
    assert f"idempotently unpause {ORIGIN}" in str(raised.value)


def test_a_pause_past_the_deadline_raises_too(tmp_path: Path, fake_time: FakeTime) -> None:
    """A pause within max_retry_after but past the call's deadline is not waited out."""
    transport, sent = server(limited("20"))
    with session(tmp_path / "j.db", fake_time, transport) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="first")
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, policy=idempotently.RetryPolicy(deadline=10.0))
    assert ([], 1) == (fake_time.sleeps, len(sent))


def test_one_tenants_pause_does_not_pause_another(tmp_path: Path, fake_time: FakeTime) -> None:
    """The pause is scoped to the credentials it was answered to."""
    transport, sent = server(limited("600"))
    with session(tmp_path / "j.db", fake_time, transport) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={})
        other = s.post(URL, json={}, headers={"Authorization": "Bearer tenant-b"})
    assert 201 == other.status_code
    assert 2 == len(sent)


def test_the_journal_keeps_a_digest_never_the_credentials(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """The pause row names the credentials by a digest: the token is nowhere in the file."""
    transport, _ = server(limited("600"))
    with (
        session(tmp_path / "j.db", fake_time, transport) as s,
        pytest.raises(idempotently.RetryLaterError),
    ):
        s.post(URL, json={})
    with session(tmp_path / "j.db", fake_time, transport) as s:
        [pause] = s.journal.origin_pauses(now=fake_time.now)
    assert 32 == len(pause.credentials)
    assert b"tenant-a" not in (tmp_path / "j.db").read_bytes()


def test_pause_origin_false_neither_pauses_nor_waits(tmp_path: Path, fake_time: FakeTime) -> None:
    """ServerProfile(pause_origin=False), for APIs that limit per resource."""
    profile = attrs.evolve(profiles.GENERIC, name="per-resource", pause_origin=False)
    transport, sent = server(limited("600"))
    with session(tmp_path / "j.db", fake_time, transport, profile=profile) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={})
        assert [] == s.journal.origin_pauses(now=fake_time.now)
        assert 201 == s.post(URL, json={}).status_code
    assert 2 == len(sent)


def test_a_resume_leaves_a_paused_origins_operations_unsent(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """Resume does not send to a paused origin: its operations stay pending with their
    keys, reported still_pending (so a watch worker parks them)."""
    transport, sent = server(httpx.Response(503), limited("600"))
    with session(tmp_path / "j.db", fake_time, transport) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={}, operation_id="pending")
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="limited")
    fake_time.now += 1
    with session(tmp_path / "j.db", fake_time, transport) as s:
        results = s.resume()
    assert 2 == len(sent)
    assert ["still_pending", "waiting"] == [result.action for result in results]
    # The operation the 429 answered waits for its own not_before; the other for the pause.
    assert f"{ORIGIN} is paused until" in results[0].detail


@pytest.mark.anyio
async def test_an_async_session_waits_out_a_pause(tmp_path: Path, fake_time: FakeTime) -> None:
    """AsyncSession (asyncio and trio) honours the same journaled pause."""
    transport, sent = server(limited("3"))
    async with idempotently.AsyncSession(
        tmp_path / "j.db",
        transport=transport,
        policy=POLICY,
        headers={"Authorization": "Bearer tenant-a"},
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
    ) as s:
        with pytest.raises(idempotently.RetryLaterError):
            await s.post(URL, json={})
        assert 201 == (await s.post(URL, json={})).status_code
    assert 3.0 == sum(fake_time.sleeps)
    assert 2 == len(sent)


def test_stats_lists_paused_origins_and_unpause_lifts_them(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """`stats` shows the paused origin (text and JSON); `unpause` lifts it, says what it
    lifted, and a call then sends at once."""
    import time

    fake_time.now = time.time()
    transport, sent = server(limited("3600"))
    path = tmp_path / "j.db"
    with session(path, fake_time, transport) as s, pytest.raises(idempotently.RetryLaterError):
        s.post(URL, json={})
    runner = CliRunner()
    text = runner.invoke(cli, ["--journal", str(path), "stats"])
    assert 0 == text.exit_code, text.output
    assert re.search(r"^paused origins\t1$", text.output, re.MULTILINE)  # piped: a record
    assert ORIGIN in text.output and "429 with Retry-After 3600s" in text.output
    data = json.loads(runner.invoke(cli, ["--journal", str(path), "stats", "--json"]).output)
    assert [ORIGIN] == [pause["origin"] for pause in data["paused_origins"]]
    lifted = runner.invoke(
        cli, ["--journal", str(path), "unpause", "https://api.example.test", "--actor", "ops"]
    )
    assert 0 == lifted.exit_code, lifted.output
    assert f"unpaused {ORIGIN}" in lifted.output
    again = runner.invoke(cli, ["--journal", str(path), "unpause", ORIGIN])
    assert "was not paused" in again.output
    fake_time.now += 2  # past the engine's one-second view of the pauses
    with session(path, fake_time, transport) as s:
        assert 201 == s.post(URL, json={}).status_code
    assert 2 == len(sent)


def test_unpause_refuses_what_is_no_origin(tmp_path: Path, fake_time: FakeTime) -> None:
    """An ORIGIN that is not scheme://host is a usage error (exit 2)."""
    transport, _ = server()
    with session(tmp_path / "j.db", fake_time, transport) as s:
        s.post(URL, json={})
    result = CliRunner().invoke(cli, ["--journal", str(tmp_path / "j.db"), "unpause", "api"])
    assert 2 == result.exit_code
    assert "not an origin" in result.output


CHILD = textwrap.dedent(
    """
    import json, sys
    import idempotently
    journal, url = sys.argv[1], sys.argv[2]
    with idempotently.Session(journal, headers={"Authorization": "Bearer tenant-a"},
                              policy=idempotently.RetryPolicy(max_attempts=1)) as s:
        try:
            response = s.post(url, json={}, operation_id="child")
            print(json.dumps({"status": response.status_code}))
        except idempotently.RetryLaterError as error:
            print(json.dumps({"retry_later": error.not_before}))
    """
)


def run_child(journal: str, url: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, journal, url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "PYTHONPATH": "src"},
    )
    assert 0 == done.returncode, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_another_process_on_the_journal_honours_the_pause(
    journal_target: str, scripted: tuple[ScriptedApp, str], store: str
) -> None:
    """Two processes on one journal (SQLite or PostgreSQL), a real server on loopback:
    this one is answered 429 with Retry-After 600; the other sends nothing and journals
    nothing, until `idempotently unpause` lifts the pause."""
    app, url = scripted
    app.answer(Answer(status=429, headers=(("Retry-After", "600"),)))
    with (
        idempotently.Session(
            journal_target,
            headers={"Authorization": "Bearer tenant-a"},
            policy=idempotently.RetryPolicy(max_attempts=1),
        ) as s,
        pytest.raises(idempotently.RetryLaterError),
    ):
        s.post(f"{url}/charges", json={}, operation_id="parent")
    assert 1 == len(app.arrivals)
    assert "retry_later" in run_child(journal_target, f"{url}/charges")
    assert 1 == len(app.arrivals)
    with idempotently.Journal(journal_target) as journal:
        assert ["parent"] == [operation.operation_id for operation in journal.operations()]
    result = CliRunner().invoke(cli, ["--journal", journal_target, "unpause", url])
    assert 0 == result.exit_code, result.output
    assert {"status": 201} == run_child(journal_target, f"{url}/charges")
    assert 2 == len(app.arrivals)


def test_a_watch_worker_sends_nothing_to_a_paused_origin_and_parks(tmp_path: Path) -> None:
    """A `resume --watch` worker meeting a paused origin sends nothing to it: the
    operations are parked (their lease held for the interval), not claimed in a loop."""
    import threading

    fake = FakeTime()
    transport, sent = server(httpx.Response(503), httpx.Response(503), limited("3600"))
    path = tmp_path / "j.db"
    with session(path, fake, transport) as s:
        for operation_id in ("a", "b"):
            with pytest.raises(idempotently.OperationPendingError):
                s.post(URL, json={"n": operation_id}, operation_id=operation_id)
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="limited")
    assert 3 == len(sent)
    fake.now += 1
    stop = threading.Event()
    batches: list[idempotently.WatchBatch] = []

    def on_batch(batch: idempotently.WatchBatch) -> None:
        batches.append(batch)
        stop.set()

    with session(path, fake, transport, host_id="worker-1") as worker:
        worker.watch(
            stop,
            interval=10.0,
            concurrency=1,
            on_result=None,
            on_batch=on_batch,
        )
    assert 3 == len(sent)  # nothing more was sent
    [batch] = batches
    assert {("a", "still_pending"), ("b", "still_pending")} == {
        (result.operation_id, result.action) for result in batch.results
    }


# -- reads through a Transport honour the same pauses ---------------------------------------


def transport_client(
    journal: str, fake_time: FakeTime, transport: httpx.MockTransport, **options: Any
) -> httpx.Client:
    options.setdefault("policy", POLICY)
    wrapped = idempotently.Transport(
        journal, transport=transport, clock=fake_time.clock, sleep=fake_time.sleep, **options
    )
    return httpx.Client(transport=wrapped, headers={"Authorization": "Bearer tenant-a"})


def test_a_read_waits_out_the_pause_a_write_was_answered(
    journal_target: str, fake_time: FakeTime
) -> None:
    """A POST answered 429 with Retry-After 5 pauses the origin: a GET through the same
    Transport (SQLite or PostgreSQL journal) waits the 5 s out before it is sent."""
    transport, sent = server(limited("5"), httpx.Response(200))
    with transport_client(journal_target, fake_time, transport) as c:
        with pytest.raises(idempotently.RetryLaterError):
            c.post(URL, json={})
        assert 200 == c.get(URL).status_code
    assert (5.0, 2) == (sum(fake_time.sleeps), len(sent))


def test_a_read_is_not_sent_into_a_pause_longer_than_it_may_wait(
    journal_target: str, fake_time: FakeTime
) -> None:
    """A pause beyond max_retry_after: the GET raises RetryLaterError with the pause's
    end, sending nothing, as a write would."""
    transport, sent = server(limited("600"))
    with transport_client(journal_target, fake_time, transport) as c:
        with pytest.raises(idempotently.RetryLaterError):
            c.post(URL, json={})
        with pytest.raises(idempotently.RetryLaterError) as raised:
            c.get(URL)
    assert 1 == len(sent)
    assert (fake_time.now + 600, None) == (raised.value.not_before, raised.value.operation_id)
    assert f"idempotently unpause {ORIGIN}" in str(raised.value)


def test_a_reads_429_pauses_the_origin_for_writes(journal_target: str, fake_time: FakeTime) -> None:
    """A GET answered 429 with Retry-After 600 comes back as it came, and journals the
    origin's pause: a POST after it raises RetryLaterError, journaling nothing."""
    transport, sent = server(limited("600"))
    with transport_client(journal_target, fake_time, transport) as c:
        assert 429 == c.get(URL).status_code
        with pytest.raises(idempotently.RetryLaterError):
            c.post(URL, json={}, headers={"Idempotency-Operation-Id": "after"})
        journal = c._transport.journal  # type: ignore[attr-defined]
        [pause] = journal.origin_pauses(now=fake_time.now)
        assert (ORIGIN, []) == (pause.origin, journal.operations())
    assert 1 == len(sent)


def test_a_read_under_other_credentials_is_not_paused(tmp_path: Path, fake_time: FakeTime) -> None:
    """The pause of one tenant does not hold another tenant's GET."""
    transport, sent = server(limited("600"), httpx.Response(200))
    with transport_client(str(tmp_path / "j.db"), fake_time, transport) as c:
        with pytest.raises(idempotently.RetryLaterError):
            c.post(URL, json={})
        assert 200 == c.get(URL, headers={"Authorization": "Bearer tenant-b"}).status_code
    assert 2 == len(sent)


@pytest.mark.anyio
async def test_an_async_transports_read_waits_out_a_pause(
    journal_target: str, fake_time: FakeTime
) -> None:
    """AsyncTransport (asyncio and trio, SQLite and PostgreSQL): the GET waits out the
    journaled pause."""
    transport, sent = server(limited("3"), httpx.Response(200))
    wrapped = idempotently.AsyncTransport(
        journal_target,
        transport=transport,
        policy=POLICY,
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
    )
    async with httpx.AsyncClient(
        transport=wrapped, headers={"Authorization": "Bearer tenant-a"}
    ) as c:
        with pytest.raises(idempotently.RetryLaterError):
            await c.post(URL, json={})
        assert 200 == (await c.get(URL)).status_code
    assert (3.0, 2) == (sum(fake_time.sleeps), len(sent))
