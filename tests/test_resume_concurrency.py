"""Resume at scale: several operations at once, each under its own lease, none sent twice."""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import httpx
import pytest
from click.testing import CliRunner

import idempotently
from idempotently._commands import Record
from idempotently.cli import cli
from tests.faults import around_commit
from tests.scripted_server import ScriptedApp

SRC = str(Path(idempotently.__file__).resolve().parents[1])

BASE = "https://api.example.test"
OPERATIONS = 24
CONCURRENCY = 6


def journal_with_pending(path: Path, count: int = OPERATIONS) -> list[str]:
    """A journal with ``count`` pending operations (each attempt was refused); their ids."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("down", request=request)

    with idempotently.Session(
        path,
        transport=httpx.MockTransport(refuse),
        base_url=BASE,
        policy=idempotently.RetryPolicy(max_attempts=1),
    ) as session:
        for n in range(count):
            with pytest.raises(idempotently.OperationPendingError):
                session.post("/v1/charges", json={"n": n}, operation_id=f"op-{n:03}")
    return [f"op-{n:03}" for n in range(count)]


class Concurrent:
    """A server stand-in that answers only once ``parties`` requests are in flight together."""

    def __init__(self, parties: int) -> None:
        self.barrier = threading.Barrier(parties, timeout=10)
        self.keys: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.keys[request.headers["idempotency-key"]] += 1
        self.barrier.wait()  # raises BrokenBarrierError unless `parties` sends overlap
        return httpx.Response(201, json={"ok": True})


def test_resume_with_concurrency_sends_each_operation_once_and_in_parallel(
    tmp_path: Path,
) -> None:
    """concurrency=6: six sends overlap, every pending operation is sent exactly once,
    and the results keep the queue's order."""
    path = tmp_path / "journal.db"
    ids = journal_with_pending(path)
    server = Concurrent(CONCURRENCY)
    seen: list[str] = []
    with idempotently.Session(path, transport=httpx.MockTransport(server)) as session:
        results = session.resume(
            concurrency=CONCURRENCY, on_result=lambda result: seen.append(result.operation_id)
        )
        counts = session.journal.counts()
    assert ids == [result.operation_id for result in results]
    assert {"succeeded"} == {result.action for result in results}
    assert sorted(ids) == sorted(seen)
    assert OPERATIONS == len(server.keys)
    assert {1} == set(server.keys.values())
    assert OPERATIONS == counts["succeeded"]


@pytest.mark.anyio
async def test_async_resume_with_concurrency_sends_each_operation_once_and_in_parallel(
    tmp_path: Path,
) -> None:
    """AsyncSession.resume(concurrency=6) runs six operations as overlapping tasks."""
    path = tmp_path / "journal.db"
    ids = journal_with_pending(path)
    keys: collections.Counter[str] = collections.Counter()
    in_flight = 0
    most = 0
    wave = anyio.Event()

    async def answer(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, most, wave
        keys[request.headers["idempotency-key"]] += 1
        in_flight += 1
        most = max(most, in_flight)
        if in_flight == CONCURRENCY:
            wave.set()
        with anyio.fail_after(10):
            await wave.wait()
        in_flight -= 1
        if in_flight == 0:
            wave = anyio.Event()
        return httpx.Response(201)

    async with idempotently.AsyncSession(path, transport=httpx.MockTransport(answer)) as session:
        results = await session.resume(concurrency=CONCURRENCY)
    assert ids == [result.operation_id for result in results]
    assert {"succeeded"} == {result.action for result in results}
    assert (OPERATIONS, {1}) == (len(keys), set(keys.values()))
    assert CONCURRENCY == most


@pytest.mark.parametrize(
    ("value", "error"), [(0, ValueError), (257, ValueError), (True, TypeError), ("4", TypeError)]
)
def test_resume_concurrency_is_checked_before_anything_is_sent(
    tmp_path: Path, value: object, error: type[Exception]
) -> None:
    """A concurrency that is not an int from 1 to 256 is refused, naming the argument."""
    path = tmp_path / "journal.db"
    journal_with_pending(path, count=1)
    sent: list[httpx.Request] = []
    with idempotently.Session(
        path, transport=httpx.MockTransport(lambda r: sent.append(r) or httpx.Response(201))
    ) as session:
        with pytest.raises(error, match="concurrency"):
            session.resume(concurrency=value)  # type: ignore[arg-type]
        assert 1 == session.journal.counts()["pending"]
    assert [] == sent


def test_a_journal_error_in_one_worker_stops_the_resume(tmp_path: Path) -> None:
    """A journal that fails mid-resume ends the whole resume with that error, leases released."""
    path = tmp_path / "journal.db"
    journal_with_pending(path, count=8)
    journal = idempotently.Journal(path)
    calls = 0

    def failing_record(write: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise idempotently.JournalWriteError("disk full (test)")

    with (
        around_commit(journal, Record, before=failing_record),
        idempotently.Session(
            journal, transport=httpx.MockTransport(lambda r: httpx.Response(201))
        ) as s,
        pytest.raises(idempotently.JournalWriteError),
    ):
        s.resume(concurrency=4)
    leased = [op for op in journal.operations() if op.lease_owner is not None]
    journal.close()
    assert [] == leased


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_cli_resume_against_a_dead_host_is_bounded_by_its_options(tmp_path: Path) -> None:
    """--concurrency 4 --max-attempts 2 --deadline 2s against a closed port: every
    operation stays pending, none tries more than twice, and resume exits 1; the resume's
    circuit breaker (five failures in a row) stops the run: at most the five that open it
    and the three others already in flight are sent, not all sixteen."""
    path = tmp_path / "journal.db"
    journal_with_pending(path, count=8)
    dead = f"http://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(
        cli,
        [
            "--journal",
            os.fspath(path),
            "resume",
            "--base-url",
            dead,
            "--concurrency",
            "4",
            "--max-attempts",
            "2",
            "--deadline",
            "2s",
            "--json",
        ],
    )
    assert 1 == result.exit_code, result.output
    with idempotently.Journal(path) as journal:
        operations = journal.operations()
        attempts = [journal.operation(op.operation_id).attempt_count for op in operations]  # type: ignore[union-attr]
    assert {"pending"} == {op.status for op in operations}
    this_run = [count - 1 for count in attempts]  # each had the first call's one
    assert (True, True) == (all(0 <= n <= 2 for n in this_run), 5 <= sum(this_run) <= 8)
    results, _ = json.JSONDecoder().raw_decode(result.output)
    untried = [r for r in results if r["detail"].startswith("not sent")]
    assert all("circuit breaker open" in r["detail"] for r in untried)


@pytest.mark.parametrize(
    "args",
    [
        ("--concurrency", "0"),
        ("--concurrency", "300"),
        ("--max-attempts", "0"),
        ("--deadline", "0s"),
    ],
)
def test_cli_resume_options_out_of_range_are_usage_errors(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    """Out-of-range resume options exit 2 and send nothing."""
    path = tmp_path / "journal.db"
    journal_with_pending(path, count=1)
    result = CliRunner().invoke(cli, ["--journal", os.fspath(path), "resume", *args])
    assert 2 == result.exit_code, result.output
    with idempotently.Journal(path) as journal:
        operation = journal.operation("op-000")
    assert operation is not None and 1 == operation.attempt_count


def test_two_resume_processes_at_concurrency_16_send_each_operation_once(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """Two `idempotently resume --concurrency 16` processes on one journal, started
    together over 120 enqueued operations: the server gets exactly one POST per key,
    and every operation ends succeeded (each resume reads its queue once and takes
    each lease on the row it read: the other's lease makes its swap fail)."""
    app, url = scripted
    with idempotently.Session(journal_target, base_url=url) as session:
        for n in range(120):
            session.enqueue("POST", "/v1/charges", json={"n": n}, operation_id=f"op-{n:03}")
        keys = {op.key for op in session.journal.operations()}
    argv = [
        sys.executable, "-m", "idempotently", "--journal", journal_target,
        "resume", "--concurrency", "16",
    ]  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": SRC}
    resumes = [
        subprocess.Popen(argv, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for resume in resumes:
        resume.communicate(timeout=300)
    with idempotently.Journal(journal_target) as journal:
        statuses = collections.Counter(op.status for op in journal.operations())
    posts = collections.Counter(arrival.key for arrival in app.arrivals)
    assert {key: 1 for key in keys} == dict(posts)
    assert {"succeeded": 120} == dict(statuses)
