"""What `idempotently resume` prints as it goes, and its `--watch` worker loop.

Without ``--watch``: one line per operation as soon as its result is known
(Ctrl-C keeps what was printed), a progress bar on a terminal only when there is
work and never with ``--dry-run``.

With ``--watch``: on a terminal, one line per batch on stderr. Otherwise (or with
``--json``, then on stdout) structured log lines: one JSON object per line with
``ts`` (UTC, ISO 8601), ``level``, ``event``, ``message`` and the event's fields;
events ``watch_started``, ``claimed`` (a batch's operation ids), ``operation`` (one
per result), ``batch``,
``watch_stopping``, ``watch_stopped``, and the library's warnings (``heartbeat_failed``).
SIGTERM or SIGINT: stop claiming, let operations in flight finish their current
attempt, release every lease, exit 0. A second signal exits at once with 128 +
the signal number (143, 130); its leases then expire after the lease duration.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TextIO

import click

from idempotently import _early_signals
from idempotently._cli_format import columns, printable, wrap_words
from idempotently._flow import ResumeResult
from idempotently._lookup import BoundReconciler, Lookup
from idempotently._session import Session
from idempotently._watch import WatchSummary, watch

OPERATION_WIDTH = 22
RESULT_HEADERS = ("operation", "action", "status", "code", "detail")
JSON_ESCAPES = {
    code: f"\\u{code:04x}"
    for code in (*range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A))
}


def stdout_is_terminal() -> bool:
    """Whether people read stdout: only then are long sentences wrapped to its width."""
    return sys.stdout.isatty()


def result_row(cells: tuple[object, ...], dry_run: bool) -> str:
    """One aligned row of resume's results, printable as soon as it is known.

    Nothing a user needs to act on is cut: an operation id too long for its
    column is printed whole on a line of its own above the row, and the detail
    (what happened, or what to do, such as which ``--header-env`` to pass) wraps
    between words under its column, or on indented lines below the row when the
    terminal leaves that column too little room. The row may be several lines.
    """
    widths = (OPERATION_WIDTH, 20 if dry_run else 15, 15, 4)
    text = [printable("-" if cell is None else str(cell)) for cell in cells]
    lines: list[str] = []
    operation = text[0]
    if columns(operation) > widths[0]:
        lines.append(operation)
        operation = ""
    padded = [
        operation + " " * (widths[0] - columns(operation)),
        text[1].ljust(widths[1]),
        text[2].ljust(widths[2]),
        text[3].rjust(widths[3]),
    ]
    terminal = shutil.get_terminal_size().columns
    start = sum(widths) + 2 * len(widths)
    room = terminal - start
    detail = text[4]
    if not stdout_is_terminal():
        # A pipe or a file: one line per row, the detail whole at its end, for scripts.
        return "\n".join([*lines, "  ".join([*padded, detail]).rstrip()])
    if columns(detail) <= room or room >= DETAIL_ROOM:
        first, *rest = wrap_words(detail, max(room, 1))
        lines.append("  ".join([*padded, first]).rstrip())
        lines += [" " * start + line for line in rest]
    else:
        lines.append("  ".join(padded).rstrip())
        lines += ["    " + line for line in wrap_words(detail, terminal - 4)]
    return "\n".join(lines)


DETAIL_ROOM = 30
"""Columns the detail needs beside the row; with less it goes on lines of its own below."""


def result_line(result: ResumeResult, dry_run: bool) -> str:
    return result_row(
        (result.operation_id, result.action, result.status, result.status_code, result.detail),
        dry_run,
    )


# -- --watch -----------------------------------------------------------------------


class JsonLines(logging.Formatter):
    """One JSON object per record: ts, level, event, message and the record's fields."""

    def __init__(self, host_id: str) -> None:
        super().__init__()
        self.host_id = host_id

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = dict(getattr(record, "idempotently", None) or {})
        line: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "event": fields.pop("event", "log"),
            "host_id": self.host_id,
            "message": record.getMessage(),
            **fields,
        }
        return json.dumps(line, ensure_ascii=False, default=str).translate(JSON_ESCAPES)


class BatchLines(logging.Formatter):
    """For a terminal: the worker's start and stop, and one line per batch."""

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "idempotently", None) or {}
        moment = datetime.datetime.fromtimestamp(record.created).strftime("%H:%M:%S")
        if fields.get("event") == "batch":
            actions = ", ".join(f"{n} {action}" for action, n in fields["actions"].items())
            text = (
                f"batch {fields['batch']}: {fields['resumed']} of {fields['claimed']} claimed "
                f"operations resumed in {fields['elapsed']:.1f}s ({actions or 'none'}); "
                f"{fields.get('pending_left', '?')} pending left"
            )
        else:
            text = record.getMessage()
        # Wrapped between words with a hanging indent, never mid-word by the terminal.
        width = max(shutil.get_terminal_size().columns - len(moment) - 1, 20)
        first, *rest = wrap_words(printable(text), width)
        return "\n".join([f"{moment} {first}", *(" " * (len(moment) + 1) + line for line in rest)])


class _WatchFilter(logging.Filter):
    """The worker's own events (info and up); the library's warnings and errors."""

    def __init__(self, per_operation: bool) -> None:
        super().__init__()
        self.per_operation = per_operation

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "idempotently.watch":
            return record.levelno >= logging.WARNING
        fields = getattr(record, "idempotently", None) or {}
        return self.per_operation or fields.get("event") not in ("operation", "claimed")


@contextmanager
def watch_output(*, as_json: bool, terminal: bool, host_id: str) -> Iterator[None]:
    """Route the worker's log records to the screen while it runs."""
    human = terminal and not as_json
    stream: TextIO = sys.stdout if as_json else sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(BatchLines() if human else JsonLines(host_id))
    handler.addFilter(_WatchFilter(per_operation=not human))
    root = logging.getLogger("idempotently")
    watch_logger = logging.getLogger("idempotently.watch")
    levels = root.level, watch_logger.level
    root.addHandler(handler)
    if root.getEffectiveLevel() > logging.WARNING:
        root.setLevel(logging.WARNING)
    watch_logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(levels[0])
        watch_logger.setLevel(levels[1])


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[threading.Event]:
    """SIGTERM/SIGINT set ``stop``; a second one ends the process at once.

    The handler takes no lock: it writes a byte to a pipe. ``stop.set()`` would take
    the event's lock, which the interrupted main thread may hold at that moment (inside
    ``stop.wait()``): a deadlock, seen as a worker that never stopped. A small thread
    reads the pipe, sets ``stop``, says that the worker is stopping, then sets the
    event it yields."""
    received: list[str] = []
    announced = threading.Event()
    wake_r, wake_w = os.pipe()

    def handler(signum: int, frame: FrameType | None) -> None:
        if received or stop.is_set():
            # Not SIG_DFL and re-raise: as PID 1 in a container that would be ignored.
            os._exit(128 + signum)
        received.append(signal.Signals(signum).name)
        os.write(wake_w, b"\0")

    def announce() -> None:
        os.read(wake_r, 1)  # a signal, or the end of the watch
        stop.set()
        try:
            if received:
                logging.getLogger("idempotently.watch").info(
                    "%s: finishing operations in flight, then releasing leases",
                    received[0],
                    extra={"idempotently": {"event": "watch_stopping", "signal": received[0]}},
                )
        finally:
            announced.set()

    watched = (signal.SIGTERM, signal.SIGINT)
    previous = {signum: signal.signal(signum, handler) for signum in watched}
    early = _early_signals.take()  # a signal that came while the worker was starting
    if early is not None:
        received.append(signal.Signals(early).name)
        stop.set()
        os.write(wake_w, b"\0")
    announcer = threading.Thread(target=announce, name="idempotently-watch-signals", daemon=True)
    announcer.start()
    try:
        yield announced
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
        stop.set()
        os.write(wake_w, b"\0")
        announcer.join()
        os.close(wake_r)
        os.close(wake_w)


def run_watch(
    session: Session,
    *,
    interval: float,
    concurrency: int,
    base_url: str | None,
    as_json: bool,
    terminal: bool,
    stop: threading.Event | None = None,
    reconciler: Lookup | None = None,
) -> WatchSummary:
    """`resume --watch`: resume due operations until SIGTERM/SIGINT (and, with a
    ``reconciler``, reconcile needs_reconcile operations as it goes)."""
    stop = stop or threading.Event()
    journal = session.journal
    engine = session._engine
    logger = logging.getLogger("idempotently.watch")

    def on_result(result: ResumeResult) -> None:
        logger.info(
            "operation %s: %s",
            result.operation_id,
            result.action,
            extra={"idempotently": {"event": "operation", **result.to_json()}},
        )

    with (
        watch_output(as_json=as_json, terminal=terminal, host_id=engine.host_id),
        stop_on_signals(stop) as announced,
    ):
        return watch(
            engine,
            journal,
            session._build,
            send=session._send,  # its answers' bodies read within bounds, as a call's
            stop=stop,
            interval=interval,
            concurrency=concurrency,
            base_url=base_url,
            on_result=on_result,
            pending_left=lambda: journal.counts()["pending"],
            before_stopped=lambda: announced.wait(1.0),
            reconcile=None if reconciler is None else BoundReconciler(reconciler, session.client),
        )


ResultPrinter = Callable[[ResumeResult], None]


def echo_result(dry_run: bool, clear_bar: bool) -> ResultPrinter:
    """Print one result line on stdout as soon as it is known (above a progress bar)."""

    def echo(result: ResumeResult) -> None:
        if clear_bar:
            click.echo("\r\x1b[K", nl=False, err=True)
        click.echo(result_line(result, dry_run))

    return echo
