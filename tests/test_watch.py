"""The resume worker (`resume --watch`) in process, and what `resume` prints as it goes."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

import idempotently
from idempotently import cli as cli_module
from idempotently._cli_watch import run_watch, stop_on_signals
from idempotently.cli import cli
from tests.journal_commands import claim_due
from tests.support import URL, FakeTime

NOW = 1_800_000_000.0


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def seed(path: Path, count: int, url: str = URL, *, at: float = NOW - 60) -> list[str]:
    """``count`` pending operations (their one attempt was refused), oldest first."""
    fake = FakeTime(now=at)
    ids = [f"order-{i}:charge" for i in range(count)]
    with idempotently.Session(
        idempotently.Journal(path, durability="os"),
        transport=httpx.MockTransport(refuse),
        policy=idempotently.RetryPolicy(max_attempts=1),
        clock=fake.clock,
        sleep=fake.sleep,
    ) as session:
        for operation_id in ids:
            fake.now += 0.001
            with pytest.raises(idempotently.IdempotentlyError):
                session.post(url, json={"order": operation_id}, operation_id=operation_id)
    return ids


def worker_session(
    path: Path, fake: FakeTime, answer: Callable[[httpx.Request], httpx.Response], **options: object
) -> idempotently.Session:
    return idempotently.Session(
        path,
        host_id="worker-1",
        transport=httpx.MockTransport(answer),
        policy=idempotently.RetryPolicy(max_attempts=1),
        clock=fake.clock,
        sleep=fake.sleep,
        **options,  # type: ignore[arg-type]
    )


def run_worker(
    session: idempotently.Session,
    stop: threading.Event,
    *,
    concurrency: int = 2,
    interval: float = 5.0,
    on_batch: Callable[[idempotently.WatchBatch], object] | None = None,
    results: list[idempotently.ResumeResult] | None = None,
) -> object:
    return session.watch(
        stop,
        interval=interval,
        concurrency=concurrency,
        on_result=None if results is None else results.append,
        on_batch=on_batch,
    )


def leases(path: Path) -> dict[str, tuple[str | None, float]]:
    with idempotently.Journal(path) as journal:
        return {op.operation_id: (op.lease_owner, op.lease_until) for op in journal.operations()}


def test_a_worker_resumes_what_it_claimed_as_its_own(tmp_path: Path) -> None:
    """Claimed operations are sent once each (never 'leased' by the worker's own claim),
    each result reported as it comes, then the worker stops on request."""
    path = tmp_path / "journal.db"
    ids = seed(path, 7)
    fake = FakeTime(now=NOW)
    sent: list[str] = []
    stop = threading.Event()
    results: list[idempotently.ResumeResult] = []
    batches: list[idempotently.WatchBatch] = []

    def server(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content)["order"])
        return httpx.Response(201)

    def on_batch(batch: idempotently.WatchBatch) -> None:
        batches.append(batch)
        if sum(len(done.results) for done in batches) == len(ids):
            stop.set()

    with worker_session(path, fake, server) as session:
        summary = run_worker(session, stop, concurrency=2, on_batch=on_batch, results=results)
    assert sorted(ids) == sorted(sent)
    assert {"succeeded"} == {result.action for result in results}
    assert [(7, 7)] == [(batch.claimed, len(batch.results)) for batch in batches]
    assert {operation_id: (None, 0.0) for operation_id in ids} == leases(path)
    assert 7 == summary.operations  # type: ignore[attr-defined]


def test_stopping_releases_claimed_operations_it_never_started(tmp_path: Path) -> None:
    """Stop mid-batch: the operation in flight finishes, the rest of the claim is given back
    (no lease left), nothing is sent twice."""
    path = tmp_path / "journal.db"
    ids = seed(path, 5)
    fake = FakeTime(now=NOW)
    stop = threading.Event()
    sent: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content)["order"])
        stop.set()  # SIGTERM arrives while the first operation is in flight
        return httpx.Response(201)

    with worker_session(path, fake, server) as session:
        summary = run_worker(session, stop, concurrency=1)
    assert [ids[0]] == sent
    assert 3 == summary.released  # a batch is 4 per worker: the fifth was never claimed  # type: ignore[attr-defined]
    assert {operation_id: (None, 0.0) for operation_id in ids} == leases(path)
    with idempotently.Journal(path) as journal:
        assert 1 == journal.counts()["succeeded"]


def test_a_stop_during_a_retry_wait_ends_that_operation_with_its_attempt_journaled(
    tmp_path: Path,
) -> None:
    """A worker told to stop does not wait out a backoff: the operation stays pending
    with the attempt it made, and its lease is released."""
    path = tmp_path / "journal.db"
    [operation_id] = seed(path, 1)
    fake = FakeTime(now=NOW)
    stop = threading.Event()
    results: list[idempotently.ResumeResult] = []

    def server(request: httpx.Request) -> httpx.Response:
        stop.set()
        return httpx.Response(503)

    with idempotently.Session(
        path,
        transport=httpx.MockTransport(server),
        policy=idempotently.RetryPolicy(max_attempts=5, initial_backoff=30, max_backoff=30),
        clock=fake.clock,
    ) as session:
        run_worker(session, stop, results=results)
    assert [("still_pending", "pending")] == [(r.action, r.status) for r in results]
    with idempotently.Journal(path) as journal:
        operation = journal.operation(operation_id)
    assert operation is not None
    assert (2, None, 0.0) == (operation.attempt_count, operation.lease_owner, operation.lease_until)


def test_an_operation_left_pending_is_parked_longer_each_round(tmp_path: Path) -> None:
    """An answer that settles nothing (401) is not retried in a loop: the worker keeps the
    operation's lease for the interval, then twice as long; released when it stops."""
    path = tmp_path / "journal.db"
    [operation_id] = seed(path, 1)
    fake = FakeTime(now=NOW)
    stop = threading.Event()
    sent: list[float] = []
    seen: list[tuple[float, list[object]]] = []

    def server(request: httpx.Request) -> httpx.Response:
        sent.append(fake.now)
        return httpx.Response(401)

    def on_batch(batch: idempotently.WatchBatch) -> None:
        owner, until = leases(path)[operation_id]
        with idempotently.Journal(path) as other:
            claimed = claim_due(other, owner="other:1:t", now=fake.now, lease_until=0, limit=9)
        seen.append((until - fake.now, claimed))
        assert owner is not None and owner.startswith("worker-1:")
        fake.now += 11  # past the first park: the next round takes it again
        if len(seen) == 2:
            stop.set()

    with worker_session(path, fake, server) as session:
        run_worker(session, stop, interval=10, on_batch=on_batch)
    assert [(10.0, []), (20.0, [])] == seen
    assert 2 == len(sent)
    assert {operation_id: (None, 0.0)} == leases(path)


@pytest.mark.parametrize(
    ("stop", "interval", "error"),
    [
        (None, 5.0, TypeError),
        (object(), 5.0, TypeError),
        ("event", 0, ValueError),
        ("event", -1.0, ValueError),
        ("event", -0.0, ValueError),
        ("event", float("nan"), ValueError),
        ("event", float("inf"), ValueError),
        ("event", 10**400, ValueError),
        ("event", True, TypeError),
        ("event", "5s", TypeError),
    ],
    # repr, but the same in every xdist worker: an object()'s repr holds its address.
    ids=lambda value: "object()" if type(value) is object else repr(value),
)
def test_a_watch_with_a_bad_stop_or_interval_is_refused_before_it_claims(
    tmp_path: Path, stop: object, interval: object, error: type[Exception]
) -> None:
    """Session.watch(stop, interval=...): a stop that is no threading.Event, an interval
    that is 0, negative, -0.0, NaN, infinite, 10**400 or no number is a TypeError or
    ValueError in one line naming the argument; nothing is claimed or sent."""
    path = tmp_path / "journal.db"
    seed(path, 1)
    sent: list[httpx.Request] = []

    def server(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(201)

    given = threading.Event() if stop == "event" else stop
    with (
        worker_session(path, FakeTime(now=NOW), server) as session,
        pytest.raises(error, match=r"^(stop|interval) must") as raised,
    ):
        session.watch(given, interval=interval)  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)
    assert [] == sent
    assert {"order-0:charge": (None, 0.0)} == leases(path)


def test_a_signal_is_announced_before_the_worker_is_told_to_stop() -> None:
    """`resume --watch`'s SIGTERM notice (watch_stopping) is logged before ``stop`` is
    set, so the worker's last line (watch_stopped) always comes after it."""
    stop = threading.Event()
    stop_set_when_announced: list[bool] = []

    class Probe(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            fields = getattr(record, "idempotently", None) or {}
            if fields.get("event") == "watch_stopping":
                stop_set_when_announced.append(stop.is_set())

    logger = logging.getLogger("idempotently.watch")
    probe, level = Probe(), logger.level
    logger.addHandler(probe)
    logger.setLevel(logging.INFO)
    try:
        with stop_on_signals(stop):
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.wait(30)
    finally:
        logger.removeHandler(probe)
        logger.setLevel(level)
    assert [False] == stop_set_when_announced


@pytest.mark.parametrize("columns", [80, 200])
def test_watch_on_a_terminal_prints_one_line_per_batch(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    columns: int,
) -> None:
    """On a terminal the worker says when it starts and stops, and one line per batch.

    A line wider than the terminal wraps between words under its text (after the
    time), never mid-word; at 200 columns each is one line.
    """
    monkeypatch.setenv("COLUMNS", str(columns))
    path = tmp_path / "journal.db"
    seed(path, 3)
    fake = FakeTime(now=NOW)
    sent: list[int] = []

    def server(request: httpx.Request) -> httpx.Response:
        sent.append(1)
        if len(sent) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # while the last operation is in flight
        return httpx.Response(201)

    with worker_session(path, fake, server) as session:
        run_watch(  # on the main thread: it installs the signal handlers
            session,
            interval=5,
            concurrency=1,
            base_url=None,
            as_json=False,
            terminal=True,
        )
    printed = capsys.readouterr().err.splitlines()
    assert [] == [line for line in printed if len(line) > columns]
    # Continuation lines start under the text, after the time: join them back.
    lines: list[str] = []
    for line in printed:
        if line.startswith(" " * 9):
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    # The signal's notice comes when the signal does: before the last line.
    [notice] = [n for n, line in enumerate(lines) if "SIGTERM: finishing operations" in line]
    assert notice < len(lines) - 1
    del lines[notice]
    assert 3 == len(lines), lines
    assert (columns == 200) == (4 == len(printed))
    assert "resume worker worker-1:" in lines[0] and lines[0].endswith("started")
    assert "batch 1: 3 of 3 claimed operations resumed" in lines[1]
    assert "(3 succeeded); 0 pending left" in lines[1]
    assert lines[2].endswith("stopped")


def test_watch_off_a_terminal_logs_json_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Off a terminal (or with --json, on stdout) every event is one JSON object per line."""
    path = tmp_path / "journal.db"
    seed(path, 1)
    fake = FakeTime(now=NOW)

    def server(request: httpx.Request) -> httpx.Response:
        os.kill(os.getpid(), signal.SIGTERM)  # while the first operation is in flight
        return httpx.Response(201)

    with worker_session(path, fake, server) as session:
        run_watch(  # on the main thread: it installs the signal handlers
            session,
            interval=5,
            concurrency=1,
            base_url=None,
            as_json=True,
            terminal=True,
        )
    out = capsys.readouterr().out
    events = [json.loads(line) for line in out.splitlines()]
    names = [event["event"] for event in events]
    # The signal's notice comes when the signal does: before the last line.
    assert "SIGTERM" == events[names.index("watch_stopping")]["signal"]
    assert names.index("watch_stopping") < len(names) - 1
    events = [event for event in events if event["event"] != "watch_stopping"]
    assert ["watch_started", "claimed", "operation", "batch", "watch_stopped"] == [
        event["event"] for event in events
    ]
    assert {"worker-1"} == {event["host_id"] for event in events}
    assert ("order-0:charge", "succeeded", 201) == (
        events[2]["operation_id"],
        events[2]["action"],
        events[2]["status_code"],
    )
    assert 0 == events[-1]["released"]
    assert all(event["ts"].endswith("Z") and event["level"] == "info" for event in events)


# -- the command line ---------------------------------------------------------------------


def run(*args: str) -> object:
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--watch", "--dry-run"), "--watch and --dry-run"),
        (("--watch", "--interval", "0s"), "--interval"),
        (("--host-id", "a:b"), "host_id"),
        (("--lease-duration", "0s"), "--lease-duration"),
    ],
)
def test_resume_watch_usage_errors(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    """Options that cannot work are usage errors (exit 2) before anything is claimed."""
    path = tmp_path / "journal.db"
    seed(path, 1)
    result = CliRunner().invoke(cli, ["--journal", str(path), "resume", *args])
    assert 2 == result.exit_code, result.output
    assert message in result.stderr
    assert {"order-0:charge": (None, 0.0)} == leases(path)


@pytest.mark.parametrize("dry_run", [True, False])
def test_no_progress_bar_without_work_or_for_a_dry_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dry_run: bool
) -> None:
    """On a terminal the bar is drawn only when there is work to send: never 0/0, never
    for --dry-run."""
    path = tmp_path / "journal.db"
    seed(path, 1 if dry_run else 0)
    monkeypatch.setattr(cli_module, "stderr_is_terminal", lambda: True)
    args = ["--journal", str(path), "resume"] + (["--dry-run"] if dry_run else [])
    result = CliRunner().invoke(cli, args)
    assert 0 == result.exit_code, result.output
    assert "resuming" not in result.stderr
    # Piped, stdout holds records only: the remark goes to stderr.
    assert ("would_send" if dry_run else "") in result.stdout
    assert dry_run or "nothing to resume" in result.stderr


def test_resume_prints_each_result_as_soon_as_it_is_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Interrupted (Ctrl-C) on its second operation, resume has already printed the first."""
    path = tmp_path / "journal.db"
    seed(path, 3)
    calls: list[int] = []

    def send(self: httpx.HTTPTransport, request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return httpx.Response(201, request=request)

    monkeypatch.setattr(httpx.HTTPTransport, "handle_request", send)
    result = CliRunner().invoke(cli, ["--journal", str(path), "resume"])
    assert 1 == result.exit_code  # aborted by the interrupt
    lines = result.stdout.splitlines()  # piped: one record per result, no header
    assert ["order-0:charge", "succeeded", "succeeded", "201"] == lines[0].split("\t")[:4]
    assert 1 == len(lines)


def test_claimed_operations_waiting_their_turn_keep_their_lease(tmp_path: Path) -> None:
    """While the first claimed operation is sent, the heartbeat renews the claims of the
    ones queued behind it: no other worker can take them meanwhile."""

    path = tmp_path / "journal.db"
    ids = seed(path, 2)
    fake = FakeTime(now=NOW)
    stop = threading.Event()
    queued: list[float] = []

    def server(request: httpx.Request) -> httpx.Response:
        if not queued:
            fake.now += 100  # past the claim's 30 s lease
            session.journal._heartbeat.beat()
            queued.append(leases(path)[ids[1]][1] - fake.now)
        else:
            stop.set()
        return httpx.Response(201)

    with worker_session(path, fake, server, lease_duration=30) as session:
        run_worker(session, stop, concurrency=1)
    assert [30.0] == queued
