"""Journaled Session.post against bare httpx on the same loopback server, in one run.

    python benchmarks/bench_post.py [--ops 2000] [--rounds 10]

The server is uvicorn in its own process on 127.0.0.1, so it does not share a
GIL with the client. Bare and journaled batches are interleaved round by
round, so drift in the machine hits both alike. The journal lives in a fresh
temporary directory with the default durability (key row fsync'd before send).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import httpx

import idempotently

HERE = Path(__file__).resolve().parent
PAYLOAD = {"amount": 1000, "currency": "usd", "customer": "cus_42"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(latency_ms: float = 0.0) -> tuple[subprocess.Popen[bytes], str]:
    """uvicorn with the loopback app in its own process; every answer waits ``latency_ms``."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "loopback_app:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
        ],
        cwd=HERE,
        env={**os.environ, "BENCH_LATENCY_MS": str(latency_ms)},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.post(url, json={})
            return process, url
        except httpx.TransportError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit("the loopback server did not start")


class Series:
    def __init__(self, name: str) -> None:
        self.name = name
        self.latencies: list[float] = []
        self.elapsed = 0.0
        self.ops = 0

    def ops_per_second(self) -> float:
        return self.ops / self.elapsed

    def row(self, baseline: Series | None) -> str:
        ordered = sorted(self.latencies)
        p50 = statistics.median(ordered) * 1000
        p99 = ordered[int(len(ordered) * 0.99) - 1] * 1000
        ratio = (
            "" if baseline is None else f"{self.ops_per_second() / baseline.ops_per_second():6.2f}"
        )
        return f"{self.name:<34}{self.ops_per_second():>9.0f}{p50:>10.3f}{p99:>10.3f}  {ratio}"


def timed_batch(series: Series, count: int, call: Callable[[], object]) -> None:
    started = time.perf_counter()
    for _ in range(count):
        before = time.perf_counter()
        call()
        series.latencies.append(time.perf_counter() - before)
    series.elapsed += time.perf_counter() - started
    series.ops += count


async def timed_async_batch(
    series: Series, count: int, concurrency: int, call: Callable[[], Awaitable[object]]
) -> None:
    remaining = count

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            before = time.perf_counter()
            await call()
            series.latencies.append(time.perf_counter() - before)

    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(concurrency):
            group.start_soon(worker)
    series.elapsed += time.perf_counter() - started
    series.ops += count


def header() -> str:
    return f"{'':<34}{'ops/s':>9}{'p50 ms':>10}{'p99 ms':>10}  ratio"


def bench_sync(url: str, tmp: Path, ops: int, rounds: int) -> tuple[Series, Series, Series]:
    bare, journaled = Series("httpx.Client.post"), Series("idempotently.Session.post")
    unsynced = Series('  same, Journal(durability="os")')
    per_round = ops // rounds
    with (
        httpx.Client(base_url=url) as client,
        idempotently.Session(tmp / f"{uuid.uuid4()}.db", base_url=url) as s,
        idempotently.Session(
            idempotently.Journal(tmp / f"{uuid.uuid4()}.db", durability="os"), base_url=url
        ) as fast,
    ):
        for _ in range(20):  # warm the connection pools
            for sender in (client, s, fast):
                sender.post("/v1/charges", json=PAYLOAD)
        for _ in range(rounds):
            timed_batch(bare, per_round, lambda: client.post("/v1/charges", json=PAYLOAD))
            timed_batch(journaled, per_round, lambda: s.post("/v1/charges", json=PAYLOAD))
            timed_batch(unsynced, per_round, lambda: fast.post("/v1/charges", json=PAYLOAD))
    return bare, journaled, unsynced


async def bench_async(
    url: str, journal: Path, ops: int, rounds: int, concurrency: int
) -> tuple[Series, Series]:
    bare = Series(f"httpx.AsyncClient.post (c={concurrency})")
    journaled = Series(f"idempotently.AsyncSession.post (c={concurrency})")
    per_round = ops // rounds
    limits = httpx.Limits(max_connections=concurrency)
    async with (
        httpx.AsyncClient(base_url=url, limits=limits) as client,
        idempotently.AsyncSession(journal, base_url=url, limits=limits) as s,
    ):
        for _ in range(20):
            await client.post("/v1/charges", json=PAYLOAD)
            await s.post("/v1/charges", json=PAYLOAD)
        for _ in range(rounds):
            await timed_async_batch(
                bare, per_round, concurrency, lambda: client.post("/v1/charges", json=PAYLOAD)
            )
            await timed_async_batch(
                journaled, per_round, concurrency, lambda: s.post("/v1/charges", json=PAYLOAD)
            )
    return bare, journaled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="operations per series")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    args = parser.parse_args()
    process, url = start_server()
    try:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
            print(f"loopback server {url}; journal in {tmp}; {args.ops} ops per series")
            print(header())
            bare, journaled, unsynced = bench_sync(url, Path(tmp), args.ops, args.rounds)
            print(bare.row(None))
            print(journaled.row(bare))
            print(unsynced.row(bare))
            for concurrency in (1, 10):
                bare, journaled = anyio.run(
                    bench_async,
                    url,
                    Path(tmp) / f"{uuid.uuid4()}.db",
                    args.ops,
                    args.rounds,
                    concurrency,
                    backend=args.backend,
                )
                print(bare.row(None))
                print(journaled.row(bare))
    finally:
        process.terminate()
        process.wait(timeout=10)


if __name__ == "__main__":
    main()
