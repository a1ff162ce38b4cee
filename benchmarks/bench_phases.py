"""Where a journaled Session.post spends its time, against the same loopback server.

    python benchmarks/bench_phases.py [--ops 2000] [--no-fsync]

Wraps the journal writes and httpx's send with timers inside real calls and
prints medians; --no-fsync commits the key row like Journal(durability="os"),
to show what the fsync itself costs in flow.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from bench_post import PAYLOAD, start_server

import idempotently
from idempotently._commands import Insert, Record


def timed(
    timings: dict[str, list[float]], label: str, call: Callable[..., Any]
) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            timings.setdefault(label, []).append(time.perf_counter() - started)

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--no-fsync", action="store_true")
    args = parser.parse_args()
    process, url = start_server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            journal = idempotently.Journal(
                Path(tmp) / "journal.db", durability="os" if args.no_fsync else "fsync"
            )
            timings: dict[str, list[float]] = {}
            with (
                httpx.Client(base_url=url) as client,
                idempotently.Session(journal, base_url=url) as session,
            ):
                execute = journal._execute
                key = timed(timings, "journal: insert key row + commit", execute)
                answer = timed(timings, "journal: attempt + completion commit", execute)

                def timed_execute(command: Any) -> Any:
                    if isinstance(command, Insert):
                        return key(command)
                    if isinstance(command, Record):
                        return answer(command)
                    return execute(command)

                journal._execute = timed_execute  # type: ignore[method-assign]
                session.client.send = timed(  # type: ignore[method-assign]
                    timings, "httpx send (inside Session.post)", session.client.send
                )
                for _ in range(200):
                    client.post("/v1/charges", json=PAYLOAD)
                    session.post("/v1/charges", json=PAYLOAD)
                timings.clear()
                for _ in range(args.ops):
                    timed(timings, "bare httpx.Client.post", client.post)(
                        "/v1/charges", json=PAYLOAD
                    )
                    timed(timings, "idempotently.Session.post", session.post)(
                        "/v1/charges", json=PAYLOAD
                    )
            fsync = "without" if args.no_fsync else "with"
            print(f"medians over {args.ops} calls, key row committed {fsync} fsync")
            for label, values in timings.items():
                print(f"  {label:<40}{statistics.median(values) * 1000:8.3f} ms")
    finally:
        process.terminate()
        process.wait(timeout=10)


if __name__ == "__main__":
    main()
