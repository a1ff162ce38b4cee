"""Audit queries on a large journal: what `idempotently list/show/stats` cost.

    python benchmarks/bench_journal.py [--operations 1000000]

Fills a fresh journal with N operations (1 % pending, 0.1 % needs_reconcile,
the rest succeeded, ~1.3 attempts each) in bulk, then times the read API the
CLI is built on. Prints milliseconds per call (best of 5).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import idempotently

HEADERS = json.dumps([["content-type", "application/json"], ["idempotency-key", "k"]])
BODY = b'{"amount":1000,"currency":"usd","customer":"cus_42"}'


def fill(journal: idempotently.Journal, count: int) -> str:
    now = time.time()
    probe = ""
    with journal._write() as conn:
        for start in range(0, count, 10_000):
            operations, attempts = [], []
            for i in range(start, min(start + 10_000, count)):
                status = (
                    "pending"
                    if i % 100 == 0
                    else "needs_reconcile"
                    if i % 1000 == 1
                    else "succeeded"
                )
                key = str(uuid.uuid4())
                operation_id = f"order-{i}:charge"
                created = now - (count - i)
                operations.append(
                    (
                        operation_id,
                        key,
                        status,
                        "exactly_once",
                        "POST",
                        "http://127.0.0.1/v1/charges",
                        HEADERS,
                        BODY,
                        "f" * 64,
                        "generic",
                        "Idempotency-Key",
                        created,
                        created,
                        created + 86400,
                        1 + (i % 3 == 0),
                        201 if status == "succeeded" else None,
                    )
                )
                for number in range(1, 2 + (i % 3 == 0)):
                    attempts.append(
                        (
                            operation_id,
                            number,
                            created,
                            0.001,
                            "answered",
                            409 if number == 1 and i % 3 == 0 else 201,
                            int(i % 7 == 0),
                        )
                    )
                probe = operation_id
            conn.executemany(
                "INSERT INTO operations (operation_id, key, status, delivery, method, url,"
                " request_headers, request_body, fingerprint, profile, key_header, created_at,"
                " updated_at, key_expires_at, attempt_count, last_status_code)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                operations,
            )
            conn.executemany(
                "INSERT INTO attempts (operation_id, number, started_at, elapsed, outcome,"
                " status_code, replayed) VALUES (?, ?, ?, ?, ?, ?, ?)",
                attempts,
            )
    return probe


def best_of(call: Callable[[], object], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--operations", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal.db"
        journal = idempotently.Journal(path)
        started = time.perf_counter()
        probe = fill(journal, args.operations)
        print(
            f"filled {args.operations:,} operations in {time.perf_counter() - started:.1f} s; "
            f"{path.stat().st_size / 1e6:.0f} MB"
        )
        now = time.time()
        queries: dict[str, Callable[[], object]] = {
            "counts()": journal.counts,
            "stats()  [idempotently stats]": lambda: journal.stats(now=now),
            "operations(status='pending', limit=50)": lambda: journal.operations(
                status="pending", limit=50
            ),
            "operations(limit=50)  [idempotently list]": lambda: journal.operations(limit=50),
            "operation(id)  [idempotently show]": lambda: journal.operation(probe),
            "prune(dry_run=True)": lambda: journal.prune(older_than=86400, now=now, dry_run=True),
        }
        for name, call in queries.items():
            print(f"{name:<45}{best_of(call):>10.1f} ms")
        journal.close()


if __name__ == "__main__":
    main()
