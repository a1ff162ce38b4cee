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
attempt (a lookup in flight is not waited for: it is a read), release every lease,
exit 0. A second signal exits at once with 128 +
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
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any, TextIO, get_args

import click

from idempotently import _early_signals
from idempotently._cli_format import columns, one_line, printable, record, wrap_words
from idempotently._flow._operation import ResumeResult
from idempotently._lookup import Lookup
from idempotently._session import Session
from idempotently._vocabulary import RESUME_DONE, STATUSES, ResumeAction
from idempotently._watch import WatchSummary

RESULT_HEADERS = ("operation", "action", "status", "code", "detail")
JSON_ESCAPES = {
    code: f"\\u{code:04x}"
    for code in (*range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A))
}
ACTION_WIDTHS = {
    dry_run: max(len(a) for a in get_args(ResumeAction) if a.startswith("would_") == dry_run)
    for dry_run in (False, True)
}
STATUS_WIDTH = max(map(len, STATUSES))
CODE_WIDTH = 4


def stdout_is_terminal() -> bool:
    """Whether people read stdout: only then are long sentences wrapped to its width."""
    return sys.stdout.isatty()


DETAIL_ROOM = 30
"""Columns the detail needs beside the row; with less it goes on lines of its own below."""
MIN_OPERATION_WIDTH = 10


class ResultTable:
    """resume's (and reconcile's) results, each printed as soon as it is known.

    Piped: one record per result, tab-separated and escaped (`record`), the detail
    whole; no header. On a terminal: aligned rows whose columns are sized to the
    terminal and to the ids about to be resumed, so a short detail sits on its row;
    an id too wide for its column is printed whole on a line of its own, and a long
    detail wraps between words (under its column, or below the row when the
    terminal leaves it too little room). A detail already printed in full is not
    repeated for an unfinished operation (the 401 hint of 900 operations once): the
    row says ``(as above)`` and the summary counts it. With a progress bar on stderr,
    the bar's line is cleared before anything is printed, so no row shares a line
    with it.
    """

    def __init__(
        self,
        ids: Iterable[str],
        *,
        dry_run: bool,
        terminal: bool,
        clear_bar: bool,
    ) -> None:
        self.terminal, self.clear_bar = terminal, clear_bar
        self.width = shutil.get_terminal_size().columns
        action = ACTION_WIDTHS[dry_run]
        rest = action + STATUS_WIDTH + CODE_WIDTH + 2 * (len(RESULT_HEADERS) - 1)
        # The id column as wide as the widest id that fits beside the other columns
        # (the detail goes below the row when it cannot sit on it).
        room = max(MIN_OPERATION_WIDTH, self.width - rest)
        fitting = [w for w in (columns(one_line(i)) for i in ids) if w <= room]
        self.widths = (max([len(RESULT_HEADERS[0]), *fitting]), action, STATUS_WIDTH, CODE_WIDTH)
        self.started = False
        self.printed: set[str] = set()

    def __call__(self, result: ResumeResult) -> None:
        cells = (
            result.operation_id,
            result.action,
            result.status,
            result.status_code,
            result.detail,
        )
        if self.clear_bar:
            click.echo("\r\x1b[K", nl=False, err=True)
        if not self.terminal:
            click.echo(record(cells))
            return
        if not self.started:
            self.started = True
            click.echo(self.row(RESULT_HEADERS))
        if result.detail and result.action not in RESUME_DONE:
            if result.detail in self.printed:
                cells = (*cells[:4], "(as above)")
            self.printed.add(result.detail)
        click.echo(self.row(cells))

    def row(self, cells: tuple[object, ...]) -> str:
        """One aligned row, several lines if its id or its detail needs them."""
        text = [one_line("-" if cell is None else str(cell)) for cell in cells]
        lines: list[str] = []
        operation = text[0]
        if columns(operation) > self.widths[0]:
            lines.append(operation)
            operation = ""
        padded = [
            operation + " " * (self.widths[0] - columns(operation)),
            text[1].ljust(self.widths[1]),
            text[2].ljust(self.widths[2]),
            text[3].rjust(self.widths[3]),
        ]
        start = sum(self.widths) + 2 * len(self.widths)
        room = self.width - start
        detail = text[4]
        if columns(detail) <= room or room >= DETAIL_ROOM:
            first, *rest = wrap_words(detail, max(room, 1))
            lines.append("  ".join([*padded, first]).rstrip())
            lines += [" " * start + line for line in rest]
        else:
            lines.append("  ".join(padded).rstrip())
            lines += ["    " + line for line in wrap_words(detail, self.width - 4)]
        return "\n".join(lines)


def summary_lines(results: Sequence[ResumeResult], verb: str) -> list[str]:
    """What a run did, counted by action, then by reason: each distinct detail of an
    operation left unfinished once, with how many it concerns, most first."""
    counts = Counter(result.action for result in results)
    summary = ", ".join(f"{count} {action}" for action, count in sorted(counts.items()))
    noun = "operation" if len(results) == 1 else "operations"
    lines = [f"{verb} {len(results)} {noun}: {summary}"]
    reasons = Counter(
        (result.action, result.detail)
        for result in results
        if result.detail and result.action not in RESUME_DONE
    )
    for (action, detail), count in reasons.most_common(MAX_REASONS):
        lines.append(f"  {count} {action}: {one_line(detail)}")
    if len(reasons) > MAX_REASONS:
        lines.append(f"  ... and {len(reasons) - MAX_REASONS} other reasons (--json lists each)")
    return lines


MAX_REASONS = 20
"""Distinct reasons a summary lists; the rest are counted in one line."""


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


def _announce_stopping(signal_name: str) -> None:
    logging.getLogger("idempotently.watch").info(
        "%s: finishing operations in flight, then releasing leases",
        signal_name,
        extra={"idempotently": {"event": "watch_stopping", "signal": signal_name}},
    )


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM/SIGINT set ``stop``; a second one ends the process at once.

    The handler takes no lock: it writes a byte to a pipe. ``stop.set()`` would take
    the event's lock, which the interrupted main thread may hold at that moment (inside
    ``stop.wait()``): a deadlock, seen as a worker that never stopped. A small thread
    reads the pipe, says that the worker is stopping, then sets ``stop``: the worker's
    last line ("stopped") comes after that notice, since it is written once ``stop``
    is set."""
    received: list[str] = []
    wake_r, wake_w = os.pipe()

    def handler(signum: int, frame: FrameType | None) -> None:
        if received or stop.is_set():
            # Not SIG_DFL and re-raise: as PID 1 in a container that would be ignored.
            os._exit(128 + signum)
        received.append(signal.Signals(signum).name)
        os.write(wake_w, b"\0")

    def announce() -> None:
        os.read(wake_r, 1)  # a signal, or the end of the watch
        try:
            if received and not stop.is_set():
                _announce_stopping(received[0])
        finally:
            stop.set()

    watched = (signal.SIGTERM, signal.SIGINT)
    previous = {signum: signal.signal(signum, handler) for signum in watched}
    early = _early_signals.take()  # a signal that came while the worker was starting
    if early is not None:
        # Said and set here, before the worker starts: it claims nothing.
        received.append(signal.Signals(early).name)
        _announce_stopping(received[0])
        stop.set()
        os.write(wake_w, b"\0")
    announcer = threading.Thread(target=announce, name="idempotently-watch-signals", daemon=True)
    announcer.start()
    try:
        yield
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
    reconciler: Lookup | None = None,
) -> WatchSummary:
    """`resume --watch`: `Session.watch` until SIGTERM/SIGINT (and, with a
    ``reconciler``, reconcile needs_reconcile operations as it goes), its events on
    the screen."""
    stop = threading.Event()
    logger = logging.getLogger("idempotently.watch")

    def on_result(result: ResumeResult) -> None:
        logger.info(
            "operation %s: %s",
            result.operation_id,
            result.action,
            extra={"idempotently": {"event": "operation", **result.to_json()}},
        )

    with (
        watch_output(as_json=as_json, terminal=terminal, host_id=session.host_id),
        stop_on_signals(stop),
    ):
        return session.watch(
            stop,
            interval=interval,
            concurrency=concurrency,
            base_url=base_url,
            on_result=on_result,
            reconciler=reconciler,
        )
