"""How the CLI renders journal records: JSON for scripts, aligned text for people.

Pure functions of the library's own types; nothing here reads the journal.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import io
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Literal

import wcwidth

from idempotently._cli_durations import format_age, format_duration
from idempotently._credentials import described, read_record
from idempotently._differences import shown_url
from idempotently._keys import SENSITIVE_HEADERS
from idempotently._pauses import is_breaker
from idempotently._policy import may_have_been_delivered, never_sent
from idempotently._profiles import profile_label
from idempotently._rows import (
    Attempt,
    AuditEntry,
    JournalStats,
    Operation,
    OriginPause,
    answered_by,
)

# The journal never stores these; a CLI that prints headers still refuses to,
# in case a journal was written by something else or a newer redaction list.
HIDDEN_HEADERS = SENSITIVE_HEADERS | {"set-cookie", "set-cookie2"}
REDACTED = "[redacted]"


def _moment(timestamp: float) -> datetime | None:
    try:
        return datetime.fromtimestamp(timestamp, timezone.utc)
    except (OverflowError, OSError, ValueError):  # past year 9999: no calendar date
        return None


def iso(timestamp: float | None) -> str | None:
    """ISO-8601 in UTC with milliseconds, e.g. ``2026-01-02T03:04:05.678+00:00``."""
    if timestamp is None:
        return None
    moment = _moment(timestamp)
    if moment is None:
        return f"{timestamp:.0f} (seconds since the epoch)"
    return moment.isoformat(timespec="milliseconds")


def utc(timestamp: float | None) -> str:
    """ISO-8601 in UTC to the second, e.g. ``2026-01-02T03:04:05Z``; ``-`` if unset."""
    if timestamp is None:
        return "-"
    moment = _moment(timestamp)
    if moment is None:
        return f"{timestamp:.0f} (seconds since the epoch)"
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def when(timestamp: float | None, now: float) -> str:
    """A time for people in ``show``: ISO-8601 UTC plus how long ago (``… (3m ago)``)."""
    if timestamp is None:
        return "-"
    if _moment(timestamp) is None:
        return utc(timestamp)
    return f"{utc(timestamp)} ({format_age(timestamp, now)})"


# C0 and C1 control characters, DEL, and the bidirectional overrides: what a server
# (or a journal) could use to rewrite an operator's terminal or hide text; and U+2028
# and U+2029, line breaks to str.splitlines() and to editors, which could split a record.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028-\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(found: re.Match[str]) -> str:
    code = ord(found.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` with every terminal control character shown as an escape, never obeyed."""
    return _UNPRINTABLE.sub(_escape, text)


_LINE_BREAKING = re.compile(r"[\\\t\n\r]")
_ONE_LINE = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}


def one_line(text: str) -> str:
    r"""``text`` as one field of one line: backslash, tab, LF and CR as ``\\``, ``\t``,
    ``\n``, ``\r``, every other control character as ``\xNN`` (as `printable`).

    Supplied text (an id, a note, a server's hint) so can neither start a line of its
    own, which could pass for an entry of the audit trail, nor add a field to a piped
    record; the backslash is escaped too, so the escapes read back unambiguously."""
    return printable(_LINE_BREAKING.sub(lambda found: _ONE_LINE[found.group()], text))


def record(cells: Iterable[object]) -> str:
    """One piped record: its fields `one_line` each, tab-separated; ``None`` is empty."""
    return "\t".join("" if cell is None else one_line(str(cell)) for cell in cells)


def _strict_json(text: str) -> Any:
    """JSON as RFC 8259 has it: NaN and Infinity are not JSON; too deep is not shown as JSON."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    def finite(number: str) -> float:
        value = float(number)
        if not math.isfinite(value):  # 1e999: valid JSON text, but no float holds it
            raise ValueError(f"{number[:20]} overflows a float")
        return value

    return json.loads(text, parse_constant=refuse, parse_float=finite)


def visible_headers(headers: Iterable[tuple[str, str]] | None) -> list[tuple[str, str]]:
    """Headers safe to print: secrets are replaced, never shown."""
    return [
        (name, REDACTED if name.lower() in HIDDEN_HEADERS else value)
        for name, value in headers or ()
    ]


def body_json(body: bytes | None) -> dict[str, Any] | None:
    """A body for scripts: its size, its text if UTF-8 (parsed too if JSON), else base64."""
    if body is None:
        return None
    rendered: dict[str, Any] = {"size": len(body)}
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        rendered["base64"] = base64.b64encode(body).decode("ascii")
        return rendered
    rendered["text"] = text
    with contextlib.suppress(ValueError, RecursionError):
        parsed = _strict_json(text)
        json.dumps(parsed)  # deep enough to parse may be too deep to print
        rendered["json"] = parsed
    return rendered


def body_lines(body: bytes | None) -> list[str]:
    """A body for people: pretty JSON, plain text, or a byte count for binary."""
    if body is None:
        return ["(none)"]
    if not body:
        return ["(empty)"]
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return [f"({len(body)} bytes of binary data; --json shows them as base64)"]
    try:
        return json.dumps(_strict_json(text), indent=2, ensure_ascii=False).splitlines()
    except (ValueError, RecursionError):
        return text.splitlines()


def operation_json(operation: Operation) -> dict[str, Any]:
    """An operation as ``list --json`` prints it (no bodies, no headers)."""
    return {
        "operation_id": operation.operation_id,
        "key": operation.key,
        "status": operation.status,
        "reason": operation.reason,
        "delivery": operation.delivery,
        "method": operation.method,
        "url": shown_url(operation.url),
        "attempts": operation.attempt_count,
        "last_status_code": operation.last_status_code,
        "created_at": iso(operation.created_at),
        "updated_at": iso(operation.updated_at),
        "not_before": iso(operation.not_before),
        "deadline_at": iso(operation.deadline_at),
        "key_expires_at": iso(operation.key_expires_at),
        "lease_owner": operation.lease_owner,
        "lease_until": iso(operation.lease_until) if operation.lease_until else None,
        "cap_reason": operation.cap_reason,
    }


def attempt_json(attempt: Attempt) -> dict[str, Any]:
    return {
        "number": attempt.number,
        "outcome": attempt.outcome,
        "status_code": attempt.status_code,
        "replayed": attempt.replayed,
        "started_at": iso(attempt.started_at),
        "elapsed": attempt.elapsed,
        "wait": attempt.wait,
        "error": attempt.error,
    }


def operation_detail_json(operation: Operation) -> dict[str, Any]:
    """An operation as ``show --json`` prints it: everything, attempts included."""
    return {
        **operation_json(operation),
        "profile": operation.profile,
        "key_header": operation.key_header,
        "fingerprint": operation.fingerprint,
        "request_headers": [list(pair) for pair in visible_headers(operation.request_headers)],
        "request_body": body_json(operation.request_body),
        "response_status": operation.response_status,
        "answered_by": answered_by(operation),
        "response_headers": None
        if operation.response_headers is None
        else [list(pair) for pair in visible_headers(operation.response_headers)],
        "response_body": body_json(operation.response_body),
        **at_rest_json(operation),
        "may_have_been_delivered": may_have_been_delivered(operation),
        "enqueued_at": iso(operation.enqueued_at),
        "first_send_at": iso(operation.first_send_at),
        "group_id": operation.group_id,
        "step": operation.step,
        "successor": operation.successor,
        "history": [attempt_json(attempt) for attempt in operation.attempts],
    }


def operation_fields(op: Operation, now: float) -> list[tuple[str, str]]:
    """The named fields at the top of ``show``: on a terminal aligned, piped one record each."""
    status = op.status + (f" ({op.reason})" if op.reason else "")
    fields = [
        ("operation", op.operation_id),
        ("key", f"{op.key}  ({op.key_header}, profile {profile_label(op.profile)})"),
        ("status", status),
        ("delivery", op.delivery),
        ("request", f"{op.method} {shown_url(op.url)}"),
        ("created", when(op.created_at, now)),
        ("updated", when(op.updated_at, now)),
        ("key expires", when(op.key_expires_at, now)),
    ]
    if op.enqueued_at is not None:
        fields.append(("enqueued", when(op.enqueued_at, now)))
        sent = "not yet" if op.first_send_at is None else when(op.first_send_at, now)
        fields.append(("first send", sent))
    if op.deadline_at is not None:
        fields.append(("deadline", when(op.deadline_at, now)))
    if op.not_before is not None:
        fields.append(("not before", when(op.not_before, now)))
    if op.lease_until > now:
        fields.append(("leased by", f"{op.lease_owner} until {when(op.lease_until, now)}"))
    fields.append(("attempts", str(op.attempt_count)))
    if op.cap_reason is not None:
        fields.append(("attempts cap", op.cap_reason))
    fields += at_rest_fields(op)
    return fields


def operation_records(
    op: Operation, entries: Sequence[AuditEntry], now: float
) -> list[tuple[object, ...]]:
    """``show`` piped: one record per field, attempt, header, body and audit entry, each
    led by what it is (``attempt``, ``request header``, ``audit``, ...), every value whole."""
    records: list[tuple[object, ...]] = list(operation_fields(op, now))
    records += [
        (
            "attempt",
            a.number,
            a.outcome,
            a.status_code,
            "yes" if a.replayed else "no",
            utc(a.started_at),
            seconds(a.elapsed),
            seconds(a.wait),
            a.error,
        )
        for a in op.attempts
    ]
    if not op.attempts:
        records.append(("no attempt", no_attempt(op)))
    records += [("request header", *pair) for pair in visible_headers(op.request_headers)]
    records.append(("request body", _body_field(op.request_body, op.unreadable)))
    records.append(("response", op.response_status if op.response_status is not None else "none"))
    source = answer_source(op) if op.response_status is not None else None
    if source is not None:
        records.append(("response source", source))
    records += [("response header", *pair) for pair in visible_headers(op.response_headers)]
    if op.response_status is not None:
        records.append(("response body", _body_field(op.response_body, op.unreadable)))
    if op.forked_from is not None:
        records.append(("forked from", op.forked_from))
    records += [("forked as", fork) for fork in _forks(entries)]
    if op.lookup_after is not None and op.status == "needs_reconcile":
        records.append(("next lookup", when(op.lookup_after, now)))
    for entry in entries:
        detail = entry_detail(entry)
        records.append(
            (
                "audit",
                utc(entry.at),
                entry.actor,
                entry.action,
                detail.get("from"),
                detail.get("to"),
                entry.note,
            )
        )
    return records


def no_attempt(op: Operation) -> str:
    """What an operation with no attempt journaled means for its delivery."""
    if never_sent(op):
        return "none: enqueued and not sent yet, so nothing can have been delivered"
    # The key is committed just before the first send begins: no attempt means that
    # send is in flight or was cut off (its process killed) before it was journaled.
    return "none recorded: the first send began, so it may have been delivered"


def _body_field(body: bytes | None, unreadable: str | None) -> str:
    if unreadable is not None:
        return f"(not shown: {unreadable})"
    if body is None:
        return "(none)"
    try:
        return body.decode("utf-8") if body else "(empty)"
    except UnicodeDecodeError:
        return f"({len(body)} bytes of binary data; --json shows them as base64)"


def _forks(entries: Sequence[AuditEntry]) -> list[str]:
    forks = (entry_detail(entry).get("fork") for entry in entries)
    return [fork for fork in forks if isinstance(fork, str)]


def operation_lines(op: Operation, now: float, width: int | None = None) -> list[str]:
    """``show`` for people: the fields, the attempt table, headers and bodies.

    Within ``width`` terminal columns, long values (a reason, an error, a header)
    wrap between words under themselves; nothing is cut.
    """
    out = field_lines(operation_fields(op, now), width)

    out += ["", "attempts"]
    if op.attempts:
        rows = (
            (
                a.number,
                a.outcome,
                a.status_code,
                "yes" if a.replayed else "no",
                utc(a.started_at),
                seconds(a.elapsed),
                seconds(a.wait),
            )
            for a in op.attempts
        )
        headers = ("#", "outcome", "status", "replayed", "started", "elapsed", "wait")
        out += _indent(table(headers, rows, right="#,status,elapsed,wait"))
        # Errors are prose: whole, under the table, so the table fits 80 columns.
        for a in op.attempts:
            if a.error:
                out += indented_wrap(f"attempt {a.number}: {a.error}", width)
    else:
        out.append(f"  ({no_attempt(op)})")

    out += ["", "request headers"]
    for name, value in visible_headers(op.request_headers):
        out += indented_wrap(f"{name}: {value}", width)
    if op.unreadable is not None:
        out += ["", f"request body (not shown: {op.unreadable})"]
    else:
        out += ["", f"request body ({_bytes(len(op.request_body))})"]
        out += _indent(body_lines(op.request_body))

    if op.response_status is None:
        return [*out, "", "response: none stored"]
    out += ["", f"response {op.response_status}"]
    source = answer_source(op)
    if source is not None:
        out += indented_wrap(source, width)
    for name, value in visible_headers(op.response_headers):
        out += indented_wrap(f"{name}: {value}", width)
    if op.unreadable is not None:
        return [*out, "", "response body (not shown: encoded, see the request body)"]
    out += ["", f"response body ({_bytes(len(op.response_body or b''))})"]
    out += _indent(body_lines(op.response_body))
    return out


def answer_source(op: Operation) -> str | None:
    """What ``show`` says of a stored answer that is not the server's answer to the
    operation's request (None: it is)."""
    by = answered_by(op)
    if by == "lookup":
        where = next(
            (
                value
                for name, value in op.response_headers or ()
                if name.lower() == "content-location"
            ),
            None,
        )
        page = "" if where is None else f" in the answer to GET {shown_url(where)}"
        return (
            f"(not the server's answer to this request: the object a lookup found{page}, "
            "stored with that answer's status; a call again returns it)"
        )
    if by == "reconciler":
        return (
            "(not the server's answer to this request: the response a reconciler settled it "
            "with; a call again returns it)"
        )
    return None


# -- data at rest: what show says of codecs, redacted parameters, bound credentials ----------


def _listed(text: str | None) -> list[str]:
    try:
        names = json.loads(text) if text else []
    except ValueError:
        return []
    return [name for name in names if isinstance(name, str)] if isinstance(names, list) else []


def at_rest_fields(op: Operation) -> list[tuple[str, str]]:
    """The ``show`` lines for a codec, redacted query parameters and bound credentials."""
    fields = []
    if op.codec is not None:
        fields.append(("codec", op.codec + (" (bodies not decoded here)" if op.unreadable else "")))
    if op.secret_params:
        fields.append(("redacted", "query " + ", ".join(_listed(op.secret_params))))
    if op.credentials_digest:
        try:
            names = list(read_record(op.credentials_digest)[0])
        except ValueError:
            names = []
        fields.append(("key bound to", described(names) + " (a salted digest; never the values)"))
    return fields


def at_rest_json(op: Operation) -> dict[str, Any]:
    """``show --json``'s fields for data at rest; bodies are null when not decoded."""
    shown: dict[str, Any] = {
        "codec": op.codec,
        "secret_params": _listed(op.secret_params),
        "key_bound_to_credentials": op.credentials_digest is not None,
        "bodies_unreadable": op.unreadable,
    }
    if op.unreadable is not None:
        shown["request_body"] = None
        shown["response_body"] = None
    return shown


def _indent(lines: Iterable[str]) -> list[str]:
    return [f"  {line}".rstrip() for line in lines]


def _bytes(size: int) -> str:
    return plural(size, "byte")


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 attempt``, ``2 attempts``, ``0 attempts`` (``nouns`` for irregular plurals)."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


ELLIPSIS = "…"
MIN_SHORTENED = 10
"""A shortened cell keeps at least this many columns (or its header's width)."""
Shorten = Literal["middle", "end", "url"]


def columns(text: str) -> int:
    """Terminal columns ``text`` takes: 2 for a CJK character or an emoji, 0 for a combining mark.

    Cells reach here through `printable`, so there is no control character
    to measure; one that slips through counts as nothing rather than as -1.
    """
    measured = wcwidth.wcswidth(text)
    if measured >= 0:
        return measured
    return sum(max(0, wcwidth.wcwidth(char)) for char in text)


def _clusters(text: str) -> list[str]:
    """``text`` in pieces never to be split: its grapheme clusters (``👩🏽``, ``🇯🇵``)."""
    return list(wcwidth.iter_graphemes(text))


def _fit(pieces: Iterable[str], width: int) -> list[str]:
    """The leading pieces that together take at most ``width`` columns."""
    kept: list[str] = []
    used = 0
    for piece in pieces:
        used += columns(piece)
        if used > width:
            break
        kept.append(piece)
    return kept


def shorten(text: str, width: int, where: Shorten = "middle") -> str:
    """``text`` in at most ``width`` columns: ``abc…xyz`` (ids, URLs) or ``abcdef…`` (prose).

    The middle keeps both what tells ids apart at the start (the host, the order)
    and at the end (the path, the step); prose keeps its beginning. Width is
    measured in terminal columns, and a wide character is never cut in half:
    where half of one would fit, the line is one column shorter.
    """
    if columns(text) <= width:
        return text
    if width <= 1:
        return ELLIPSIS[:width]
    pieces = _clusters(text)
    if where == "end":
        return "".join(_fit(pieces, width - 1)).rstrip() + ELLIPSIS
    head = _fit(pieces, width // 2)
    tail = _fit(reversed(pieces[len(head) :]), width - 1 - columns("".join(head)))
    return "".join(head) + ELLIPSIS + "".join(reversed(tail))


_ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*")


def origin_width(url: str) -> int:
    """Columns of ``url``'s ``scheme://host:port`` (the whole URL if it has none)."""
    found = _ORIGIN.match(url)
    return columns(found.group() if found else url)


def shorten_url(url: str, width: int) -> str:
    """``url`` in at most ``width`` columns, its ``scheme://host:port`` kept whole and
    the middle of its path elided (``http://127.0.0.1:8000/v…ges``), while the
    origin and a character of the path fit; below that, shortened in the middle."""
    found = _ORIGIN.match(url)
    if columns(url) <= width or found is None or width < columns(found.group()) + 2:
        return shorten(url, width, "middle")
    origin = found.group()
    return origin + shorten(url[len(origin) :], width - columns(origin), "middle")


def wrap_words(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` terminal columns, broken only between words.

    A word wider than ``width`` (a long URL, a key) gets a line of its own and is
    never split: a terminal that wraps it still shows it whole, and a reader can
    copy it. Existing line breaks are kept.
    """
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            if not line:
                line = word
            elif columns(line) + 1 + columns(word) <= width:
                line = f"{line} {word}"
            else:
                lines.append(line)
                line = word
        lines.append(line)
    return lines


def field_lines(fields: Sequence[tuple[str, str]], width: int | None = None) -> list[str]:
    """``name  value`` lines, names aligned; within ``width``, a long value wraps between
    words under itself (never mid-word), so nothing is cut and nothing is lost."""
    name_width = max(columns(name) for name, _ in fields)
    out: list[str] = []
    for name, value in fields:
        label = name + " " * (name_width - columns(name)) + "  "
        value = one_line(value)  # no value can start a line that reads as another field
        room = None if width is None else width - columns(label)
        if room is None or room < MIN_WRAPPED:
            out.append(f"{label}{value}")
            continue
        first, *rest = wrap_words(value, room)
        out.append(f"{label}{first}")
        out += [" " * columns(label) + line for line in rest]
    return out


def indented_wrap(
    text: str, width: int | None, indent: str = "  ", hanging: str = "    "
) -> list[str]:
    """``text`` indented; within ``width``, wrapped between words with a hanging indent."""
    text = one_line(text)
    if width is None:
        return [f"{indent}{text}"]
    first, *rest = wrap_words(text, max(width - len(hanging), MIN_WRAPPED))
    return [f"{indent}{first}", *(f"{hanging}{line}" for line in rest)]


MIN_WRAPPED = 20
"""A wrapped value gets at least this many columns, however narrow the terminal."""


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[object]],
    right: str = "",
    *,
    width: int | None = None,
    shrink: Mapping[str, Shorten] | None = None,
    give: Sequence[tuple[str, int]] = (),
    own_line: str | None = None,
) -> list[str]:
    """Aligned columns; a ``None`` cell shows as ``-``; columns named in ``right`` align right.

    With ``width``, columns give up terminal columns until each line fits: first
    the steps of ``give`` in order, each ``(column, floor)`` narrowing one column
    down to ``floor``, then the columns named in ``shrink``, widest first, down
    to `MIN_SHORTENED`. A narrowed column's cells are shortened with ``…``
    (in the middle or at the end, as ``shrink`` says), except the ``own_line``
    column: a cell too wide for it is never cut but printed whole on a line of
    its own, its row following on the next line. The other columns are never cut.
    """
    cells = [["-" if cell is None else one_line(str(cell)) for cell in row] for row in rows]
    widths = [
        max([columns(name)] + [columns(row[i]) for row in cells]) for i, name in enumerate(headers)
    ]
    right_aligned = {i for i, name in enumerate(headers) if name in right.split(",")}
    shrinkable = {headers.index(name): where for name, where in (shrink or {}).items()}
    whole = None if own_line is None else headers.index(own_line)
    gap = "  "
    if width is not None:
        excess = sum(widths) + 2 * (len(widths) - 1) - width
        if excess > 0:
            # One space between columns, as ls -l and ps have, before any value gives way.
            gap = " "
            excess -= len(widths) - 1
        natural = list(widths)
        for name, floor in give:
            i = headers.index(name)
            taken = max(0, min(excess, widths[i] - max(floor, columns(headers[i]))))
            if i == whole and taken:
                # Narrowed to the widest cell that still fits, so every id that can be
                # whole on its row is; the columns freed by the snap go back below.
                fits = [columns(row[i]) for row in cells if columns(row[i]) <= widths[i] - taken]
                taken = widths[i] - max([columns(headers[i]), *fits])
            widths[i] -= taken
            excess -= taken
        for name, _ in give:  # what a snap freed returns to the columns that gave first
            i = headers.index(name)
            returned = 0 if i == whole else max(0, min(-excess, natural[i] - widths[i]))
            widths[i] += returned
            excess += returned
        if excess + len(widths) - 1 <= 0:
            gap = "  "  # room enough for the wide gaps again
            excess += len(widths) - 1
        floors = {i: max(columns(headers[i]), MIN_SHORTENED) for i in shrinkable}
        while excess > 0:
            wide = [i for i in shrinkable if widths[i] > floors[i]]
            if not wide:
                break
            widest = max(wide, key=lambda i: widths[i])
            widths[widest] -= 1
            excess -= 1
        for row in cells:
            for i, where in shrinkable.items():
                if i == whole:
                    continue
                if where == "url":
                    row[i] = shorten_url(row[i], widths[i])
                else:
                    row[i] = shorten(row[i], widths[i], where)

    def line(row: Sequence[str]) -> str:
        padding = [" " * max(0, widths[i] - columns(cell)) for i, cell in enumerate(row)]
        padded = [
            padding[i] + cell if i in right_aligned else cell + padding[i]
            for i, cell in enumerate(row)
        ]
        return gap.join(padded).rstrip()

    out = [line(list(headers))]
    for row in cells:
        if whole is not None and columns(row[whole]) > widths[whole]:
            out.append(row[whole])
            row = [*row[:whole], "", *row[whole + 1 :]]
        out.append(line(row))
    return out


def operations_table(
    operations: Iterable[Operation], now: float, width: int | None = None
) -> list[str]:
    """The aligned table of `idempotently list` on a terminal (the demo prints it too).

    One rule: an operation id is never cut, since it is what ``show`` and every
    operator action take. Within ``width`` columns the gaps narrow to one space, then
    the URL gives way (its ``scheme://host:port`` kept, the middle of its path
    elided); an id that still does not fit beside the others is printed whole on a
    line of its own above its row (the only line that may pass the width, when the
    id is wider than the terminal); only then does the URL shorten further.
    """
    operations = list(operations)
    floor = max((origin_width(shown_url(op.url)) + 2 for op in operations), default=0)
    return table(
        ("operation", "status", "method", "url", "tries", "last", "age"),
        (
            (
                op.operation_id,
                listed_status(op),
                op.method,
                shown_url(op.url),
                op.attempt_count,
                op.last_status_code,
                short_age(op.created_at, now),
            )
            for op in operations
        ),
        right="tries,last",
        width=width,
        shrink={"url": "url"},
        give=(("url", floor), ("operation", 0)),
        own_line="operation",
    )


def listed_status(op: Operation) -> str:
    """An operation's status in ``list``'s table: one its ``max_total_attempts`` ended
    says so (the whole reason is in ``show`` and ``list --json``)."""
    return op.status if op.cap_reason is None else f"{op.status} (attempts cap)"


def short_age(timestamp: float, now: float) -> str:
    """An age for a column: ``3m``, ``2d``, ``now``; ``in 5h`` for a time ahead of this
    clock."""
    age = format_age(timestamp, now)
    return "now" if age == "just now" else age.removesuffix(" ago")


def operation_record(operation: Operation) -> tuple[object, ...]:
    """One piped record of ``list``: the table's fields, each whole, the creation time
    in ISO 8601 UTC (an age means nothing once it is stored)."""
    return (
        operation.operation_id,
        operation.status,
        operation.method,
        shown_url(operation.url),
        operation.attempt_count,
        operation.last_status_code,
        utc(operation.created_at),
    )


OPERATION_FIELDS = (
    "operation_id",
    "key",
    "status",
    "reason",
    "delivery",
    "method",
    "url",
    "attempts",
    "last_status_code",
    "created_at",
    "updated_at",
    "not_before",
    "deadline_at",
    "key_expires_at",
    "lease_owner",
    "lease_until",
    "cap_reason",
)
"""The keys of `operation_json`, in order: the columns of ``list --format csv``."""


def csv_text(records: Sequence[Mapping[str, Any]], fields: Sequence[str] = ()) -> str:
    """Records as CSV with a header row (RFC 4180 line ends); ``None`` is an empty field.

    Control characters in text are shown as escapes, as in every format for people.

    The columns are ``fields``, else the first record's keys. No records: the header
    row alone when ``fields`` names the columns (a spreadsheet or ``pandas.read_csv``
    refuses an empty file), else no output.
    """
    if not records and not fields:
        return ""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(fields or records[0]), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(
        {name: _csv_cell(value) for name, value in record.items()} for record in records
    )
    return out.getvalue()


def _csv_cell(value: object) -> object:
    if value is None:
        return ""
    return printable(value) if isinstance(value, str) else value


def nl_lines(records: Iterable[Any]) -> list[str]:
    """Newline-delimited JSON: one compact JSON value per line."""
    return [json.dumps(record, ensure_ascii=False, separators=(",", ":")) for record in records]


def seconds(value: float | None) -> str | None:
    """Elapsed or wait time for people: ``0.012s``, ``2.5s``, ``3m20s``."""
    if value is None:
        return None
    if value < 60:
        return f"{value:.3f}s" if value < 10 else f"{value:.1f}s"
    return format_duration(value)


def percent(rate: float) -> str:
    return f"{rate * 100:.1f}%"


def stats_lines(
    stats: JournalStats,
    path: str,
    stuck_after: float,
    pauses: Sequence[OriginPause] = (),
    width: int | None = None,
) -> list[str]:
    """``stats`` for people: one named figure per line, then the paused origins (wrapped
    between words within ``width``)."""
    return field_lines(stats_fields(stats, path, stuck_after, pauses), width)


def stats_fields(
    stats: JournalStats, path: str, stuck_after: float, pauses: Sequence[OriginPause] = ()
) -> list[tuple[str, str]]:
    """``stats``'s named figures; a status count and a paused origin are indented under
    what they count (piped, each is a record of its own, its name unindented)."""
    age = stats.oldest_pending_age
    oldest = stats.oldest_pending_created_at
    fields = [
        ("journal", path),
        ("operations", str(stats.operations)),
        *((f"  {status}", str(count)) for status, count in stats.counts.items()),
        ("attempts", str(stats.attempts)),
        ("replay rate", f"{percent(stats.replay_rate)} of answers were replays"),
        ("409 rate", f"{percent(stats.in_progress_rate)} of answers said in progress"),
        ("retries/op", f"{stats.retries_per_operation:.2f}"),
        (
            "oldest pending",
            "-" if age is None or oldest is None else f"created {format_age(oldest, stats.now)}",
        ),
        ("stuck", f"{stats.stuck} (pending, unleased, idle over {format_duration(stuck_after)})"),
    ]
    if stats.expiring is not None and stats.expiring_within is not None:
        fields.append(
            (
                "expiring keys",
                f"{stats.expiring} (pending, key expires within "
                f"{format_duration(stats.expiring_within)} or has expired)",
            )
        )
    fields.append(("attempts cap", f"{stats.capped} (operations that reached max_total_attempts)"))
    fields.append(("paused origins", str(len(pauses))))
    breakers = sum(is_breaker(pause) for pause in pauses)
    fields.extend(
        (
            f"  {printable(pause.origin)}",
            f"until {iso(pause.until)} ({printable(pause.reason or '')})"
            + (
                f"; written by a clock {format_duration(pause.set_at - stats.now)} ahead of "
                f"this host's: a call here waits at most its "
                f"{format_duration(pause.until - pause.set_at)} from when it first sees it"
                if pause.set_at > stats.now
                else ""
            ),
        )
        for pause in pauses
    )
    # A breaker is a pause (listed above, its reason saying open or half-open): counted
    # apart too, as the circuit breakers' own figure.
    fields.append(("open breakers", str(breakers)))
    return fields


def pause_json(pause: OriginPause, now: float | None = None) -> dict[str, Any]:
    """An origin pause for scripts: its times as ISO 8601 too, its length, and (with
    ``now``) how far ahead of ``now`` the clock that wrote it was (0: not ahead)."""
    ahead = {} if now is None else {"clock_ahead": max(0.0, pause.set_at - now)}
    return {
        **pause.to_json(),
        "until_iso": iso(pause.until),
        "set_at_iso": iso(pause.set_at),
        "length": pause.until - pause.set_at,
        "breaker": is_breaker(pause),
        **ahead,
    }


def _label(value: str) -> str:
    """A Prometheus label value: backslash, double quote and line feed escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sample(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


def stats_prometheus(
    stats: JournalStats, path: str, pauses: Sequence[OriginPause] | None = None
) -> str:
    """``stats`` in the Prometheus text exposition format, for node-exporter's textfile collector.

    Every metric is a gauge labelled with the journal's path; operations are
    counted per ``status`` label; an age with nothing pending is 0.
    """
    journal = f'journal="{_label(path)}"'
    metrics: list[tuple[str, str, list[tuple[str, float]]]] = [
        (
            "operations",
            "Operations in the journal, by status.",
            [(f'{journal},status="{status}"', count) for status, count in stats.counts.items()],
        ),
        ("attempts", "Attempts journaled (pruning removes some).", [(journal, stats.attempts)]),
        (
            "replay_rate",
            "Share of answers the server marked as replays (0 to 1).",
            [(journal, round(stats.replay_rate, 6))],
        ),
        (
            "in_progress_rate",
            "Share of answers saying the key was still in progress, 409 or 423 (0 to 1).",
            [(journal, round(stats.in_progress_rate, 6))],
        ),
        (
            "retries_per_operation",
            "Attempts beyond the first, per operation.",
            [(journal, round(stats.retries_per_operation, 6))],
        ),
        (
            "stuck_operations",
            "Pending operations nobody holds a lease on and idle over the stuck-after window.",
            [(journal, stats.stuck)],
        ),
        (
            "oldest_pending_age_seconds",
            "Age of the oldest pending operation in seconds (0 when none is pending).",
            [(journal, round(stats.oldest_pending_age or 0.0, 3))],
        ),
    ]
    metrics.append(
        (
            "capped_operations",
            "Operations that reached their policy's max_total_attempts (needs_reconcile, "
            "or failed when none can have acted), whatever their status now.",
            [(journal, stats.capped)],
        )
    )
    if stats.expiring is not None:
        metrics.append(
            (
                "expiring_keys",
                "Pending operations whose key expires within --expiring-within (default "
                "the key-expiry margin, 1 h: resume will not resend them) or has expired.",
                [(journal, stats.expiring)],
            )
        )
    if pauses is not None:
        metrics.append(
            (
                "open_breakers",
                "Circuit breakers open or half-open, by origin (RetryPolicy(breaker=...)).",
                [
                    (f'{journal},origin="{_label(origin)}"', count)
                    for origin, count in sorted(
                        Counter(pause.origin for pause in pauses if is_breaker(pause)).items()
                    )
                ]
                or [(journal, 0)],
            )
        )
    lines: list[str] = []
    for name, help_text, samples in metrics:
        full = f"idempotently_{name}"
        lines += [f"# HELP {full} {help_text}", f"# TYPE {full} gauge"]
        lines += [f"{full}{{{labels}}} {_sample(value)}" for labels, value in samples]
    return "\n".join(lines) + "\n"


# -- the operator's journal: links and audit entries ------------------------------------


def operator_json(operation: Operation, entries: Sequence[AuditEntry]) -> dict[str, Any]:
    """What ``show --json`` adds for the operator's journal: links and audit entries."""
    return {
        "forked_from": operation.forked_from,
        "forks": [
            entry_detail(entry)["fork"] for entry in entries if "fork" in entry_detail(entry)
        ],
        "lookup_after": iso(operation.lookup_after),
        "audit": [{**entry.to_json(), "at": iso(entry.at)} for entry in entries],
    }


def entry_detail(entry: AuditEntry) -> dict[str, Any]:
    detail = entry.to_json()["detail"]
    return detail if isinstance(detail, dict) else {}


def operator_lines(operation: Operation, entries: Sequence[AuditEntry], now: float) -> list[str]:
    """What ``show`` adds for people: links, the lookup backoff, the audit trail."""
    out: list[str] = []
    if operation.forked_from is not None:
        out.append(f"forked from  {one_line(operation.forked_from)}")
    out += [f"forked as    {one_line(fork)}" for fork in _forks(entries)]
    if operation.lookup_after is not None and operation.status == "needs_reconcile":
        out.append(f"next lookup  {when(operation.lookup_after, now)}")
    out += ["", "audit"]
    if not entries:
        return [*out, "  (no operator action or lookup recorded)"]
    for entry in entries:
        detail = entry_detail(entry)
        change = (
            f" ({one_line(str(detail['from']))} -> {one_line(str(detail['to']))})"
            if "from" in detail and detail.get("from") != detail.get("to")
            else ""
        )
        # Each entry is exactly two lines however its text reads: a note holding a line
        # break shows it as \n, so no note can print a second, forged entry.
        out.append(f"  {utc(entry.at)}  {one_line(entry.actor)}  {one_line(entry.action)}{change}")
        if entry.note:
            out.append(f"    {one_line(entry.note)}")
    return out
