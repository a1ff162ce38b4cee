"""What the journal's audits cost at a million operations, and what keeping them fast costs.

    python benchmarks/bench_journal.py [--operations 1000000] [--rebuild]
    python benchmarks/bench_journal.py --hot-path [--ops 250] [--rounds 40]
    python benchmarks/bench_journal.py --store postgres [--postgres-url URL] [--operations N]

The first form builds a journal of N operations once (1 % pending, 0.1 %
needs_reconcile, 0.5 % failed, 0.05 % abandoned, the rest succeeded, ~1.3
attempts each), caches it under benchmarks/.data/, and times the read API the
CLI is built on (milliseconds, best of 5), then prunes a copy in full and
reports its longest transaction and what a concurrent writer waited.

The PostgreSQL form fills a journal of N operations in that database (or a throwaway
server's, under benchmarks/.data/) with one ``INSERT ... SELECT generate_series``
statement per table (the same mix), recounts it, and times the audits: counts,
stats, ``list --status needs_reconcile --limit 20`` and a prune dry run, beside the
``GROUP BY`` statements the counts took before journal_counts (best of 5, ms).

The last form times the two writes of every call, ``_insert_operation`` and
``_record_attempt``, on fresh journals: the schema, and the schema without each of its
partial indexes (median microseconds per call; the journals take turns, so a busy
machine slows all alike).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import sqlite3
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import idempotently
from idempotently import Journal
from idempotently._commands import Insert, Record
from idempotently._journal import DURABILITIES, AttemptRecord, Durability, NewOperation, _sqlite
from idempotently._vocabulary import STATUSES, Status

DATA = Path(__file__).parent / ".data"
HEADERS = '[["content-type", "application/json"], ["idempotency-key", "k"]]'
BODY = b'{"amount":1000,"currency":"usd","customer":"cus_42"}'
NOW = 1_800_000_000.0
"""The fill's clock: operation i of N was created N - i seconds before NOW."""
DAY = 86_400.0


def insert_operation(
    journal: Journal, new: NewOperation, *, owner: str, lease_until: float
) -> bool:
    """A call's first write: its key (through the journal's one execute path)."""
    return bool(journal._execute(Insert(new, owner, lease_until)))


def record_attempt(
    journal: Journal, operation_id: str, record: AttemptRecord, *, now: float
) -> None:
    """A call's second write: its answer."""
    journal._execute(Record(operation_id, record, now, None))


def status_of(i: int) -> str:
    if i % 100 == 0:
        return "pending"
    if i % 1000 == 1:
        return "needs_reconcile"
    if i % 200 == 3:
        return "failed"
    if i % 2000 == 7:
        return "abandoned"
    return "succeeded"


def fill(journal: idempotently.Journal, count: int) -> None:
    """Bulk inserts by hand (a first attempt in its operation's row, a second one in
    attempts), then one recount: the counts follow the journal's own writes only."""
    for start in range(0, count, 10_000):
        operations, attempts = [], []
        for i in range(start, min(start + 10_000, count)):
            status = status_of(i)
            operation_id = f"order-{i}:charge"
            created = NOW - (count - i)
            operations.append(
                (
                    operation_id,
                    str(uuid.uuid4()),
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
                    created + DAY,
                    1 + (i % 3 == 0),
                    201 if status == "succeeded" else None,
                    created,
                    0.001,
                    "answered",
                    409 if i % 3 == 0 else 201,
                    int(i % 7 == 0),
                )
            )
            for number in range(2, 2 + (i % 3 == 0)):
                attempts.append(
                    (
                        operation_id,
                        number,
                        created,
                        0.001,
                        "answered",
                        201,
                        int(i % 7 == 0),
                    )
                )
        with journal._store._write() as conn:
            conn.executemany(
                "INSERT INTO operations (operation_id, key, status, delivery, method, url,"
                " request_headers, request_body, fingerprint, profile, key_header, created_at,"
                " updated_at, key_expires_at, attempt_count, last_status_code,"
                " attempt1_started_at, attempt1_elapsed, attempt1_outcome,"
                " attempt1_status_code, attempt1_replayed)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                operations,
            )
            conn.executemany(
                "INSERT INTO attempts (operation_id, number, started_at, elapsed, outcome,"
                " status_code, replayed) VALUES (?, ?, ?, ?, ?, ?, ?)",
                attempts,
            )
    with journal._store._write() as conn:
        conn.execute(_sqlite._RECOUNT)


def cached_journal(count: int, rebuild: bool) -> Path:
    """The N-operation journal under benchmarks/.data/, built once."""
    path = DATA / f"journal-v{_sqlite.SCHEMA_VERSION}-{count}.db"
    if path.exists() and not rebuild:
        with idempotently.Journal(path, readonly=True) as journal:
            if count == sum(journal.counts().values()):
                print(f"cached: {path} ({path.stat().st_size / 1e6:.0f} MB)")
                return path
    DATA.mkdir(exist_ok=True)
    building = path.with_suffix(".building")
    for stale in (building, Path(f"{building}-wal"), Path(f"{building}-shm")):
        stale.unlink(missing_ok=True)
    started = time.perf_counter()
    with idempotently.Journal(building, durability="os") as journal:
        fill(journal, count)
    os.replace(building, path)  # closed: the WAL is checkpointed and gone
    print(
        f"filled {count:,} operations in {time.perf_counter() - started:.1f} s: "
        f"{path} ({path.stat().st_size / 1e6:.0f} MB)"
    )
    return path


def best_of(call: Callable[[], object], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times) * 1000


def audit(count: int, rebuild: bool) -> None:
    path = cached_journal(count, rebuild)
    probe = f"order-{count - 1}:charge"
    with idempotently.Journal(path, readonly=True) as journal:
        probe_key = journal.operations(limit=1)[0].key
        queries: dict[str, Callable[[], object]] = {
            "counts()": journal.counts,
            "stats()  [stats]": lambda: journal.stats(now=NOW),
            "operation(id)  [show]": lambda: journal.operation(probe),
            "operation(key)  [show]": lambda: journal.operation(probe_key),
            "prune(1 day, dry_run=True)": lambda: journal.prune(
                older_than=DAY, now=NOW, dry_run=True
            ),
            "prune(0 s, dry_run=True)": lambda: journal.prune(older_than=0, now=NOW, dry_run=True),
        }
        statuses: list[Status | tuple[Status, ...] | None] = [None, *STATUSES]
        statuses.append(("succeeded", "failed"))
        for status in statuses:
            for newest_first in (True, False):
                name = "list" if status is None else f"list --status {status}"
                order = "newest" if newest_first else "oldest"
                queries[f"operations(limit=50)  [{name}, {order} first]"] = functools.partial(
                    journal.operations, status=status, limit=50, newest_first=newest_first
                )
        for name, call in queries.items():
            print(f"{name:<62}{best_of(call):>9.1f} ms")
    prune_a_copy(path)


@contextlib.contextmanager
def timed_writes(journal: idempotently.Journal, held: list[float]) -> Iterator[None]:
    """Record how long each of the journal's write transactions holds the lock."""
    real = journal._store._write

    @contextlib.contextmanager
    def write(**options: Any) -> Iterator[sqlite3.Connection]:
        with real(**options) as conn:
            started = time.perf_counter()
            yield conn
        held.append(time.perf_counter() - started)

    journal._store._write = write  # type: ignore[method-assign]
    try:
        yield
    finally:
        journal._store._write = real  # type: ignore[method-assign]


def prune_a_copy(path: Path) -> None:
    """prune(older_than=1 day) on a copy, while another connection journals keys."""
    with tempfile.TemporaryDirectory(dir=DATA) as tmp:
        copy = Path(tmp) / "copy.db"
        shutil.copyfile(path, copy)
        held: list[float] = []
        waits: list[float] = []
        done = threading.Event()

        def writer() -> None:
            with idempotently.Journal(copy, durability="os") as other:
                number = 0
                while not done.is_set():
                    started = time.perf_counter()
                    insert_operation(
                        other, new_operation(f"writer-{number}", NOW), owner="bench", lease_until=0
                    )
                    waits.append(time.perf_counter() - started)
                    number += 1
                    time.sleep(0.005)

        with idempotently.Journal(copy) as journal, timed_writes(journal, held):
            thread = threading.Thread(target=writer)
            thread.start()
            started = time.perf_counter()
            deleted = journal.prune(older_than=DAY, now=NOW)
            elapsed = time.perf_counter() - started
            done.set()
            thread.join()
        held.sort()
        waits.sort()
        print(
            f"prune(1 day) on a copy: {deleted:,} operations in {elapsed:.1f} s, "
            f"{len(held)} transactions holding the lock {held[len(held) // 2] * 1000:.0f} ms "
            f"(median), {held[len(held) * 99 // 100] * 1000:.0f} ms (p99), "
            f"{held[-1] * 1000:.0f} ms (longest); a concurrent writer's {len(waits)} inserts "
            f"took {waits[len(waits) // 2] * 1000:.1f} ms (median), "
            f"{waits[len(waits) * 99 // 100] * 1000:.0f} ms (p99), "
            f"{waits[-1] * 1000:.0f} ms (longest)"
        )


# -- the hot path ------------------------------------------------------------------------

# name: (the tables' SQL, what to drop from them)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    f"version {_sqlite.SCHEMA_VERSION}": (_sqlite._SCHEMA, ()),
    "  without operations_pending": (_sqlite._SCHEMA, ("operations_pending",)),
    "  without operations_settled": (_sqlite._SCHEMA, ("operations_settled",)),
}


def new_operation(operation_id: str, now: float) -> NewOperation:
    return NewOperation(
        operation_id=operation_id,
        key=str(uuid.uuid4()),
        delivery="exactly_once",
        method="POST",
        url="http://127.0.0.1/v1/charges",
        request_headers=[("content-type", "application/json")],
        request_body=BODY,
        fingerprint="f" * 64,
        profile="generic",
        key_header="Idempotency-Key",
        created_at=now,
        key_expires_at=now + DAY,
        deadline_at=None,
    )


def variant(path: Path, durability: Durability, tables: str, dropped: tuple[str, ...]) -> Journal:
    real = _sqlite._SCHEMA
    _sqlite._SCHEMA = tables
    try:
        journal = idempotently.Journal(path, durability=durability)
    finally:
        _sqlite._SCHEMA = real
    for name in dropped:
        kind = journal._conn.execute(
            "SELECT type FROM sqlite_master WHERE name = ?", (name,)
        ).fetchone()[0]
        journal._conn.execute(f"DROP {kind} {name}")
    return journal


def calls(journal: Journal, first: int, count: int) -> tuple[list[float], list[float]]:
    """``count`` calls' two writes: the key's insert, then the completing attempt."""
    inserts, records = [], []
    now = time.time()
    for number in range(first, first + count):
        operation_id = f"op-{number}"
        started = time.perf_counter()
        insert_operation(
            journal, new_operation(operation_id, now), owner="bench", lease_until=now + 30
        )
        inserted = time.perf_counter()
        record_attempt(
            journal,
            operation_id,
            AttemptRecord(
                started_at=now,
                elapsed=0.001,
                outcome="answered",
                status_code=201,
                status="succeeded",
                response_status=201,
                response_headers=[("content-type", "application/json")],
                response_body=b'{"id":"ch_1"}',
            ),
            now=now,
        )
        records.append(time.perf_counter() - inserted)
        inserts.append(inserted - started)
    return inserts, records


def hot_path(ops: int, rounds: int) -> None:
    """Every variant's journal open at once, fed in turns of ``ops`` calls: load hits all alike."""
    for durability in DURABILITIES[::-1]:
        timings: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in VARIANTS}
        with tempfile.TemporaryDirectory() as tmp:
            journals = {
                name: variant(Path(tmp) / f"{number}.db", durability, tables, dropped)
                for number, (name, (tables, dropped)) in enumerate(VARIANTS.items())
            }
            for journal in journals.values():
                calls(journal, 0, 200)  # warm up
            for turn in range(rounds):
                for name, journal in journals.items():
                    inserts, records = calls(journal, 200 + turn * ops, ops)
                    timings[name][0].extend(inserts)
                    timings[name][1].extend(records)
            for journal in journals.values():
                journal.close()
        print(f"durability={durability!r}: median µs per call, {rounds} turns of {ops} calls")
        print(f"  {'schema':<36}{'insert key':>12}{'attempt':>12}")
        for name, (inserts, records) in timings.items():
            print(
                f"  {name:<36}{statistics.median(inserts) * 1e6:>12.1f}"
                f"{statistics.median(records) * 1e6:>12.1f}"
            )


def status_sql(i: str) -> str:
    """`status_of` in SQL."""
    return (
        f"CASE WHEN {i} % 100 = 0 THEN 'pending' WHEN {i} % 1000 = 1 THEN 'needs_reconcile' "
        f"WHEN {i} % 200 = 3 THEN 'failed' WHEN {i} % 2000 = 7 THEN 'abandoned' "
        "ELSE 'succeeded' END"
    )


def fill_postgres(url: str, count: int) -> None:
    """`fill`'s journal in PostgreSQL: one statement per table, then one recount."""
    import psycopg

    from idempotently._journal import _postgres

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {_postgres.SCHEMA} CASCADE")
    Journal(url).close()
    created = f"({NOW} - ({count} - i))"
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET search_path = idempotently")
        conn.execute(
            "INSERT INTO operations (operation_id, key, status, delivery, method, url, "
            "request_headers, request_body, fingerprint, profile, key_header, created_at, "
            "updated_at, key_expires_at, attempt_count, response_status, attempt1_started_at, "
            "attempt1_elapsed, attempt1_outcome, attempt1_status_code, attempt1_replayed) "
            f"SELECT 'order-' || i || ':charge', gen_random_uuid()::text, {status_sql('i')}, "
            "'exactly_once', 'POST', 'http://127.0.0.1/v1/charges', "
            f"$h${HEADERS}$h$, convert_to($b${BODY.decode()}$b$, 'UTF8'), repeat('f', 64), "
            f"'generic', 'Idempotency-Key', {created}, {created}, {created} + {DAY}, "
            f"1 + (i % 3 = 0)::int, CASE WHEN {status_sql('i')} = 'succeeded' THEN 201 END, "
            f"{created}, 0.001, 'answered', CASE WHEN i % 3 = 0 THEN 409 ELSE 201 END, "
            f"(i % 7 = 0)::int FROM generate_series(0, {count - 1}) AS i"
        )
        conn.execute(
            "INSERT INTO attempts (operation_id, number, started_at, elapsed, outcome, "
            f"status_code, replayed) SELECT 'order-' || i || ':charge', 2, {created}, 0.001, "
            f"'answered', 201, (i % 7 = 0)::int FROM generate_series(0, {count - 1}) AS i "
            "WHERE i % 3 = 0"
        )
        with Journal(url) as journal:
            journal._store.recount()
        conn.execute("VACUUM ANALYZE")
    print(f"filled {count:,} operations in {time.perf_counter() - started:.1f} s")


def audit_postgres(url: str, count: int, rebuild: bool) -> None:
    import psycopg

    with Journal(url) as journal:
        if rebuild or count != sum(journal.counts().values()):
            fill_postgres(url, count)
    with Journal(url, readonly=True) as journal, psycopg.connect(url) as conn:
        queries: dict[str, Callable[[], object]] = {
            "counts()": journal.counts,
            "stats()  [stats]": lambda: journal.stats(now=NOW),
            "operations(status=needs_reconcile, limit=20)  [list]": lambda: journal.operations(
                status="needs_reconcile", limit=20
            ),
            "prune(1 day, dry_run=True)": lambda: journal.prune(
                older_than=DAY, now=NOW, dry_run=True
            ),
            "before: counts (GROUP BY status)": lambda: conn.execute(
                "SELECT status, count(*) FROM idempotently.operations GROUP BY status"
            ).fetchall(),
            "before: stats' attempt figures (both tables scanned)": lambda: conn.execute(
                "SELECT count(*), count(status_code), sum(replayed), "
                "count(*) FILTER (WHERE status_code IN (409, 423)) FROM idempotently.attempts "
                "UNION ALL SELECT count(attempt1_outcome), count(attempt1_status_code), "
                "sum(attempt1_replayed), count(*) FILTER (WHERE attempt1_status_code "
                "IN (409, 423)) FROM idempotently.operations"
            ).fetchall(),
        }
        for name, call in queries.items():
            print(f"{name:<62}{best_of(call):>9.1f} ms")


def postgres_audit(args: argparse.Namespace) -> None:
    if args.postgres_url:
        audit_postgres(args.postgres_url, args.operations, args.rebuild)
        return
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from tests.postgres_server import postgres_server

    DATA.mkdir(exist_ok=True)
    with postgres_server(parent=DATA) as server:
        audit_postgres(server.url(), args.operations, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--operations", type=int, default=1_000_000)
    parser.add_argument("--rebuild", action="store_true", help="refill the cached journal")
    parser.add_argument("--hot-path", action="store_true", help="time the writes of each call")
    parser.add_argument("--ops", type=int, default=250, help="calls per hot-path turn")
    parser.add_argument("--rounds", type=int, default=40, help="hot-path turns per journal")
    parser.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--postgres-url", help="with --store postgres: fill this database")
    args = parser.parse_args()
    if args.store == "postgres":
        postgres_audit(args)
    elif args.hot_path:
        hot_path(args.ops, args.rounds)
    else:
        audit(args.operations, args.rebuild)


if __name__ == "__main__":
    main()
