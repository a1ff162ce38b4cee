"""Shared test doubles: a fake clock and sleep, and a session wired to them."""

from __future__ import annotations

import contextlib
import fcntl
import json
import queue
import re
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx

import idempotently

URL = "https://api.example.test/v1/charges"


@attrs.define
class FakeTime:
    """A clock that only moves when the session sleeps."""

    now: float = 1_800_000_000.0
    sleeps: list[float] = attrs.field(factory=list)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def async_sleep(self, seconds: float) -> None:
        self.sleep(seconds)


def recording_transport() -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """A transport answering 201 to everything, for sync and async clients alike, and the
    list of every request it received (appended from any thread)."""
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)  # list.append is atomic: threads and loops may share it
        return httpx.Response(201)

    return httpx.MockTransport(answer), sent


def make_session(tmp_path: Path, fake_time: FakeTime, **options: Any) -> idempotently.Session:
    options.setdefault("headers", {"Authorization": "Bearer sk_test"})
    return idempotently.Session(
        tmp_path / "journal.db", clock=fake_time.clock, sleep=fake_time.sleep, **options
    )


class JsonLinesProcess:
    """A child process whose stdout JSON lines a thread reads as they are printed.

    Subclasses start ``self.proc`` (stdout piped, text mode), then call
    :meth:`_start_reading`; ``events`` holds every line read so far, parsed.
    """

    proc: subprocess.Popen[str]
    wait: float = 30.0
    """The longest a test waits for one line: past this, something hangs."""

    def _start_reading(self, name: str) -> None:
        self.name = name
        self.events: list[dict[str, Any]] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def next_event(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next line, parsed; None when the process's output has ended."""
        timeout = self.wait if timeout is None else timeout
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name} printed nothing for {timeout} s") from None
        if line is None:
            return None
        event: dict[str, Any] = json.loads(line)
        self.events.append(event)
        return event


@contextlib.contextmanager
def fixed_port_lock(source: str) -> Iterator[None]:
    """Hold a machine-wide lock on each fixed port `source` serves on, while it runs.

    The examples (and the README's copy of the quickstart) start their server on
    a fixed port, so that a re-run sends the same URL; two runs of the same one
    at once (xdist workers, two checkouts on one machine) would collide.
    """
    ports = sorted({int(port) for port in re.findall(r"serve\([^)]*port=(\d+)", source)})
    with contextlib.ExitStack() as stack:
        for port in ports:
            path = Path(tempfile.gettempdir()) / f"idempotently-example-port-{port}.lock"
            lock = stack.enter_context(open(path, "a"))
            fcntl.flock(lock, fcntl.LOCK_EX)
            stack.callback(fcntl.flock, lock, fcntl.LOCK_UN)
        yield


def recount(conn: Any, *, now: float, stuck_after: float = 60.0) -> Any:
    """Every figure of a SQLite journal's stats(), by scanning its tables: the truth its
    counts row must equal (a first attempt is in its operation's row, later ones in
    attempts)."""
    from idempotently._rows import JournalStats
    from idempotently._vocabulary import STATUSES

    counts = dict.fromkeys(STATUSES, 0)
    for status, count in conn.execute("SELECT status, count(*) FROM operations GROUP BY status"):
        counts[status] = count
    figures = [0, 0, 0, 0]
    for prefix, table in (("attempt1_", "operations"), ("", "attempts")):
        found = conn.execute(
            f"SELECT count({prefix}outcome), count({prefix}status_code),"
            f" coalesce(sum({prefix}replayed), 0),"
            f" coalesce(sum({prefix}status_code IN (409, 423)), 0) FROM {table}"
        ).fetchone()
        figures = [total + int(value) for total, value in zip(figures, found, strict=True)]
    oldest, stuck = conn.execute(
        "SELECT min(created_at), coalesce(sum(lease_until < :now AND updated_at < :idle"
        " AND coalesce(not_before, 0) <= :now), 0) FROM operations WHERE status = 'pending'",
        {"now": now, "idle": now - stuck_after},
    ).fetchone()
    return JournalStats(
        counts=counts,
        operations=sum(counts.values()),
        attempts=figures[0],
        answered_attempts=figures[1],
        replayed_attempts=figures[2],
        in_progress_attempts=figures[3],
        oldest_pending_created_at=oldest,
        stuck=stuck,
        now=now,
    )
