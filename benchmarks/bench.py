"""Every throughput figure in one table: journaled against bare httpx, same server, same run.

    python benchmarks/bench.py [--ops 2000] [--quick] [--skip-audit] [--skip-postgres]
                                                                          (nox -s bench)

Servers are uvicorn processes on 127.0.0.1 answering at once, after 1 ms (a
LAN) or after 20 ms (a real API). Each row runs the bare httpx client and the
journaled one on the same server, interleaved in rounds, and prints both
ops/s, the journaled p50 and p99, and the ratio. The disk's median fsync time
is measured first, in the same run. The audit rows come from
``bench_journal.py`` on a cached 1,000,000-operation journal. The PostgreSQL
rows journal to a throwaway local server (tests/postgres_server.py, fsync on,
its data directory in $BENCH_DIR if set).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Literal

import anyio
import httpx
from bench_post import PAYLOAD, Series, start_server, timed_async_batch, timed_batch

import idempotently
from idempotently._commands import Insert, Record

PATH = "/v1/charges"
ROOT = Path(__file__).resolve().parent.parent


def fsync_median(directory: Path, samples: int = 200) -> float:
    """Median seconds for one small append + fsync: the floor under a durable key."""
    times = []
    with open(directory / "fsync.probe", "wb") as file:
        for _ in range(samples):
            file.write(b"x" * 128)
            file.flush()
            started = time.perf_counter()
            os.fsync(file.fileno())
            times.append(time.perf_counter() - started)
    return statistics.median(times)


@contextmanager
def server(latency_ms: float) -> Iterator[str]:
    process, url = start_server(latency_ms)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def row(name: str, bare: Series | None, journaled: Series) -> str:
    ordered = sorted(journaled.latencies) or [0.0]
    p50 = statistics.median(ordered) * 1000
    p99 = ordered[max(0, int(len(ordered) * 0.99) - 1)] * 1000
    ops = journaled.ops_per_second()
    if bare is None:
        return f"{name:<46}{ops:>9.0f}{'':>9}{p50:>9.2f}{p99:>9.2f}{'':>8}"
    base = bare.ops_per_second()
    return f"{name:<46}{ops:>9.0f}{base:>9.0f}{p50:>9.2f}{p99:>9.2f}{ops / base:>8.2f}"


HEADER = f"{'':<46}{'ops/s':>9}{'bare':>9}{'p50 ms':>9}{'p99 ms':>9}{'ratio':>8}"


def cpu_split(tmp: Path, ops: int) -> list[str]:
    """The client's CPU per call, split: bare httpx, the journal, the rest of the library.

    Measured with thread CPU time (not wall time) against an in-process
    transport, so neither a server nor time spent waiting for the disk is in
    any figure (an fsync's own kernel CPU is): the
    journal's part is its SQLite statements and the Python around them, key
    row plus completion, which is what issue 9's "journal CPU per operation
    (everything but the fsync)" target is about.
    """

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"id": "ch_1", "object": "charge"})

    def cpu_per_call(call: Callable[[], object], count: int) -> float:
        started = time.thread_time()
        for _ in range(count):
            call()
        return (time.thread_time() - started) / count

    lines = [
        "client CPU per call, µs (thread CPU time, in-process transport, no server):",
        f"{'':<28}{'total':>8}{'bare':>8}{'journal':>9}{'key':>7}{'completion':>12}{'rest':>8}",
    ]
    count = max(ops, 500)
    with httpx.Client(base_url="http://bench", transport=httpx.MockTransport(answer)) as client:
        bare = min(cpu_per_call(lambda: client.post(PATH, json=PAYLOAD), count) for _ in range(3))
        spent = {"key": 0.0, "completion": 0.0}

        def timed_write(part: str, write: Callable[..., object]) -> Callable[..., object]:
            def wrapper(*args: object, **kwargs: object) -> object:
                started = time.thread_time()
                try:
                    return write(*args, **kwargs)
                finally:
                    spent[part] += time.thread_time() - started

            return wrapper

        for mode in ("os", "fsync"):
            journal = idempotently.Journal(tmp / f"{uuid.uuid4()}.db", durability=mode)
            # Every journal command of the sync driver goes through Journal._execute: the
            # key's insert and the answer's record, each through the journal's writer.
            execute = journal._execute
            timed_key = timed_write("key", execute)
            timed_completion = timed_write("completion", execute)

            def timed_execute(
                command: Any,
                _key: Any = timed_key,
                _done: Any = timed_completion,
                _run: Any = execute,
            ) -> Any:
                if isinstance(command, Insert):
                    return _key(command)
                if isinstance(command, Record):
                    return _done(command)
                return _run(command)

            journal._execute = timed_execute  # type: ignore[method-assign]
            with idempotently.Session(
                journal, base_url="http://bench", transport=httpx.MockTransport(answer)
            ) as session:
                for _ in range(100):
                    session.post(PATH, json=PAYLOAD)
                best = None
                for _ in range(3):
                    spent.update(key=0.0, completion=0.0)
                    total = cpu_per_call(lambda s=session: s.post(PATH, json=PAYLOAD), count)
                    figures = (total, spent["key"] / count, spent["completion"] / count)
                    best = figures if best is None or figures[0] < best[0] else best
            assert best is not None
            total, key, completion = (value * 1e6 for value in best)
            rest = total - key - completion - bare * 1e6
            lines.append(
                f"{f'durability={mode!r}':<28}{total:>8.0f}{bare * 1e6:>8.0f}"
                f"{key + completion:>9.0f}{key:>7.0f}{completion:>12.0f}{rest:>8.0f}"
            )
    lines.append("(the journal's target: ≤ 100 µs per operation, everything but the fsync)")
    return lines


def sync_rows(
    url: str, tmp: Path, ops: int, rounds: int, label: str, store: str | None = None
) -> list[str]:
    """One bare client, one Session per durability mode, interleaved.

    ``store`` is a PostgreSQL URL to journal to instead of a new SQLite file.
    """
    lines = []
    bare = Series("bare")
    modes = {mode: Series(mode) for mode in ("fsync", "os")}
    with httpx.Client(base_url=url) as client:
        sessions = {
            mode: idempotently.Session(
                idempotently.Journal(store or tmp / f"{uuid.uuid4()}.db", durability=mode),
                base_url=url,
            )
            for mode in modes
        }
        try:
            for _ in range(20):
                client.post(PATH, json=PAYLOAD)
                for session in sessions.values():
                    session.post(PATH, json=PAYLOAD)
            per_round = ops // rounds
            for _ in range(rounds):
                timed_batch(bare, per_round, lambda: client.post(PATH, json=PAYLOAD))
                for mode, session in sessions.items():
                    timed_batch(
                        modes[mode], per_round, lambda s=session: s.post(PATH, json=PAYLOAD)
                    )
        finally:
            for session in sessions.values():
                session.close()
    for mode, series in modes.items():
        lines.append(row(f"sync {label}, durability={mode!r}", bare, series))
    return lines


async def async_pair(
    url: str,
    journal: Path | str,
    ops: int,
    rounds: int,
    concurrency: int,
    durability: Literal["fsync", "os"] = "fsync",
) -> tuple[Series, Series]:
    bare, journaled = Series("bare"), Series("journaled")
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    store = (
        journal if durability == "fsync" else idempotently.Journal(journal, durability=durability)
    )
    async with (
        httpx.AsyncClient(base_url=url, limits=limits) as client,
        idempotently.AsyncSession(store, base_url=url, limits=limits) as session,
    ):
        for _ in range(min(concurrency, 20)):
            await client.post(PATH, json=PAYLOAD)
            await session.post(PATH, json=PAYLOAD)
        per_round = ops // rounds
        for _ in range(rounds):
            await timed_async_batch(
                bare, per_round, concurrency, lambda: client.post(PATH, json=PAYLOAD)
            )
            await timed_async_batch(
                journaled, per_round, concurrency, lambda: session.post(PATH, json=PAYLOAD)
            )
    return bare, journaled


def threaded_batch(series: Series, count: int, threads: int, call: Callable[[], object]) -> None:
    remaining = count
    lock = threading.Lock()

    def worker() -> None:
        nonlocal remaining
        while True:
            with lock:
                if remaining <= 0:
                    return
                remaining -= 1
            before = time.perf_counter()
            call()
            elapsed = time.perf_counter() - before
            with lock:
                series.latencies.append(elapsed)

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(threads):
            pool.submit(worker)
    series.elapsed += time.perf_counter() - started
    series.ops += count


def threads_row(url: str, tmp: Path, ops: int, rounds: int, threads: int, label: str) -> str:
    bare, journaled = Series("bare"), Series("journaled")
    limits = httpx.Limits(max_connections=threads, max_keepalive_connections=threads)
    with (
        httpx.Client(base_url=url, limits=limits) as client,
        idempotently.Session(tmp / f"{uuid.uuid4()}.db", base_url=url, limits=limits) as s,
    ):
        per_round = ops // rounds
        for _ in range(rounds):
            threaded_batch(bare, per_round, threads, lambda: client.post(PATH, json=PAYLOAD))
            threaded_batch(journaled, per_round, threads, lambda: s.post(PATH, json=PAYLOAD))
    return row(f"{threads} threads sharing one Session, {label}", bare, journaled)


def pending_journal(path: Path, count: int) -> None:
    """``count`` pending operations, journaled by a session whose sends were refused."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("down", request=request)

    with idempotently.Session(
        idempotently.Journal(path, durability="os"),
        transport=httpx.MockTransport(refuse),
        base_url="http://bench.invalid",
        policy=idempotently.RetryPolicy(max_attempts=1),
    ) as session:
        for _ in range(count):
            with suppress(idempotently.OperationPendingError):
                session.post(PATH, json=PAYLOAD)


def resume_row(url: str, tmp: Path, count: int, concurrency: int) -> str:
    path = tmp / f"{uuid.uuid4()}.db"
    pending_journal(path, count)
    series = Series("resume")
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with idempotently.Session(path, limits=limits) as session:
        started = time.perf_counter()
        results = session.resume(base_url=url, concurrency=concurrency)
        series.elapsed = time.perf_counter() - started
    series.ops = sum(result.action == "succeeded" for result in results)
    return row(f"resume, concurrency {concurrency} ({count} operations)", None, series)


def postgres_rows(tmp: Path, ops: int, rounds: int, backend: str) -> None:
    """The same rows with the journal in PostgreSQL (a local server, fsync on, in $BENCH_DIR)."""
    sys.path.insert(0, str(ROOT))
    from tests.postgres_server import PostgresUnavailable, postgres_server

    try:
        # Not in tmp: as root the server runs as user postgres, who cannot enter it (0700).
        parent = os.environ.get("BENCH_DIR")
        with postgres_server(fsync=True, parent=Path(parent) if parent else None) as pg:
            store = pg.new_database()
            with server(0) as url:
                for line in sync_rows(url, tmp, ops, rounds, "loopback, postgres", store):
                    print(line, flush=True)
                bare, journaled = anyio.run(
                    async_pair, url, store, ops, rounds, 16, backend=backend
                )
                print(row("async c=16, loopback, postgres", bare, journaled), flush=True)
            with server(20) as url:
                bare, journaled = anyio.run(
                    async_pair, url, store, ops, rounds, 16, backend=backend
                )
                print(row("async c=16, 20 ms latency, postgres", bare, journaled), flush=True)
    except PostgresUnavailable as error:
        print(f"postgres rows skipped: {error}", flush=True)


def async_row(
    url: str,
    tmp: Path,
    ops: int,
    args: argparse.Namespace,
    concurrency: int,
    label: str,
    durability: Literal["fsync", "os"] = "fsync",
) -> str:
    """One async row: bare and journaled at ``concurrency``, on a new journal file."""
    bare, journaled = anyio.run(
        async_pair,
        url,
        tmp / f"{uuid.uuid4()}.db",
        ops,
        args.rounds,
        concurrency,
        durability,
        backend=args.backend,
    )
    suffix = "" if durability == "fsync" else f", durability={durability!r}"
    return row(f"async c={concurrency}, {label}{suffix}", bare, journaled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="operations per series")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="a tenth of the operations")
    parser.add_argument("--skip-audit", action="store_true", help="leave out the audit rows")
    parser.add_argument(
        "--skip-postgres", action="store_true", help="leave out the PostgreSQL journal rows"
    )
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    args = parser.parse_args()
    ops = args.ops // 10 if args.quick else args.ops
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as name:
        tmp = Path(name)
        print(f"disk: median fsync {fsync_median(tmp) * 1000:.3f} ms ({tmp})")
        for line in cpu_split(tmp, ops):
            print(line, flush=True)
        print(HEADER)
        with server(0) as url:
            for line in sync_rows(url, tmp, ops, args.rounds, "loopback"):
                print(line, flush=True)
            for concurrency in (1, 16, 64):
                print(async_row(url, tmp, ops, args, concurrency, "loopback"), flush=True)
            # With "os", an async call's writes all commit on the event loop (no thread hop).
            print(async_row(url, tmp, ops, args, 1, "loopback", "os"), flush=True)
            for concurrency in (1, 16):
                print(resume_row(url, tmp, max(ops // 2, 100), concurrency), flush=True)
        with server(1) as url:
            for line in sync_rows(url, tmp, ops, args.rounds, "1 ms latency"):
                print(line, flush=True)
        with server(20) as url:
            for concurrency in (1, 16, 64):
                count = ops if concurrency > 1 else max(ops // 10, 50)
                print(async_row(url, tmp, count, args, concurrency, "20 ms latency"), flush=True)
            print(async_row(url, tmp, ops, args, 16, "20 ms latency", "os"), flush=True)
            print(threads_row(url, tmp, ops, args.rounds, 16, "20 ms latency"), flush=True)
        if not args.skip_postgres:
            postgres_rows(tmp, ops, args.rounds, args.backend)
    if not args.skip_audit:
        import bench_journal

        bench_journal.audit(1_000_000, rebuild=False)


if __name__ == "__main__":
    main()
