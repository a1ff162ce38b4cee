"""Per-operation counts that do not move with machine load: instructions, system calls,
WAL pages and SQLite statements per logical POST (issue 17, item 7).

    python benchmarks/bench_counts.py [--rows bare,session-os,...] [--repeat 2]
        [--callgrind-ops 100,600] [--strace-ops 300,1800] [--stats-ops 500]
        [--wall-ops 1000] [--show-statements] [--postgres | --postgres-url URL]
        [--clock-rate 1000 | --real-clock]                     (nox -s bench -- counts)

Every row posts the benchmark's small JSON charge to an in-process
``httpx.MockTransport`` answering 201 with a small JSON body, so no server
shares the machine and nothing waits on a network. Each figure comes from a
child process (this script with ``--child ROW``) that does a warm-up and then
``--ops`` operations:

- instructions/op: the child runs under ``valgrind --tool=callgrind`` with N
  and with M operations; (Ir(M) - Ir(N)) / (M - N), so start-up and warm-up
  cancel. ``--repeat 2`` measures every pair twice and prints both.
- system calls/op: the same with ``strace -f -c``, plus the top few calls.
- WAL pages/op (SQLite rows): the journal's own connection gets
  ``PRAGMA wal_autocheckpoint=0`` and a ``wal_checkpoint(TRUNCATE)`` after the
  warm-up; after K operations the WAL holds (size - 32) / (page_size + 24)
  frames (cross-checked against the frame count ``wal_checkpoint`` reports).
- statements/op (SQLite rows): ``set_trace_callback`` on the same connection.
  SQLite also reports each trigger program it runs, which Python's callback
  shows as the triggering statement again: consecutive identical texts are
  counted once (and the repeats as trigger runs).
- ops/s: one plain run of each row, one after the other (a sanity check, the
  one figure here that moves with load).

Rows: ``bare`` (httpx.Client), ``floor-os`` and ``floor-fsync`` (the least a
journaled client must do, written here with sqlite3: insert the key's row,
send with the key header, update the row with the answer; for "fsync" the
insert commits with ``synchronous=FULL`` and the update with NORMAL, as the
library's durability promises only the key's row), ``session-os`` and
``session-fsync`` (idempotently.Session), ``transport`` (an ``httpx.Client`` over
``idempotently.Transport``, durability "os", each request naming its operation with
the ``Idempotency-Operation-Id`` header, so it has the Session rows' operation ids
and derived keys), ``flow-only`` (the ``session-os`` Session with every journal
command answered at once by a stub, as an empty journal would: the flow's own Python,
no SQLite; its difference from ``session-os`` is the journal's share),
``bare-async-c1``/``-c16`` and ``async-c1``/``-c16`` (httpx.AsyncClient and
idempotently.AsyncSession, durability "os", c tasks on asyncio), and ``postgres`` (a
Session on ``Journal(url)``, only with ``--postgres`` or ``--postgres-url``: its
"statements" column is round trips, the ``sendto`` calls per operation).

The clock: every journaled row gets ``clock=`` (the public Session and Transport
argument) a simulated one, in which each operation takes ``1 / --clock-rate``
seconds (1 ms by default) and time stands still within it. What runs "once a
second" (the engine's read of the journal's origin pauses) then runs once every
``--clock-rate`` operations in every child, at full speed as under valgrind or
strace, where the real clock would make it run as many times more often per
operation as the tool slows the child down (some 50 times under callgrind).
``--real-clock`` gives the journaled rows ``time.time`` instead (the figures
before the clock was injected).

Only the public API is used, plus :func:`_journal_connection` to reach the
SQLite journal's connection for the WAL and statement counts, and
:func:`_answer_commands_at_once` for the ``flow-only`` row, which no public option
can give: a journal that does no I/O.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

import idempotently

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
PATH = "/v1/charges"
BASE_URL = "http://bench.invalid"
PAYLOAD = {"amount": 1000, "currency": "usd", "customer": "cus_42"}
ANSWER = {"id": "ch_1", "object": "charge", **PAYLOAD}
FLOOR_NAMESPACE = uuid.UUID("6f1c5c9e-8d0b-4d43-9a52-3f4e1b7c2a10")

SYNC_ROWS = (
    "bare",
    "floor-os",
    "floor-fsync",
    "session-os",
    "session-fsync",
    "transport",
    "flow-only",
)
ASYNC_ROWS = ("bare-async-c1", "async-c1", "bare-async-c16", "async-c16")
ALL_ROWS = (*SYNC_ROWS, *ASYNC_ROWS, "postgres")
RESULT = "BENCH_COUNTS_RESULT "


# -- the child: one row, warm-up then --ops operations ---------------------------------


def answer(request: httpx.Request) -> httpx.Response:
    return httpx.Response(201, json=ANSWER)


async def answer_async(request: httpx.Request) -> httpx.Response:
    return httpx.Response(201, json=ANSWER)


def _journal_connection(journal: Any) -> sqlite3.Connection:
    """The SQLite connection a journal writes through (benchmark only: private attributes).

    ``journal._store._conn`` once the journal is a facade over a store, else
    ``journal._conn``.
    """
    store = getattr(journal, "_store", None)
    for owner in (store, journal):
        conn = getattr(owner, "_conn", None) if owner is not None else None
        if isinstance(conn, sqlite3.Connection):
            return conn
    raise RuntimeError(f"cannot find the SQLite connection of {type(journal).__name__}")


class Ticks:
    """A simulated clock for the journaled rows: each operation takes ``1 / rate``
    seconds, and time stands still within one. ``count`` is the operations started."""

    def __init__(self, rate: float) -> None:
        self.start, self.rate, self.count = time.time(), rate, 0

    def __call__(self) -> float:
        return self.start + self.count / self.rate


def _answer_commands_at_once(journal: idempotently.Journal) -> None:
    """Answer every journal command of ``journal`` as an empty journal would, with no
    I/O: what is left of a call is the flow's own Python (benchmark only: it replaces
    the private ``Journal._execute``, the one door through which the drivers and the
    heartbeat reach the store)."""
    from idempotently import _commands as c

    granted = (c.Insert, c.TakeLease, c.SetStatus, c.BindCredentials, c.RenewLease)

    def execute(command: object) -> object:
        if isinstance(command, granted):
            return True
        if isinstance(command, c.Pauses):
            return ()
        if isinstance(command, c.ExtendLeases):
            return len(command.leases)
        return None  # Find: no such operation; Record, Release: nothing to answer

    journal._execute = execute  # type: ignore[method-assign]


class Floor:
    """The raw-sqlite floor: the least any journaled client must do per operation."""

    def __init__(self, path: Path, durability: str) -> None:
        self.path = path
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS ops (id TEXT PRIMARY KEY, key TEXT NOT NULL, "
            "status TEXT, body BLOB, response BLOB)"
        )
        self.fsync = durability == "fsync"
        self.conn.execute(f"PRAGMA synchronous = {'FULL' if self.fsync else 'NORMAL'}")
        self.client = httpx.Client(transport=httpx.MockTransport(answer), base_url=BASE_URL)

    def post(self, operation_id: str) -> httpx.Response:
        key = str(uuid.uuid5(FLOOR_NAMESPACE, operation_id))
        request = self.client.build_request(
            "POST", PATH, json=PAYLOAD, headers={"Idempotency-Key": key}
        )
        # A lone statement in autocommit: committed (and with FULL, fsync'd) before sending.
        self.conn.execute(
            "INSERT INTO ops (id, key, status, body) VALUES (?, ?, 'pending', ?)",
            (operation_id, key, request.content),
        )
        if self.fsync:
            self.conn.execute("PRAGMA synchronous = NORMAL")  # a lost completion is harmless
        response = self.client.send(request)
        self.conn.execute(
            "UPDATE ops SET status = ?, response = ? WHERE id = ?",
            (str(response.status_code), response.content, operation_id),
        )
        if self.fsync:
            self.conn.execute("PRAGMA synchronous = FULL")
        return response

    def close(self) -> None:
        self.client.close()
        self.conn.close()


class Row:
    """One row's client: ``run(start, count)`` posts operations start..start+count-1."""

    conn: sqlite3.Connection | None = None
    wal: Path | None = None

    def run(self, start: int, count: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SyncRow(Row):
    def __init__(self, post: Callable[[str], object], close: Callable[[], None]) -> None:
        self.post, self._close = post, close

    def run(self, start: int, count: int) -> None:
        post = self.post
        for i in range(start, start + count):
            post(f"order-{i}")

    def close(self) -> None:
        self._close()


class AsyncRow(Row):
    def __init__(
        self, client: Any, concurrency: int, journaled: bool, ticks: Ticks | None = None
    ) -> None:
        self.client, self.concurrency, self.journaled = client, concurrency, journaled
        self.ticks = ticks
        self.loop = asyncio.new_event_loop()

    async def _run(self, start: int, count: int) -> None:
        ticks = self.ticks

        async def worker(first: int) -> None:
            for i in range(first, start + count, self.concurrency):
                if self.journaled:
                    if ticks is not None:
                        ticks.count += 1  # never backwards, however the tasks interleave
                    await self.client.post(PATH, json=PAYLOAD, operation_id=f"order-{i}")
                else:
                    await self.client.post(PATH, json=PAYLOAD)

        await asyncio.gather(*(worker(start + n) for n in range(self.concurrency)))

    def run(self, start: int, count: int) -> None:
        self.loop.run_until_complete(self._run(start, count))

    def close(self) -> None:
        closing = self.client.aclose() if hasattr(self.client, "aclose") else None
        if closing is not None:
            self.loop.run_until_complete(closing)
        self.loop.close()


def make_row(name: str, tmp: Path, postgres_url: str | None, clock_rate: float | None) -> Row:
    """The row's client; ``clock_rate`` None: the journaled rows read ``time.time``."""
    path = tmp / "journal.db"
    ticks = Ticks(clock_rate) if clock_rate else None
    clock: Callable[[], float] = ticks if ticks is not None else time.time
    if name == "bare":
        client = httpx.Client(transport=httpx.MockTransport(answer), base_url=BASE_URL)
        return SyncRow(lambda _: client.post(PATH, json=PAYLOAD), client.close)
    if name.startswith("floor-"):
        floor = Floor(path, name.removeprefix("floor-"))
        row: Row = SyncRow(floor.post, floor.close)
        row.conn, row.wal = floor.conn, Path(f"{path}-wal")
        return row
    if name == "transport":
        journal = idempotently.Journal(path, durability="os")
        client = httpx.Client(
            transport=idempotently.Transport(
                journal, transport=httpx.MockTransport(answer), clock=clock
            ),
            base_url=BASE_URL,
        )

        def send(operation_id: str) -> object:
            if ticks is not None:
                ticks.count += 1
            return client.post(
                PATH, json=PAYLOAD, headers={"Idempotency-Operation-Id": operation_id}
            )

        def close() -> None:
            client.close()
            journal.close()

        row = SyncRow(send, close)
        row.conn, row.wal = _journal_connection(journal), Path(f"{path}-wal")
        return row
    if name.startswith("session-") or name in ("postgres", "flow-only"):
        if name == "postgres":
            if not postgres_url:
                raise SystemExit("the postgres row needs --postgres-url")
            journal = idempotently.Journal(postgres_url)
        else:
            durability = "os" if name == "flow-only" else name.removeprefix("session-")
            journal = idempotently.Journal(path, durability=durability)  # type: ignore[arg-type]
        if name == "flow-only":
            _answer_commands_at_once(journal)
        session = idempotently.Session(
            journal,
            client=httpx.Client(transport=httpx.MockTransport(answer), base_url=BASE_URL),
            clock=clock,
        )

        # A database outlives a child: ids of this child's own (all the same length), so
        # no operation is a replay of an earlier child's.
        prefix = f"{uuid.uuid4().hex[:12]}:" if name == "postgres" else ""

        def post(operation_id: str) -> object:
            if ticks is not None:
                ticks.count += 1
            return session.post(PATH, json=PAYLOAD, operation_id=prefix + operation_id)

        row = SyncRow(post, session.close)
        if name.startswith("session-"):
            row.conn, row.wal = _journal_connection(journal), Path(f"{path}-wal")
        return row
    concurrency = int(name.rsplit("-c", 1)[1])
    transport = httpx.MockTransport(answer_async)
    if name.startswith("bare-async-"):
        return AsyncRow(
            httpx.AsyncClient(transport=transport, base_url=BASE_URL), concurrency, False
        )
    journal = idempotently.Journal(path, durability="os")
    session = idempotently.AsyncSession(
        journal, client=httpx.AsyncClient(transport=transport, base_url=BASE_URL), clock=clock
    )
    row = AsyncRow(session, concurrency, True, ticks)
    row.conn, row.wal = _journal_connection(journal), Path(f"{path}-wal")
    return row


_LITERAL = re.compile(r"X'[0-9A-F]*'|'(?:[^']|'')*'|\b\d+(?:\.\d+)?\b", re.IGNORECASE)


class StatementCounter:
    """Statements run on one connection, through ``set_trace_callback``."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def __call__(self, text: str) -> None:
        self.texts.append(text)

    def distinct(self) -> tuple[int, int, Counter[str]]:
        """(statements, trigger runs, statements by normalised text)."""
        statements, triggers, last = Counter[str](), 0, None
        for text in self.texts:
            if text == last:
                triggers += 1  # SQLite reports each trigger program as its statement again
                continue
            last = text
            statements[" ".join(_LITERAL.sub("?", text).split())[:110]] += 1
        return sum(statements.values()), triggers, statements


def wal_frames(row: Row) -> int:
    assert row.conn is not None and row.wal is not None
    page_size = int(row.conn.execute("PRAGMA page_size").fetchone()[0])
    size = row.wal.stat().st_size if row.wal.exists() else 0
    return max(0, size - 32) // (page_size + 24)


def count_statements(row: Row, start: int, count: int) -> dict[str, Any]:
    """Statements run on the row's connection for ``count`` operations, settings untouched."""
    assert row.conn is not None
    counter = StatementCounter()
    row.conn.set_trace_callback(counter)
    try:
        row.run(start, count)
    finally:
        row.conn.set_trace_callback(None)
    statements, triggers, by_text = counter.distinct()
    return {
        "statements": statements,
        "trigger_runs": triggers,
        "statement_texts": by_text.most_common(),
    }


def count_wal_frames(row: Row, start: int, count: int) -> dict[str, Any]:
    """WAL frames written by ``count`` operations, with no checkpoint meanwhile."""
    assert row.conn is not None
    # No checkpoint during the run, and an empty WAL to start from.
    row.conn.execute("PRAGMA wal_autocheckpoint = 0")
    row.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    before = wal_frames(row)
    row.run(start, count)
    after = wal_frames(row)
    # The WAL's own frame count, as SQLite reports it (checkpointing now changes nothing
    # measured: the run is over).
    busy, log, _ = row.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return {"wal_frames": after - before, "wal_log": None if busy else log}


def child(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-counts-", dir=args.tmp) as name:
        clock_rate = None if args.real_clock else args.clock_rate
        row = make_row(args.child, Path(name), args.postgres_url, clock_rate)
        try:
            row.run(0, args.warmup)
            result: dict[str, Any] = {"row": args.child, "ops": args.ops}
            started = time.perf_counter()
            row.run(args.warmup, args.ops)
            result["seconds"] = time.perf_counter() - started
            if args.stats and row.conn is not None:
                result.update(count_statements(row, args.warmup + args.ops, args.ops))
                result.update(count_wal_frames(row, args.warmup + 2 * args.ops, args.ops))
        finally:
            row.close()
    print(RESULT + json.dumps(result), flush=True)


# -- the parent: run the children, print the tables ------------------------------------


def child_command(args: argparse.Namespace, row: str, ops: int, *extra: str) -> list[str]:
    command = [sys.executable, str(SCRIPT), "--child", row, "--ops", str(ops)]
    command += ["--warmup", str(args.warmup), *extra]
    command += ["--real-clock"] if args.real_clock else ["--clock-rate", str(args.clock_rate)]
    if row == "postgres":
        # A new database per child on a server of our own (the same tables for every run).
        server = getattr(args, "postgres_server", None)
        command += ["--postgres-url", server.new_database() if server else args.postgres_url]
    if args.tmp:
        command += ["--tmp", args.tmp]
    return command


PYCACHE = Path(tempfile.gettempdir()) / "bench-counts-pycache"


def run_child(command: list[str]) -> dict[str, Any]:
    # A fixed hash seed: the same dict and set layouts in every run of a pair. Bytecode
    # cached outside the tree, so a child under callgrind does not compile every module.
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPYCACHEPREFIX": str(PYCACHE)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return dict(json.loads(line[len(RESULT) :]))
    raise RuntimeError(
        f"{shlex.join(command)} exited {done.returncode}:\n{(done.stderr or done.stdout)[-2000:]}"
    )


def callgrind_total(args: argparse.Namespace, row: str, ops: int, out: Path) -> int:
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "-q"]
    run_child([*command, *child_command(args, row, ops)])
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no summary: or totals: line in {out}")


def strace_counts(args: argparse.Namespace, row: str, ops: int, out: Path) -> Counter[str]:
    run_child(["strace", "-f", "-c", "-o", str(out), *child_command(args, row, ops)])
    calls = Counter[str]()
    for line in out.read_text().splitlines():
        fields = line.split()
        # "% time  seconds  usecs/call  calls  [errors]  syscall"; skip headers and total.
        if len(fields) in (5, 6) and fields[-1] != "total" and fields[3].isdigit():
            calls[fields[-1]] += int(fields[3])
    return calls


def rounded(ops: int, row: str) -> int:
    """``ops`` rounded up to a multiple of the row's concurrency (every task does as many)."""
    concurrency = int(row.rsplit("-c", 1)[1]) if "-c" in row else 1
    return -(-ops // concurrency) * concurrency


def load() -> str:
    """The 1, 5 and 15 minute load averages (the wall clock moves with them)."""
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def instructions_base(row: str) -> str:
    if row.startswith("async-"):
        return "bare-" + row
    return row if row.startswith("bare") else "bare"


def floor_of(row: str) -> str:
    return "floor-fsync" if row.endswith("fsync") or row == "postgres" else "floor-os"


def parse_pair(text: str) -> tuple[int, int]:
    n, m = (int(part) for part in text.split(","))
    if not 0 <= n < m:
        raise argparse.ArgumentTypeError(f"want N,M with 0 <= N < M, not {text!r}")
    return n, m


@contextmanager
def postgres(args: argparse.Namespace) -> Iterator[None]:
    """A throwaway PostgreSQL server (tests/postgres_server.py) for ``--postgres``."""
    if not args.postgres:
        yield
        return
    sys.path.insert(0, str(ROOT))
    from tests.postgres_server import postgres_server

    parent = os.environ.get("BENCH_DIR")
    with postgres_server(fsync=True, parent=Path(parent) if parent else None) as server:
        args.postgres_server = server
        args.postgres_url = server.url()
        yield


def main_parent(args: argparse.Namespace) -> None:
    rows = [row for row in args.rows.split(",") if row]
    unknown = sorted(set(rows) - set(ALL_ROWS))
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {', '.join(ALL_ROWS)}")
    notes: list[str] = []
    if "postgres" in rows and not (args.postgres or args.postgres_url):
        rows.remove("postgres")
        notes.append("postgres row skipped: pass --postgres or --postgres-url URL")
    missing = [tool for tool in ("valgrind", "strace") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"{' and '.join(missing)} not installed")
    with postgres(args):
        measure(args, rows, notes)


def measure(args: argparse.Namespace, rows: list[str], notes: list[str]) -> None:
    cg_n, cg_m = args.callgrind_ops
    st_n, st_m = args.strace_ops
    print(f"# bench_counts.py, {datetime.date.today()}, nproc {os.cpu_count()}")
    print(f"$ {shlex.join([Path(sys.executable).name, *sys.argv])}")
    print("child commands (ROW each row; OPS as below, rounded up to a multiple of c):")
    child = "python benchmarks/bench_counts.py --child ROW --ops OPS --warmup " + str(args.warmup)
    child += " --real-clock" if args.real_clock else f" --clock-rate {args.clock_rate:g}"
    print(f"  valgrind --tool=callgrind --callgrind-out-file=OUT -q {child}    OPS={cg_n},{cg_m}")
    print(f"  strace -f -c -o OUT {child}    OPS={st_n},{st_m}")
    print(f"  {child} --stats    OPS={args.stats_ops}")
    print(f"  {child}    OPS={args.wall_ops}  (wall clock, rows one after the other)")
    versions = f"Python {sys.version.split()[0]}, SQLite {sqlite3.sqlite_version}"
    print(f"  (env PYTHONHASHSEED=0 PYTHONPYCACHEPREFIX={PYCACHE}; {versions})")
    for note in notes:
        print(f"  {note}")
    print(f"load average at the start: {load()}")
    print(flush=True)

    # One short run of each row first, one at a time: it fails fast on a broken row, and
    # caches the bytecode, so that no child of a pair compiles what the other one reads.
    for row in rows:
        run_child(child_command(args, row, rounded(1, row)))
    with tempfile.TemporaryDirectory(prefix="bench-counts-out-") as name:
        out = Path(name)
        jobs: dict[tuple[str, str, int, int], Any] = {}
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for repeat in range(args.repeat):
                for row in rows:
                    for ops in (rounded(cg_n, row), rounded(cg_m, row)):
                        jobs["cg", row, repeat, ops] = pool.submit(
                            callgrind_total, args, row, ops, out / f"cg.{row}.{repeat}.{ops}"
                        )
            for row in rows:
                for ops in (rounded(st_n, row), rounded(st_m, row)):
                    jobs["st", row, 0, ops] = pool.submit(
                        strace_counts, args, row, ops, out / f"st.{row}.{ops}"
                    )
                jobs["stats", row, 0, 0] = pool.submit(
                    run_child, child_command(args, row, rounded(args.stats_ops, row), "--stats")
                )
            results = {job: future.result() for job, future in jobs.items()}
    # The wall clock last, alone on the machine, one row after the other.
    wall_load = load()
    walls = {row: run_child(child_command(args, row, rounded(args.wall_ops, row))) for row in rows}

    instructions: dict[str, list[float]] = {}
    syscalls: dict[str, float] = {}
    per_call: dict[str, dict[str, float]] = {}
    for row in rows:
        n, m = rounded(cg_n, row), rounded(cg_m, row)
        instructions[row] = [
            (results["cg", row, r, m] - results["cg", row, r, n]) / (m - n)
            for r in range(args.repeat)
        ]
        n, m = rounded(st_n, row), rounded(st_m, row)
        low, high = results["st", row, 0, n], results["st", row, 0, m]
        per_call[row] = {call: (high[call] - low[call]) / (m - n) for call in set(high) | set(low)}
        syscalls[row] = (sum(high.values()) - sum(low.values())) / (m - n)

    def instr(row: str) -> float | None:
        return instructions[row][0] if row in instructions else None

    head = (
        f"{'row':<16}{'instr/op':>11}{'× bare':>8}{'syscalls/op':>13}{'× floor':>9}"
        f"{'WAL pages/op':>14}{'statements/op':>15}"
    )
    print(head)
    print("-" * len(head))
    for row in rows:
        stats = results["stats", row, 0, 0]
        pages = statements = None
        if "wal_frames" in stats:
            pages = stats["wal_frames"] / stats["ops"]
            statements = stats["statements"] / stats["ops"]
        elif row == "postgres":
            statements = per_call[row].get("sendto", 0.0)  # round trips to the server
        floor = floor_of(row)
        syscall_ratio = (
            None if row.startswith("bare") else ratio(syscalls[row], syscalls.get(floor))
        )
        shown = f"{statements:.1f}" + (" rt" if row == "postgres" else "") if statements else ""
        print(
            f"{row:<16}{instr(row) or 0:>11,.0f}"
            f"{fmt(ratio(instr(row), instr(instructions_base(row))), '.2f'):>8}"
            f"{syscalls[row]:>13.1f}{fmt(syscall_ratio, '.2f'):>9}"
            f"{fmt(pages, '.1f'):>14}{shown:>15}"
        )
    print(
        "× bare: sync rows against bare, async rows against the bare async row of the same "
        "concurrency; × floor: against floor-os or floor-fsync (async rows: floor-os; "
        "postgres: floor-fsync); rt: round trips (sendto calls)."
    )

    if args.repeat > 1:
        print("\ncallgrind, instructions/op in each run:")
        for row in rows:
            runs = instructions[row]
            spread = (max(runs) - min(runs)) / min(runs) * 100
            flag = "" if spread <= 0.3 else "   (more than 0.3 % apart)"
            shown = "  ".join(f"{value:,.0f}" for value in runs)
            print(f"  {row:<16}{shown}   spread {spread:.3f} %{flag}")

    print(f"\nsystem calls per operation, the most frequent ({st_n} and {st_m} operations):")
    for row in rows:
        calls = per_call[row]
        top = sorted(calls.items(), key=lambda item: -item[1])
        top = [(call, value) for call, value in top if round(value, 1) != 0][: args.top]
        for call in ("fsync", "fdatasync"):
            if call in calls and call not in dict(top) and round(calls[call], 2):
                top.append((call, calls[call]))
        shown = ", ".join(f"{call} {value:.{1 if value >= 0.1 else 2}f}" for call, value in top)
        shown = shown or "none"
        print(f"  {row:<16}{shown}")

    wal_checks = [
        f"{row}: {stats['wal_frames']} frames by size, {stats['wal_log']} by wal_checkpoint"
        for row in rows
        if "wal_frames" in (stats := results["stats", row, 0, 0])
        and stats["wal_log"] != stats["wal_frames"]
    ]
    for check in wal_checks:
        print(f"  WAL frame counts disagree: {check}")

    if args.show_statements:
        print(f"\nstatements per operation ({args.stats_ops} operations):")
        for row in rows:
            stats = results["stats", row, 0, 0]
            if "statement_texts" not in stats:
                continue
            trigger_runs = stats["trigger_runs"] / stats["ops"]
            print(f"  {row} (plus {trigger_runs:.1f} trigger runs/op):")
            for text, count in stats["statement_texts"]:
                print(f"    {count / stats['ops']:6.2f}  {text}")

    print(
        f"\nwall clock, one run of {args.wall_ops} operations per row (moves with load; load "
        f"average before it {wall_load}, after it {load()}):"
    )
    print(f"{'row':<16}{'ops/s':>9}{'× bare':>8}{'× floor':>9}")
    rates = {row: wall["ops"] / wall["seconds"] for row, wall in walls.items()}
    for row in rows:
        base = rates.get(instructions_base(row))
        floor = None if row.startswith("bare") else ratio(rates[row], rates.get(floor_of(row)))
        shown = f"{fmt(ratio(rates[row], base), '.2f'):>8}{fmt(floor, '.2f'):>9}"
        print(f"{row:<16}{rates[row]:>9.0f}{shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ALL_ROWS), help="comma-separated rows")
    parser.add_argument("--callgrind-ops", type=parse_pair, default=(100, 600), metavar="N,M")
    parser.add_argument("--strace-ops", type=parse_pair, default=(300, 1800), metavar="N,M")
    parser.add_argument("--stats-ops", type=int, default=500, help="operations for WAL/statements")
    parser.add_argument("--wall-ops", type=int, default=1000, help="operations for ops/s")
    parser.add_argument("--warmup", type=int, default=50, help="operations before counting")
    parser.add_argument("--repeat", type=int, default=1, help="callgrind runs of each N,M pair")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="children at once")
    parser.add_argument("--top", type=int, default=6, help="system calls shown per row")
    parser.add_argument("--show-statements", action="store_true", help="list SQL per row")
    parser.add_argument("--postgres", action="store_true", help="start a throwaway PostgreSQL")
    parser.add_argument("--postgres-url", help="journal the postgres row in this database")
    parser.add_argument("--tmp", help="directory for the journals (default: the system's)")
    parser.add_argument(
        "--clock-rate",
        type=float,
        default=1000.0,
        metavar="OPS",
        help="the journaled rows' simulated clock: OPS operations a second (default 1000)",
    )
    parser.add_argument(
        "--real-clock", action="store_true", help="give the journaled rows time.time instead"
    )
    parser.add_argument("--child", choices=ALL_ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--ops", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--stats", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
    else:
        main_parent(args)


if __name__ == "__main__":
    main()
