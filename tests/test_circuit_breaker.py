"""The circuit breaker: an origin's failures in a row pause it, journaled, for everyone.

`RetryPolicy(breaker=Breaker(...))` counts network errors and 5xx answers without
Retry-After per origin and credentials; at ``failures`` in a row within ``window`` it
opens a journaled origin pause (one mechanism with a server's Retry-After pause) that
every thread, process and resume sharing the journal waits out. When it ends one caller
takes the probe by compare-and-swap on the pause row; answered, the breaker closes;
failed, it opens again for twice as long, capped. Unit tests run on scripted transports
with an injected clock (no sleeps); end to end ones on a loopback server.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from click.testing import CliRunner

import idempotently
from idempotently import Breaker, OriginPause
from idempotently._budget import origin_of
from idempotently._commands import PauseOrigin
from idempotently._pauses import is_breaker, open_length, opened_reason, probe_claim
from idempotently.cli import cli
from tests.scripted_server import Answer, ScriptedApp
from tests.support import FakeTime

URL = "https://api.example.test/v1/charges"
ORIGIN = "https://api.example.test:443"
NOW = 1_800_000_000.0
BREAKER = Breaker(failures=3, window=30.0, min_open=5.0, max_open=40.0)
POLICY = idempotently.RetryPolicy(
    max_attempts=10, initial_backoff=0.01, max_backoff=0.01, budget=None, breaker=BREAKER
)


class Origin:
    """A scripted origin: answers ``status`` (or fails to connect) and notes when each
    request arrived on the fake clock."""

    def __init__(self, fake_time: FakeTime, status: int | None = 503) -> None:
        self.fake_time, self.status, self.arrived = fake_time, status, []  # type: list[float]
        self.arrived: list[float] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.arrived.append(self.fake_time.now)
        if self.status is None:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(self.status)


def session(
    where: Path | str, fake_time: FakeTime, origin: Origin, **options: Any
) -> idempotently.Session:
    """A Session on the journal in directory ``where`` (or at URL/path ``where``)."""
    options.setdefault("policy", POLICY)
    return idempotently.Session(
        where / "journal.db" if isinstance(where, Path) else where,
        transport=httpx.MockTransport(origin),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        **options,
    )


# -- the argument ------------------------------------------------------------------------

BAD_NUMBERS = [0, -1, -0.0, math.nan, math.inf, -math.inf, 10**400, True, "5", None]


@pytest.mark.parametrize("field", ["failures", "window", "min_open", "max_open"])
@pytest.mark.parametrize("value", BAD_NUMBERS, ids=lambda value: repr(value)[:12])
def test_a_breaker_refuses_every_bad_number_naming_it(field: str, value: Any) -> None:
    """0, negative, -0.0, NaN, ±inf, 10**400, a bool, no number: one line naming the field."""
    with pytest.raises((TypeError, ValueError)) as error:
        Breaker(**{field: value})
    assert f"Breaker {field}" in str(error.value)
    assert "\n" not in str(error.value)


def test_failures_must_be_a_whole_number() -> None:
    """2.5 failures in a row is no count."""
    with pytest.raises(TypeError, match="Breaker failures must be a whole number"):
        Breaker(failures=2.5)  # type: ignore[arg-type]


def test_min_open_may_not_exceed_max_open() -> None:
    """An open length that starts above its cap is refused."""
    with pytest.raises(ValueError, match=r"min_open \(60s\) must not exceed max_open \(30s\)"):
        Breaker(min_open=60, max_open=30)


def test_the_breaker_is_off_by_default_and_a_policy_takes_only_a_breaker() -> None:
    """RetryPolicy().breaker is None; anything but a Breaker is refused."""
    assert None is idempotently.RetryPolicy().breaker
    assert Breaker(5, 30.0, 5.0, 300.0) == Breaker()
    with pytest.raises(TypeError):
        idempotently.RetryPolicy(breaker={"failures": 5})  # type: ignore[arg-type]


# -- opening -----------------------------------------------------------------------------


@pytest.mark.parametrize("status", [503, 500, None], ids=["503", "500", "refused"])
def test_failures_in_a_row_open_it_and_the_next_retry_is_not_sent(
    tmp_path: Path, fake_time: FakeTime, status: int | None
) -> None:
    """Three 5xx without Retry-After (or refused connections) in a row: the breaker opens,
    the fourth attempt is not sent, the operation stays pending and RetryLaterError names
    the origin, the operation, its key and `unpause`."""
    origin = Origin(fake_time, status)
    with session(tmp_path, fake_time, origin) as s:
        with pytest.raises(idempotently.RetryLaterError) as error:
            s.post(URL, json={}, operation_id="op-1")
        assert 3 == len(origin.arrived)
        assert "op-1" == error.value.operation_id
        assert s.journal.operation("op-1").key == error.value.key
        assert "idempotently unpause https://api.example.test:443" in str(error.value)
        assert "pending" == s.journal.operation("op-1").status
        assert 3 == s.journal.operation("op-1").attempt_count
        [pause] = s.journal.origin_pauses(now=fake_time.now)
        assert (ORIGIN, 5.0) == (pause.origin, pause.until - pause.set_at)
        assert (pause.reason or "").startswith("circuit breaker open 5s: 3 failures in a row")


def test_an_answer_between_failures_resets_the_count(tmp_path: Path, fake_time: FakeTime) -> None:
    """Failures must come in a row: an answer between them starts the count again."""
    origin = Origin(fake_time, 503)
    with session(
        tmp_path,
        fake_time,
        origin,
        policy=POLICY.__class__(
            max_attempts=2, budget=None, breaker=BREAKER, initial_backoff=0.01, max_backoff=0.01
        ),
    ) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={}, operation_id="op-1")  # two failures
        origin.status = 201
        s.post(URL, json={}, operation_id="op-2")
        origin.status = 503
        with pytest.raises(idempotently.OperationPendingError) as error:
            s.post(URL, json={}, operation_id="op-3")  # two more: not three in a row
        assert not isinstance(error.value, idempotently.RetryLaterError)
        assert [] == s.journal.origin_pauses(now=fake_time.now)


def test_failures_further_apart_than_the_window_do_not_open_it(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """Three failures in a row spread over more than the window: still closed."""
    origin = Origin(fake_time, 503)
    one = POLICY.__class__(max_attempts=1, budget=None, breaker=BREAKER)
    with session(tmp_path, fake_time, origin, policy=one) as s:
        for n in range(3):
            with pytest.raises(idempotently.OperationPendingError):
                s.post(URL, json={}, operation_id=f"op-{n}")
            fake_time.now += 20
        assert [] == s.journal.origin_pauses(now=fake_time.now)


def test_a_503_with_retry_after_is_the_servers_pause_not_a_failure(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A 503 that says when to come back pauses the origin as it says; it does not count."""
    origin = Origin(fake_time, 201)
    answers = iter([httpx.Response(503, headers={"Retry-After": "1"})] * 4 + [httpx.Response(201)])

    def server(request: httpx.Request) -> httpx.Response:
        origin.arrived.append(fake_time.now)
        return next(answers)

    with idempotently.Session(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(server),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        policy=POLICY,
    ) as s:
        assert 201 == s.post(URL, json={}, operation_id="op-1").status_code
    assert 5 == len(origin.arrived)


def test_a_breaker_off_sends_every_retry(tmp_path: Path, fake_time: FakeTime) -> None:
    """breaker=None: ten 503s in a row are ten attempts, nothing paused."""
    origin = Origin(fake_time, 503)
    off = POLICY.__class__(max_attempts=10, budget=None, initial_backoff=0.01, max_backoff=0.01)
    with session(tmp_path, fake_time, origin, policy=off) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={}, operation_id="op-1")
        assert [] == s.journal.origin_pauses(now=fake_time.now)
    assert 10 == len(origin.arrived)


# -- while open, half-open, the probe ---------------------------------------------------


def test_while_open_nothing_is_sent_and_then_one_probe_closes_it(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A call made while the breaker is open waits it out without sending; when it ends
    the call is the probe, answered: the breaker closes (its row is gone)."""
    origin = Origin(fake_time, 503)
    with session(tmp_path, fake_time, origin) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="op-1")
        [pause] = s.journal.origin_pauses(now=fake_time.now)
        origin.status = 201
        assert 201 == s.post(URL, json={}, operation_id="op-2").status_code
        assert origin.arrived[-1] >= pause.until
        assert 4 == len(origin.arrived)
        assert [] == s.journal.origin_pauses(now=fake_time.now)


def test_a_failed_probe_reopens_it_doubled_up_to_max_open(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """Each failed probe opens it again for twice as long: 5, 10, 20, 40, 40 (max_open)."""
    origin = Origin(fake_time, 503)
    lengths = []
    with session(
        tmp_path,
        fake_time,
        origin,
        policy=POLICY.__class__(
            max_attempts=10,
            budget=None,
            breaker=BREAKER,
            initial_backoff=0.01,
            max_backoff=0.01,
            max_retry_after=60,
        ),
    ) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="op-1")
        for n in range(5):
            [pause] = s.journal.origin_pauses(now=fake_time.now)
            lengths.append(pause.until - pause.set_at)
            fake_time.now = pause.until
            with pytest.raises(idempotently.RetryLaterError) as error:
                s.post(URL, json={}, operation_id=f"probe-{n}")
            assert "its probe answered 503" in str(error.value)
        [pause] = s.journal.origin_pauses(now=fake_time.now)
        lengths.append(pause.until - pause.set_at)
    assert [5.0, 10.0, 20.0, 40.0, 40.0, 40.0] == lengths
    assert 3 + 5 == len(origin.arrived)


def test_the_open_length_never_exceeds_max_retry_after(tmp_path: Path, fake_time: FakeTime) -> None:
    """max_retry_after=8: the pause doubles 5 -> 8, not 10, so no queue waits past it."""
    origin = Origin(fake_time, 503)
    policy = POLICY.__class__(
        max_attempts=10,
        budget=None,
        breaker=BREAKER,
        initial_backoff=0.01,
        max_backoff=0.01,
        max_retry_after=8,
    )
    with session(tmp_path, fake_time, origin, policy=policy) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="op-1")
        [pause] = s.journal.origin_pauses(now=fake_time.now)
        fake_time.now = pause.until
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="probe")
        [pause] = s.journal.origin_pauses(now=fake_time.now)
    assert 8.0 == pause.until - pause.set_at


# -- resume ------------------------------------------------------------------------------


def test_a_resume_of_an_origin_that_is_down_stops_at_the_breaker(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """Resuming ten operations against a dead origin (a resume always runs with a breaker,
    Breaker() unless its policy has one): after five failures in a row the origin is
    paused and the rest stay pending unsent; once the server is back and the pause over,
    a resume sends them all."""
    origin = Origin(fake_time, 503)
    once = idempotently.RetryPolicy(max_attempts=1, budget=None)
    with session(tmp_path, fake_time, origin, policy=once) as s:
        for n in range(10):
            with pytest.raises(idempotently.OperationPendingError):
                s.post(URL, json={"n": n}, operation_id=f"op-{n}")
    origin.arrived.clear()
    with session(tmp_path, fake_time, origin, policy=once) as s:
        results = s.resume()
        [pause] = s.journal.origin_pauses(now=fake_time.now)
    assert 5 == len(origin.arrived)
    assert ["still_pending"] * 10 == [result.action for result in results]
    assert all(result.detail.startswith(f"not sent: {ORIGIN} is paused") for result in results[5:])
    assert "circuit breaker open 5s: 5 failures in a row" in results[9].detail
    origin.status = 201
    fake_time.now = pause.until
    with session(tmp_path, fake_time, origin, policy=once) as s:
        assert ["succeeded"] * 10 == [result.action for result in s.resume()]
        assert [] == s.journal.origin_pauses(now=fake_time.now)


# -- across callers: the probe is one, taken by compare-and-swap -------------------------


def write_breaker(journal: str, origin: str, *, set_at: float, length: float) -> OriginPause:
    """A breaker's row as an engine writes it when it opens (``length`` seconds at
    ``set_at``): the journal's state after failures in a row."""
    pause = OriginPause(origin, "", set_at + length, opened_reason(length, "test"), set_at)
    with idempotently.Journal(journal) as opened:
        opened._execute(PauseOrigin(origin, "", pause.until, pause.reason or "", set_at))
    return pause


CLAIM = textwrap.dedent(
    """
    import json, sys
    import idempotently
    from idempotently._pauses import probe_claim
    journal, now = sys.argv[1], float(sys.argv[2])
    with idempotently.Journal(journal) as opened:
        [row] = opened.origin_pauses(now=now)
        claim = probe_claim(row, now, 5.0)
        print(json.dumps(opened._execute(claim) == claim.new))
    """
)


def claimers(journal: str, now: float, count: int) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(
            [sys.executable, "-c", CLAIM, journal, repr(now)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(idempotently.__file__).parents[1])},
        )
        for _ in range(count)
    ]


@pytest.mark.slow
def test_exactly_one_process_takes_the_probe(journal_target: str) -> None:
    """Four processes on one journal (SQLite, PostgreSQL) race for the probe of an ended
    breaker: the compare-and-swap on its row gives it to exactly one."""
    now = time.time()
    write_breaker(journal_target, ORIGIN, set_at=now - 10, length=5.0)
    won = []
    for child in claimers(journal_target, now, 4):
        out, err = child.communicate(timeout=120)
        assert 0 == child.returncode, err
        won.append(json.loads(out))
    assert 1 == won.count(True)
    with idempotently.Journal(journal_target) as journal:
        [row] = journal.origin_pauses(now=now)
    assert (now + 5.0, True) == (
        row.until,
        "half-open 5s: one probe in flight" in (row.reason or ""),
    )


def test_exactly_one_thread_takes_the_probe(journal_target: str) -> None:
    """Eight threads, each with its own Journal (its own view of the pauses), race for the
    probe: exactly one compare-and-swap wins."""
    now = time.time()
    write_breaker(journal_target, ORIGIN, set_at=now - 10, length=5.0)
    barrier, won = threading.Barrier(8), []

    def claim() -> None:
        with idempotently.Journal(journal_target) as journal:
            [row] = journal.origin_pauses(now=now)
            swap = probe_claim(row, now, 5.0)
            barrier.wait(timeout=60)
            won.append(journal._execute(swap) == swap.new)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [True] + [False] * 7 == sorted(won, reverse=True)


class Spy(httpx.HTTPTransport):
    """A real socket transport that notes, as each request leaves, what the journal says
    of the origin's breaker at that moment."""

    def __init__(self, journal: str, seen: list[str]) -> None:
        super().__init__()
        self.journal, self.seen = journal, seen

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with idempotently.Journal(self.journal) as journal:
            rows = journal.origin_pauses(now=time.time())
        self.seen.append(rows[0].reason or "" if rows else "closed")
        return super().handle_request(request)


@pytest.mark.slow
def test_threads_send_one_probe_and_the_rest_after_it_closed(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """A loopback server; six threads, each its own Session, call an origin whose breaker
    has just ended: exactly one request leaves while the breaker is half-open (the probe,
    answered 201: it closes); every other leaves after it closed."""
    app, url = scripted
    origin = origin_of(httpx.URL(url))
    write_breaker(journal_target, origin, set_at=time.time() - 10, length=2.0)
    seen: list[str] = []
    barrier = threading.Barrier(6)
    statuses: list[int | str] = []

    def call(n: int) -> None:
        # A 30 s timeout: the probe's claim holds that long, however loaded the machine.
        with idempotently.Session(
            journal_target, transport=Spy(journal_target, seen), policy=POLICY, timeout=30
        ) as s:
            barrier.wait(timeout=60)
            try:
                response = s.post(f"{url}/charges", json={}, operation_id=f"op-{n}")
            except idempotently.IdempotentlyError as error:
                statuses.append(repr(error))
            else:
                statuses.append(response.status_code)

    threads = [threading.Thread(target=call, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [201] * 6 == statuses
    assert 6 == len(app.arrivals)
    assert 1 == sum("half-open" in reason for reason in seen)
    assert 5 == seen.count("closed")


CHILD = textwrap.dedent(
    """
    import json, sys
    import idempotently
    journal, url = sys.argv[1], sys.argv[2]
    policy = idempotently.RetryPolicy(
        max_attempts=1, max_retry_after=1, breaker=idempotently.Breaker(failures=3)
    )
    with idempotently.Session(journal, policy=policy) as s:
        try:
            print(json.dumps({"status": s.post(url, json={}, operation_id="child").status_code}))
        except idempotently.RetryLaterError as error:
            print(json.dumps({"retry_later": str(error)}))
    """
)


def run_child(journal: str, url: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, journal, url],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(idempotently.__file__).parents[1])},
    )
    assert 0 == done.returncode, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
@pytest.mark.parametrize("status", [503, None], ids=["503", "refused"])
def test_another_process_sends_nothing_while_open_until_unpause_closes_it(
    journal_target: str, scripted: tuple[ScriptedApp, str], status: int | None
) -> None:
    """A loopback server answering 503 without Retry-After (or a port that refuses
    connections): three failures open the breaker; a second process on the journal
    (SQLite, PostgreSQL) sends nothing while it is open; `idempotently unpause` closes
    it, and the second process is answered."""
    app, url = scripted
    if status is None:
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    else:
        app.answer(*[Answer(status=503)] * 3)
        dead = url
    # Open for 25 s: longer than a child process may take to start on a loaded machine.
    policy = attrs.evolve(POLICY, breaker=attrs.evolve(BREAKER, min_open=25.0))
    with (
        idempotently.Session(journal_target, policy=policy) as s,
        pytest.raises(idempotently.RetryLaterError) as error,
    ):
        s.post(f"{dead}/charges", json={}, operation_id="parent")
    assert f"idempotently unpause {origin_of(httpx.URL(dead))}" in str(error.value)
    assert (3 if status else 0) == len(app.arrivals)
    refused = run_child(journal_target, f"{dead}/charges")
    assert "circuit breaker open 25s" in refused["retry_later"]
    assert (3 if status else 0) == len(app.arrivals)
    result = CliRunner().invoke(cli, ["--journal", journal_target, "unpause", dead])
    assert 0 == result.exit_code, result.output
    if status is not None:
        assert {"status": 201} == run_child(journal_target, f"{url}/charges")
        assert 4 == len(app.arrivals)


# -- a probe holder that died, a clock behind the writer -------------------------------


def test_a_crashed_probe_holders_claim_expires(journal_target: str, fake_time: FakeTime) -> None:
    """A caller took the probe and died before sending: its claim holds the others off
    only for its length; then the next caller takes the probe, is answered and closes it."""
    write_breaker(journal_target, ORIGIN, set_at=fake_time.now - 10, length=5.0)
    with idempotently.Journal(journal_target) as journal:
        [row] = journal.origin_pauses(now=fake_time.now)
        dead = probe_claim(row, fake_time.now, 7.0)
        assert dead.new == journal._execute(dead)
    origin = Origin(fake_time, 201)
    with session(journal_target, fake_time, origin) as s:
        assert 201 == s.post(URL, json={}, operation_id="op-1").status_code
        assert [] == s.journal.origin_pauses(now=fake_time.now)
    assert dead.new is not None
    assert [dead.new.until] == [at for at in origin.arrived if at >= dead.new.until]
    assert 1 == len(origin.arrived)


def test_a_breaker_written_by_a_clock_ahead_lasts_no_longer_than_its_length(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A breaker opened for 5 s by a host ten years ahead: this reader waits 5 s (counted
    from its own now), not ten years, then probes."""
    journal = str(tmp_path / "journal.db")
    write_breaker(journal, ORIGIN, set_at=fake_time.now + 10 * 365 * 86400, length=5.0)
    origin = Origin(fake_time, 201)
    started = fake_time.now
    with session(tmp_path, fake_time, origin) as s:
        assert 201 == s.post(URL, json={}, operation_id="op-1").status_code
    assert 1 == len(origin.arrived)
    assert started + 5.0 <= origin.arrived[0] <= started + 5.0 + 1.0


# -- what operators see ------------------------------------------------------------------


def test_stats_shows_the_open_breaker_and_unpause_closes_it(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """`stats` (text, --json, Prometheus) counts the open breaker and lists its pause;
    `idempotently unpause ORIGIN` closes it (audited as any unpause) and a call is sent."""
    fake_time.now = time.time()
    origin = Origin(fake_time, 503)
    path = str(tmp_path / "journal.db")
    with session(tmp_path, fake_time, origin) as s, pytest.raises(idempotently.RetryLaterError):
        s.post(URL, json={}, operation_id="op-1")
    runner = CliRunner()
    text = runner.invoke(cli, ["--journal", path, "stats"]).output
    assert "open breakers\t1" in text
    assert f"{ORIGIN}\tuntil" in text and "circuit breaker open 5s: 3 failures in a row" in text
    data = json.loads(runner.invoke(cli, ["--journal", path, "stats", "--json"]).output)
    assert (1, [True]) == (
        data["open_breakers"],
        [pause["breaker"] for pause in data["paused_origins"]],
    )
    metrics = runner.invoke(cli, ["--journal", path, "stats", "--format", "prometheus"]).output
    assert f'idempotently_open_breakers{{journal="{path}",origin="{ORIGIN}"}} 1' in metrics
    lifted = runner.invoke(cli, ["--journal", path, "unpause", ORIGIN, "--actor", "ops"])
    assert (0, True) == (lifted.exit_code, f"unpaused {ORIGIN}" in lifted.output)
    assert "open breakers\t0" in runner.invoke(cli, ["--journal", path, "stats"]).output
    origin.status = 201
    fake_time.now += 2  # past the engine's one-second view of the pauses
    with session(tmp_path, fake_time, origin) as s:
        assert 201 == s.post(URL, json={}, operation_id="op-2").status_code
    assert 4 == len(origin.arrived)


# -- asyncio and trio, a per-call breaker, hooks ------------------------------------------


@pytest.mark.anyio
async def test_an_async_session_opens_waits_and_probes(tmp_path: Path, fake_time: FakeTime) -> None:
    """AsyncSession (asyncio and trio): three failures open it, the retry is not sent; the
    next call waits it out without sending, probes, is answered, and it closes."""
    origin = Origin(fake_time, 503)
    async with idempotently.AsyncSession(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(origin),
        policy=POLICY,
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
    ) as s:
        with pytest.raises(idempotently.RetryLaterError):
            await s.post(URL, json={}, operation_id="op-1")
        [pause] = s.journal.origin_pauses(now=fake_time.now)
        origin.status = 201
        assert 201 == (await s.post(URL, json={}, operation_id="op-2")).status_code
        assert [] == s.journal.origin_pauses(now=fake_time.now)
    assert 4 == len(origin.arrived)
    assert origin.arrived[-1] >= pause.until


def test_a_per_call_breaker_is_journaled_and_a_resume_applies_it(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """post(..., policy=RetryPolicy(breaker=Breaker(failures=2))) journals the breaker
    with the operation: a resume of three such operations against a dead origin sends
    two (its breaker opens there), not the five of a resume's default Breaker()."""
    origin = Origin(fake_time, 503)
    own = idempotently.RetryPolicy(max_attempts=1, budget=None, breaker=Breaker(failures=2))
    with session(tmp_path, fake_time, origin, policy=idempotently.RetryPolicy(budget=None)) as s:
        for n in range(3):
            fake_time.now += 60  # apart: no breaker opens while they are made
            with pytest.raises(idempotently.OperationPendingError):
                s.post(URL, json={"n": n}, operation_id=f"op-{n}", policy=own)
        assert 3 == len(origin.arrived)
        assert '"breaker":{"failures":2,' in (s.journal.operation("op-0").overrides or "")
    origin.arrived.clear()
    fake_time.now += 60
    with session(tmp_path, fake_time, origin, policy=idempotently.RetryPolicy(budget=None)) as s:
        results = s.resume()
    assert 2 == len(origin.arrived)
    assert "circuit breaker open 5s: 2 failures in a row" in results[2].detail


def test_hooks_hear_the_breaker_open_and_close(tmp_path: Path, fake_time: FakeTime) -> None:
    """A hook receives BreakerChanged: opened (with until), then closed by the probe."""
    events: list[idempotently.BreakerChanged] = []

    def hook(event: Any) -> None:
        if isinstance(event, idempotently.BreakerChanged):
            events.append(event)

    origin = Origin(fake_time, 503)
    with session(tmp_path, fake_time, origin, hooks=[hook]) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="op-1")
        origin.status = 201
        s.post(URL, json={}, operation_id="op-2")
    assert [("opened", "op-1", ORIGIN), ("closed", "op-2", ORIGIN)] == [
        (event.change, event.operation_id, event.origin) for event in events
    ]
    assert events[0].until is not None and events[1].until is None


def test_opentelemetry_counts_breaker_changes_by_origin(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """idempotently.breaker.changes counts openings, reopenings and closings by origin."""
    from tests.test_retry_budget import telemetry as make_telemetry

    telemetry = make_telemetry.__wrapped__()  # type: ignore[attr-defined]
    origin = Origin(fake_time, 503)
    with session(tmp_path, fake_time, origin, hooks=[telemetry.hook]) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="op-1")
        [pause] = s.journal.origin_pauses(now=fake_time.now)
        fake_time.now = pause.until
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="op-2")  # the probe fails: reopened
        origin.status = 201
        s.post(URL, json={}, operation_id="op-3")
    points = sorted(
        (labels["idempotently.breaker.change"], value)
        for labels, value in telemetry.points()["idempotently.breaker.changes"]
    )
    assert [("closed", 1), ("opened", 1), ("reopened", 1)] == points


def test_a_watch_worker_sends_nothing_while_it_is_open_and_parks(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A `resume --watch` worker meets an open breaker: it sends nothing to the origin and
    parks its operations (still_pending), as for any pause."""
    origin = Origin(fake_time, 503)
    once = idempotently.RetryPolicy(max_attempts=1, budget=None)
    with session(tmp_path, fake_time, origin, policy=once) as s:
        for n in range(2):
            with pytest.raises(idempotently.OperationPendingError):
                s.post(URL, json={"n": n}, operation_id=f"op-{n}")
    write_breaker(str(tmp_path / "journal.db"), ORIGIN, set_at=fake_time.now, length=300.0)
    origin.arrived.clear()
    fake_time.now += 1
    stop, batches = threading.Event(), []

    def on_batch(batch: idempotently.WatchBatch) -> None:
        batches.append(batch)
        stop.set()

    with session(tmp_path, fake_time, origin, policy=once, host_id="worker-1") as worker:
        worker.watch(stop, interval=10.0, concurrency=1, on_result=None, on_batch=on_batch)
    assert [] == origin.arrived
    [batch] = batches
    assert {("op-0", "still_pending"), ("op-1", "still_pending")} == {
        (result.operation_id, result.action) for result in batch.results
    }


def test_reads_through_a_transport_count_and_probe_too(tmp_path: Path, fake_time: FakeTime) -> None:
    """GETs through a Transport count for the origin's breaker as writes do: three failed
    reads open it (the third's retry not sent, its answer returned); a read once it has
    ended takes the probe, and its answer closes the breaker."""
    origin = Origin(fake_time, 503)
    wrapped = idempotently.Transport(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(origin),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        policy=POLICY,
    )
    with httpx.Client(transport=wrapped) as client:
        assert 503 == client.get(URL).status_code
        assert 3 == len(origin.arrived)
        with idempotently.Journal(tmp_path / "journal.db") as journal:
            [pause] = journal.origin_pauses(now=fake_time.now)
        origin.status = 200
        fake_time.now = pause.until
        assert 200 == client.get(URL).status_code
        with idempotently.Journal(tmp_path / "journal.db") as journal:
            assert [] == journal.origin_pauses(now=fake_time.now)
    assert 4 == len(origin.arrived)


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("circuit breaker open 20s: 5 failures in a row", 20.0),
        ("circuit breaker half-open 40s: one probe in flight (abc)", 40.0),
        ("circuit breaker open 1.2.3s: damaged", 5.0),
        ("circuit breaker open 1e999s: damaged", 0.0),
        ("circuit breaker open nans: damaged", 5.0),
    ],
)
def test_a_damaged_reason_never_breaks_the_open_length(reason: str, expected: float) -> None:
    """The open length is read from the reason; one that is no length falls back to the
    row's own (5 s here), and an endless one to 0: never an error, never inf."""
    assert expected == open_length(OriginPause(ORIGIN, "", NOW + 5, reason, NOW))


# -- review: a server's pause and a damaged row meet the probe -------------------------


def test_a_probe_answered_503_with_retry_after_keeps_the_servers_pause(
    journal_target: str, fake_time: FakeTime
) -> None:
    """The probe is answered 503 with Retry-After 2 (shorter than its claim): the breaker
    closes, but the server's 2 s pause stays journaled for every caller, not deleted with
    the claim."""
    write_breaker(journal_target, ORIGIN, set_at=fake_time.now - 10, length=5.0)
    arrived: list[float] = []

    def server(request: httpx.Request) -> httpx.Response:
        arrived.append(fake_time.now)
        return httpx.Response(503, headers={"Retry-After": "2"})

    once = idempotently.RetryPolicy(max_attempts=1, budget=None, breaker=BREAKER)
    with idempotently.Session(
        journal_target,
        transport=httpx.MockTransport(server),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        policy=once,
    ) as s:
        with pytest.raises(idempotently.IdempotentlyError):
            s.post(URL, json={}, operation_id="probe")
        probed_at = arrived[-1]
        [pause] = s.journal.origin_pauses(now=fake_time.now)
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="op-2", policy=attrs.evolve(once, max_retry_after=1))
    assert (probed_at + 2.0, "503 with Retry-After 2s") == (pause.until, pause.reason)
    assert [probed_at] == arrived


def test_a_read_probe_answered_503_with_retry_after_keeps_the_servers_pause(
    journal_target: str, fake_time: FakeTime
) -> None:
    """A GET through a Transport takes the probe and is answered 503 with Retry-After 2:
    the breaker closes, and the server's 2 s pause stays journaled, so the next read within
    it is not sent."""
    write_breaker(journal_target, ORIGIN, set_at=fake_time.now - 10, length=5.0)
    arrived: list[float] = []

    def server(request: httpx.Request) -> httpx.Response:
        arrived.append(fake_time.now)
        return httpx.Response(503, headers={"Retry-After": "2"})

    once = idempotently.RetryPolicy(max_attempts=1, budget=None, breaker=BREAKER)
    wrapped = idempotently.Transport(
        journal_target,
        transport=httpx.MockTransport(server),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        policy=once,
    )
    with httpx.Client(transport=wrapped) as client:
        assert 503 == client.get(URL).status_code
        probed_at = arrived[-1]
        with idempotently.Journal(journal_target) as journal:
            pauses = journal.origin_pauses(now=fake_time.now)
    assert [(probed_at + 2.0, "503 with Retry-After 2s")] == [
        (pause.until, pause.reason) for pause in pauses
    ]
    assert [probed_at] == arrived


def test_a_claim_never_outlasts_max_retry_after_whatever_the_reason_says(
    journal_target: str, fake_time: FakeTime
) -> None:
    """A damaged (or another policy's) breaker row says it was open 10**12 s: the probe's
    claim, journaled while the probe is in flight, lasts no longer than the claimer's
    max_retry_after, so a probe holder that dies never wedges the origin for years."""
    write_breaker(journal_target, ORIGIN, set_at=fake_time.now - 10, length=5.0)
    with idempotently.Journal(journal_target) as journal:
        [row] = journal.origin_pauses(now=fake_time.now)
        journal._execute(
            idempotently._commands_rare.SwapPause(
                ORIGIN,
                "",
                row.reason or "",
                None,
                attrs.evolve(row, reason=opened_reason(1e12, "x")),
            )
        )
    claims: list[OriginPause] = []

    def server(request: httpx.Request) -> httpx.Response:
        with idempotently.Journal(journal_target) as journal:
            claims.extend(journal.origin_pauses(now=fake_time.now))
        return httpx.Response(201)

    policy = attrs.evolve(POLICY, max_retry_after=60)
    with idempotently.Session(
        journal_target,
        transport=httpx.MockTransport(server),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        policy=policy,
    ) as s:
        assert 201 == s.post(URL, json={}, operation_id="probe").status_code
    [claim] = claims
    assert (True, True) == (
        (claim.reason or "").startswith("circuit breaker half-open"),
        claim.until - claim.set_at <= 60,
    )


def test_a_call_answered_from_the_journal_does_not_hold_the_probe(
    journal_target: str, fake_time: FakeTime
) -> None:
    """A call repeated for an operation that already succeeded is answered from the
    journal and sends nothing: it must not keep the half-open breaker's one probe, so the
    next caller (another process) probes at once instead of waiting the claim out."""
    origin = Origin(fake_time, 201)
    with session(journal_target, fake_time, origin) as s:
        assert 201 == s.post(URL, json={}, operation_id="done").status_code
    write_breaker(journal_target, ORIGIN, set_at=fake_time.now - 400, length=300.0)
    with session(journal_target, fake_time, origin) as s:
        assert 201 == s.post(URL, json={}, operation_id="done").status_code
    asked_at = fake_time.now
    with session(journal_target, fake_time, origin) as other:
        assert 201 == other.post(URL, json={}, operation_id="next").status_code
        assert [] == other.journal.origin_pauses(now=fake_time.now)
    assert [asked_at] == origin.arrived[1:]


def test_a_resume_that_sends_nothing_hands_the_probe_back(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A resume meets a half-open breaker with an operation it cannot send (its journaled
    overrides are damaged: not_sent): it keeps no claim, so the next operation of that
    origin is the probe, sent at once, and its answer closes the breaker."""
    import sqlite3

    origin = Origin(fake_time, 503)
    once = idempotently.RetryPolicy(max_attempts=1, budget=None)
    with session(tmp_path, fake_time, origin, policy=once) as s:
        for n in range(2):
            with pytest.raises(idempotently.OperationPendingError):
                s.post(URL, json={"n": n}, operation_id=f"op-{n}", policy=once)
    with sqlite3.connect(tmp_path / "journal.db") as conn:
        conn.execute(
            'UPDATE operations SET overrides = \'{"policy": {"max_attempts": "lots"}}\' '
            "WHERE operation_id = 'op-0'"
        )
    write_breaker(str(tmp_path / "journal.db"), ORIGIN, set_at=fake_time.now - 400, length=300.0)
    origin.status, started = 201, fake_time.now
    with session(tmp_path, fake_time, origin, policy=once) as s:
        results = s.resume()
        pauses = s.journal.origin_pauses(now=fake_time.now)
    assert [("op-0", "not_sent"), ("op-1", "succeeded")] == [
        (result.operation_id, result.action) for result in results
    ]
    assert ([started], []) == (origin.arrived[2:], pauses)


def test_one_tenants_failures_do_not_open_another_tenants_breaker(
    journal_target: str, fake_time: FakeTime
) -> None:
    """Tenant A's requests fail three times in a row and open A's breaker: tenant B's
    request to the same origin, with its own credentials, is still sent and answered."""
    seen: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        tenant = request.headers["Authorization"]
        seen.append(tenant)
        return httpx.Response(503 if tenant == "Bearer tenant-a" else 201)

    with idempotently.Session(
        journal_target,
        transport=httpx.MockTransport(server),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        policy=POLICY,
    ) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="a", headers={"Authorization": "Bearer tenant-a"})
        answer = s.post(
            URL, json={}, operation_id="b", headers={"Authorization": "Bearer tenant-b"}
        )
        pauses = s.journal.origin_pauses(now=fake_time.now)
    assert 201 == answer.status_code
    assert ["Bearer tenant-a"] * 3 + ["Bearer tenant-b"] == seen
    assert 1 == len(pauses)


def test_a_resume_finishes_other_origins_while_one_is_down(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A resume meets one origin that is down and another that is up, their operations
    interleaved: the breaker stops the dead one's after five failures, and every operation
    of the live origin is sent and succeeds."""
    down = "https://down.example.test/v1/charges"
    hits: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        hits.append(request.url.host)
        if request.url.host == "down.example.test":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(201)

    once = idempotently.RetryPolicy(max_attempts=1, budget=None)
    with idempotently.Session(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(lambda request: httpx.Response(503)),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        policy=once,
    ) as s:
        for n in range(8):
            for url in (down, URL):
                with pytest.raises(idempotently.OperationPendingError):
                    s.post(url, json={"n": n}, operation_id=f"{url[8:12]}-{n}")
    with idempotently.Session(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(server),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        policy=once,
    ) as s:
        results = s.resume()
    assert (5, 8) == (hits.count("down.example.test"), hits.count("api.example.test"))
    assert ["succeeded"] * 8 == [r.action for r in results if r.operation_id.startswith("api.")]
    assert ["still_pending"] * 8 == [r.action for r in results if r.operation_id.startswith("down")]


def test_a_retry_loop_in_another_process_stops_at_its_next_failure_once_it_is_open(
    journal_target: str, fake_time: FakeTime
) -> None:
    """While a call retries a dead origin (two seconds between attempts), another process
    opens the breaker: the call's next failure reads the journal's pauses again and its
    retry is not sent (RetryLaterError naming the breaker), rather than going on until
    this process has counted its own failures in a row."""
    sent: list[float] = []
    slow = attrs.evolve(POLICY, wait=lambda retry_state: 2.0)

    def dead(request: httpx.Request) -> httpx.Response:
        sent.append(fake_time.now)
        if len(sent) == 1:
            # Meanwhile, in another process: three failures in a row open the breaker.
            with (
                session(journal_target, fake_time, Origin(fake_time, 503)) as other,
                pytest.raises(idempotently.RetryLaterError),
            ):
                other.post(URL, json={}, operation_id="other")
        return httpx.Response(503)

    with (
        idempotently.Session(
            journal_target,
            transport=httpx.MockTransport(dead),
            clock=fake_time.clock,
            sleep=fake_time.sleep,
            policy=slow,
        ) as s,
        pytest.raises(idempotently.RetryLaterError) as error,
    ):
        s.post(URL, json={}, operation_id="mine")
    assert "circuit breaker open" in str(error.value)
    assert 2 == len(sent)


def test_a_resumes_probe_claim_covers_the_operations_own_timeout(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """An operation made with timeout=100 (journaled) is the probe of a resume: the claim,
    seen while the probe is in flight, lasts as long as that request may take (100 s), not
    the session's 5 s default, so no second caller probes while it is still waiting."""
    journal = str(tmp_path / "journal.db")
    origin = Origin(fake_time, 503)
    once = idempotently.RetryPolicy(max_attempts=1, budget=None, max_retry_after=300)
    with (
        session(tmp_path, fake_time, origin, policy=once) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(URL, json={}, operation_id="slow", timeout=100.0)
    write_breaker(journal, ORIGIN, set_at=fake_time.now - 10, length=5.0)
    claims: list[OriginPause] = []

    def server(request: httpx.Request) -> httpx.Response:
        with idempotently.Journal(journal) as opened:
            claims.extend(opened.origin_pauses(now=fake_time.now))
        return httpx.Response(201)

    with idempotently.Session(
        journal,
        transport=httpx.MockTransport(server),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        policy=once,
    ) as s:
        assert ["succeeded"] == [result.action for result in s.resume()]
    [claim] = claims
    assert (True, 100.0) == (
        (claim.reason or "").startswith("circuit breaker half-open"),
        claim.until - claim.set_at,
    )


def test_a_read_retrying_in_another_process_stops_once_it_is_open(
    journal_target: str, fake_time: FakeTime
) -> None:
    """A GET through a Transport retries a dead origin two seconds apart; meanwhile another
    process opens the breaker: the read's next failure sees it and its retry is not sent
    (the last answer is returned)."""
    sent: list[float] = []
    slow = attrs.evolve(POLICY, wait=lambda retry_state: 2.0)

    def dead(request: httpx.Request) -> httpx.Response:
        sent.append(fake_time.now)
        if len(sent) == 1:
            with (
                session(journal_target, fake_time, Origin(fake_time, 503)) as other,
                pytest.raises(idempotently.RetryLaterError),
            ):
                other.post(URL, json={}, operation_id="other")
        return httpx.Response(503)

    wrapped = idempotently.Transport(
        journal_target,
        transport=httpx.MockTransport(dead),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        policy=slow,
    )
    with httpx.Client(transport=wrapped) as client:
        assert 503 == client.get(URL).status_code
    assert 2 == len(sent)


def test_a_call_refused_before_sending_does_not_hold_the_probe(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A call that takes the half-open probe and is then refused without sending (its
    operation id already names another payload: KeyReuseError) hands the probe back: the
    next call probes at once and closes the breaker."""
    origin = Origin(fake_time, 201)
    with session(tmp_path, fake_time, origin) as s:
        assert 201 == s.post(URL, json={"amount": 1}, operation_id="done").status_code
    write_breaker(str(tmp_path / "journal.db"), ORIGIN, set_at=fake_time.now - 400, length=300.0)
    with session(tmp_path, fake_time, origin) as s:
        with pytest.raises(idempotently.KeyReuseError):
            s.post(URL, json={"amount": 2}, operation_id="done")
        asked_at = fake_time.now
        assert 201 == s.post(URL, json={}, operation_id="next").status_code
        assert [] == s.journal.origin_pauses(now=fake_time.now)
    assert [asked_at] == origin.arrived[1:]


def test_stats_counts_thousands_of_breakers_and_pauses(tmp_path: Path) -> None:
    """A journal with 2,000 open breakers and 2,000 server pauses: `stats --json` counts
    the breakers apart and the Prometheus gauge has one sample per breaker's origin."""
    import sqlite3

    path = str(tmp_path / "journal.db")
    write_breaker(path, ORIGIN, set_at=time.time(), length=60.0)
    now = time.time()
    with sqlite3.connect(path) as conn:
        conn.executemany(
            "INSERT INTO origin_pauses (origin, credentials, until, reason, set_at) "
            "VALUES (?, '', ?, ?, ?)",
            [
                (f"https://h{n}.example.test:443", now + 60, reason, now)
                for n in range(1, 4000)
                for reason in [opened_reason(60.0, "test") if n % 2 else "503 with Retry-After 60s"]
            ],
        )
    runner = CliRunner()
    data = json.loads(runner.invoke(cli, ["--journal", path, "stats", "--json"]).output)
    metrics = runner.invoke(cli, ["--journal", path, "stats", "--format", "prometheus"]).output
    assert (4000, 2001) == (len(data["paused_origins"]), data["open_breakers"])
    assert 2001 == sum(
        line.startswith("idempotently_open_breakers{") for line in metrics.split("\n")
    )


def test_a_hook_raising_on_the_breakers_change_changes_nothing(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A hook that raises on every BreakerChanged: the breaker still opens (journaled,
    RetryLaterError) and the next probe still closes it."""
    heard: list[str] = []

    def hook(event: Any) -> None:
        if isinstance(event, idempotently.BreakerChanged):
            heard.append(event.change)
            raise RuntimeError("a broken exporter")

    origin = Origin(fake_time, 503)
    with session(tmp_path, fake_time, origin, hooks=[hook]) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="op-1")
        [pause] = s.journal.origin_pauses(now=fake_time.now)
        origin.status = 201
        assert 201 == s.post(URL, json={}, operation_id="op-2").status_code
        assert [] == s.journal.origin_pauses(now=fake_time.now)
    assert (["opened", "closed"], True) == (heard, is_breaker(pause))
