"""What ``idempotently resume`` costs per operation, beside bare httpx (issue 29).

    python benchmarks/bench_resume.py [--n 2000] [--concurrency 16,1]
        [--callgrind-n 100,400 | --no-callgrind] [--threads 16]
                                                          (nox -s bench -- resume ARGS)

A counting server (a plain ASGI app under uvicorn, in its own process on
127.0.0.1: this script with ``--serve PORT``) answers every POST 201 with a small
JSON body and counts the POSTs it got per ``Idempotency-Key``. For each run a
fresh SQLite journal gets N pending operations: Sessions post the small JSON
charge (operation ids ``order-0`` ...) to a closed port on 127.0.0.1 with
``RetryPolicy(max_attempts=1)``, so each one is journaled with its key, refused
at connect, and left pending. Then, in a child process each:

- ``python -m idempotently --journal J resume --concurrency C --base-url URL --format json``
  for each C of ``--concurrency``: wall-clock ops/s (N over the command's whole
  run, start-up included; and over the run less the start-up, the same command on
  a journal with nothing pending) and CPU-seconds per resumed operation
  (``(CPU(N) - CPU(0)) / N``, user + system, from ``wait4``);
- the same command under ``valgrind --tool=callgrind`` with two N's:
  instructions per resumed operation are ``(Ir(N2) - Ir(N1)) / (N2 - N1)``, so
  start-up cancels and the figure does not move with load; beside it, the same
  for bare httpx and for a Session posting from one thread (this script with
  ``--post bare|session``), so resume's instructions have a bare and a Session
  figure of the same run to be held against;

and in this process, against the same app, in the same run:

- bare httpx: one ``httpx.Client`` posting the same requests (same path, same
  JSON body, a key header of its own) from ``--threads`` threads, and from one;
- a Session (durability "fsync", the CLI's journal's default) posting N
  operations from one thread: CPU-seconds per call, the figure resume's CPU per
  operation is held against (issue 29: at most 2x).

After each run the server's counts are checked: every key of the run's journal
POSTed exactly once (and every bare request arrived), and every operation
``succeeded`` in the journal. A failed check is printed and the exit status is 1.
Wall-clock and ops/s move with the machine's load (printed with them); callgrind
counts do not.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
PATH = "/v1/charges"
PAYLOAD = {"amount": 1000, "currency": "usd", "customer": "cus_42"}
ANSWER = b'{"id": "ch_1", "object": "charge", "amount": 1000}'
PYCACHE = Path(tempfile.gettempdir()) / "bench-counts-pycache"


# -- the counting server (its own process) ---------------------------------------------


def serve(port: int) -> None:
    """A plain ASGI app under uvicorn: POST answered 201 and counted per key;
    ``GET /_counts`` returns {key: POSTs}."""
    import uvicorn

    counts: Counter[str] = Counter()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        body = ANSWER
        if scope["method"] == "POST":
            key = dict(scope["headers"]).get(b"idempotency-key", b"").decode("latin-1")
            counts[key] += 1
        elif scope["path"] == "/_counts":
            body = json.dumps(counts).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 201 if scope["method"] == "POST" else 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """The counting server in a child process."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, str(SCRIPT), "--serve", str(self.port)]
        self.process = subprocess.Popen(command)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.counts()
                return
            except OSError as error:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(
                        f"the counting server did not start: {shlex.join(command)}"
                    ) from error
                time.sleep(0.1)

    def counts(self) -> Counter[str]:
        with urllib.request.urlopen(f"{self.url}/_counts", timeout=30) as answer:
            return Counter(json.loads(answer.read()))

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


# -- journals with N pending operations ------------------------------------------------


def pending_journal(path: Path, n: int, first: int = 0) -> list[str]:
    """A journal at ``path`` with ``n`` pending operations; returns their keys."""
    import httpx

    import idempotently

    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: refused at connect
    # Durability "os" while building (the CLI opens it with its default, "fsync"): an
    # fsync per key would only make building slow.
    with idempotently.Journal(path, durability="os") as journal:
        with idempotently.Session(
            journal,
            client=httpx.Client(base_url=closed),
            policy=idempotently.RetryPolicy(max_attempts=1),
        ) as session:
            for i in range(first, first + n):
                with contextlib.suppress(idempotently.OperationPendingError):
                    session.post(PATH, json=PAYLOAD, operation_id=f"order-{i}")
        keys = [operation.key for operation in journal.operations(limit=n + 1)]
        stats = journal.stats(now=time.time())
    if len(keys) != n or stats.counts["pending"] != n:
        raise SystemExit(f"{path}: want {n} pending operations, found {stats.counts}")
    return keys


def statuses(path: Path) -> dict[str, int]:
    import idempotently

    with idempotently.Journal(path, readonly=True) as journal:
        return {
            status: count
            for status, count in journal.stats(now=time.time()).counts.items()
            if count
        }


# -- the runs --------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    # As bench_counts.py: the same hash seed in every run, bytecode cached outside the tree.
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPYCACHEPREFIX": str(PYCACHE)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def resume_command(journal: Path, concurrency: int, url: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "idempotently",
        "--journal",
        str(journal),
        "resume",
        "--concurrency",
        str(concurrency),
        "--base-url",
        url,
        "--format",
        "json",
    ]


def run_measured(command: Sequence[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds (user + system), stdout) of one child."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err, env=child_env())
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if process.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(command)} exited {process.returncode}:\n{(stderr or stdout)[-2000:]}"
        )
    return wall, usage.ru_utime + usage.ru_stime, stdout


class Checks:
    """What the server and the journals show; a failure is printed and fails the run."""

    def __init__(self, server: Server) -> None:
        self.server, self.failures, self.lock = server, list[str](), threading.Lock()

    def once_each(self, what: str, keys: Sequence[str]) -> None:
        counts = self.server.counts()
        wrong = {key: counts.get(key, 0) for key in keys if counts.get(key, 0) != 1}
        if wrong:
            shown = dict(list(wrong.items())[:3])
            with self.lock:
                self.failures.append(
                    f"{what}: {len(wrong)} of {len(keys)} keys not POSTed exactly once "
                    f"(e.g. {shown})"
                )

    def succeeded(self, what: str, journal: Path, n: int) -> None:
        found = statuses(journal)
        if found != ({"succeeded": n} if n else {}):
            with self.lock:
                self.failures.append(f"{what}: the journal holds {found}, want {n} succeeded")


def resume_once(
    tmp: Path, server: Server, checks: Checks, n: int, concurrency: int, first: int
) -> tuple[float, float]:
    journal = tmp / f"resume-{first}.db"
    keys = pending_journal(journal, n, first)
    wall, cpu, _ = run_measured(resume_command(journal, concurrency, server.url))
    what = f"resume --concurrency {concurrency}, N={n}"
    checks.once_each(what, keys)
    checks.succeeded(what, journal, n)
    return wall, cpu


WARM_UP = 20
"""Calls a ``--post`` child makes before the N it is counted for."""


def post_child(kind: str, url: str, n: int, tag: str, journal: str | None) -> None:
    """``--post``: bare httpx or a Session (durability "fsync") posting WARM_UP + n
    requests from one thread, for callgrind (keys ``TAG-i``; the Session's are derived
    from operation ids ``TAG-i``)."""
    import httpx

    import idempotently

    with httpx.Client(base_url=url, timeout=60) as client:
        if kind == "bare":
            for i in range(WARM_UP + n):
                client.post(PATH, json=PAYLOAD, headers={"Idempotency-Key": f"{tag}-{i}"})
            return
        assert journal is not None
        with (
            idempotently.Journal(journal) as opened,
            idempotently.Session(opened, client=client) as session,
        ):
            for i in range(WARM_UP + n):
                session.post(PATH, json=PAYLOAD, operation_id=f"{tag}-{i}")


def callgrind_total(out: Path) -> int:
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no summary: or totals: line in {out}")


CALLGRIND = ("valgrind", "--tool=callgrind", "-q")


def callgrind_post(tmp: Path, server: Server, checks: Checks, kind: str, n: int, tag: str) -> int:
    """Instructions of a ``--post`` child posting WARM_UP + n (all its threads)."""
    out, journal = tmp / f"callgrind.out.{tag}", tmp / f"{tag}.db"
    command = [sys.executable, str(SCRIPT), "--post", kind, "--url", server.url]
    command += ["--n", str(n), "--tag", tag, "--journal", str(journal)]
    run_measured([*CALLGRIND, f"--callgrind-out-file={out}", *command])
    what = f"{kind} under callgrind, N={n}"
    if kind == "bare":
        checks.once_each(what, [f"{tag}-{i}" for i in range(WARM_UP + n)])
    else:
        import idempotently

        with idempotently.Journal(journal, readonly=True) as opened:
            keys = [operation.key for operation in opened.operations(limit=WARM_UP + n + 1)]
        checks.once_each(what, keys)
        checks.succeeded(what, journal, WARM_UP + n)
    return callgrind_total(out)


def callgrind_once(
    tmp: Path, server: Server, checks: Checks, n: int, concurrency: int, first: int
) -> int:
    journal = tmp / f"callgrind-{first}.db"
    keys = pending_journal(journal, n, first)
    out = tmp / f"callgrind.out.{first}"
    run_measured(
        [
            *CALLGRIND,
            f"--callgrind-out-file={out}",
            *resume_command(journal, concurrency, server.url),
        ]
    )
    what = f"resume --concurrency {concurrency} under callgrind, N={n}"
    checks.once_each(what, keys)
    checks.succeeded(what, journal, n)
    return callgrind_total(out)


def bare(server: Server, checks: Checks, n: int, threads: int, tag: str) -> tuple[float, float]:
    """(wall, CPU) of n bare httpx POSTs from ``threads`` threads sharing one client."""
    import httpx

    keys = [f"bare-{tag}-{i}" for i in range(n)]
    with httpx.Client(base_url=server.url, timeout=60) as client:

        def post(key: str) -> None:
            answer = client.post(PATH, json=PAYLOAD, headers={"Idempotency-Key": key})
            if answer.status_code != 201:
                raise RuntimeError(f"bare POST answered {answer.status_code}")

        client.post(PATH, json=PAYLOAD, headers={"Idempotency-Key": f"bare-{tag}-warm"})
        cpu, started = time.process_time(), time.perf_counter()
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(post, keys))
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    checks.once_each(f"bare httpx, {threads} threads", keys)
    return wall, cpu


def session_calls(tmp: Path, server: Server, checks: Checks, n: int) -> tuple[float, float]:
    """(wall, CPU) of n Session.post calls from one thread (durability "fsync")."""
    import httpx

    import idempotently

    path = tmp / "session.db"
    with idempotently.Journal(path) as journal:
        with idempotently.Session(journal, client=httpx.Client(base_url=server.url)) as session:
            session.post(PATH, json=PAYLOAD, operation_id="warm")
            cpu, started = time.process_time(), time.perf_counter()
            for i in range(n):
                session.post(PATH, json=PAYLOAD, operation_id=f"order-{i}")
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        keys = [
            operation.key
            for operation in journal.operations(limit=n + 2)
            if operation.operation_id != "warm"
        ]
    checks.once_each("Session, one thread", keys)
    checks.succeeded("Session, one thread", path, n + 1)
    return wall, cpu


def parse_pair(text: str) -> tuple[int, int]:
    n, m = (int(part) for part in text.split(","))
    if not 0 < n < m:
        raise argparse.ArgumentTypeError(f"want N1,N2 with 0 < N1 < N2, not {text!r}")
    return n, m


def parse_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"want positive numbers, not {text!r}")
    return values


def phase(text: str) -> None:
    """Progress on stderr (the tables go to stdout)."""
    print(f"{time.strftime('%H:%M:%S')} {text} (load {load()})", file=sys.stderr, flush=True)


def load() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def main_parent(args: argparse.Namespace) -> int:
    if not args.no_callgrind and shutil.which("valgrind") is None:
        raise SystemExit("valgrind not installed (or pass --no-callgrind)")
    print(f"# bench_resume.py, {datetime.date.today()}, nproc {os.cpu_count()}")
    print(f"$ {shlex.join([Path(sys.executable).name, *sys.argv])}")
    print("child commands (J a fresh journal with N pending operations, URL the counting app):")
    print("  python benchmarks/bench_resume.py --serve PORT    (the counting app, uvicorn)")
    print(
        "  python -m idempotently --journal J resume --concurrency C --base-url URL --format json"
    )
    if not args.no_callgrind:
        print("  valgrind --tool=callgrind --callgrind-out-file=OUT -q (the same)")
        print(
            "  valgrind --tool=callgrind --callgrind-out-file=OUT -q python "
            "benchmarks/bench_resume.py --post bare|session --url URL --n N --tag T --journal J"
        )
    print(
        f"  (env PYTHONHASHSEED=0 PYTHONPYCACHEPREFIX={PYCACHE}; Python {sys.version.split()[0]})"
    )
    print(f"load average at the start: {load()}", flush=True)

    server = Server()
    checks = Checks(server)
    n = args.n
    try:
        with tempfile.TemporaryDirectory(prefix="bench-resume-", dir=args.tmp) as name:
            tmp = Path(name)
            firsts = iter(range(0, 10**9, 10**6))  # every journal's operation ids its own
            # A first run, not counted: it caches the bytecode of what resume imports, so
            # that no measured child compiles it.
            for concurrency in sorted({*args.concurrency, *args.callgrind_concurrency}):
                resume_once(tmp, server, checks, 5, concurrency, next(firsts))
            instructions: dict[int, float] = {}
            post_instructions: dict[str, float] = {}
            if not args.no_callgrind:
                n1, n2 = args.callgrind_n
                for concurrency in args.callgrind_concurrency:
                    phase(f"callgrind, resume --concurrency {concurrency}, N={n1} and {n2}")
                    jobs: dict[int, Any] = {}
                    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                        for count in (n1, n2):
                            jobs[count] = pool.submit(
                                callgrind_once,
                                tmp,
                                server,
                                checks,
                                count,
                                concurrency,
                                next(firsts),
                            )
                        totals = {count: job.result() for count, job in jobs.items()}
                    instructions[concurrency] = (totals[n2] - totals[n1]) / (n2 - n1)
                phase(f"callgrind, bare httpx and Session from one thread, N={n1} and {n2}")
                with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                    posts = {
                        (kind, count): pool.submit(
                            callgrind_post, tmp, server, checks, kind, count, f"{kind}-cg-{count}"
                        )
                        for kind in ("bare", "session")
                        for count in (n1, n2)
                    }
                    for kind in ("bare", "session"):
                        low, high = posts[kind, n1].result(), posts[kind, n2].result()
                        post_instructions[kind] = (high - low) / (n2 - n1)
            # The wall clock after callgrind, one run at a time.
            phase(f"wall clock: resume, bare httpx and Session, N={n}")
            startup_wall, startup_cpu = resume_once(tmp, server, checks, 0, 1, next(firsts))
            resumed = {
                concurrency: resume_once(tmp, server, checks, n, concurrency, next(firsts))
                for concurrency in args.concurrency
            }
            bares = {
                threads: bare(server, checks, n, threads, str(threads))
                for threads in sorted({args.threads, 1}, reverse=True)
            }
            session = session_calls(tmp, server, checks, n)
        counts = server.counts()
    finally:
        server.close()
    print(f"load average at the end: {load()}\n")

    report(
        args, instructions, post_instructions, startup_wall, startup_cpu, resumed, bares, session
    )
    stray = sum(counts.values()) - len(counts)
    if stray:
        checks.failures.append(f"the server got {stray} POSTs for a key it had already seen")
    for failure in checks.failures:
        print(f"CHECK FAILED: {failure}")
    if not checks.failures:
        print("checked: every key POSTed exactly once; every resumed operation succeeded")
    return 1 if checks.failures else 0


def report(
    args: argparse.Namespace,
    instructions: dict[int, float],
    post_instructions: dict[str, float],
    startup_wall: float,
    startup_cpu: float,
    resumed: dict[int, tuple[float, float]],
    bares: dict[int, tuple[float, float]],
    session: tuple[float, float],
) -> None:
    n = args.n
    bare_rate = n / bares[args.threads][0]
    session_cpu = session[1] / n
    bare_instr, session_instr = post_instructions.get("bare"), post_instructions.get("session")
    head = (
        f"{'run':<26}{'ops/s':>8}{'× bare':>8}{'ops/s*':>8}{'× bare':>8}"
        f"{'CPU ms/op':>11}{'× Session':>11}{'instr/op':>12}{'× bare':>8}{'× Session':>11}"
    )
    print(f"N = {n} operations per run")
    print(head)
    print("-" * len(head))
    row: Callable[..., None] = lambda name, rate, rate2, cpu, instr: print(  # noqa: E731
        f"{name:<26}{rate:>8.0f}{rate / bare_rate:>8.2f}"
        + (f"{rate2:>8.0f}{rate2 / bare_rate:>8.2f}" if rate2 else f"{'':>16}")
        + f"{cpu * 1000:>11.3f}{cpu / session_cpu:>11.2f}"
        + (f"{instr:>12,.0f}" if instr else "")
        + (f"{instr / bare_instr:>8.2f}" if instr and bare_instr else "")
        + (f"{instr / session_instr:>11.2f}" if instr and session_instr else "")
    )
    for concurrency, (wall, cpu) in resumed.items():
        rate2 = n / (wall - startup_wall) if wall > startup_wall else 0.0
        per_op = (cpu - startup_cpu) / n
        row(
            f"resume --concurrency {concurrency}",
            n / wall,
            rate2,
            per_op,
            instructions.get(concurrency),
        )
    for threads, (wall, cpu) in bares.items():
        name = f"bare httpx, {threads} thread{'s' if threads > 1 else ''}"
        row(name, n / wall, 0, cpu / n, bare_instr if threads == 1 else None)
    row("Session.post, 1 thread", n / session[0], 0, session_cpu, session_instr)
    print(
        f"ops/s: N over the whole command (resume: start-up included); ops/s*: resume less "
        f"its start-up (the same command with nothing pending: {startup_wall:.2f} s wall, "
        f"{startup_cpu:.2f} s CPU). × bare: against bare httpx from {args.threads} threads. "
        "CPU ms/op: user + system per operation (resume: less the start-up's); × Session: "
        "against Session.post's. instr/op: callgrind (all threads; bare httpx and Session "
        f"from one thread, after {WARM_UP} calls), "
        + (
            f"(Ir(N2) - Ir(N1)) / (N2 - N1) with N1,N2 = {args.callgrind_n[0]},"
            f"{args.callgrind_n[1]}."
            if instructions
            else "not run."
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="pending operations per run")
    parser.add_argument(
        "--concurrency", type=parse_list, default=[16, 1], help="resume --concurrency values"
    )
    parser.add_argument("--threads", type=int, default=16, help="threads posting bare httpx")
    parser.add_argument("--callgrind-n", type=parse_pair, default=(100, 400), metavar="N1,N2")
    parser.add_argument(
        "--callgrind-concurrency",
        type=parse_list,
        default=[16],
        help="resume --concurrency values counted under callgrind",
    )
    parser.add_argument("--no-callgrind", action="store_true", help="skip the callgrind counts")
    parser.add_argument("--jobs", type=int, default=2, help="callgrind children at once")
    parser.add_argument("--tmp", help="directory for the journals (default: the system's)")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--post", choices=("bare", "session"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    parser.add_argument("--journal", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    if args.post:
        post_child(args.post, args.url, args.n, args.tag, args.journal)
        return
    sys.exit(main_parent(args))


if __name__ == "__main__":
    main()
