"""Rate-limit headers pause the origin (DESIGN §3.10), end to end: a real uvicorn server
on 127.0.0.1, a real journal (SQLite, PostgreSQL where the store matters), sync, asyncio
and trio, threads and processes.

A 429 or 503 whose wait comes from a reset header waits, and pauses the origin as
Retry-After does; an answer saying the request quota is spent (``Remaining: 0``) pauses
the origin before the next send, so the fleet does not spend a request to learn it. A
wait so derived that is longer than ``max_retry_after`` stops the call and pauses nothing.
What is asserted is what the server's log and the journal show, never a timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from typing import Any

import attrs
import pytest
from click.testing import CliRunner

import idempotently
from idempotently import profiles
from idempotently.cli import cli
from tests.scripted_server import Answer, ScriptedApp
from tests.support import FakeTime

TOKEN = {"Authorization": "Bearer tenant-a"}
POLICY = idempotently.RetryPolicy(max_attempts=3, budget=None)
LIMITS = attrs.evolve(
    profiles.GENERIC, name="limits", rate_limit_headers=("retry-after", "x-ratelimit")
)
OPENAI_LIKE = attrs.evolve(
    profiles.GENERIC, name="openai-like", rate_limit_headers=("retry-after", "openai")
)


def host(journal: str, clock: FakeTime, **options: Any) -> idempotently.Session:
    options.setdefault("policy", POLICY)
    options.setdefault("profile", LIMITS)
    return idempotently.Session(
        journal, headers=TOKEN, clock=clock.clock, sleep=clock.sleep, **options
    )


def spent(reset: str) -> Answer:
    """A 201 that says no request is left until ``reset``."""
    return Answer(headers=(("X-RateLimit-Remaining", "0"), ("X-RateLimit-Reset", reset)))


def first_send(journal: idempotently.Journal, operation_id: str) -> float:
    operation = journal.operation(operation_id)
    assert operation is not None
    return operation.attempts[0].started_at


@pytest.mark.parametrize("kind", ["epoch", "delta"])
def test_a_429_with_only_x_ratelimit_reset_waits_and_pauses_the_origin(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime, kind: str
) -> None:
    """``429`` with ``X-RateLimit-Reset`` (epoch seconds or a delta) and no Retry-After:
    the call waits until the reset, then sends again; the origin's pause is journaled
    with the reset's length."""
    app, url = scripted
    reset = str(int(fake_time.now) + 8) if kind == "epoch" else "8"
    app.answer(Answer(status=429, headers=(("X-RateLimit-Reset", reset),)))
    with host(journal_target, fake_time) as s:
        assert 201 == s.post(f"{url}/charges", json={}, operation_id="a").status_code
        [pause] = s.journal.origin_pauses(now=0.0)
    assert (2, 8.0) == (len(app.arrivals), sum(fake_time.sleeps))
    assert (8.0, "429 with X-RateLimit-Reset 8s: request quota spent") == (
        pause.until - pause.set_at,
        pause.reason,
    )


def test_a_503_with_only_a_reset_waits_too(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """A 503 is read like a 429: its reset is the wait."""
    app, url = scripted
    app.answer(Answer(status=503, headers=(("X-RateLimit-Reset", "4"),)))
    with host(journal_target, fake_time) as s:
        assert 201 == s.post(f"{url}/charges", json={}).status_code
    assert (2, 4.0) == (len(app.arrivals), sum(fake_time.sleeps))


def test_a_retry_is_not_sent_inside_the_pause_its_answer_set(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """A 502 saying no request is left for 6 s: the retry waits the reset out (journaled
    at or after the pause's end), not a short backoff into the pause."""
    app, url = scripted
    app.answer(Answer(status=502, headers=spent("6").headers))
    with host(journal_target, fake_time) as s:
        assert 201 == s.post(f"{url}/charges", json={}, operation_id="a").status_code
        [pause] = s.journal.origin_pauses(now=0.0)
        operation = s.journal.operation("a")
    assert operation is not None
    assert [502, 201] == [attempt.status_code for attempt in operation.attempts]
    assert operation.attempts[1].started_at >= pause.until
    assert (2, 6.0) == (len(app.arrivals), pause.until - pause.set_at)


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_spent_quota_makes_another_threads_call_wait_before_sending(
    journal_target: str, scripted: tuple[ScriptedApp, str], store: str
) -> None:
    """A 201 with ``X-RateLimit-Remaining: 0`` pauses the origin: another Session on the
    journal, in another thread, sends nothing until the reset (its first send is
    journaled at or after the pause's end), and the server saw no request inside it."""
    app, url = scripted
    clock = FakeTime()
    app.answer(spent("20"))
    with host(journal_target, clock) as s:
        assert 201 == s.post(f"{url}/charges", json={}, operation_id="first").status_code
    assert 1 == len(app.arrivals)
    results: list[int] = []

    def second() -> None:
        with host(journal_target, clock) as other:
            results.append(other.post(f"{url}/charges", json={}, operation_id="second").status_code)

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(timeout=120)
    assert [201] == results
    with idempotently.Journal(journal_target) as journal:
        [pause] = journal.origin_pauses(now=0.0)
        assert first_send(journal, "second") >= pause.until
        assert first_send(journal, "first") <= pause.set_at
    assert (2, 20.0) == (len(app.arrivals), pause.until - pause.set_at)


@pytest.mark.anyio
async def test_an_async_session_waits_out_a_spent_quota(
    tmp_path: Any, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """AsyncSession (asyncio and trio): a 201 saying the quota is spent for 6 s, then the
    next call waits 6 s before sending; a 429 with only a reset waits and sends again."""
    app, url = scripted
    app.answer(spent("6"), Answer(status=429, headers=(("X-RateLimit-Reset", "3"),)))
    async with idempotently.AsyncSession(
        tmp_path / "j.db",
        headers=TOKEN,
        policy=POLICY,
        profile=LIMITS,
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
    ) as s:
        assert 201 == (await s.post(f"{url}/charges", json={}, operation_id="a")).status_code
        assert 1 == len(app.arrivals)
        assert 201 == (await s.post(f"{url}/charges", json={}, operation_id="b")).status_code
        first = s.journal.operation("b")
    assert first is not None
    assert (3, 9.0) == (len(app.arrivals), sum(fake_time.sleeps))
    assert [429, 201] == [attempt.status_code for attempt in first.attempts]


def test_a_token_counter_at_zero_does_not_pause(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """``x-ratelimit-remaining-tokens: 0`` (OpenAI's token counter) pauses nothing: the
    next call sends at once; a request counter at 0 does pause."""
    app, url = scripted
    tokens = Answer(
        headers=(("x-ratelimit-remaining-tokens", "0"), ("x-ratelimit-reset-tokens", "6m0s"))
    )
    requests = Answer(
        headers=(("x-ratelimit-remaining-requests", "0"), ("x-ratelimit-reset-requests", "1.5s"))
    )
    app.answer(tokens, Answer(), requests, Answer())
    with host(journal_target, fake_time, profile=OPENAI_LIKE) as s:
        for name in ("a", "b"):
            s.post(f"{url}/charges", json={}, operation_id=name)
        assert ([], []) == (s.journal.origin_pauses(now=0.0), fake_time.sleeps)
        for name in ("c", "d"):
            s.post(f"{url}/charges", json={}, operation_id=name)
    assert (4, 1.5) == (len(app.arrivals), sum(fake_time.sleeps))


def test_a_long_reset_raises_retry_later_and_journals_no_pause(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """A 429 whose reset (600 s) is beyond max_retry_after (30 s): RetryLaterError for
    this call, the operation pending with its not_before, and no origin pause: the next
    operation is sent."""
    app, url = scripted
    app.answer(Answer(status=429, headers=(("X-RateLimit-Reset", "600"),)))
    with host(journal_target, fake_time) as s:
        with pytest.raises(idempotently.RetryLaterError) as raised:
            s.post(f"{url}/charges", json={}, operation_id="long")
        assert [] == s.journal.origin_pauses(now=0.0)
        assert 201 == s.post(f"{url}/charges", json={}, operation_id="next").status_code
        operation = s.journal.operation("long")
    assert operation is not None
    assert ("pending", fake_time.now + 600) == (operation.status, raised.value.not_before)
    assert (2, []) == (len(app.arrivals), fake_time.sleeps)


def test_a_long_reset_on_a_2xx_pauses_nothing(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """``Remaining: 0`` with a reset beyond max_retry_after pauses no origin."""
    app, url = scripted
    app.answer(spent("3600"))
    with host(journal_target, fake_time) as s:
        s.post(f"{url}/charges", json={})
        s.post(f"{url}/charges", json={})
        assert [] == s.journal.origin_pauses(now=0.0)
    assert (2, []) == (len(app.arrivals), fake_time.sleeps)


def test_pause_origin_false_reads_the_wait_but_pauses_nothing(
    tmp_path: Any, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """Under ``pause_origin=False`` a spent quota pauses nothing; a 429's reset still
    paces that call's own retry."""
    app, url = scripted
    profile = attrs.evolve(LIMITS, pause_origin=False)
    app.answer(spent("20"), Answer(status=429, headers=(("X-RateLimit-Reset", "2"),)))
    with host(str(tmp_path / "j.db"), fake_time, profile=profile) as s:
        s.post(f"{url}/charges", json={})
        s.post(f"{url}/charges", json={})
        assert [] == s.journal.origin_pauses(now=0.0)
    assert (3, [2.0]) == (len(app.arrivals), fake_time.sleeps)


def test_the_generic_profile_ignores_rate_limit_headers(
    tmp_path: Any, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """Retry-After only by default: a spent quota on a 201 pauses nothing."""
    app, url = scripted
    app.answer(spent("20"))
    with host(str(tmp_path / "j.db"), fake_time, profile=profiles.GENERIC) as s:
        s.post(f"{url}/charges", json={})
        s.post(f"{url}/charges", json={})
        assert [] == s.journal.origin_pauses(now=0.0)
    assert (2, []) == (len(app.arrivals), fake_time.sleeps)


def test_a_resume_reads_the_headers_its_operations_profile_trusts(
    tmp_path: Any, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """The profile is journaled with the operation: a resume under the generic Session
    profile reads a 429's reset with the stored one, and pauses the origin."""
    app, url = scripted
    path = str(tmp_path / "j.db")
    app.answer(Answer(status=500))
    with (
        host(path, fake_time, policy=idempotently.RetryPolicy(max_attempts=1, budget=None)) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(f"{url}/charges", json={}, operation_id="later")
    app.answer(Answer(status=429, headers=(("X-RateLimit-Reset", "5"),)))
    with host(path, fake_time, profile=profiles.GENERIC) as s:
        [result] = s.resume()
        [pause] = s.journal.origin_pauses(now=0.0)
    assert ("succeeded", 3) == (result.action, len(app.arrivals))
    assert (5.0, 5.0) == (pause.until - pause.set_at, sum(fake_time.sleeps))


def test_a_read_through_a_transport_pauses_the_writes(
    tmp_path: Any, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """A GET answered 200 with the quota spent pauses the origin for the next write."""
    import httpx

    app, url = scripted
    app.answer(Answer(status=200, headers=spent("7").headers))
    transport = idempotently.Transport(
        str(tmp_path / "j.db"),
        policy=POLICY,
        profile=LIMITS,
        clock=fake_time.clock,
        sleep=fake_time.sleep,
    )
    with httpx.Client(transport=transport, headers=TOKEN) as client:
        assert 200 == client.get(f"{url}/charges").status_code
        assert 201 == client.post(f"{url}/charges", json={}).status_code
    assert (2, 7.0) == (len(app.arrivals), sum(fake_time.sleeps))


CHILD = textwrap.dedent(
    """
    import json, sys
    import attrs
    import idempotently
    from idempotently import profiles
    journal, url = sys.argv[1], sys.argv[2]
    profile = attrs.evolve(profiles.GENERIC, name="limits",
                           rate_limit_headers=("retry-after", "x-ratelimit"))
    policy = idempotently.RetryPolicy(max_attempts=1, max_retry_after=1)
    with idempotently.Session(journal, headers={"Authorization": "Bearer tenant-a"},
                              profile=profile, policy=policy) as s:
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
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": "src"},
    )
    assert 0 == done.returncode, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_another_process_sends_nothing_while_the_quota_is_spent(
    journal_target: str, scripted: tuple[ScriptedApp, str], store: str
) -> None:
    """Two processes on one journal (SQLite or PostgreSQL): this one is answered 201 with
    ``X-RateLimit-Remaining: 0`` and a reset 25 s ahead; the other, which may wait 1 s,
    sends and journals nothing (RetryLaterError) until `idempotently unpause` lifts it."""
    app, url = scripted
    app.answer(spent("25"))
    with idempotently.Session(journal_target, headers=TOKEN, policy=POLICY, profile=LIMITS) as s:
        assert 201 == s.post(f"{url}/charges", json={}, operation_id="parent").status_code
    assert "retry_later" in run_child(journal_target, f"{url}/charges")
    assert 1 == len(app.arrivals)
    with idempotently.Journal(journal_target) as journal:
        assert ["parent"] == [operation.operation_id for operation in journal.operations()]
    result = CliRunner().invoke(cli, ["--journal", journal_target, "unpause", url])
    assert 0 == result.exit_code, result.output
    assert {"status": 201} == run_child(journal_target, f"{url}/charges")
    assert 2 == len(app.arrivals)


def test_a_quota_pause_written_by_a_clock_ten_years_ahead_lasts_its_length(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """A host whose clock is ten years fast is answered 201 with the quota spent for 5 s:
    a reader ten years behind waits 5 s (the pause's length), not ten years, then sends."""
    app, url = scripted
    fast = FakeTime(now=fake_time.now + 10 * 365 * 86400.0)
    app.answer(spent("5"))
    with host(journal_target, fast) as writer:
        assert 201 == writer.post(f"{url}/charges", json={}, operation_id="fast").status_code
    with host(journal_target, fake_time) as reader:
        assert 201 == reader.post(f"{url}/charges", json={}, operation_id="slow").status_code
    assert (2, 5.0) == (len(app.arrivals), sum(fake_time.sleeps))
