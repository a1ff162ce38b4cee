"""Async calls with no server at all: bare httpx.AsyncClient against AsyncSession, in one process.

    python benchmarks/bench_async_inprocess.py [--durability os] [--concurrency 16]
                                               [--latency 0.02] [--calls 960] [--rounds 2]

Both clients use an in-process transport whose answer comes after ``--latency``
seconds (``anyio.sleep``), so no server shares the CPU with the client: what
the ratio shows is the journal's cost in latency and client CPU alone, the
figures docs/performance.md gives for the async writes that commit on the
event loop. Each round runs bare then journaled; CPU per call is the process's
CPU time (every thread) divided by the calls.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anyio
import httpx

import idempotently


class Answering(httpx.AsyncBaseTransport):
    """Answers 200 after ``latency`` seconds, without a socket."""

    def __init__(self, latency: float) -> None:
        self.latency = latency

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        if self.latency:
            await anyio.sleep(self.latency)
        return httpx.Response(200, json={"id": "ch_1"})


async def timed(client: httpx.AsyncClient, calls: int, concurrency: int) -> tuple[float, float]:
    """(calls per second, CPU seconds per call) for ``calls`` posts by ``concurrency`` tasks."""

    async def worker(count: int) -> None:
        for _ in range(count):
            await client.post("/v1/charges", json={"amount": 100})

    wall, cpu = time.perf_counter(), time.process_time()
    async with anyio.create_task_group() as group:
        for _ in range(concurrency):
            group.start_soon(worker, calls // concurrency)
    done = calls // concurrency * concurrency
    return done / (time.perf_counter() - wall), (time.process_time() - cpu) / done


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        journal = idempotently.Journal(Path(tmp) / "journal.db", durability=args.durability)
        async with (
            httpx.AsyncClient(transport=Answering(args.latency), base_url="http://x") as bare,
            idempotently.AsyncSession(
                journal, transport=Answering(args.latency), base_url="http://x"
            ) as journaled,
        ):
            for client in (bare, journaled):  # warm up
                await timed(client, args.concurrency * 5, args.concurrency)
            print(
                f"durability={args.durability!r}, concurrency {args.concurrency}, "
                f"latency {args.latency * 1000:g} ms"
            )
            for _ in range(args.rounds):
                bare_rate, bare_cpu = await timed(bare, args.calls, args.concurrency)
                rate, cpu = await timed(journaled, args.calls, args.concurrency)
                print(
                    f"bare {bare_rate:7.0f} ops/s {bare_cpu * 1e6:6.0f} µs CPU/call   "
                    f"journaled {rate:7.0f} ops/s {cpu * 1e6:6.0f} µs CPU/call   "
                    f"ratio {rate / bare_rate:.2f}"
                )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--durability", default="os", choices=["fsync", "os"])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--latency", type=float, default=0.02, help="seconds per answer")
    parser.add_argument("--calls", type=int, default=960, help="calls per series")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    arguments = parser.parse_args()
    anyio.run(main, arguments, backend=arguments.backend)
