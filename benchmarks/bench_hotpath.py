"""Instructions per journaled POST against bare httpx, counted by callgrind.

    python benchmarks/bench_hotpath.py                  # every client, printed as a table
    python benchmarks/bench_hotpath.py --client session --durability os   # one count
    python benchmarks/bench_hotpath.py --run session-os 500               # (what valgrind runs)

Each figure runs the same script twice under ``valgrind --tool=callgrind``, with N
and M operations after the same warm-up, and divides the difference in
instructions by M - N: interpreter start-up, imports and the journal's creation
cancel out, and the count does not depend on the machine's load. The server is an
in-process ``httpx.MockTransport``, so only the client's Python work is counted.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

import idempotently

PAYLOAD = {"amount": 1000, "currency": "usd", "customer": "cus_42"}
WARM_UP = 20
URL = "https://api.example.test/v1/charges"
CLIENTS = (
    "bare",
    "session-os",
    "session-os-nobudget",
    "session-fsync",
    "bare-async16",
    "async16-os",
    "flow-only",
)
"""``flow-only``: a Session whose journal commands are answered by a stub (no SQLite),
to tell the flow's own Python from the journal's. ``session-os-nobudget``: the same
Session with ``RetryPolicy(budget=None)``, so that the retry budget's cost on the happy
path is its difference from ``session-os``."""


def _answer(request: httpx.Request) -> httpx.Response:
    return httpx.Response(201, json={"id": "ch_1"})


def _run_sync(client_name: str, ops: int) -> None:
    import idempotently

    client = httpx.Client(transport=httpx.MockTransport(_answer))
    if client_name == "bare":
        for _ in range(WARM_UP + ops):
            client.post(URL, json=PAYLOAD)
        return
    budget = not client_name.endswith("-nobudget")
    durability = client_name.removesuffix("-nobudget").rpartition("-")[2]
    policy = idempotently.RetryPolicy() if budget else idempotently.RetryPolicy(budget=None)
    with tempfile.TemporaryDirectory() as directory:
        journal = idempotently.Journal(
            Path(directory, "ops.db"), durability="os" if durability == "only" else durability
        )
        if client_name == "flow-only":
            _stub_commands(journal)
        with idempotently.Session(journal, client=client, policy=policy) as session:
            for i in range(WARM_UP + ops):
                session.post(URL, json=PAYLOAD, operation_id=f"o-{i}")
        journal.close()


def _stub_commands(journal: idempotently.Journal) -> None:
    # bench_counts.py's flow-only row's stub (this script's directory is on sys.path).
    from bench_counts import _answer_commands_at_once

    _answer_commands_at_once(journal)


def _run_async(client_name: str, ops: int, concurrency: int = 16) -> None:
    import anyio

    import idempotently

    async def main() -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(_answer))

        async def batch(post: object, start: int, count: int) -> None:
            async with anyio.create_task_group() as tasks:
                for i in range(start, start + count):
                    tasks.start_soon(post, i)  # type: ignore[arg-type]

        async def rounds(post: object) -> None:
            await batch(post, 0, WARM_UP)
            done = WARM_UP
            while done < WARM_UP + ops:
                count = min(concurrency, WARM_UP + ops - done)
                await batch(post, done, count)
                done += count

        if client_name == "bare-async16":

            async def bare(i: int) -> None:
                await client.post(URL, json=PAYLOAD)

            await rounds(bare)
            return
        with tempfile.TemporaryDirectory() as directory:
            journal = idempotently.Journal(Path(directory, "ops.db"), durability="os")
            async with idempotently.AsyncSession(journal, client=client) as session:

                async def journaled(i: int) -> None:
                    await session.post(URL, json=PAYLOAD, operation_id=f"o-{i}")

                await rounds(journaled)
            journal.close()

    anyio.run(main)


def run(client_name: str, ops: int) -> None:
    if "async" in client_name:
        _run_async(client_name, ops)
    else:
        _run_sync(client_name, ops)


def instructions(client_name: str, ops: int) -> int:
    """Instructions callgrind counts for one run of ``ops`` operations (all threads)."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory, "callgrind.out")
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--run",
                client_name,
                str(ops),
            ],
            check=True,
            capture_output=True,
            env={**os.environ, "PYTHONHASHSEED": "0"},
        )
        total = 0
        # One file per thread with --separate-threads; one file with a totals line here.
        for path in Path(directory).glob("callgrind.out*"):
            match = re.search(r"^(?:summary|totals): (\d+)", path.read_text(), re.M)
            if match:
                total += int(match.group(1))
        return total


def per_op(client_name: str, low: int, high: int) -> float:
    return (instructions(client_name, high) - instructions(client_name, low)) / (high - low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", nargs=2, metavar=("CLIENT", "OPS"), help=argparse.SUPPRESS)
    parser.add_argument("--client", choices=CLIENTS, action="append")
    parser.add_argument("--low", type=int, default=100)
    parser.add_argument("--high", type=int, default=500)
    args = parser.parse_args()
    if args.run:
        run(args.run[0], int(args.run[1]))
        return
    chosen = args.client or list(CLIENTS)
    figures = {name: per_op(name, args.low, args.high) for name in chosen}
    for name, figure in figures.items():
        base = figures.get("bare-async16" if "async" in name else "bare")
        ratio = f"{figure / base:.2f}x" if base else ""
        print(f"{name:15} {figure / 1000:9.1f}k instructions/op  {ratio}")


if __name__ == "__main__":
    main()
