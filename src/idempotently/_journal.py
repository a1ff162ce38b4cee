"""The SQLite journal: one row per operation, one per attempt.

Durability: with ``durability="fsync"`` (the default) the row that names an
operation's key is committed with ``synchronous=FULL`` (the WAL is fsync'd)
before the first attempt; with ``"os"`` it is committed before the first
attempt but left to the OS to write back. Every later write (attempt rows,
completion, leases) commits with ``synchronous=NORMAL``: losing one to a power
cut only means a resume gets a replay from the server, which the key makes
harmless. See https://idempotently.readthedocs.io/en/latest/journal/

Audits stay fast on large journals without scanning them: triggers keep the
counts per status and per kind of attempt in one row, a partial index holds
the pending operations and another the finished ones by idle time.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import random
import re
import sqlite3
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from heapq import merge
from itertools import islice
from json.encoder import encode_basestring_ascii as _json_str
from pathlib import Path
from typing import Any, Final, Literal, NoReturn, TypeVar, cast, get_args

import attrs
import sqlite_utils

from idempotently._exceptions import (
    JournalCorruptError,
    JournalError,
    JournalMissingError,
    JournalMovedError,
    JournalVersionError,
    JournalWriteError,
)
from idempotently._group_commit import Failed, GroupCommit
from idempotently._vocabulary import FINISHED_STATUSES, STATUSES, Delivery, Outcome, Status

T = TypeVar("T")

_POSTGRES_SCHEMES = ("postgresql://", "postgres://")
"""A journal path starting with one of these is a PostgreSQL URL (see _postgres.py)."""
# A URL the PostgreSQL journal does not take (another scheme, upper case, surrounding
# spaces, or a pathlib.Path, which folds "//" into "/"): not a file name either.
_URL_LIKE = re.compile(r"(?i)\s*(postgres(ql)?:/|[a-z][a-z0-9+.-]+://)")


def _refuse_url(path: str) -> None:
    """A JournalError, never echoing a password, for a path that is a mistyped URL."""
    text = os.fsdecode(path)
    if _URL_LIKE.match(text):
        shown = re.sub(r"(?<=:)[^:@/]*(?=@)", "***", text.strip())[:200]
        raise JournalError(
            f"{shown!r} looks like a URL, not a journal file: a PostgreSQL journal takes a "
            "str URL starting exactly with postgresql:// or postgres:// (lower case, no "
            "spaces around it, not a pathlib.Path); a SQLite journal takes a file path"
        )


MAX_LIMIT = 2**63 - 1
"""SQLite's largest integer: the largest ``limit`` a listing takes."""

SCHEMA_VERSION = 2
# "IDMP": marks the file as ours, so a stray database is never taken for a journal.
APPLICATION_ID = 0x49444D50


def _one_of(column: str, values: Sequence[str]) -> str:
    """``(column = 'a' OR column = 'b' ...)``.

    Not ``IN (...)``: SQLite builds a temporary b-tree for an IN list of more
    than two values each time a CHECK, a trigger or a partial index's WHERE
    evaluates it, on every write (with the triggers, it tripled an insert's cost).
    """
    return "(" + " OR ".join(f"{column} = '{value}'" for value in values) + ")"


# Written with OR, not IN: see _one_of. (Journals made by version 1 keep their
# IN lists; only a rebuild of the table could change them.)
_SCHEMA = f"""
CREATE TABLE operations (
    operation_id     TEXT PRIMARY KEY,
    key              TEXT NOT NULL UNIQUE,
    status           TEXT NOT NULL CHECK {_one_of("status", STATUSES)},
    delivery         TEXT NOT NULL CHECK (delivery IN ('exactly_once', 'at_most_once')),
    method           TEXT NOT NULL,
    url              TEXT NOT NULL,
    request_headers  TEXT NOT NULL,
    request_body     BLOB NOT NULL,
    fingerprint      TEXT NOT NULL,
    profile          TEXT NOT NULL,
    key_header       TEXT NOT NULL,
    created_at       REAL NOT NULL,
    updated_at       REAL NOT NULL,
    key_expires_at   REAL NOT NULL,
    deadline_at      REAL,
    not_before       REAL,
    lease_owner      TEXT,
    lease_until      REAL NOT NULL DEFAULT 0,
    attempt_count    INTEGER NOT NULL DEFAULT 0,
    last_status_code INTEGER,
    response_status  INTEGER,
    response_headers TEXT,
    response_body    BLOB,
    reason           TEXT
);
CREATE INDEX operations_by_status ON operations (status);
CREATE TABLE attempts (
    operation_id TEXT NOT NULL,
    number      INTEGER NOT NULL,
    started_at  REAL NOT NULL,
    elapsed     REAL NOT NULL,
    outcome     TEXT NOT NULL CHECK {_one_of("outcome", get_args(Outcome))},
    status_code INTEGER,
    replayed    INTEGER NOT NULL DEFAULT 0,
    error       TEXT,
    wait        REAL,
    PRIMARY KEY (operation_id, number)
) WITHOUT ROWID;
"""
# Every index is paid for by an fsync on the hot path, so there are few:
# listings order by rowid (insertion order, which is creation order) instead
# of an index on created_at, and attempts live in their primary key's b-tree.


_FINISHED = _one_of("status", FINISHED_STATUSES)
"""operations_finished's WHERE: a query must say it the same way to use the index."""
_STATUSES_SQL = ", ".join(f"'{status}'" for status in STATUSES)


def _status_deltas(*changes: str) -> str:
    """``pending = pending + (NEW.status = 'pending'), ...``: a trigger's SET list.

    Each change is ``"+NEW"`` or ``"-OLD"``: a row that came or went.
    """

    def delta(column: str, test: str) -> str:
        return f"{column} = {column}" + "".join(
            f" {change[0]} {test.format(row=change[1:])}" for change in changes
        )

    terms = [delta(status, f"({{row}}.status = '{status}')") for status in STATUSES]
    terms.append(delta("unknown_status", f"(NOT {_one_of('{row}.status', STATUSES)})"))
    return ",\n        ".join(terms)


def _attempt_deltas(*changes: str) -> str:
    """The attempt counters' SET list for attempt rows that came (``+NEW``) or went (``-OLD``)."""

    def delta(column: str, value: str) -> str:
        return f"{column} = {column}" + "".join(
            f" {change[0]} {value.format(row=change[1:])}" for change in changes
        )

    return ",\n        ".join(
        [
            delta("attempts", "1"),
            delta("answered_attempts", "({row}.status_code IS NOT NULL)"),
            delta("replayed_attempts", "{row}.replayed"),
            delta("in_progress_attempts", "coalesce({row}.status_code IN (409, 423), 0)"),
        ]
    )


# Version 2: what makes a journal of a million operations as quick to audit
# as an empty one, and the namespace its derived keys are made in. A version-1
# journal gets all of it, in one transaction, the first time it is opened to
# write. The triggers run on every write, whoever makes it (even the sqlite3
# shell), so the counts cannot drift from the rows; but SQLite fires no DELETE
# trigger for a row a REPLACE removes (docs/journal.md). The partial indexes carry
# `status` too: SQLite reads the column to check the WHERE again, and without
# it every entry would cost a lookup in the table.
_SCHEMA_V2 = f"""
CREATE TABLE journal_meta (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE journal_counts (
    id                   INTEGER PRIMARY KEY CHECK (id = 1),
    pending              INTEGER NOT NULL,
    succeeded            INTEGER NOT NULL,
    failed               INTEGER NOT NULL,
    needs_reconcile      INTEGER NOT NULL,
    abandoned            INTEGER NOT NULL,
    unknown_status       INTEGER NOT NULL,
    attempts             INTEGER NOT NULL,
    answered_attempts    INTEGER NOT NULL,
    replayed_attempts    INTEGER NOT NULL,
    in_progress_attempts INTEGER NOT NULL
);
CREATE INDEX operations_pending
    ON operations (created_at, lease_until, updated_at, not_before, status)
    WHERE status = 'pending';
CREATE INDEX operations_finished
    ON operations (updated_at, status)
    WHERE {_FINISHED};
CREATE TRIGGER count_new_operation AFTER INSERT ON operations BEGIN
    UPDATE journal_counts SET
        {_status_deltas("+NEW")};
END;
CREATE TRIGGER count_deleted_operation AFTER DELETE ON operations BEGIN
    UPDATE journal_counts SET
        {_status_deltas("-OLD")};
END;
CREATE TRIGGER count_status_change AFTER UPDATE OF status ON operations
WHEN OLD.status IS NOT NEW.status BEGIN
    UPDATE journal_counts SET
        {_status_deltas("-OLD", "+NEW")};
END;
CREATE TRIGGER count_new_attempt AFTER INSERT ON attempts BEGIN
    UPDATE journal_counts SET
        {_attempt_deltas("+NEW")};
END;
CREATE TRIGGER count_deleted_attempt AFTER DELETE ON attempts BEGIN
    UPDATE journal_counts SET
        {_attempt_deltas("-OLD")};
END;
CREATE TRIGGER count_changed_attempt AFTER UPDATE OF status_code, replayed ON attempts BEGIN
    UPDATE journal_counts SET
        {_attempt_deltas("-OLD", "+NEW")};
END;
"""

_SCHEMA_V2_NAMES: Final = frozenset(re.findall(r"CREATE (?:TABLE|INDEX|TRIGGER) (\w+)", _SCHEMA_V2))
"""Every table, index and trigger version 2 added: the audits rely on each."""

# The counts, from the rows: for a new journal (all zero) and a migrated one.
_RECOUNT = f"""
INSERT OR REPLACE INTO journal_counts SELECT 1,
    {", ".join(f"(SELECT count(*) FROM operations WHERE status = '{s}')" for s in STATUSES)},
    (SELECT count(*) FROM operations WHERE status NOT IN ({_STATUSES_SQL})),
    count(*),
    count(status_code),
    coalesce(sum(replayed), 0),
    coalesce(sum(status_code IN (409, 423)), 0)
FROM attempts
"""

_COUNTERS: Final = (
    *STATUSES,
    "unknown_status",
    "attempts",
    "answered_attempts",
    "replayed_attempts",
    "in_progress_attempts",
)

Durability = Literal["fsync", "os"]
"""``fsync``: the key's row is fsync'd before the first byte is sent; ``os``: only committed."""

DURABILITIES: Final[tuple[Durability, ...]] = ("fsync", "os")

_PRUNE_BATCH_SECONDS = 0.025
"""How long one prune transaction aims to hold the write lock."""
_PRUNE_BATCH_SIZES = (100, 20_000)
"""The fewest and most operations one prune transaction deletes."""
_SQL_VARIABLES = 500
"""Ids per statement: under SQLite's oldest limit on bound variables (999)."""
_PRUNE_PAUSE = (0.5, 1.5)
"""After each batch prune sleeps this many times the batch's time, drawn at random:
writers waiting for the lock get in, whatever the rhythm of their busy handler's retries."""

_INSERT_OPERATION = """
INSERT INTO operations (
    operation_id, key, status, delivery, method, url, request_headers, request_body,
    fingerprint, profile, key_header, created_at, updated_at, key_expires_at, deadline_at,
    lease_owner, lease_until
) VALUES (?, ?, 'pending', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT DO NOTHING
"""

# The attempt's number is the operation's next one, read in the same
# transaction: two writers can never both claim number n.
_INSERT_ATTEMPT = """
INSERT INTO attempts (
    operation_id, number, started_at, elapsed, outcome, status_code, replayed, error, wait
) SELECT operation_id, attempt_count + 1, ?, ?, ?, ?, ?, ?, ?
FROM operations WHERE operation_id = ?
"""


@attrs.frozen
class Attempt:
    """One HTTP exchange of an operation, as journaled."""

    number: int
    started_at: float
    elapsed: float
    outcome: Outcome
    """``not_sent``, ``maybe_delivered`` or ``answered``."""
    status_code: int | None
    replayed: bool
    """The server marked the answer as a replay of a stored response."""
    error: str | None
    wait: float | None
    """Seconds waited after this attempt before the next one."""


@attrs.frozen
class Operation:
    """One logical operation and its key, as journaled (never any secret)."""

    operation_id: str
    key: str
    status: Status
    delivery: Delivery
    method: str
    url: str
    request_headers: tuple[tuple[str, str], ...]
    request_body: bytes
    fingerprint: str
    profile: str
    key_header: str
    created_at: float
    updated_at: float
    key_expires_at: float
    deadline_at: float | None
    not_before: float | None
    lease_owner: str | None
    lease_until: float
    attempt_count: int
    last_status_code: int | None
    response_status: int | None
    response_headers: tuple[tuple[str, str], ...] | None
    response_body: bytes | None
    reason: str | None
    attempts: tuple[Attempt, ...] = ()
    """Filled in by :meth:`Journal.operation`; empty in listings."""

    @classmethod
    def _from_row(cls, row: dict[str, Any], attempts: tuple[Attempt, ...] = ()) -> Operation:
        values = dict(row)
        values["request_headers"] = _headers_from_json(values["request_headers"])
        if values["response_headers"] is not None:
            values["response_headers"] = _headers_from_json(values["response_headers"])
        return cls(**values, attempts=attempts)


@attrs.frozen
class NewOperation:
    """What the engine commits before the first attempt."""

    operation_id: str
    key: str
    delivery: Delivery
    method: str
    url: str
    request_headers: Sequence[tuple[str, str]]
    request_body: bytes
    fingerprint: str
    profile: str
    key_header: str
    created_at: float
    key_expires_at: float
    deadline_at: float | None

    def row(self, owner: str, lease_until: float) -> tuple[Any, ...]:
        """The values of the insert that journals it (both stores' column order)."""
        return (
            self.operation_id,
            self.key,
            self.delivery,
            self.method,
            self.url,
            _headers_json(self.request_headers),
            self.request_body,
            self.fingerprint,
            self.profile,
            self.key_header,
            self.created_at,
            self.created_at,
            self.key_expires_at,
            self.deadline_at,
            owner,
            lease_until,
        )


@attrs.frozen
class AttemptRecord:
    """One attempt's result and the operation's state after it."""

    started_at: float
    elapsed: float
    outcome: Outcome
    status_code: int | None = None
    replayed: bool = False
    error: str | None = None
    wait: float | None = None
    status: Status = "pending"
    reason: str | None = None
    not_before: float | None = None
    lease_until: float = 0.0
    """0 releases the lease; a live caller keeps it while it waits to retry."""
    response_status: int | None = None
    response_headers: Sequence[tuple[str, str]] | None = None
    response_body: bytes | None = None


_WRITE_ADVICE = {
    "locked": "another process held the journal's write lock past the busy timeout; "
    "look for a stuck process using this file, or raise busy_timeout",
    "full": "the disk is full; free some space",
    "readonly": "the file or its directory is read-only; fix the permissions",
    "other": "check free disk space and that the file and its directory are writable",
}


def _write_problem(error: sqlite3.Error) -> str:
    message = str(error).lower()
    if "locked" in message or "busy" in message:
        return "locked"
    if "full" in message:
        return "full"
    if "readonly" in message or "read-only" in message:
        return "readonly"
    return "other"


MAX_TIMESTAMP = 1e11
"""Seconds since the epoch in the year 5138: any later time is a mistake."""
MAX_WINDOW = 100 * 366 * 86400.0
DEFAULT_EXPIRING_WITHIN = 3600.0
"""The key-expiry margin ``resume`` keeps by default (``_flow.DEFAULT_KEY_EXPIRY_MARGIN``)."""
"""A century, in seconds: the longest age or window a read takes."""


def _check_number(name: str, value: object, *, integer: bool, low: float, high: float) -> None:
    """A read argument is a number from ``low`` to ``high`` (None allowed), or a clear error."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (integer and not isinstance(value, int))
    ):
        raise TypeError(
            f"{name} must be {'an int' if integer else 'a number'}, not {type(value).__name__}"
        )
    # Compared as they are: an int too large for a float is still simply too large.
    if not low <= value <= high:  # also false for nan
        raise ValueError(f"{name} must be a number from {low:g} to {high:g}, not {value!r:.40}")


def _split_statements(script: str) -> list[str]:
    """The statements of ``script`` (triggers hold semicolons), to run inside one transaction.

    ``executescript`` would commit first.
    """
    statements: list[str] = []
    current = ""
    for piece in script.split(";"):
        current += piece + ";"
        if sqlite3.complete_statement(current):
            if current.strip(" \n;"):
                statements.append(current.strip())
            current = ""
    return statements


def _headers_json(headers: Sequence[tuple[str, str]]) -> str:
    """``json.dumps(list(headers))`` for (name, value) pairs of str, character for character.

    Written out because it runs twice per call and json.dumps costs three times more;
    each string goes through the encoder json.dumps itself uses for it.
    """
    pairs = [f"[{_json_str(name)}, {_json_str(value)}]" for name, value in headers]
    return "[" + ", ".join(pairs) + "]"


def _headers_from_json(text: str) -> tuple[tuple[str, str], ...]:
    return tuple((name, value) for name, value in json.loads(text))


def _is_corruption(error: sqlite3.Error) -> bool:
    """SQLITE_CORRUPT or SQLITE_NOTADB: the file is damaged, retrying cannot help."""
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None and code & 0xFF in (11, 26):
        return True
    message = str(error).lower()
    return "malformed" in message or "not a database" in message


# What each column may hold, by column name: (types, NULL allowed, allowed values).
# Every row read goes through Journal._check_row, so a damaged value is a
# JournalCorruptError naming the operation, never a crash further on. Aliases in
# queries (stats, counts) must not reuse these names for something else.
_TEXT: tuple[type, ...] = (str,)
_REAL: tuple[type, ...] = (int, float)
_INT: tuple[type, ...] = (int,)
_BLOB: tuple[type, ...] = (bytes,)
_COLUMNS: dict[str, tuple[tuple[type, ...], bool, tuple[str, ...]]] = {
    "operation_id": (_TEXT, False, ()),
    "key": (_TEXT, False, ()),
    "status": (_TEXT, False, STATUSES),
    "delivery": (_TEXT, False, ("exactly_once", "at_most_once")),
    "method": (_TEXT, False, ()),
    "url": (_TEXT, False, ()),
    "request_headers": (_TEXT, False, ()),
    "request_body": (_BLOB, False, ()),
    "fingerprint": (_TEXT, False, ()),
    "profile": (_TEXT, False, ()),
    "key_header": (_TEXT, False, ()),
    "created_at": (_REAL, False, ()),
    "updated_at": (_REAL, False, ()),
    "key_expires_at": (_REAL, False, ()),
    "deadline_at": (_REAL, True, ()),
    "not_before": (_REAL, True, ()),
    "lease_owner": (_TEXT, True, ()),
    "lease_until": (_REAL, False, ()),
    "attempt_count": (_INT, False, ()),
    "last_status_code": (_INT, True, ()),
    "response_status": (_INT, True, ()),
    "response_headers": (_TEXT, True, ()),
    "response_body": (_BLOB, True, ()),
    "reason": (_TEXT, True, ()),
    "number": (_INT, False, ()),
    "started_at": (_REAL, False, ()),
    "elapsed": (_REAL, False, ()),
    "outcome": (_TEXT, False, ("not_sent", "maybe_delivered", "answered")),
    "status_code": (_INT, True, ()),
    "replayed": (_INT, False, ()),
    "error": (_TEXT, True, ()),
    "wait": (_REAL, True, ()),
}
_HEADER_COLUMNS = ("request_headers", "response_headers")


def _column_problem(column: str, value: object) -> str | None:
    """What is wrong with ``value`` in ``column``, or None if it can be decoded."""
    rule = _COLUMNS.get(column)
    if rule is None:
        return None
    types, nullable, choices = rule
    if value is None:
        return None if nullable else f"{column} is NULL"
    if not isinstance(value, types):
        return f"{column} holds {type(value).__name__} {_short(value)}"
    if choices and value not in choices:
        return f"{column} is {_short(value)}, not one of {', '.join(choices)}"
    if column in _HEADER_COLUMNS:
        try:
            pairs = json.loads(str(value))
        except ValueError as error:
            return f"{column} is not valid JSON ({error})"
        if not isinstance(pairs, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)
            for pair in pairs
        ):
            return f"{column} is not a list of [name, value] pairs"
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _QueuedWrite:
    """One thread's write, waiting for a transaction (``Journal._write_combined``)."""

    __slots__ = ("error", "finished", "result", "write")

    def __init__(self, write: Callable[[sqlite3.Connection], Any]) -> None:
        self.write = write
        self.finished = False
        self.result: Any = None
        self.error: Exception | None = None


class _WriteRaised(Exception):
    """One write of a shared transaction raised: roll it back, run each write alone."""


class _ClosedConnection:
    """A closed Journal's connection: any use raises a JournalError that names the file."""

    in_transaction = False

    def __init__(self, path: str) -> None:
        self._path = path

    def _closed(self, *args: object, **kwargs: object) -> NoReturn:
        raise JournalError(
            f"the journal {self._path} was closed (Journal.close(), or the end of the "
            "Session's `with` block); nothing was sent or written. Open the journal again "
            "(a new Journal or Session) to use it"
        )

    execute = executemany = executescript = _closed

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        self._closed()


class _WouldWait(BaseException):
    """Running now would wait or fsync (another connection holds the write lock, the
    write is durable, or the WAL would start over): :meth:`Journal._try_now` gives up.

    A BaseException, so no ``except Exception`` on the way (the combiner, the
    group commit) records it as a write's outcome: it unwinds to ``_try_now``
    before anything was written.
    """


CHECKPOINT_EVERY: Final = 200
"""After this many :meth:`Journal._try_now` commands, commands run in a thread until one
commits there, with SQLite's automatic checkpoint on.

A command writes 10-15 WAL pages; SQLite checkpoints past 1,000 (its default
``wal_autocheckpoint``, which the journal keeps), so the WAL stays under about
4,000 pages whatever runs on the loop."""

_WAL_INDEX: Final = struct.Struct("=16xI76xI")
"""The start of the ``-shm`` WAL index (SQLite's wal.c, native byte order): two copies
of a 48-byte header whose ``mxFrame`` (the WAL's last frame) is at byte 16, then
``nBackfill`` (how many frames were checkpointed)."""

NOT_NOW: Final = (False, None)
"""What :meth:`Journal._try_now` returns when running the command now would mean waiting."""


class Journal:
    """The local record of every operation, its key and its attempts.

    Safe to share between threads; several processes may open the same file.
    A ``postgresql://`` (or ``postgres://``) URL opens a journal in that
    PostgreSQL database instead (``pip install 'idempotently[postgres]'``).
    """

    def __new__(cls, path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Journal:
        """A PostgreSQL journal for a ``postgresql://`` URL, so ``isinstance(x, Journal)`` holds."""
        if cls is Journal and isinstance(path, str) and path.startswith(_POSTGRES_SCHEMES):
            from idempotently._postgres import PostgresJournal

            return super().__new__(PostgresJournal)
        return super().__new__(cls)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        readonly: bool = False,
        busy_timeout: float = 30.0,
        durability: Durability = "fsync",
    ) -> None:
        """Open (or create, mode 0600) the journal at ``path``.

        ``create=False`` neither creates the file nor initialises an empty
        one. ``readonly=True`` implies it, and opens the file read-only (SQLite
        ``mode=ro``): nothing is ever written, not even the switch to WAL mode
        or the upgrade of an older journal's schema.

        ``durability`` is what "journaled before the first byte is sent" means
        for the row naming a key. ``"fsync"`` (the default, the contract): the
        row is committed and fsync'd. ``"os"``: committed, never fsync'd; it
        survives the process being killed (SIGKILL, OOM) but not a power cut or
        an OS crash before the OS writes it back, and roughly halves the
        journal's cost per call (https://idempotently.readthedocs.io/en/latest/performance/).
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"the journal path must be a str or os.PathLike, not {type(path).__name__}"
            )
        _check_number("busy_timeout", busy_timeout, integer=False, low=0, high=MAX_WINDOW)
        if durability not in DURABILITIES:
            raise ValueError(
                f"durability must be one of {', '.join(map(repr, DURABILITIES))}, "
                f"not {durability!r}"
            )
        self.path = os.fspath(path)
        _refuse_url(self.path)
        self.durability: Durability = durability
        self.readonly = readonly
        self._create = create and not readonly
        self._busy_timeout = busy_timeout
        # SQLite resolves a relative path once, at open; so does the moved-file check.
        self._abspath = os.path.abspath(self.path)
        self._file_id: tuple[int, int] | None = None
        self._version = SCHEMA_VERSION
        self._namespace: uuid.UUID | None = None
        if not self._create and self.path != ":memory:" and not os.path.exists(self.path):
            raise JournalMissingError(
                f"no journal at {self.path}; pass --journal PATH (or set IDEMPOTENTLY_JOURNAL) "
                "to the file your Session writes"
            )
        self._lock = threading.RLock()
        self._durable_inserts: GroupCommit[tuple[NewOperation, str, float], bool] = GroupCommit(
            self._insert_batch
        )
        # The thread running a command through _try_now (writes go straight to SQLite,
        # past the combiner and the group commit), and whether its first BEGIN may
        # refuse to wait for another connection's write lock.
        self._now_thread: int | None = None
        self._refuse_busy = False
        self._now_runs = 0
        self._shm: int | None = None  # the -shm file, for _wal_starts_over
        self._combiner = threading.Condition()
        self._combining = False
        self._queued: list[_QueuedWrite] = []
        self._conn = self._connect(busy_timeout)
        self.db = sqlite_utils.Database(self._conn)
        try:
            self._check_schema()
            if self.path != ":memory:":
                self._file_id = self._file_identity()
        except BaseException:
            self._conn.close()
            raise

    # -- opening -------------------------------------------------------------

    def _connect(self, busy_timeout: float) -> sqlite3.Connection:
        if self.path != ":memory:" and not os.path.exists(self.path):
            self._create_private_file()
        readonly = self.readonly and self.path != ":memory:"
        try:
            conn = sqlite3.connect(
                Path(self._abspath).as_uri() + "?mode=ro" if readonly else self.path,
                timeout=busy_timeout,
                isolation_level=None,
                check_same_thread=False,
                uri=readonly,
            )
            conn.execute("PRAGMA synchronous = NORMAL")
        except sqlite3.DatabaseError as error:
            raise self._open_error(error) from error
        return conn

    def _create_private_file(self) -> None:
        # SQLite gives -wal and -shm the main file's mode, so 0600 here covers all three.
        # O_EXCL refuses a symlink, even a dangling one: create its target instead,
        # or SQLite would create it with the umask's mode.
        try:
            fd = os.open(os.path.realpath(self.path), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return  # another process created it first: fine
        except OSError as error:
            raise JournalWriteError(
                f"cannot create the journal {self.path}: {error.strerror}; "
                "check the directory exists and is writable"
            ) from error
        os.close(fd)

    def _open_error(self, error: sqlite3.DatabaseError) -> JournalError:
        message = str(error)
        if _is_corruption(error):
            return JournalCorruptError(
                f"{self.path} is not a readable idempotently journal ({message}); "
                "move it aside and restore a backup, or point --journal at the right file"
            )
        return JournalWriteError(
            f"cannot open the journal {self.path}: {message}; "
            "check the file and its directory are readable and writable"
        )

    def _check_schema(self) -> None:
        try:
            with self._lock:
                # One read transaction: a consistent snapshot even while
                # another process is creating the schema.
                self._conn.execute("BEGIN")
                try:
                    version = self._conn.execute("PRAGMA user_version").fetchone()[0]
                    app_id = self._conn.execute("PRAGMA application_id").fetchone()[0]
                    tables = set(self.db.table_names())
                    names = {row[0] for row in self._conn.execute("SELECT name FROM sqlite_master")}
                finally:
                    self._conn.execute("COMMIT")
                if version == 0 and not tables:
                    if not self._create:
                        raise JournalCorruptError(
                            f"{self.path} is empty, not an idempotently journal (it was left "
                            "as it is); point --journal (or Journal(path)) at the file your "
                            "Session writes"
                        )
                    self._create_schema()
                    self._namespace = self._read_namespace()
                    return
                if app_id != APPLICATION_ID:
                    raise JournalCorruptError(
                        f"{self.path} is an SQLite database but not an idempotently journal; "
                        "point --journal (or Journal(path)) at the journal file"
                    )
                if version > SCHEMA_VERSION:
                    raise JournalVersionError(
                        f"{self.path} has journal schema version {version}, but this "
                        f"idempotently reads up to version {SCHEMA_VERSION}; upgrade "
                        "idempotently (pip install -U idempotently). The file was not modified."
                    )
                if not {"operations", "attempts"} <= tables or (
                    version >= 2 and not _SCHEMA_V2_NAMES <= names
                ):
                    raise JournalCorruptError(
                        f"{self.path} is missing journal tables; restore it from a backup"
                    )
                if not self.readonly:
                    # A journal an older idempotently left in rollback mode.
                    self._ensure_wal()
                    if version < SCHEMA_VERSION:
                        self._migrate()
                        version = SCHEMA_VERSION
                self._version = version
                if version >= 2:
                    self._namespace = self._read_namespace()
        except sqlite3.DatabaseError as error:
            raise self._open_error(error) from error

    def _migrate(self) -> None:
        """Bring a version-1 journal to version 2, in one durable transaction.

        Builds the counts from the rows and the partial indexes from the table:
        a few seconds for a million operations, once. Another process may have
        migrated the file since we read its version: then there is nothing to do.
        """
        with self._write(durable=True):
            if self._conn.execute("PRAGMA user_version").fetchone()[0] >= 2:
                return
            self._create_v2_schema()

    def _create_v2_schema(self) -> None:
        for statement in _split_statements(_SCHEMA_V2):
            self._conn.execute(statement)
        self._conn.execute(_RECOUNT)
        self._conn.execute(
            "INSERT INTO journal_meta (name, value) VALUES ('namespace', ?)",
            (str(uuid.uuid4()),),
        )
        self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _read_namespace(self) -> uuid.UUID:
        with self._lock:
            row = self._conn.execute(
                "SELECT value FROM journal_meta WHERE name = 'namespace'"
            ).fetchone()
        try:
            return uuid.UUID(row[0])
        except (TypeError, ValueError, AttributeError) as error:
            raise JournalCorruptError(
                f"{self.path} has no valid key namespace ({_short(None if row is None else row[0])}"
                "); move it aside and restore a backup"
            ) from error

    def _ensure_wal(self) -> None:
        """Switch the file to WAL mode (persistent), or raise: never a rollback-mode journal.

        Switching needs an exclusive lock and SQLite does not always wait for
        it (several processes creating one journal): retry, but for no longer
        than the busy timeout in all.
        """
        if self.path == ":memory:" or self._journal_mode() == "wal":
            return
        deadline = time.monotonic() + self._busy_timeout
        problem, kind = "", "other"
        try:
            while True:
                try:
                    mode = str(self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
                except sqlite3.OperationalError as error:
                    if _write_problem(error) != "locked":
                        raise
                    problem, kind = str(error), "locked"
                else:
                    if mode.lower() == "wal":
                        return
                    problem = f"SQLite kept journal_mode {mode}"
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._conn.execute(f"PRAGMA busy_timeout = {max(1, int(left * 1000))}")
                time.sleep(min(0.02, left))
        finally:
            with suppress(sqlite3.Error):
                self._conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
        raise JournalWriteError(
            f"cannot switch the journal {self.path} to WAL mode ({problem}) within the "
            f"{self._busy_timeout:g} s busy timeout; "
            + _WRITE_ADVICE[kind]
            + " (the journal was left unchanged)"
        )

    def _journal_mode(self) -> str:
        return str(self._conn.execute("PRAGMA journal_mode").fetchone()[0]).lower()

    def _create_schema(self) -> None:
        self._ensure_wal()
        with self._write(durable=True):
            # Another process may have created it while we waited for the lock
            # (an older idempotently: version 1).
            if "operations" in self.db.table_names():
                if self._conn.execute("PRAGMA user_version").fetchone()[0] < 2:
                    self._create_v2_schema()
                return
            for statement in _split_statements(_SCHEMA):
                self._conn.execute(statement)
            self._conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            self._create_v2_schema()

    def close(self) -> None:
        """Close the file. Any later use raises :class:`JournalError` (closing again is a no-op)."""
        with self._lock:
            self._conn.close()
            if self._shm is not None:
                self._shm_closer()
                self._shm = None
            # Not sqlite3's "Cannot operate on a closed database": say which journal.
            self._conn = cast(sqlite3.Connection, _ClosedConnection(self.path))
            self.db.conn = self._conn

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Journal({self.path!r})"

    @property
    def namespace(self) -> uuid.UUID:
        """The journal's own random namespace: made with the journal, never changed.

        A named operation's key is ``uuid5(namespace, operation_id)``, so a
        re-run after a lost write sends the same key. A version-1 journal opened
        read-only has none yet (JournalVersionError): opening it to write
        upgrades it and makes one.
        """
        if self._namespace is None:
            raise JournalVersionError(
                f"the journal {self.path} has schema version {self._version}, which has no key "
                "namespace, and was opened read-only; open it once without readonly=True to "
                "upgrade it"
            )
        return self._namespace

    # -- the file under the path -------------------------------------------------

    def _file_identity(self) -> tuple[int, int]:
        try:
            found = os.stat(self._abspath)
        except OSError as error:
            raise JournalMovedError(
                f"the journal {self.path} was deleted or moved while in use "
                f"({error.strerror}); nothing was sent: a key journaled in a file nobody opens "
                "again could never be resumed. Put the file back, or close this Journal (or "
                "Session) and open a new one"
            ) from error
        return found.st_dev, found.st_ino

    def _check_still_there(self) -> None:
        """Raise :class:`JournalMovedError` unless ``path`` is still the file this Journal has open.

        One ``os.stat``. Call it before journaling a new key: a file deleted or
        renamed over while open keeps taking writes, but nobody would resume them.
        """
        if self._file_id is None:
            return
        if self._file_identity() != self._file_id:
            raise JournalMovedError(
                f"the journal {self.path} was replaced by another file while in use; "
                "nothing was sent. Close this Journal (or Session) and open it again to use "
                "the new file; operations pending in the old one are only in the old one"
            )

    # -- transactions ----------------------------------------------------------

    def _check_writable(self) -> None:
        if self.readonly:
            raise JournalWriteError(
                f"the journal {self.path} was opened read-only; open it without readonly=True"
            )

    @contextmanager
    def _snapshot(self) -> Iterator[None]:
        """Several reads as one consistent view, while other processes write."""
        with self._lock:
            self._conn.execute("BEGIN")
            try:
                yield
            finally:
                with suppress(sqlite3.Error):
                    self._conn.execute("ROLLBACK")

    @contextmanager
    def _write(self, *, durable: bool = False) -> Iterator[sqlite3.Connection]:
        """One short write transaction; ``durable`` fsyncs the WAL at commit."""
        self._check_writable()
        with self._lock:
            try:
                if self._refuse_busy:
                    self._begin_or_refuse(durable=durable)  # began, or raised
                else:
                    if durable:
                        self._conn.execute("PRAGMA synchronous = FULL")
                    self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self._conn
                    self._conn.execute("COMMIT")
                    if self._now_thread is None:
                        # Committed with the automatic checkpoint on: it ran if due.
                        self._now_runs = 0
                except BaseException:
                    # SQLite may already have rolled back (SQLITE_FULL does):
                    # a second ROLLBACK would hide the real error.
                    if self._conn.in_transaction:
                        with suppress(sqlite3.Error):
                            self._conn.execute("ROLLBACK")
                    raise
            except sqlite3.DatabaseError as error:
                if _is_corruption(error):
                    raise self._damaged(error) from error
                if isinstance(error, sqlite3.DataError):
                    raise JournalWriteError(
                        f"cannot write the journal {self.path}: {error}; a value is over "
                        "SQLite's size limit (a request or response body of a gigabyte?): "
                        "send it in smaller parts (nothing was written)"
                    ) from error
                if not isinstance(error, sqlite3.OperationalError):
                    raise
                raise JournalWriteError(
                    f"cannot write the journal {self.path}: {error}; "
                    + _WRITE_ADVICE.get(_write_problem(error), _WRITE_ADVICE["other"])
                    + " (nothing was lost: the previous state stands)"
                ) from error
            finally:
                if durable:
                    with suppress(sqlite3.Error):
                        self._conn.execute("PRAGMA synchronous = NORMAL")

    def _begin_or_refuse(self, *, durable: bool) -> None:
        """BEGIN IMMEDIATE, or :class:`_WouldWait` at once if another connection is
        writing or the transaction would fsync.

        Only the first transaction of a :meth:`_try_now` command may refuse: a
        later one would leave the command half done, so it waits as usual.
        """
        self._refuse_busy = False
        if durable:
            raise _WouldWait
        self._conn.execute("PRAGMA busy_timeout = 0")
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as error:
            if _write_problem(error) == "locked":
                raise _WouldWait from None
            raise
        finally:
            with suppress(sqlite3.Error):
                self._conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
        if self._wal_starts_over():
            self._conn.execute("ROLLBACK")
            raise _WouldWait

    def _wal_starts_over(self) -> bool:
        """Whether the write transaction just begun will write the WAL's header, and fsync it.

        SQLite starts the WAL over (or creates it) when the transaction began with
        every frame already checkpointed (by this connection's thread, another
        process, or the last connection to close): it writes a new header and syncs
        it even with ``synchronous = NORMAL``. The WAL index (``-shm``) says so:
        its last frame (``mxFrame``) equals the checkpointed count (``nBackfill``).
        The write lock held, ``mxFrame`` cannot move; ``nBackfill`` only grows toward
        it, so "no" stays true. Unreadable: "yes", so the write goes to a thread.
        """
        if self.path == ":memory:":
            return False
        try:
            if self._shm is None:
                # Opened once, while SQLite has it open too: the same file SQLite reads,
                # even if the journal is later renamed or replaced at its path.
                self._shm = os.open(self._abspath + "-shm", os.O_RDONLY | os.O_CLOEXEC)
                # Closed with the journal, or when it is collected unclosed.
                self._shm_closer = weakref.finalize(self, os.close, self._shm)
            index = os.pread(self._shm, _WAL_INDEX.size, 0)
        except OSError:
            return True
        if len(index) < _WAL_INDEX.size:
            return True
        frames, backfilled = _WAL_INDEX.unpack(index)
        return index[:48] != index[48:96] or frames == backfilled

    def _try_now(self, run: Callable[[], T]) -> tuple[bool, T | None]:
        """``(True, run())`` if the journal commands in ``run`` need not wait; else NOT_NOW.

        What an async session calls on the event loop before handing a command
        to a worker thread: a hop to a thread and back costs more than the write
        itself (0.3 ms of CPU and more of latency, against 0.1-0.2 ms for a
        commit without fsync). It runs ``run`` here only if nothing would make
        the loop wait on the journal, as the async driver promises: no lock wait and no
        fsync. So: this journal's lock is free (no other thread is using it);
        no other connection holds the file's write lock and the first write is
        not a durable one (its ``BEGIN IMMEDIATE`` does not wait: if it would,
        or would fsync, nothing was written and NOT_NOW sends the command to a
        thread, which waits as usual), nor starts the WAL over (which fsyncs its
        header: see :meth:`_wal_starts_over`); and SQLite's automatic checkpoint,
        which fsyncs, is off meanwhile: after CHECKPOINT_EVERY commands here,
        commands go to a thread until one commits there, checkpointing if the
        WAL is due for it. The writes skip the combiner and the group commit,
        which wait for others. A subclass that overrides any of Journal's
        methods runs every command in a thread: its code may wait.
        """
        if isinstance(self._conn, _ClosedConnection):
            return NOT_NOW  # the worker thread raises the error, naming the operation
        if type(self) is not Journal and not _only_journal_code(type(self)):
            return NOT_NOW  # a subclass's own writes: nobody vouched they never wait
        if self._now_thread is not None or self._now_runs >= CHECKPOINT_EVERY:
            # Past CHECKPOINT_EVERY, every command goes to a thread until one commits
            # there (see _write): the next one may only read, which checkpoints nothing.
            return NOT_NOW
        if not self._lock.acquire(blocking=False):
            return NOT_NOW
        try:
            # Whatever it is now (0 while a prune runs between its batches): put back after.
            autocheckpoint = int(self._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0])
            if autocheckpoint:
                self._conn.execute("PRAGMA wal_autocheckpoint = 0")
            self._now_thread, self._refuse_busy = threading.get_ident(), True
            try:
                result = run()
            except _WouldWait:
                return NOT_NOW
            finally:
                self._now_thread, self._refuse_busy = None, False
                if autocheckpoint:
                    with suppress(sqlite3.Error):
                        self._conn.execute(f"PRAGMA wal_autocheckpoint = {autocheckpoint}")
            self._now_runs += 1
            return True, result
        finally:
            self._lock.release()

    def _running_now(self) -> bool:
        """Whether this thread is in :meth:`_try_now` (its writes go straight to SQLite)."""
        return self._now_thread is not None and self._now_thread == threading.get_ident()

    def _write_combined(self, write: Callable[[sqlite3.Connection], Any]) -> Any:
        """Run ``write`` in a transaction, shared with other threads' writes waiting meanwhile.

        Flat combining: a thread that finds another thread committing queues its
        write; when that commit ends, one waiting thread takes every queued write
        and commits them in one transaction, and the others return without
        touching SQLite. Fewer transactions, and fewer threads passing the GIL
        around at every statement. Each write's own outcome stands: if one write
        raises, the shared transaction rolls back and each write runs again in a
        transaction of its own, so a failing write fails only its own caller; if
        the transaction itself cannot begin or commit, every write in it fails
        with (its own copy of) that error, and none was written.
        """
        (outcome,) = self._write_combined_many([write])
        if isinstance(outcome, Failed):
            raise outcome.error
        return outcome

    def _write_combined_many(
        self, writes: Sequence[Callable[[sqlite3.Connection], Any]]
    ) -> list[Any]:
        """Several writes, as :meth:`_write_combined`, in one transaction; each one's outcome.

        An outcome is the write's result or a :class:`Failed` with its own error.
        """
        self._check_writable()
        queued = [_QueuedWrite(write) for write in writes]
        if self._running_now():
            self._commit_together(queued)
            return [each.result if each.error is None else Failed(each.error) for each in queued]
        with self._combiner:
            # Appended together, so one thread always takes all of them at once.
            self._queued.extend(queued)
            while self._combining and not queued[0].finished:
                self._combiner.wait()
            batch: list[_QueuedWrite] = []
            if not queued[0].finished:
                self._combining = True
                batch, self._queued = self._queued, []
        if batch:
            try:
                self._commit_together(batch)
            finally:
                with self._combiner:
                    # Interrupted (KeyboardInterrupt): what was not written goes to the
                    # next thread; nothing in an unfinished write was committed.
                    self._queued[:0] = [
                        each for each in batch if not each.finished and each not in queued
                    ]
                    self._combining = False
                    self._combiner.notify_all()
        return [each.result if each.error is None else Failed(each.error) for each in queued]

    def _commit_together(self, batch: Sequence[_QueuedWrite]) -> None:
        if len(batch) > 1:
            results: list[Any] = []
            try:
                with self._write() as conn:
                    for each in batch:
                        try:
                            results.append(each.write(conn))
                        except Exception as error:
                            raise _WriteRaised from error
            except _WriteRaised:
                pass  # rolled back; each one again, alone, below
            except Exception as error:  # the transaction: BEGIN or COMMIT failed
                for each in batch:
                    each.error, each.finished = copy.copy(error), True
                return
            else:
                for each, result in zip(batch, results, strict=True):
                    each.result, each.finished = result, True
                return
        for each in batch:
            try:
                with self._write() as conn:
                    each.result = each.write(conn)
            except Exception as error:
                each.error = error
            each.finished = True

    # -- writes used by the sessions -------------------------------------------

    def _insert_operation(self, new: NewOperation, *, owner: str, lease_until: float) -> bool:
        """Durably record a new operation; False if its id or key already exists.

        With ``durability="fsync"``, concurrent callers (threads, or an async
        session's tasks, whose journal writes run in threads) share one commit
        and one fsync: group commit. Each returns once its own row is durable.
        """
        self._check_still_there()
        if self._running_now():
            with self._write(durable=self.durability == "fsync") as conn:
                return self._insert(conn, new, owner, lease_until)
        if self.durability == "fsync":
            return self._durable_inserts.submit((new, owner, lease_until))
        with self._write() as conn:
            return self._insert(conn, new, owner, lease_until)

    def _insert_operations(
        self, items: Sequence[tuple[NewOperation, str, float]]
    ) -> list[bool | Failed]:
        """Several new operations (``(new, owner, lease_until)``) in one commit; each one's outcome.

        What an async session's worker thread calls with the keys its tasks
        are waiting for: one transaction (with ``"fsync"``, shared with any
        other caller's through group commit, and one fsync). An outcome is what
        :meth:`_insert_operation` returns, or a :class:`Failed` with the error it
        would raise.
        """
        own_insert = type(self)._insert_operation is Journal._insert_operation
        if not own_insert or "_insert_operation" in vars(self):
            # A subclass (another store) or a wrapper inserts its own way: one at a time.
            outcomes: list[bool | Failed] = []
            for new, owner, lease_until in items:
                try:
                    outcomes.append(
                        self._insert_operation(new, owner=owner, lease_until=lease_until)
                    )
                except Exception as error:
                    outcomes.append(Failed(error))
            return outcomes
        self._check_still_there()
        if self.durability == "fsync":
            return self._durable_inserts.submit_many(items)
        try:
            return self._insert_batch(items, durable=False)
        except Exception as error:
            return [Failed(copy.copy(error)) for _ in items]

    def _insert_batch(
        self, batch: Sequence[tuple[NewOperation, str, float]], *, durable: bool = True
    ) -> list[bool | Failed]:
        """New operations in one transaction, made durable by one fsync (with ``durable``).

        A row SQLite refuses (a body over its size limit) fails only its own
        caller: the shared transaction rolls back and each row is inserted alone.
        """
        if len(batch) > 1:
            try:
                with self._write(durable=durable) as conn:
                    results: list[bool | Failed] = []
                    for item in batch:
                        try:
                            results.append(self._insert(conn, *item))
                        except sqlite3.OperationalError:
                            raise  # the transaction's own problem: everyone's error
                        except Exception as error:
                            raise _WriteRaised from error
                    return results
            except _WriteRaised:
                pass  # rolled back; each one again, alone, below
        outcomes: list[bool | Failed] = []
        for item in batch:
            try:
                with self._write(durable=durable) as conn:
                    outcomes.append(self._insert(conn, *item))
            except Exception as error:
                outcomes.append(Failed(error))
        return outcomes

    def _insert(
        self, conn: sqlite3.Connection, new: NewOperation, owner: str, lease_until: float
    ) -> bool:
        cursor = conn.execute(_INSERT_OPERATION, new.row(owner, lease_until))
        return cursor.rowcount == 1

    def _record_attempt(
        self, operation_id: str, record: AttemptRecord, *, now: float, owner: str | None = None
    ) -> None:
        """The attempt row and the operation's new state, in one transaction.

        With ``owner``, the new state applies only while that caller still holds
        the operation's lease and the operation is pending: an attempt that
        outlived its lease (another caller took over, or settled it) is kept in
        the history but changes nothing else.
        """
        self._write_combined(self._attempt_write(operation_id, record, now, owner))

    def _record_attempts(
        self, items: Sequence[tuple[str, AttemptRecord, float, str | None]]
    ) -> list[Failed | None]:
        """Several completions (``(operation_id, record, now, owner)``) in one transaction.

        What an async session's worker thread calls with the completions its
        tasks are waiting for. An outcome is None, or a :class:`Failed` with the
        error :meth:`_record_attempt` would raise; one failing write fails only
        its own outcome (see :meth:`_write_combined`).
        """
        own_record = type(self)._record_attempt is _JOURNAL_RECORD_ATTEMPT
        if not own_record or "_record_attempt" in vars(self):
            # A subclass (another store), a wrapper or a patch records its own way:
            # one at a time, through it.
            outcomes: list[Failed | None] = []
            for operation_id, record, now, owner in items:
                try:
                    self._record_attempt(operation_id, record, now=now, owner=owner)
                    outcomes.append(None)
                except Exception as error:
                    outcomes.append(Failed(error))
            return outcomes
        return self._write_combined_many([self._attempt_write(*item) for item in items])

    def _attempt_write(
        self, operation_id: str, record: AttemptRecord, now: float, owner: str | None
    ) -> Callable[[sqlite3.Connection], None]:
        response_headers = (
            None if record.response_headers is None else _headers_json(record.response_headers)
        )

        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                _INSERT_ATTEMPT,
                (
                    record.started_at,
                    record.elapsed,
                    record.outcome,
                    record.status_code,
                    int(record.replayed),
                    record.error,
                    record.wait,
                    operation_id,
                ),
            )
            holds = "" if owner is None else " AND status = 'pending' AND lease_owner IS ?"
            cursor = conn.execute(
                f"""
                UPDATE operations SET
                    status = ?, reason = ?, not_before = ?, updated_at = ?,
                    attempt_count = attempt_count + 1,
                    last_status_code = coalesce(?, last_status_code),
                    response_status = ?, response_headers = ?, response_body = ?,
                    lease_until = ?, lease_owner = CASE WHEN ? > 0 THEN lease_owner END
                WHERE operation_id = ?{holds}
                """,
                (
                    record.status,
                    record.reason,
                    record.not_before,
                    now,
                    record.status_code,
                    record.response_status,
                    response_headers,
                    record.response_body,
                    record.lease_until,
                    record.lease_until,
                    operation_id,
                    *(() if owner is None else (owner,)),
                ),
            )
            if cursor.rowcount == 0 and owner is not None:
                # Not ours any more: count the attempt, keep whoever holds it now.
                conn.execute(
                    "UPDATE operations SET attempt_count = attempt_count + 1, updated_at = ? "
                    "WHERE operation_id = ?",
                    (now, operation_id),
                )

        return write

    def _set_status(
        self,
        operation_id: str,
        status: Status,
        *,
        reason: str | None,
        now: float,
        expect: Status = "pending",
    ) -> bool:
        """Move an operation out of ``expect`` without an attempt; releases any lease."""

        def write(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                """
                UPDATE operations SET status = ?, reason = ?, updated_at = ?,
                    lease_owner = NULL, lease_until = 0
                WHERE operation_id = ? AND status = ?
                """,
                (status, reason, now, operation_id, expect),
            )
            return cursor.rowcount == 1

        return bool(self._write_combined(write))

    def _take_lease(
        self, operation: Operation, *, owner: str, lease_until: float, now: float
    ) -> bool:
        """Compare-and-swap on the lease read in ``operation``: one winner only."""

        def write(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                """
                UPDATE operations SET lease_owner = ?, lease_until = ?, updated_at = ?
                WHERE operation_id = ? AND status = 'pending'
                  AND lease_until = ? AND lease_owner IS ?
                """,
                (
                    owner,
                    lease_until,
                    now,
                    operation.operation_id,
                    operation.lease_until,
                    operation.lease_owner,
                ),
            )
            return cursor.rowcount == 1

        return bool(self._write_combined(write))

    def _settle(
        self,
        operation_id: str,
        status: Status,
        *,
        reason: str,
        now: float,
        response_status: int | None = None,
        response_headers: Sequence[tuple[str, str]] | None = None,
        response_body: bytes | None = None,
    ) -> bool:
        """A reconciler's verdict on a needs_reconcile operation."""
        headers = None if response_headers is None else json.dumps(list(response_headers))

        def write(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                """
                UPDATE operations SET status = ?, reason = ?, updated_at = ?,
                    response_status = ?, response_headers = ?, response_body = ?,
                    lease_owner = NULL, lease_until = 0
                WHERE operation_id = ? AND status = 'needs_reconcile'
                """,
                (
                    status,
                    reason,
                    now,
                    response_status,
                    headers,
                    response_body,
                    operation_id,
                ),
            )
            return cursor.rowcount == 1

        return bool(self._write_combined(write))

    def _release_lease(self, operation_id: str, *, owner: str) -> None:
        self._write_combined(
            lambda conn: conn.execute(
                "UPDATE operations SET lease_owner = NULL, lease_until = 0 "
                "WHERE operation_id = ? AND lease_owner = ?",
                (operation_id, owner),
            )
        )

    def _claim_due(
        self, *, owner: str, now: float, lease_until: float, limit: int
    ) -> list[Operation]:
        """Lease up to ``limit`` due pending operations to ``owner``, oldest first.

        Due: pending, its lease expired (``lease_until <= now``) and its
        ``not_before`` passed. One ``BEGIN IMMEDIATE`` transaction: two workers
        (threads or processes) never claim one operation.
        """
        self._check_still_there()
        with self._write() as conn:
            ids = [
                row[0]
                for row in conn.execute(
                    """
                    SELECT operation_id FROM operations
                    WHERE status = 'pending' AND lease_until <= ?
                      AND coalesce(not_before, 0) <= ?
                    ORDER BY created_at, operation_id LIMIT ?
                    """,
                    (now, now, limit),
                )
            ]
            conn.executemany(
                "UPDATE operations SET lease_owner = ?, lease_until = ?, updated_at = ? "
                "WHERE operation_id = ?",
                [(owner, lease_until, now, operation_id) for operation_id in ids],
            )
            claimed = []
            for operation_id in ids:
                rows = self._query(
                    "SELECT * FROM operations WHERE operation_id = ?", (operation_id,)
                )
                claimed.append(self._with_attempts(rows[0]))
            return claimed

    def _extend_leases(self, leases: Sequence[tuple[str, str]], *, lease_until: float) -> int:
        """Heartbeat: push ``lease_until`` forward on each (operation_id, owner) still
        pending and leased by that owner; how many rows were extended."""
        if not leases:
            return 0
        with self._write() as conn:
            extended = 0
            for operation_id, owner in leases:
                cursor = conn.execute(
                    "UPDATE operations SET lease_until = max(lease_until, ?) "
                    "WHERE operation_id = ? AND lease_owner = ? AND status = 'pending'",
                    (lease_until, operation_id, owner),
                )
                extended += cursor.rowcount
            return extended

    # -- reading ---------------------------------------------------------------

    def _query(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            cursor = None
            try:
                cursor = self._conn.execute(sql, params)
                columns = [description[0] for description in cursor.description]
                rows = [dict(zip(columns, row, strict=True)) for row in cursor]
            except sqlite3.DatabaseError as error:
                if _is_corruption(error):
                    raise self._damaged(error) from error
                raise self._open_error(error) from error
            finally:
                # A statement that failed halfway must not hold its read
                # transaction open (until garbage collection) under later writes.
                if cursor is not None:
                    cursor.close()
        for row in rows:
            self._check_row(row)
        return rows

    def _check_row(self, row: dict[str, Any]) -> None:
        """Raise JournalCorruptError, naming the operation, if a value cannot be decoded."""
        for column, value in row.items():
            problem = _column_problem(column, value)
            if problem is not None:
                operation_id, key = row.get("operation_id"), row.get("key")
                raise JournalCorruptError(
                    f"{self.path} holds a damaged operation: {problem}; move the journal aside "
                    "and restore a backup (or repair that row with the sqlite3 shell); the "
                    "other operations can still be read one by one with `idempotently show`",
                    operation_id=operation_id if isinstance(operation_id, str) else None,
                    key=key if isinstance(key, str) else None,
                )

    def _damaged(self, error: sqlite3.DatabaseError) -> JournalCorruptError:
        return JournalCorruptError(
            f"the journal {self.path} is damaged ({error}); stop using it: move it aside "
            f"(keep it: `sqlite3 {self.path} .recover` may save its rows) and restore a backup"
        )

    def operation(self, operation_id_or_key: str) -> Operation | None:
        """One operation with all its attempts, by operation id or by key."""
        rows = self._query(
            "SELECT * FROM operations WHERE operation_id = ? "
            "UNION ALL SELECT * FROM operations WHERE key = ? AND operation_id != ? LIMIT 1",
            (operation_id_or_key, operation_id_or_key, operation_id_or_key),
        )
        if not rows:
            return None
        return self._with_attempts(rows[0])

    def _with_attempts(self, row: dict[str, Any]) -> Operation:
        attempts = tuple(
            Attempt(
                number=attempt["number"],
                started_at=attempt["started_at"],
                elapsed=attempt["elapsed"],
                outcome=attempt["outcome"],
                status_code=attempt["status_code"],
                replayed=bool(attempt["replayed"]),
                error=attempt["error"],
                wait=attempt["wait"],
            )
            for attempt in self._query(
                "SELECT * FROM attempts WHERE operation_id = ? ORDER BY number",
                (row["operation_id"],),
            )
        )
        return Operation._from_row(row, attempts)

    def _find(self, operation_id: str | None, key: str | None) -> Operation | None:
        """The operation with this id, else the one with this key, with its attempts."""
        try:
            for column, value in (("operation_id", operation_id), ("key", key)):
                if value is None:
                    continue
                rows = self._query(f"SELECT * FROM operations WHERE {column} = ?", (value,))
                if rows:
                    return self._with_attempts(rows[0])
        except JournalError:
            # A file replaced under this Journal (and its -wal and -shm left behind)
            # reads as a broken journal: say what happened instead.
            self._check_still_there()
            raise
        return None

    def operations(
        self,
        *,
        status: Status | Sequence[Status] | None = None,
        since: float | None = None,
        limit: int | None = None,
        newest_first: bool = True,
    ) -> list[Operation]:
        """Operations (without their attempts), filtered by status and age.

        ``since`` is seconds since the epoch: only operations created since then.
        """
        _check_number("since", since, integer=False, low=0, high=MAX_TIMESTAMP)
        _check_number("limit", limit, integer=True, low=0, high=MAX_LIMIT)
        statuses: list[Status | None] = [None]
        if status is not None:
            if not isinstance(status, (str, list, tuple, set, frozenset)):
                raise TypeError(
                    f"status must be a status or a list of them ({', '.join(STATUSES)}), not "
                    f"{type(status).__name__}"
                )
            statuses = list(dict.fromkeys([status] if isinstance(status, str) else status))
            for value in statuses:
                if value not in STATUSES:
                    raise ValueError(f"unknown status {value!r}; expected one of {STATUSES}")
        # One query per status, each walking operations_by_status in rowid order
        # and stopping at the limit, merged here: `status IN (...) ORDER BY rowid`
        # would sort every match first (a million rows for succeeded + failed).
        with self._snapshot():
            listings = [self._listing(value, since, limit, newest_first) for value in statuses]
        rows = merge(*listings, key=lambda row: row["_rowid"], reverse=newest_first)
        return [
            Operation._from_row({name: value for name, value in row.items() if name != "_rowid"})
            for row in islice(rows, limit)
        ]

    def _listing(
        self, status: Status | None, since: float | None, limit: int | None, newest_first: bool
    ) -> list[dict[str, Any]]:
        where: list[str] = []
        params: list[Any] = []
        if status is not None:
            where.append("status = ?")
            params.append(status)
        if since is not None:
            where.append("created_at >= ?")
            params.append(since)
        sql = "SELECT rowid AS _rowid, * FROM operations"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY rowid " + ("DESC" if newest_first else "ASC")
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return self._query(sql, params)

    def stats(
        self,
        *,
        now: float,
        stuck_after: float = 60.0,
        expiring_within: float | None = None,
    ) -> JournalStats:
        """Counts, rates and the stuck count (pending, unleased, idle ``stuck_after`` s).

        With ``expiring_within`` (seconds), also how many pending operations have a
        key that expires by ``now + expiring_within``; with the key-expiry margin
        (:data:`DEFAULT_EXPIRING_WITHIN`), exactly those ``resume`` no longer resends.
        That count reads one row per pending operation; without it, stats reads the
        pending operations' index alone.
        """
        _check_number("now", now, integer=False, low=0, high=MAX_TIMESTAMP)
        _check_number("stuck_after", stuck_after, integer=False, low=0, high=MAX_WINDOW)
        if expiring_within is not None:
            _check_number("expiring_within", expiring_within, integer=False, low=0, high=MAX_WINDOW)
        with self._snapshot():
            return self._stats(now, stuck_after, expiring_within)

    def _stats(self, now: float, stuck_after: float, expiring_within: float | None) -> JournalStats:
        if self._version >= 2:
            counters = self._counters()
            counts: dict[str, int] = {status: counters[status] for status in STATUSES}
            attempts = counters
        else:
            counts = self.counts()
            attempts = self._query(
                """
                SELECT count(*) AS attempts,
                       count(status_code) AS answered_attempts,
                       coalesce(sum(replayed), 0) AS replayed_attempts,
                       coalesce(sum(status_code IN (409, 423)), 0) AS in_progress_attempts
                FROM attempts
                """
            )[0]
        # In version 2 this reads operations_pending alone (it covers these columns)
        # unless the expiring keys are asked for: key_expires_at is not in that index,
        # so each pending row costs one lookup (about 20 ms per 10,000 pending).
        expiring = (
            "NULL" if expiring_within is None else "coalesce(sum(key_expires_at <= :soon), 0)"
        )
        pending = self._query(
            f"""
            SELECT min(created_at) AS oldest,
                   coalesce(sum(lease_until < :now AND updated_at < :idle
                                AND coalesce(not_before, 0) <= :now), 0) AS stuck,
                   {expiring} AS expiring
            FROM operations{self._indexed_by("operations_pending")} WHERE status = 'pending'
            """,
            {"now": now, "idle": now - stuck_after, "soon": now + (expiring_within or 0.0)},
        )[0]
        return JournalStats(
            counts=counts,
            operations=sum(counts.values()),
            attempts=attempts["attempts"],
            answered_attempts=attempts["answered_attempts"],
            replayed_attempts=attempts["replayed_attempts"],
            in_progress_attempts=attempts["in_progress_attempts"],
            oldest_pending_created_at=pending["oldest"],
            stuck=pending["stuck"],
            now=now,
            expiring=pending["expiring"],
            expiring_within=expiring_within,
        )

    def prune(self, *, older_than: float, now: float, dry_run: bool = False) -> int:
        """Delete finished operations (and their attempts) idle for ``older_than`` seconds.

        Never touches ``pending`` or ``needs_reconcile``: those still need work.
        Returns how many operations were (or, with ``dry_run``, would be) deleted.
        """
        _check_number("older_than", older_than, integer=False, low=0, high=MAX_WINDOW)
        _check_number("now", now, integer=False, low=0, high=MAX_TIMESTAMP)
        # Written exactly as operations_finished's WHERE, so SQLite uses that index.
        where = f"{_FINISHED} AND updated_at < ?"
        finished = "operations" + self._indexed_by("operations_finished")
        cutoff = now - older_than
        if dry_run:
            with self._snapshot():
                return self._count_prunable(finished, cutoff)
        self._check_writable()
        # Batches in short transactions, oldest first, so other writers (a
        # Session journaling a key) never wait long for the lock; each batch is
        # sized from the last one's time to hold the lock about 25 ms.
        smallest, largest = _PRUNE_BATCH_SIZES
        batch, deleted = smallest, 0
        with self._checkpoints_between_batches():
            while True:
                with self._write() as conn:
                    started = time.perf_counter()
                    rows = conn.execute(
                        f"SELECT rowid, operation_id FROM {finished} WHERE {where} "
                        "ORDER BY updated_at LIMIT ?",
                        (cutoff, batch),
                    ).fetchall()
                    for start in range(0, len(rows), _SQL_VARIABLES):
                        chunk = rows[start : start + _SQL_VARIABLES]
                        marks = ", ".join("?" for _ in chunk)
                        conn.execute(
                            f"DELETE FROM attempts WHERE operation_id IN ({marks})",
                            [operation_id for _, operation_id in chunk],
                        )
                        deleted += conn.execute(
                            f"DELETE FROM operations WHERE rowid IN ({marks})",
                            [rowid for rowid, _ in chunk],
                        ).rowcount
                elapsed = max(time.perf_counter() - started, 1e-6)
                if len(rows) < batch:
                    return deleted
                self._checkpoint()
                time.sleep(elapsed * random.uniform(*_PRUNE_PAUSE))
                batch = min(largest, max(smallest, int(batch * _PRUNE_BATCH_SECONDS / elapsed)))

    def _count_prunable(self, finished: str, cutoff: float) -> int:
        """How many finished operations were idle since before ``cutoff``.

        Version 2 counts whichever side of the cutoff looks smaller in
        operations_finished (judged from its oldest and newest entries) and,
        for the newer side, subtracts from the finished count the triggers keep:
        a usual window (keep the last week of months) counts a few entries.
        """
        older = f"SELECT count(*) AS n FROM {finished} WHERE {_FINISHED} AND "
        if self._version < 2:
            return int(self._query(older + "updated_at < ?", (cutoff,))[0]["n"])
        counters = self._counters()
        total = sum(counters[status] for status in FINISHED_STATUSES)
        # Two queries: SQLite answers a lone min() or max() from the index's ends.
        ends = [
            self._query(f"SELECT {end}(updated_at) AS edge FROM {finished} WHERE {_FINISHED}")[0][
                "edge"
            ]
            for end in ("min", "max")
        ]
        if not all(isinstance(edge, (int, float)) for edge in ends):
            return int(self._query(older + "updated_at < ?", (cutoff,))[0]["n"])
        oldest, newest = ends
        if cutoff <= oldest:
            return 0
        if cutoff > newest:
            return total
        if cutoff - oldest <= newest - cutoff:
            return int(self._query(older + "updated_at < ?", (cutoff,))[0]["n"])
        return total - int(self._query(older + "updated_at >= ?", (cutoff,))[0]["n"])

    @contextmanager
    def _checkpoints_between_batches(self) -> Iterator[None]:
        """No checkpoint inside a batch's commit: prune runs one after each, outside the lock."""
        with self._lock:
            previous = int(self._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0])
            self._conn.execute("PRAGMA wal_autocheckpoint = 0")
        try:
            yield
        finally:
            with self._lock, suppress(sqlite3.Error, JournalError):
                self._conn.execute(f"PRAGMA wal_autocheckpoint = {previous}")
                self._checkpoint()

    def _checkpoint(self) -> None:
        with self._lock:
            try:
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.DatabaseError as error:
                if _is_corruption(error):
                    raise self._damaged(error) from error
                raise self._open_error(error) from error

    def counts(self) -> dict[str, int]:
        """Operations per status; every status is present, zero included."""
        if self._version >= 2:
            counters = self._counters()
            return {status: counters[status] for status in STATUSES}
        counts: dict[str, int] = dict.fromkeys(STATUSES, 0)
        for row in self._query("SELECT status, count(*) AS n FROM operations GROUP BY status"):
            counts[row["status"]] = row["n"]
        return counts

    def _indexed_by(self, index: str) -> str:
        """Name the version-2 index: without statistics SQLite would pick operations_by_status."""
        return f" INDEXED BY {index}" if self._version >= 2 else ""

    def _counters(self) -> dict[str, int]:
        """The counts the triggers keep: one row, whatever the journal's size."""
        rows = self._query(f"SELECT {', '.join(_COUNTERS)} FROM journal_counts WHERE id = 1")
        values = rows[0] if rows else {}
        if len(values) != len(_COUNTERS) or not all(
            type(value) is int and value >= 0 for value in values.values()
        ):
            raise JournalCorruptError(
                f"{self.path} holds damaged counts ({_short(values)}); move the journal aside "
                "and restore a backup"
            )
        if values["unknown_status"]:
            # Name the damaged row, as a scan would have.
            self._query(f"SELECT * FROM operations WHERE status NOT IN ({_STATUSES_SQL}) LIMIT 1")
            raise JournalCorruptError(
                f"{self.path} counts {values['unknown_status']} operations with an unknown "
                "status but holds none; move the journal aside and restore a backup"
            )
        return values


_JOURNAL_RECORD_ATTEMPT = Journal._record_attempt
"""Journal's own, as defined: a store whose ``_record_attempt`` is anything else (a
subclass's, a patched one) records a batch through it, one at a time."""


_ONLY_JOURNAL_CODE: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _only_journal_code(cls: type[Journal]) -> bool:
    """Whether a subclass of Journal overrides none of its methods: its commands then run
    Journal's own code, which :meth:`Journal._try_now` may run on an event loop."""
    only = _ONLY_JOURNAL_CODE.get(cls)
    if only is None:
        only = _ONLY_JOURNAL_CODE[cls] = all(
            getattr(cls, name) is method
            for name, method in vars(Journal).items()
            if inspect.isfunction(method) and not name.startswith("__")
        )
    return only


@attrs.frozen
class JournalStats:
    """What to watch, as Leach's article advises: replay rate, 409 rate, stuck keys."""

    counts: dict[str, int]
    """Operations per status; every status is present."""
    operations: int
    attempts: int
    answered_attempts: int
    replayed_attempts: int
    in_progress_attempts: int
    """Answers with 409 or 423: the server was still working on the key."""
    oldest_pending_created_at: float | None
    stuck: int
    """Pending operations nobody is sending: lease expired, untouched for a while,
    and not waiting for a ``not_before`` the server asked for."""
    now: float
    expiring: int | None = None
    """Pending operations whose key expires by ``now + expiring_within`` (or already has):
    with the key-expiry margin as the window, the ones ``resume`` would no longer resend.
    None when :meth:`Journal.stats` was not given ``expiring_within``."""
    expiring_within: float | None = None

    @property
    def replay_rate(self) -> float:
        return self.replayed_attempts / self.answered_attempts if self.answered_attempts else 0.0

    @property
    def in_progress_rate(self) -> float:
        return self.in_progress_attempts / self.answered_attempts if self.answered_attempts else 0.0

    @property
    def retries_per_operation(self) -> float:
        return (self.attempts - self.operations) / self.operations if self.operations else 0.0

    @property
    def oldest_pending_age(self) -> float | None:
        if self.oldest_pending_created_at is None:
            return None
        return max(0.0, self.now - self.oldest_pending_created_at)

    def to_json(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "operations": self.operations,
            "attempts": self.attempts,
            "replay_rate": round(self.replay_rate, 6),
            "in_progress_rate": round(self.in_progress_rate, 6),
            "retries_per_operation": round(self.retries_per_operation, 6),
            "oldest_pending_age": self.oldest_pending_age,
            "stuck": self.stuck,
            "needs_reconcile": self.counts["needs_reconcile"],
            "expiring": self.expiring,
            "expiring_within": self.expiring_within,
        }
