"""The SQLite journal: one row per operation, one per attempt (a `Store`).

Durability: a batch of writes holding a key to be made durable commits with
``synchronous=FULL`` (the WAL is fsync'd) before any of those keys is sent;
every other batch (attempt rows, completions, leases) commits with
``synchronous=NORMAL``: losing one to a power cut only means a resume gets a
replay from the server, which the key makes harmless. With ``durability="os"``
no batch is fsync'd. See the journal page of the docs.

Audits stay fast on large journals without scanning them: each batch of writes
adds its changes to the counts per status and per kind of attempt in one row (no
trigger), a partial index holds the pending operations and another the others by
status and idle time.
"""

from __future__ import annotations

import copy
import functools
import os
import random
import re
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager, nullcontext, suppress
from heapq import merge
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn, cast, get_args

import attrs

from idempotently import _commands_lazy, _rows
from idempotently._commands import (
    BindCredentials,
    ClaimDue,
    Enqueue,
    ExtendLeases,
    Insert,
    PauseOrigin,
    RebaseOperation,
    RebasePause,
    Record,
    Release,
    RenewLease,
    SetStatus,
    TakeLease,
    assert_never,
)
from idempotently._exceptions import (
    ErrorContext,
    JournalCorruptError,
    JournalError,
    JournalMissingError,
    JournalMovedError,
    JournalVersionError,
    JournalWriteError,
)
from idempotently._rows import (
    CAPPED_DIGITS,
    CAPPED_META,
    DURABILITIES,
    MAX_LIMIT,
    MAX_TIMESTAMP,
    MAX_WINDOW,
    Attempt,
    Durability,
    Failed,
    NewOperation,
    Operation,
    OriginPause,
    audit_entry_problem,
    capped_count,
    check_number,
    column_problem,
    headers_json,
    row_problem,
    short,
)
from idempotently._special_files import refuse_special_file
from idempotently._vocabulary import FINISHED_STATUSES, STATUSES, Outcome, Status

if TYPE_CHECKING:
    from idempotently._commands_rare import Act, LookUpLater, Write
    from idempotently._outbox_orm import OrmConnection
    from idempotently._outbox_orm import StatementError as OrmStatementError
    from idempotently._outbox_orm import Steps as _Steps
    from idempotently._rows import AuditEntry, JournalStats

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


SCHEMA_VERSION = 10
"""The one schema before 0.1.0: development builds wrote versions 1 to 5, which this build
refuses (`development_journal_error`); from here on every change bumps it with a step."""
DEVELOPMENT_TAG: Final = "v0.1.0.dev-journal5"
"""The git tag of the last build that reads (and so can drain) a development journal."""
# "IDMP": marks the file as ours, so a stray database is never taken for a journal.
APPLICATION_ID = 0x49444D50
# In a file adopted by `idempotently migrate` (an application's database) the
# application's own PRAGMA user_version and application_id are never read nor written:
# the journal's identity and schema version are rows of its own journal_meta table.
ADOPTED_IDENTITY: Final = "idempotently"


def development_journal_error(path: str, store: str, version: int) -> JournalVersionError:
    """The refusal of a journal a development build wrote (schema version 1 to 9): it is
    left as it is, and it names the build that can finish its operations."""
    return JournalVersionError(
        f"{path} is a development journal ({store} schema version {version}) that this "
        "idempotently does not read; it was left as it is. Do not delete it while it holds "
        "pending, needs_reconcile or recently succeeded operations: their keys derive from "
        f"its namespace. To finish them, install the idempotently build at git tag "
        f"{DEVELOPMENT_TAG} (in a clone of idempotently's repository: `git checkout "
        f"{DEVELOPMENT_TAG} && pip install .`), run "
        "`idempotently resume` and `idempotently reconcile` until `idempotently stats` shows "
        "none pending or needs_reconcile, then give this version a new journal"
    )


def _one_of(column: str, values: Sequence[str]) -> str:
    """``(column = 'a' OR column = 'b' ...)``.

    Not ``IN (...)``: SQLite builds a temporary b-tree for an IN list of more
    than two values each time a CHECK or a partial index's WHERE evaluates it,
    on every write.
    """
    return "(" + " OR ".join(f"{column} = '{value}'" for value in values) + ")"


_SETTLED_STATUSES: Final = tuple(status for status in STATUSES if status != "pending")
_SETTLED = _one_of("status", _SETTLED_STATUSES)
"""operations_settled's WHERE: a query must say it the same way to use the index."""
_OUTCOMES = _one_of("attempt1_outcome", get_args(Outcome))

# Designed for the common call: a key is one INSERT, its answer one UPDATE of
# the same row (the first attempt's columns are in it) plus one of the counts row. Every
# index entry is a WAL page on the hot path, so there are few: listings order by rowid
# (insertion order, which is creation order), pending operations are in their own
# partial index (claims, stats, listings), every other in operations_settled by status
# and last change (listings, prune). The partial indexes carry `status`: SQLite reads the
# column to check the WHERE again, and without it every entry would cost a lookup.
_SCHEMA = f"""
CREATE TABLE operations (
    operation_id     TEXT PRIMARY KEY,
    key              TEXT NOT NULL UNIQUE,
    status           TEXT NOT NULL CHECK {_one_of("status", STATUSES)},
    delivery         TEXT NOT NULL CHECK {_one_of("delivery", ("exactly_once", "at_most_once"))},
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
    reason           TEXT,
    codec              TEXT,
    secret_params      TEXT,
    credentials_digest TEXT,
    body_digest        BLOB,
    overrides          TEXT,
    forked_from        TEXT,
    lookup_after       REAL,
    enqueued_at        REAL,
    first_send_at      REAL,
    attempt1_started_at  REAL,
    attempt1_elapsed     REAL,
    attempt1_outcome     TEXT CHECK (attempt1_outcome IS NULL OR {_OUTCOMES}),
    attempt1_status_code INTEGER,
    attempt1_replayed    INTEGER,
    attempt1_error       TEXT,
    attempt1_wait        REAL,
    group_id   TEXT,
    step       INTEGER,
    successor  TEXT,
    cap_reason TEXT
);
CREATE INDEX operations_pending
    ON operations (created_at, lease_until, updated_at, not_before, status)
    WHERE status = 'pending';
CREATE INDEX operations_settled ON operations (status, updated_at) WHERE {_SETTLED};
CREATE INDEX operations_forks ON operations (forked_from) WHERE forked_from IS NOT NULL;
CREATE INDEX operations_by_group ON operations (group_id, step) WHERE group_id IS NOT NULL;
CREATE TABLE attempts (
    operation_id TEXT NOT NULL,
    number      INTEGER NOT NULL CHECK (number >= 2),
    started_at  REAL NOT NULL,
    elapsed     REAL NOT NULL,
    outcome     TEXT NOT NULL CHECK {_one_of("outcome", get_args(Outcome))},
    status_code INTEGER,
    replayed    INTEGER NOT NULL DEFAULT 0,
    error       TEXT,
    wait        REAL,
    PRIMARY KEY (operation_id, number)
) WITHOUT ROWID;
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
INSERT INTO journal_counts VALUES (1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
CREATE TABLE origin_pauses (
    origin      TEXT NOT NULL,
    credentials TEXT NOT NULL DEFAULT '',
    until       REAL NOT NULL,
    reason      TEXT,
    set_at      REAL NOT NULL,
    PRIMARY KEY (origin, credentials)
) WITHOUT ROWID;
CREATE TABLE operation_audit (
    seq          INTEGER PRIMARY KEY,
    operation_id TEXT NOT NULL,
    at           REAL NOT NULL,
    actor        TEXT NOT NULL,
    action       TEXT NOT NULL,
    note         TEXT,
    detail       TEXT
);
CREATE INDEX operation_audit_by_operation ON operation_audit (operation_id, seq);
"""

_SCHEMA_NAMES: Final = frozenset(re.findall(r"CREATE (?:TABLE|INDEX) (\w+)", _SCHEMA))
"""Every table and index the journal has: a journal missing one is damaged."""
_JOURNAL_NAMES: Final = _SCHEMA_NAMES
"""Every name a journal's schema uses: a file holding any of them is not adopted."""


@functools.cache
def _schema_columns() -> frozenset[tuple[str, str]]:
    """Every (table, column) of `_SCHEMA`: what a journal at this version must have."""
    with closing(sqlite3.connect(":memory:")) as conn:
        conn.executescript(_SCHEMA)
        return frozenset(
            conn.execute(
                "SELECT m.name, c.name FROM sqlite_master AS m, pragma_table_info(m.name) AS c "
                "WHERE m.type = 'table'"
            ).fetchall()
        )


_ATTEMPT1: Final = tuple(
    f"attempt1_{name}"
    for name in ("started_at", "elapsed", "outcome", "status_code", "replayed", "error", "wait")
)
"""The columns holding an operation's first attempt (its later ones are rows of attempts)."""
_OPERATION_COLUMNS: Final = ", ".join(
    field.name
    for field in attrs.fields(Operation)
    if field.name != "attempts" and field.metadata.get("column", True)
)
"""What a listing selects: `Operation`'s columns (never ``*``: the columns carried for
the next issues are not read, and change no output)."""
_ROW_COLUMNS: Final = ", ".join([_OPERATION_COLUMNS, *_ATTEMPT1])
"""What a read of one operation selects: `Operation`'s columns and its first attempt."""


def _first_attempt(row: dict[str, Any]) -> dict[str, Any] | None:
    """The first attempt held in ``row``'s columns (taken out of it) as a row of attempts,
    or None: no attempt yet, or a row read without them (a listing)."""
    if "attempt1_outcome" not in row:
        return None
    values = {column.removeprefix("attempt1_"): row.pop(column) for column in _ATTEMPT1}
    if values["outcome"] is None:
        return None
    return {"number": 1, **values}


def _first_attempt_problem(count: Any, first: dict[str, Any] | None) -> str | None:
    """What is wrong with a row whose attempt_count disagrees with its first attempt's
    columns (an edit by hand: no write of ours makes one), or None."""
    if type(count) is not int:
        return None  # the row's own check names it
    if count < 0:
        return f"attempt_count is {count}"
    if count == 0 and first is not None:
        return "attempt_count is 0 but attempt 1 is journaled"
    if count > 0 and first is None:
        return f"attempt_count is {count} but attempt 1 is not journaled"
    return None


def _later_attempts_problem(count: Any, later: list[dict[str, Any]]) -> str | None:
    """What is wrong with attempts 2..n read for a row counting ``count``, or None (this
    store reads none when the count is 1 or less; PostgreSQL's joins whatever is there)."""
    numbers = [attempt.get("number") for attempt in later]
    if type(count) is not int or numbers == list(range(2, count + 1)):
        return None
    return f"attempt_count is {count} but its later attempts are numbered {short(numbers)}"


def _ids(new: NewOperation | None) -> ErrorContext:
    """The ids an outbox error names: the operation's, when there is one."""
    return {} if new is None else {"operation_id": new.operation_id, "key": new.key}


# The counts, from the rows (`idempotently migrate --recount`, after an edit by hand).
_RECOUNT = f"""
INSERT OR REPLACE INTO journal_counts SELECT 1,
    {", ".join(f"(SELECT count(*) FROM operations WHERE status = '{s}')" for s in STATUSES)},
    (SELECT count(*) FROM operations WHERE NOT {_one_of("status", STATUSES)}),
    o.attempts + a.attempts, o.answered + a.answered, o.replayed + a.replayed,
    o.in_progress + a.in_progress
FROM (SELECT count(attempt1_outcome) AS attempts, count(attempt1_status_code) AS answered,
             coalesce(sum(attempt1_replayed), 0) AS replayed,
             coalesce(sum(attempt1_status_code IN (409, 423)), 0) AS in_progress
      FROM operations) AS o,
     (SELECT count(*) AS attempts, count(status_code) AS answered,
             coalesce(sum(replayed), 0) AS replayed,
             coalesce(sum(status_code IN (409, 423)), 0) AS in_progress
      FROM attempts) AS a
"""

_NAMESPACE_INSERT: Final = "INSERT INTO journal_meta (name, value) VALUES ('namespace', ?)"
"""The journal's random key namespace: a uuid4 bound by the store, drawn by SQLite in
the script ``migrate --sql`` prints (so one script applied to two files gives two)."""
_RANDOM_UUID_SQL: Final = (
    "(SELECT substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-4' || substr(h, 14, 3) || '-' "
    "|| substr('89ab', 1 + (abs(random()) % 4), 1) || substr(h, 18, 3) || '-' "
    "|| substr(h, 21, 12) FROM (SELECT lower(hex(randomblob(16))) AS h))"
)


# Every time a pending row holds is written with its updated_at, by one clock: moved by
# the same amount, they all keep their length from that write. An unleased row's
# lease_until stays 0.
_REBASE_TIMES: Final = (
    "UPDATE operations SET not_before = :now + (not_before - updated_at), "
    "lease_until = CASE WHEN lease_until > 0 THEN :now + (lease_until - updated_at) "
    "ELSE lease_until END, updated_at = :now "
    "WHERE status = 'pending' AND updated_at > :ahead"
)
"""Every pending row written by a clock ahead of ours, counted from our now."""


def upgrade_statements(version: int, *, adopted: bool = False) -> list[str]:
    """Every statement from schema ``version`` (0: an empty file) to SCHEMA_VERSION, in
    order: what opening the journal to write runs in one transaction. ``adopted``: in an
    application's database, where the version and identity are journal_meta rows and the
    file's PRAGMA user_version and application_id are the application's. A development
    journal (1 to 9) has no step to this version: `development_journal_error`."""
    statements: list[str] = []
    if version < 1:
        statements += _split_statements(_SCHEMA)
        statements.append(_NAMESPACE_INSERT)
        if not adopted:
            statements.append(f"PRAGMA application_id = {APPLICATION_ID}")
    statements.append(
        "INSERT OR REPLACE INTO journal_meta (name, value) VALUES "
        f"('identity', '{ADOPTED_IDENTITY}'), ('schema_version', '{SCHEMA_VERSION}')"
        if adopted
        else f"PRAGMA user_version = {SCHEMA_VERSION}"
    )
    return statements


def migration_sql(version: int, *, adopted: bool = False, path: str = "the journal") -> str:
    """The script that brings a SQLite journal from ``version`` (0: a new file) to this
    version, for applications that run their own migrations: the statements opening it
    runs, in one transaction, after the switch to WAL mode. ``adopted``: into an
    application's database (`upgrade_statements`)."""
    if version >= SCHEMA_VERSION:
        return f"-- The journal is at schema version {version}: nothing to do.\n"
    if version > 0:
        raise development_journal_error(path, "SQLite", version)
    lines = [
        f"-- idempotently journal (SQLite): schema version {version} to {SCHEMA_VERSION}.",
        "PRAGMA journal_mode = WAL;",
        "BEGIN IMMEDIATE;",
    ]
    for statement in upgrade_statements(version, adopted=adopted):
        if statement == _NAMESPACE_INSERT:
            statement = statement.replace("?", _RANDOM_UUID_SQL)
        lines.append(statement.rstrip().rstrip(";") + ";")
    lines.append("COMMIT;")
    return "\n".join(lines) + "\n"


_COUNTERS: Final = (
    *STATUSES,
    "unknown_status",
    "attempts",
    "answered_attempts",
    "replayed_attempts",
    "in_progress_attempts",
)
_COUNTED: Final = frozenset(_SETTLED_STATUSES)
"""The statuses journal_counts keeps; pending operations are counted from their index."""
_ADD_COUNTS: Final = (
    "UPDATE journal_counts SET "
    + ", ".join(f"{name} = {name} + :{name}" for name in _COUNTERS)
    + " WHERE id = 1"
)
"""A batch's count changes, written once at its end (no trigger writes on every row)."""


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
    lease_owner, lease_until, enqueued_at, first_send_at,
    codec, secret_params, credentials_digest,
    overrides, body_digest
) VALUES (?, ?, 'pending', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?,
    ?, ?, ?, ?, ?)
ON CONFLICT DO NOTHING
"""

# Operation groups (``_flow/_groups.py``). A step's place is the group's next one, given
# by its insert; a live call's insert also waits, in the same statement, for every step
# already in the group to have succeeded (a forked step counts by its successor).
_INSERT_STEP = (
    _INSERT_OPERATION.replace(
        "overrides, body_digest\n)", "overrides, body_digest, group_id, step\n)"
    )
    .replace("VALUES (?, ?, 'pending',", "SELECT ?, ?, 'pending',")
    .replace(
        "?, ?, ?, ?, ?)\nON CONFLICT",
        "?, ?, ?, ?, ?, ?,\n"
        "    (SELECT coalesce(max(step), 0) + 1 FROM operations WHERE group_id = ?)\n"
        "WHERE NOT ? OR NOT EXISTS (SELECT 1 FROM operations WHERE group_id = ?\n"
        "    AND status != 'succeeded' AND successor IS NULL)\nON CONFLICT",
    )
)
_EARLIER_UNSETTLED: Final = (
    " AND NOT EXISTS (SELECT 1 FROM operations AS earlier WHERE earlier.group_id = ?"
    " AND (earlier.step < ? OR typeof(earlier.step) IN ('real', 'text', 'blob'))"
    " AND earlier.status != 'succeeded' AND earlier.successor IS NULL)"
)
"""A group step's lease is taken only while every earlier step has succeeded: appended
to `_TAKE_LEASE`, so the check and the lease are one statement. A step whose place is
damaged (no integer: SQLite keeps what it is given) may be earlier: it holds the rest."""
_STILL_STOPPED: Final = (
    " AND first_send_at IS NULL AND EXISTS (SELECT 1 FROM operations AS halted"
    " WHERE halted.operation_id = ? AND halted.status IN ('failed', 'abandoned')"
    " AND halted.successor IS NULL)"
)
"""A stopped group's step is settled abandoned only if never sent and the step it
stopped at still stops it: appended to a `SetStatus`'s update (`_groups.stop`)."""


def _insert_step(new: NewOperation, owner: str | None, lease_until: float) -> tuple[Any, ...]:
    return (*new.row(owner, lease_until), new.group_id, new.group_id, new.in_order, new.group_id)


_STATE: Final = """
    status = ?, reason = ?, not_before = ?, updated_at = ?,
    attempt_count = attempt_count + 1,
    last_status_code = coalesce(?, last_status_code),
    response_status = ?, response_headers = ?, response_body = ?,
    lease_until = ?, lease_owner = CASE WHEN ? > 0 THEN lease_owner END"""
_FIRST: Final = ", ".join(f"{column} = ?" for column in _ATTEMPT1)
_RECORD_FIRST: Final = (
    f"UPDATE operations SET {_STATE}, {_FIRST} "
    "WHERE operation_id = ? AND attempt_count = 0 AND attempt1_outcome IS NULL"
)
"""A first attempt and the state after it: the one statement a common call's answer is
(the caller appends its lease condition)."""
_RECORD_FIRST_ONLY: Final = (
    f"UPDATE operations SET attempt_count = 1, {_FIRST} "
    "WHERE operation_id = ? AND attempt_count = 0 AND attempt1_outcome IS NULL"
)
"""A first attempt whose caller no longer holds the lease: kept, nothing else changed."""
_RECORD_STATE: Final = f"UPDATE operations SET {_STATE} WHERE operation_id = ?"
"""The state after a later attempt (the caller appends its lease condition)."""


def _set_cap_reason(conn: sqlite3.Connection, operation_id: str, reason: str) -> None:
    """Why the write just made moved the operation for its ``max_total_attempts``, and
    one more in the count of such operations (the first time only): statements of their
    own in the same transaction, made only then (a common call's answer stays one)."""
    if conn.execute(
        "UPDATE operations SET cap_reason = ? WHERE operation_id = ? AND cap_reason IS NULL",
        (reason, operation_id),
    ).rowcount:
        _add_capped(conn, 1)
    else:
        conn.execute(
            "UPDATE operations SET cap_reason = ? WHERE operation_id = ?", (reason, operation_id)
        )


def _add_capped(conn: sqlite3.Connection, change: int) -> None:
    """Add ``change`` to the `CAPPED_META` count (a damaged value is left for stats to
    name, never made a number here: digits only, as `capped_count` reads them, since a
    CAST reads '12abc' as 12 and clamps a number past 2**63)."""
    conn.execute(
        "INSERT INTO journal_meta (name, value) VALUES (?, ?) ON CONFLICT (name) DO UPDATE "
        "SET value = CAST(CAST(value AS INTEGER) + ? AS TEXT) "
        "WHERE length(value) BETWEEN 1 AND ? AND value NOT GLOB '*[^0-9]*'",
        (CAPPED_META, str(max(change, 0)), change, CAPPED_DIGITS),
    )


# A later attempt's number is the operation's next one, read in the same
# transaction: two writers can never both claim number n.
_INSERT_ATTEMPT = """
INSERT INTO attempts (
    operation_id, number, started_at, elapsed, outcome, status_code, replayed, error, wait
) SELECT operation_id, attempt_count + 1, ?, ?, ?, ?, ?, ?, ?
FROM operations WHERE operation_id = ? AND attempt_count > 0
"""


def _moved(counts: dict[str, int], before: str, after: str) -> None:
    """An operation moved from status ``before`` to ``after``, in ``counts``."""
    if before == after:
        return
    for status, change in ((before, -1), (after, 1)):
        name = status if status in STATUSES else "unknown_status"
        if name == "pending":
            continue  # counted from operations_pending
        counts[name] = counts.get(name, 0) + change


def _uncount(
    conn: sqlite3.Connection,
    counts: dict[str, int],
    table: str,
    prefix: str,
    where: str,
    params: Sequence[Any],
) -> None:
    """Take what the rows of ``table`` matching ``where`` count off ``counts``, before
    they are deleted: their statuses (``prefix`` "status"), or their attempts (columns
    ``prefix + "status_code"`` etc.: "attempt1_" for first attempts, "" for later ones)."""
    if prefix == "status":
        for status, number in conn.execute(
            f"SELECT status, count(*) FROM {table} WHERE {where} GROUP BY status", params
        ):
            name = status if status in STATUSES else "unknown_status"
            if name != "pending":  # counted from operations_pending
                counts[name] = counts.get(name, 0) - int(number)
        return
    found = conn.execute(
        f"SELECT count({prefix}outcome), count({prefix}status_code), "
        f"coalesce(sum({prefix}replayed), 0), "
        f"coalesce(sum({prefix}status_code IN (409, 423)), 0) FROM {table} WHERE {where}",
        params,
    ).fetchone()
    for name, number in zip(
        ("attempts", "answered_attempts", "replayed_attempts", "in_progress_attempts"),
        found,
        strict=True,
    ):
        counts[name] = counts.get(name, 0) - int(number)


_INHERITED: Final = (
    "codec, secret_params, credentials_digest, overrides, body_digest, group_id, step"
)
"""What a fork takes from its parent with the request bytes."""
# The lease to send is taken by this compare-and-swap, and so the first send of an
# enqueued operation begins with it: first_send_at is set here, and the key's
# lifetime (journaled as key_expires_at - created_at) starts now. Rows made by a call
# that sends at once have first_send_at from their insert; rows from before version 4
# (enqueued_at NULL) keep theirs NULL.
_TAKE_LEASE = """
UPDATE operations SET lease_owner = ?, lease_until = ?, updated_at = ?,
    key_expires_at = CASE WHEN first_send_at IS NULL AND enqueued_at IS NOT NULL
                          THEN ? + (key_expires_at - created_at) ELSE key_expires_at END,
    first_send_at = coalesce(first_send_at, CASE WHEN enqueued_at IS NOT NULL THEN ? END)
WHERE operation_id = ? AND status = 'pending'
  AND lease_until = ? AND lease_owner IS ? AND updated_at = ? AND attempt_count = ?
"""
"""The lease taken on the row as it was read: every write to an operation moves its
lease, its updated_at or its attempt_count, so a row changed since the read (taken and
given back meanwhile, an attempt journaled) is no longer the one decided on, and the
swap fails: the reader reads it again."""

_BIND_CREDENTIALS = """
UPDATE operations SET credentials_digest = ?
WHERE operation_id = ? AND lease_owner = ? AND status = 'pending'
  AND credentials_digest IS NULL
"""


_WRITE_ADVICE = {
    "locked": "another process held the journal's write lock past the busy timeout; "
    "look for a stuck process using this file, or raise busy_timeout",
    "full": "the disk is full; free some space",
    "readonly": "the file or its directory is read-only; fix the permissions",
    "other": "check free disk space and that the file and its directory are writable",
}


_LOCKED_AT_FORK: set[tuple[int, int]] = set()
"""The journal files (device, inode) this process was forked in the middle of a write
transaction on: SQLite's bookkeeping of the parent's lock came along and is never
released here, so no connection of this process can write those files."""

_FORKED_MID_WRITE = (
    "this process was forked while its parent was committing to this journal, and SQLite "
    "keeps the parent's lock in this process's memory, where nothing can release it: this "
    "process can read the journal but never write it (other processes can). Open the "
    "journal in a process started with multiprocessing's 'spawn' or 'forkserver', or fork "
    "while no call or resume is running"
)


def _write_problem(error: sqlite3.Error) -> str:
    message = str(error).lower()
    if "locked" in message or "busy" in message:
        return "locked"
    if "full" in message:
        return "full"
    if "readonly" in message or "read-only" in message:
        return "readonly"
    return "other"


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


def _is_corruption(error: sqlite3.Error) -> bool:
    """SQLITE_CORRUPT or SQLITE_NOTADB: the file is damaged, retrying cannot help."""
    code = getattr(error, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None and code & 0xFF in (11, 26):
        return True
    message = str(error).lower()
    return "malformed" in message or "not a database" in message


@contextmanager
def _text_as_str(conn: sqlite3.Connection) -> Iterator[None]:
    """The journal's statements on an application's connection read TEXT as str, whatever
    ``text_factory`` the application set (``bytes``, say); the application's own setting
    is back as soon as they are done."""
    factory = conn.text_factory
    conn.text_factory = str
    try:
        yield
    finally:
        conn.text_factory = factory


def _identity(path: str) -> tuple[int, int]:
    """The (device, inode) naming a file, as the store's moved-file check compares them."""
    found = os.stat(path)
    return found.st_dev, found.st_ino


class _ClosedConnection:
    """A closed Journal's connection: any use raises a JournalError that names the file."""

    in_transaction = False

    def __init__(self, path: str) -> None:
        self._path = path

    def _closed(self, *args: object, **kwargs: object) -> NoReturn:
        raise JournalError(
            f"the journal {self._path} was closed (Journal.close(), or the end of the "
            "Session's `with` block); this write was not journaled. Open the journal again "
            "(a new Journal or Session) to use it"
        )

    execute = executemany = executescript = _closed

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        self._closed()


class _Transaction:
    """``with store._write(...) as conn:``: the lock, the synchronous level, BEGIN, then
    COMMIT, or ROLLBACK on any error; a database error raised as the `JournalError` that
    says what to do. A class, not a ``@contextmanager`` generator: it runs around every
    write of every call."""

    __slots__ = ("_begin", "_durable", "_store")

    def __init__(self, store: SqliteStore, durable: bool, begin: bool) -> None:
        self._store = store
        self._durable = durable
        self._begin = begin

    def __enter__(self) -> sqlite3.Connection:
        store = self._store
        store._check_writable()
        store._lock.acquire()
        try:
            store._synchronous_for(self._durable)
            if self._begin:
                store._conn.execute("BEGIN IMMEDIATE")
                store._writing = True  # the write lock is held: see after_fork
        except BaseException as error:
            store._lock.release()
            if isinstance(error, sqlite3.DatabaseError):
                raise store._write_error(error) from error
            raise
        return store._conn

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: object
    ) -> None:
        store = self._store
        conn = store._conn
        try:
            if kind is None and self._begin:
                try:
                    conn.execute("COMMIT")
                except BaseException as failed:
                    error = failed
            if kind is None and error is None:
                return
            # SQLite may already have rolled back (SQLITE_FULL does): a second ROLLBACK
            # would hide the real error.
            if conn.in_transaction:
                with suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            if isinstance(error, sqlite3.DatabaseError):
                raise store._write_error(error) from error
            if kind is None and error is not None:
                raise error
        finally:
            store._writing = False
            store._lock.release()


class SqliteStore:
    """The journal in one SQLite file (WAL mode): a `Store`.

    Safe to share between threads (one connection, behind a lock); several
    processes may open the same file. Writes arrive in batches from the
    journal's one writer (`commit`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        readonly: bool = False,
        busy_timeout: float = 30.0,
        durability: Durability = "fsync",
        adopt: bool = False,
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
        journal's cost per call (the performance page of the docs).
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"the journal path must be a str or os.PathLike, not {type(path).__name__}"
            )
        check_number("busy_timeout", busy_timeout, integer=False, low=0, high=MAX_WINDOW)
        if durability not in DURABILITIES:
            raise ValueError(
                f"durability must be one of {', '.join(map(repr, DURABILITIES))}, "
                f"not {durability!r}"
            )
        self.path = os.fspath(path)
        _refuse_url(self.path)
        # A FIFO, a socket or a device would block the open (or be taken for a file).
        refuse_special_file(self.path)
        self.durability: Durability = durability
        self.readonly = readonly
        self._create = create and not readonly
        self._busy_timeout = busy_timeout
        # SQLite resolves a relative path once, at open; so does the moved-file check.
        self._abspath = os.path.abspath(self.path)
        self._file_id: tuple[int, int] | None = None
        self._version = SCHEMA_VERSION
        self._adopt = adopt
        self._adopted = False
        """The journal lives in an application's database: its version is a journal_meta
        row, and the file's user_version and application_id are the application's."""
        self._namespace: uuid.UUID | None = None
        if not self._create and self.path != ":memory:" and not os.path.exists(self.path):
            raise JournalMissingError(
                f"no journal at {self.path}; pass --journal PATH (or set IDEMPOTENTLY_JOURNAL) "
                "to the file your Session writes"
            )
        self._lock = threading.RLock()
        self._writing = False
        """Inside `_write`'s ``BEGIN IMMEDIATE`` transaction (the write lock held)."""
        self._synchronous = "NORMAL"  # the connection's setting now: changed only when needed
        self._conn = self._connect(busy_timeout)
        self._db: Any = None
        try:
            self._check_schema()
            if not self.readonly:
                self._synchronous_for(durable=False)  # after a durable schema write
            if self.path != ":memory:":
                self._file_id = self._file_identity()
                if self._file_id in _LOCKED_AT_FORK:
                    # Its writes can never take the lock: say so at once, not after
                    # the busy timeout.
                    self._busy_timeout = 0.0
                    self._conn.execute("PRAGMA busy_timeout = 0")
        except BaseException:
            self._close_untouched()
            raise

    # -- opening -------------------------------------------------------------

    @property
    def db(self) -> Any:
        """This journal's connection as a sqlite_utils Database (imported only when asked:
        `import idempotently` does not load sqlite-utils)."""
        if self._db is None:
            import sqlite_utils

            self._db = sqlite_utils.Database(self._conn)
        return self._db

    def _table_names(self) -> set[str]:
        return {
            row[0]
            for row in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }

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
            # As sqlite-utils' Database set it when it wrapped this connection: a REPLACE
            # fires the delete triggers that keep the counts.
            conn.execute("PRAGMA recursive_triggers = on")
        except sqlite3.DatabaseError as error:
            raise (self._version_refusal() or self._open_error(error)) from error
        return conn

    def _close_untouched(self) -> None:
        """Close a connection whose file was refused (a development journal, a newer one,
        another program's), leaving the file and its -wal as they are: the last connection
        to a WAL file checkpoints its frames into the file and deletes the -wal when it
        closes, so a read-only connection (which never checkpoints) keeps the file open
        until this one has closed."""
        holder = None
        if not self.readonly and self.path != ":memory:" and os.path.exists(self.path + "-wal"):
            try:
                holder = sqlite3.connect(
                    Path(self._abspath).as_uri() + "?mode=ro", uri=True, isolation_level=None
                )
                holder.execute("SELECT count(*) FROM sqlite_master").fetchall()
            except sqlite3.Error:
                pass  # best effort: the refusal itself must still reach the caller
        try:
            self._conn.close()
        finally:
            if holder is not None:
                holder.close()

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
                    tables = self._table_names()
                    names = {row[0] for row in self._conn.execute("SELECT name FROM sqlite_master")}
                    adopted = self._adopted_version() if "journal_meta" in tables else None
                    # An adopted file's pragmas are the application's: not even read.
                    version, app_id = (
                        (adopted, APPLICATION_ID)
                        if adopted is not None
                        else (
                            self._conn.execute("PRAGMA user_version").fetchone()[0],
                            self._conn.execute("PRAGMA application_id").fetchone()[0],
                        )
                    )
                finally:
                    self._conn.execute("COMMIT")
                if adopted is not None:
                    self._adopted = True
                elif app_id != APPLICATION_ID and tables and not names & _JOURNAL_NAMES:
                    self._adopt_application_database(app_id)
                    return
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
                    named = ", ".join(sorted(names & _JOURNAL_NAMES))
                    raise JournalCorruptError(
                        f"{self.path} is an SQLite database but not an idempotently journal"
                        + (
                            f": it holds tables named like the journal's ({named}), so it is "
                            "not adopted either and was left as it is; point --journal (or "
                            "Journal(path)) at the journal file, or give the journal a file "
                            "of its own"
                            if named and app_id == 0
                            else "; point --journal (or Journal(path)) at the journal file"
                        )
                    )
                if version > SCHEMA_VERSION:
                    raise JournalVersionError(
                        f"{self.path} has journal schema version {version}, but this "
                        f"idempotently reads up to version {SCHEMA_VERSION}; upgrade "
                        "idempotently (pip install -U idempotently). The file was not modified."
                    )
                if version < SCHEMA_VERSION:
                    # A development build's journal (or one whose creation never
                    # finished): never read, never upgraded, never touched.
                    raise development_journal_error(self.path, "SQLite", version)
                if not _SCHEMA_NAMES <= names:
                    raise JournalCorruptError(
                        f"{self.path} is missing journal tables or indexes "
                        f"({', '.join(sorted(_SCHEMA_NAMES - names))}); restore it from a backup "
                        "(it was left as it is)"
                    )
                self._check_columns()
                if not self.readonly:
                    # A journal left in rollback mode (a copy made by a tool).
                    self._ensure_wal()
                self._namespace = self._read_namespace()
        except sqlite3.DatabaseError as error:
            raise (self._version_refusal() or self._open_error(error)) from error

    def _version_refusal(self) -> JournalVersionError | None:
        """The refusal of a journal at another version that SQLite could not open (a WAL
        file in a read-only directory, where its -shm cannot be made), read from the file
        alone (``immutable``: no -shm, no -wal, nothing written), or None.

        The -wal may hold later pages, but never a step to or from this version: the file's
        own version says whether this build reads it."""
        if self.path == ":memory:":
            return None
        try:
            with closing(
                sqlite3.connect(
                    Path(self._abspath).as_uri() + "?mode=ro&immutable=1",
                    uri=True,
                    isolation_level=None,
                )
            ) as conn:
                version, app_id = (
                    conn.execute(f"PRAGMA {name}").fetchone()[0]
                    for name in ("user_version", "application_id")
                )
                tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        except sqlite3.Error:
            return None
        if app_id != APPLICATION_ID or not tables or version == SCHEMA_VERSION:
            return None
        if version > SCHEMA_VERSION:
            return JournalVersionError(
                f"{self.path} has journal schema version {version}, but this "
                f"idempotently reads up to version {SCHEMA_VERSION}; upgrade "
                "idempotently (pip install -U idempotently). The file was not modified."
            )
        return development_journal_error(self.path, "SQLite", version)

    def _check_columns(self) -> None:
        """Refuse a journal at this version missing a column (a damaged or half-made file)
        before anything reads or writes it: never "no such column" from the first statement
        that needs one."""
        found = set(
            self._conn.execute(
                "SELECT m.name, c.name FROM sqlite_master AS m, pragma_table_info(m.name) AS c "
                "WHERE m.type = 'table'"
            ).fetchall()
        )
        missing = sorted(_schema_columns() - found)
        if missing:
            raise JournalCorruptError(
                f"{self.path} is missing journal columns "
                f"({', '.join(f'{table}.{column}' for table, column in missing)}): a damaged "
                "or half-made journal; restore it from a backup (it was left as it is)"
            )

    def _adopted_version(self) -> int | None:
        """The schema version of a journal adopted into an application's database (its
        journal_meta rows), or None: not adopted."""
        try:
            rows = dict(
                self._conn.execute(
                    "SELECT name, value FROM journal_meta "
                    "WHERE name IN ('identity', 'schema_version')"
                ).fetchall()
            )
        except sqlite3.OperationalError as error:
            if "no such column" not in str(error):
                raise
            return None  # an application's own journal_meta, with other columns
        if rows.get("identity") != ADOPTED_IDENTITY:
            return None
        try:
            return int(rows["schema_version"])
        except (KeyError, TypeError, ValueError):
            raise JournalCorruptError(
                f"{self.path} holds an adopted journal without a valid schema version "
                f"(journal_meta 'schema_version' is {short(rows.get('schema_version'))}); "
                "restore the file from a backup"
            ) from None

    def _adopt_application_database(self, app_id: int) -> None:
        """A file with other tables and none named like the journal's: an application's
        database. Only `idempotently migrate` (``adopt=True``) creates the journal's tables
        in it, never touching its user_version or application_id (read-only: it is
        found adoptable, at version 0). Anything else is refused with what to do."""
        if app_id != 0:
            raise JournalCorruptError(
                f"{self.path} belongs to another program (its SQLite application_id is "
                f"{app_id:#x}, not idempotently's): it is not adopted and was left as it is; "
                "give the journal a file of its own"
            )
        if not self._adopt:
            raise JournalMissingError(
                f"{self.path} holds other tables and no idempotently journal: to keep the "
                f"journal's tables in it (the outbox), run `idempotently --journal {self.path} "
                "migrate` once (your tables, user_version and application_id are left as "
                "they are); otherwise point journal= at the journal's own file. Nothing was "
                "written"
            )
        self._adopted = True
        if self.readonly or not self._create:
            self._version = 0  # adoptable: what `migrate --sql` would print from
            return
        self._ensure_wal()
        with self._write(durable=True):
            # Another process may have adopted it while we waited for the lock.
            if "journal_meta" in self._table_names():
                version = self._adopted_version()
                if version is None:
                    raise JournalCorruptError(
                        f"{self.path} gained tables named like the journal's meanwhile; "
                        "it was not adopted"
                    )
                if version != SCHEMA_VERSION:
                    raise development_journal_error(self.path, "SQLite", version)
            else:
                self._upgrade(0)
        self._version = SCHEMA_VERSION
        self._namespace = self._read_namespace()

    def _upgrade(self, version: int) -> None:
        """Every step from ``version`` (0: an empty file) to SCHEMA_VERSION, inside the
        caller's transaction: the statements ``idempotently migrate --sql`` prints."""
        for statement in upgrade_statements(version, adopted=self._adopted):
            params = (str(uuid.uuid4()),) if statement == _NAMESPACE_INSERT else ()
            self._conn.execute(statement, params)

    def _read_namespace(self) -> uuid.UUID:
        with self._lock:
            row = self._conn.execute(
                "SELECT value FROM journal_meta WHERE name = 'namespace'"
            ).fetchone()
        try:
            return uuid.UUID(row[0])
        except (TypeError, ValueError, AttributeError) as error:
            raise JournalCorruptError(
                f"{self.path} has no valid key namespace ({short(None if row is None else row[0])}"
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
            # Another process may have created it while we waited for the lock.
            if "operations" in self._table_names():
                version = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
                if version != SCHEMA_VERSION:
                    raise development_journal_error(self.path, "SQLite", version)
                return
            self._upgrade(0)

    def close(self) -> None:
        """Close the file. Any later use raises `JournalError` (closing again is a no-op)."""
        with self._lock:
            self._conn.close()
            # Not sqlite3's "Cannot operate on a closed database": say which journal.
            self._conn = cast(sqlite3.Connection, _ClosedConnection(self.path))
            if self._db is not None:
                self._db.conn = self._conn

    def __repr__(self) -> str:
        return f"SqliteStore({self.path!r})"

    def after_fork(self) -> None:
        """In a child process: a fresh lock (the parent's may have been held at fork).

        The connection stays the parent's: SQLite forbids using it across a fork,
        so the Journal refuses every command in the child (see Journal._execute).
        """
        self._lock = threading.RLock()
        # A write transaction (not a snapshot read, whose lock blocks no writer) was
        # open at the fork.
        if self._file_id is not None and self._writing and self._conn.in_transaction:
            _LOCKED_AT_FORK.add(self._file_id)

    @property
    def schema_version(self) -> int:
        return self._version

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

    def check_identity(self) -> None:
        """Raise `JournalMovedError` unless ``path`` is still the file this Journal has open.

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

    def _synchronous_for(self, durable: bool) -> None:
        """FULL (fsync the WAL at commit) for a durable write, NORMAL for any other;
        a PRAGMA only when the level changes."""
        level = "FULL" if durable else "NORMAL"
        if level != self._synchronous:
            self._conn.execute(f"PRAGMA synchronous = {level}")
            self._synchronous = level

    def _write(self, *, durable: bool = False, begin: bool = True) -> _Transaction:
        """One short write transaction; ``durable`` fsyncs the WAL at commit.

        ``begin=False`` for a lone one-statement write: SQLite commits it by itself.
        """
        return _Transaction(self, durable, begin)

    def _write_error(self, error: sqlite3.DatabaseError) -> Exception:
        """The JournalError that says what went wrong with a write, and what to do."""
        if _is_corruption(error):
            return self._damaged(error)
        if isinstance(error, sqlite3.IntegrityError):
            # Our statements never break a constraint on a sound row: a row edited by hand
            # (an attempt_count lowered below its attempts) does.
            return JournalCorruptError(
                f"{self.path} holds a damaged operation ({error}): its row disagrees with its "
                "attempts, as after an edit by hand; repair that row with the sqlite3 shell or "
                "restore a backup (nothing was written)"
            )
        if isinstance(error, sqlite3.DataError):
            return JournalWriteError(
                f"cannot write the journal {self.path}: {error}; a value is over "
                "SQLite's size limit (a request or response body of a gigabyte?): "
                "send it in smaller parts (nothing was written)"
            )
        if not isinstance(error, sqlite3.OperationalError):
            return error
        problem = _write_problem(error)
        advice = (
            _FORKED_MID_WRITE
            if problem == "locked" and self._file_id in _LOCKED_AT_FORK
            else _WRITE_ADVICE.get(problem, _WRITE_ADVICE["other"])
        )
        return JournalWriteError(
            f"cannot write the journal {self.path}: {error}; "
            + advice
            + " (nothing was lost: the previous state stands)"
        )

    # -- the writes ----------------------------------------------------------------

    def commit(self, writes: Sequence[Write], durable: bool) -> list[Any]:
        """Run ``writes`` in one transaction; each one's result, or a `Failed`.

        ``durable`` fsyncs the WAL at commit (the batch holds a key about to be
        sent). Writes that may start a send (a new key, a lease taken or renewed,
        a claim) are refused with `JournalMovedError` if the path no longer
        names the file open here, checked with a ``stat`` before the batch (nothing
        of theirs is written then) and after it: in WAL mode a write to a deleted or
        replaced file succeeds silently and nobody would ever resume it. With several
        writes each runs in a savepoint: one that fails (a body over SQLite's limit)
        fails alone and the others commit. Raises if the transaction itself cannot
        begin or commit: then none was written.
        """
        sends = any(write.starts_send for write in writes)
        if sends:
            try:
                self.check_identity()
            except JournalMovedError as moved:
                # Nothing of what may start a send goes into a file nobody would resume.
                rest = [write for write in writes if not write.starts_send]
                kept = iter(self.commit(rest, durable) if rest else [])
                return [
                    Failed(copy.copy(moved)) if write.starts_send else next(kept)
                    for write in writes
                ]
        counts: dict[str, int] = {}
        if len(writes) == 1:
            (write,) = writes
            with self._write(durable=durable, begin=not write.one_statement):
                results: list[Any] = [self._apply(write, counts)]
                self._add_counts(counts)
            return self._unless_moved(writes, results) if sends else results
        results = []
        with self._write(durable=durable) as conn:
            for write in writes:
                conn.execute("SAVEPOINT write")
                changes: dict[str, int] = {}
                try:
                    results.append(self._apply(write, changes))
                except sqlite3.OperationalError:
                    raise  # the transaction's own problem (disk full, locked): everyone's
                except (sqlite3.DatabaseError, JournalError) as error:
                    conn.execute("ROLLBACK TO write")
                    failure = (
                        self._write_error(error)
                        if isinstance(error, sqlite3.DatabaseError)
                        else error
                    )
                    results.append(Failed(failure))
                else:
                    for name, change in changes.items():
                        counts[name] = counts.get(name, 0) + change
                finally:
                    # SQLITE_FULL may have rolled the whole transaction back: a RELEASE
                    # would then hide the real error behind "no such savepoint".
                    if conn.in_transaction:
                        conn.execute("RELEASE write")
            self._add_counts(counts)
        return self._unless_moved(writes, results) if sends else results

    def _unless_moved(self, writes: Sequence[Write], results: list[Any]) -> list[Any]:
        """``results``, except that the writes after which a caller may send fail with
        JournalMovedError if the path no longer names the file written. A second ``stat``,
        after the commit: a rename or delete between the first and the commit is noticed
        too (what was committed then lives in a file nobody would resume, so nothing may
        be sent)."""
        try:
            self.check_identity()
        except JournalMovedError as moved:
            return [
                Failed(copy.copy(moved)) if write.starts_send else result
                for write, result in zip(writes, results, strict=True)
            ]
        return results

    def _add_counts(self, counts: dict[str, int]) -> None:
        """A batch's changes to the counts, in one statement at its end (none if nothing
        counted changed: journaling a key changes nothing counted)."""
        if any(counts.values()):
            self._conn.execute(_ADD_COUNTS, {name: counts.get(name, 0) for name in _COUNTERS})

    def _apply(self, write: Write, counts: dict[str, int]) -> Any:
        """One write, on the connection (the caller holds the lock and the transaction);
        what it changes in the counts is added to ``counts``."""
        conn = self._conn
        match write:
            case Insert():
                if write.new.group_id is not None:
                    cursor = conn.execute(
                        _INSERT_STEP, _insert_step(write.new, write.owner, write.lease_until)
                    )
                    return cursor.rowcount == 1
                cursor = conn.execute(
                    _INSERT_OPERATION, write.new.row(write.owner, write.lease_until)
                )
                return cursor.rowcount == 1
            case Enqueue():
                if write.new.group_id is not None:
                    return (
                        conn.execute(_INSERT_STEP, _insert_step(write.new, None, 0.0)).rowcount == 1
                    )
                return conn.execute(_INSERT_OPERATION, write.new.row(None, 0.0)).rowcount == 1
            case Record():
                return self._record(conn, write, counts)
            case TakeLease():
                operation = write.operation
                parameters: tuple[Any, ...] = (
                    write.owner,
                    write.lease_until,
                    write.now,
                    write.now,
                    write.now,
                    operation.operation_id,
                    operation.lease_until,
                    operation.lease_owner,
                    operation.updated_at,
                    operation.attempt_count,
                )
                if operation.group_id is not None:
                    return (
                        conn.execute(
                            _TAKE_LEASE + _EARLIER_UNSETTLED,
                            (*parameters, operation.group_id, operation.step or 0),
                        ).rowcount
                        == 1
                    )
                return conn.execute(_TAKE_LEASE, parameters).rowcount == 1
            case BindCredentials():
                cursor = conn.execute(
                    _BIND_CREDENTIALS, (write.record, write.operation_id, write.owner)
                )
                return cursor.rowcount == 1
            case RenewLease():
                cursor = conn.execute(
                    "UPDATE operations SET lease_until = ?, updated_at = ? WHERE operation_id = ? "
                    "AND lease_owner = ? AND status = 'pending'",
                    (write.lease_until, write.now, write.operation_id, write.owner),
                )
                return cursor.rowcount == 1
            case PauseOrigin():
                # Retry control: the longer of two pauses wins, whoever wrote first.
                conn.execute(
                    """
                    INSERT INTO origin_pauses (origin, credentials, until, reason, set_at)
                    VALUES (?, ?, ?, ?, ?)
                    ON CONFLICT (origin, credentials) DO UPDATE SET
                        until = excluded.until, reason = excluded.reason, set_at = excluded.set_at
                    WHERE excluded.until > origin_pauses.until
                    """,
                    (write.origin, write.credentials, write.until, write.reason, write.set_at),
                )
                return None
            case RebaseOperation():
                # A clock ahead of ours wrote it: counted from our now, never later.
                cursor = conn.execute(
                    _REBASE_TIMES + " AND operation_id = :operation_id AND updated_at = :read",
                    {
                        "now": write.now,
                        "ahead": write.now,
                        "operation_id": write.operation_id,
                        "read": write.updated_at,
                    },
                )
                if cursor.rowcount != 1:
                    return None
                row = conn.execute(
                    "SELECT not_before, lease_until FROM operations WHERE operation_id = ?",
                    (write.operation_id,),
                ).fetchone()
                return (None if row[0] is None else float(row[0]), float(row[1]))
            case RebasePause():
                # A clock ahead of ours wrote it: count it from our now, never longer.
                conn.execute(
                    "UPDATE origin_pauses SET until = ? + (until - set_at), set_at = ? "
                    "WHERE origin = ? AND credentials = ? AND set_at > ?",
                    (write.now, write.now, write.origin, write.credentials, write.now),
                )
                row = conn.execute(
                    "SELECT origin, credentials, until, reason, set_at FROM origin_pauses "
                    "WHERE origin = ? AND credentials = ?",
                    (write.origin, write.credentials),
                ).fetchone()
                return None if row is None else OriginPause(*tuple(row))
            case SetStatus():
                cursor = conn.execute(
                    """
                    UPDATE operations SET status = ?, reason = ?, updated_at = ?,
                        lease_owner = NULL, lease_until = 0
                    WHERE operation_id = ? AND status = ?
                    """
                    + ("" if write.stopped_at is None else _STILL_STOPPED),
                    (write.status, write.reason, write.now, write.operation_id, write.expect)
                    + (() if write.stopped_at is None else (write.stopped_at,)),
                )
                if cursor.rowcount == 1:
                    _moved(counts, write.expect, write.status)
                    if write.cap_reason is not None:
                        _set_cap_reason(conn, write.operation_id, write.cap_reason)
                return cursor.rowcount == 1
            case Release():
                conn.execute(
                    "UPDATE operations SET lease_owner = NULL, lease_until = 0 "
                    "WHERE operation_id = ? AND lease_owner = ?",
                    (write.operation_id, write.owner),
                )
                return None
            case ExtendLeases():
                extended = 0
                for operation_id, owner in write.leases:
                    cursor = conn.execute(
                        "UPDATE operations SET lease_until = max(lease_until, ?), updated_at = ? "
                        "WHERE operation_id = ? AND lease_owner = ? AND status = 'pending'",
                        (write.lease_until, write.now, operation_id, owner),
                    )
                    extended += cursor.rowcount
                return extended
            case ClaimDue():
                return self._claim(conn, write)
            # Last, and through the module: a call's writes never reach them, so the
            # operator's commands load with the operator's rooms.
            case _commands_lazy.Act():
                return self._act(conn, write, counts)
            case _commands_lazy.LookUpLater():
                return self._look_up_later(conn, write)
            case _commands_lazy.SwapPause():
                return self._swap_pause(conn, write)
            case _commands_lazy.Unpause():
                lifted = [
                    OriginPause(*tuple(row))
                    for row in conn.execute(
                        "SELECT origin, credentials, until, reason, set_at FROM origin_pauses "
                        "WHERE origin = ?",
                        (write.origin,),
                    )
                ]
                conn.execute("DELETE FROM origin_pauses WHERE origin = ?", (write.origin,))
                return lifted
            case _:
                assert_never(write)

    def _swap_pause(
        self, conn: sqlite3.Connection, write: _commands_lazy.SwapPause
    ) -> OriginPause | None:
        """A circuit breaker's compare-and-swap on its pause row (`SwapPause`)."""
        where = "WHERE origin = ? AND credentials = ? AND reason = ? AND (? IS NULL OR until <= ?)"
        match = (write.origin, write.credentials, write.expect, write.ended_by, write.ended_by)
        new = write.new
        if new is None:
            conn.execute("DELETE FROM origin_pauses " + where, match)
        else:
            conn.execute(
                "UPDATE origin_pauses SET until = ?, reason = ?, set_at = ? " + where,
                (new.until, new.reason, new.set_at, *match),
            )
        row = conn.execute(
            "SELECT origin, credentials, until, reason, set_at FROM origin_pauses "
            "WHERE origin = ? AND credentials = ?",
            (write.origin, write.credentials),
        ).fetchone()
        return None if row is None else OriginPause(*tuple(row))

    def _record(self, conn: sqlite3.Connection, write: Record, counts: dict[str, int]) -> None:
        """The attempt and the operation's new state.

        A first attempt is journaled in the operation's own row, by the one UPDATE that
        also sets its new state (the common call: one statement); a later one is a row
        of attempts. With an owner, the new state applies only while that caller still
        holds the operation's lease and the operation is pending: an attempt that
        outlived its lease (another caller took over, or settled it) is kept in the
        history but changes nothing else.
        """
        record, owner, operation_id = write.record, write.owner, write.operation_id
        before: Any = "pending"
        if owner is None:
            # No lease to hold: the status moved from is whatever the row has.
            found = conn.execute(
                "SELECT status FROM operations WHERE operation_id = ?", (operation_id,)
            ).fetchone()
            if found is None:
                return
            before = found[0]
        attempt = (
            record.started_at,
            record.elapsed,
            record.outcome,
            record.status_code,
            int(record.replayed),
            record.error,
            record.wait,
        )
        state = (
            record.status,
            record.reason,
            record.not_before,
            write.now,
            record.status_code,
            record.response_status,
            None if record.response_headers is None else headers_json(record.response_headers),
            record.response_body,
            record.lease_until,
            record.lease_until,
        )
        holds = "" if owner is None else " AND status = 'pending' AND lease_owner IS ?"
        held = () if owner is None else (owner,)
        if conn.execute(_RECORD_FIRST + holds, (*state, *attempt, operation_id, *held)).rowcount:
            _moved(counts, before, record.status)
            if record.cap_reason is not None:
                _set_cap_reason(conn, operation_id, record.cap_reason)
        elif conn.execute(_RECORD_FIRST_ONLY, (*attempt, operation_id)).rowcount:
            pass  # a first attempt that outlived its lease: in the row, nothing else changed
        elif conn.execute(_INSERT_ATTEMPT, (*attempt, operation_id)).rowcount == 0:
            if conn.execute(
                "SELECT 1 FROM operations WHERE operation_id = ?", (operation_id,)
            ).fetchone():
                # attempt_count 0 with a first attempt journaled: a row edited by hand.
                raise sqlite3.IntegrityError("attempt_count is 0 but attempt 1 is journaled")
            return  # no such operation: nothing journaled, nothing counted
        else:
            if conn.execute(_RECORD_STATE + holds, (*state, operation_id, *held)).rowcount:
                _moved(counts, before, record.status)
                if record.cap_reason is not None:
                    _set_cap_reason(conn, operation_id, record.cap_reason)
            else:
                # Not ours any more: count the attempt, keep whoever holds it now. Its
                # updated_at stays the holder's, the write time of the holder's lease and
                # not_before (`RebaseOperation`): our clock may not be theirs.
                conn.execute(
                    "UPDATE operations SET attempt_count = attempt_count + 1 "
                    "WHERE operation_id = ?",
                    (operation_id,),
                )
        counts["attempts"] = counts.get("attempts", 0) + 1
        if record.status_code is not None:
            counts["answered_attempts"] = counts.get("answered_attempts", 0) + 1
            if record.status_code in (409, 423):
                counts["in_progress_attempts"] = counts.get("in_progress_attempts", 0) + 1
        if record.replayed:
            counts["replayed_attempts"] = counts.get("replayed_attempts", 0) + 1

    def _claim(self, conn: sqlite3.Connection, write: ClaimDue) -> list[Operation]:
        """Lease up to ``limit`` due pending operations, oldest first: inside the
        writer's ``BEGIN IMMEDIATE`` transaction, so two workers (threads or
        processes) never claim one operation. A row written by a clock ahead of ``now``
        (a not_before, a dead host's lease) is first counted from ``now``
        (`RebaseOperation`), so it is due after its length, not when this host's clock
        catches up with the writer's."""
        conn.execute(_REBASE_TIMES, {"now": write.now, "ahead": write.written_ahead()})
        ids = [
            row[0]
            for row in conn.execute(
                """
                SELECT operation_id FROM operations
                WHERE status = 'pending' AND lease_until <= ?
                  AND coalesce(not_before, 0) <= ?
                  AND (group_id IS NULL OR NOT EXISTS (
                      SELECT 1 FROM operations AS earlier
                      WHERE earlier.group_id = operations.group_id
                        AND earlier.step < operations.step AND earlier.successor IS NULL
                        AND earlier.status IN ('pending', 'needs_reconcile')))
                ORDER BY created_at, operation_id LIMIT ?
                """,
                (write.now, write.now, write.limit),
            )
        ]
        conn.executemany(
            "UPDATE operations SET lease_owner = ?, lease_until = ?, updated_at = ? "
            "WHERE operation_id = ?",
            [(write.owner, write.lease_until, write.now, operation_id) for operation_id in ids],
        )
        claimed = []
        for operation_id in ids:
            rows = self._query(
                f"SELECT {_ROW_COLUMNS} FROM operations WHERE operation_id = ?",
                (operation_id,),
                checked=False,
            )
            claimed.append(self._listed(rows[0], attempts=True))
        return claimed

    # -- the operator's journal: actions, lookup verdicts, audit entries --------------

    def _act(self, conn: sqlite3.Connection, write: Act, counts: dict[str, int]) -> bool:
        """An operator's action: a compare-and-swap on the row as read, the fork (if any)
        and the audit entries, inside the writer's ``BEGIN IMMEDIATE`` transaction."""
        fork = write.fork
        if (
            fork is not None
            and conn.execute(
                "SELECT 1 FROM operations WHERE operation_id = ? OR key = ?",
                (fork.operation_id, fork.key),
            ).fetchone()
        ):
            return False
        responds = write.sets_answer
        cursor = conn.execute(
            """
            UPDATE operations SET status = ?, reason = ?, updated_at = ?,
                not_before = CASE WHEN ? THEN NULL ELSE not_before END,
                lookup_after = CASE WHEN ? THEN NULL ELSE lookup_after END,
                response_status = CASE WHEN ? THEN ? ELSE response_status END,
                response_headers = CASE WHEN ? THEN ? ELSE response_headers END,
                response_body = CASE WHEN ? THEN ? ELSE response_body END,
                lease_owner = NULL, lease_until = 0
            WHERE operation_id = ? AND status = ? AND lease_owner IS ? AND lease_until = ?
              AND updated_at = ?
            """,
            (
                write.status,
                write.reason,
                write.now,
                write.due_now,
                write.due_now,
                responds,
                write.response_status,
                responds,
                None if write.response_headers is None else headers_json(write.response_headers),
                responds,
                write.response_body,
                write.operation_id,
                write.expect_status,
                write.expect_lease_owner,
                write.expect_lease_until,
                write.expect_updated_at,
            ),
        )
        if cursor.rowcount != 1:
            return False
        _moved(counts, write.expect_status, write.status)
        if fork is not None:
            conn.execute(_INSERT_OPERATION, fork.row(None, 0.0))
            # The same bytes mean the same encoding: the parent's codec, redacted
            # parameters, credential binding and overrides go with them.
            conn.execute(
                f"UPDATE operations SET lease_owner = NULL, forked_from = ?, enqueued_at = ?, "
                f"({_INHERITED}) = (SELECT {_INHERITED} FROM operations WHERE operation_id = ?) "
                "WHERE operation_id = ?",
                (write.operation_id, write.now, write.operation_id, fork.operation_id),
            )
            # A forked group step's fork takes its place in the group (the link journaled).
            conn.execute(
                "UPDATE operations SET successor = ? WHERE operation_id = ? "
                "AND group_id IS NOT NULL",
                (fork.operation_id, write.operation_id),
            )
        conn.executemany(
            "INSERT INTO operation_audit (operation_id, at, actor, action, note, detail) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            [
                (note.operation_id, write.now, note.actor, note.action, note.note, note.detail)
                for note in write.audit
            ],
        )
        return True

    def _look_up_later(self, conn: sqlite3.Connection, write: LookUpLater) -> bool:
        cursor = conn.execute(
            "UPDATE operations SET lookup_after = ? "
            "WHERE operation_id = ? AND status = 'needs_reconcile'",
            (write.lookup_after, write.operation_id),
        )
        if cursor.rowcount != 1:
            return False
        note = write.audit
        conn.execute(
            "INSERT INTO operation_audit (operation_id, at, actor, action, note, detail) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (note.operation_id, write.now, note.actor, note.action, note.note, note.detail),
        )
        return True

    def audit(self, operation_id: str) -> list[AuditEntry]:
        """The operation's audit entries, oldest first."""
        entries = []
        with self._lock:
            try:
                rows = self._conn.execute(
                    "SELECT seq, operation_id, at, actor, action, note, detail "
                    "FROM operation_audit WHERE operation_id = ? ORDER BY seq",
                    (operation_id,),
                ).fetchall()
            except sqlite3.DatabaseError as error:
                if _is_corruption(error):
                    raise self._damaged(error) from error
                raise self._open_error(error) from error
        names = ("seq", "operation_id", "at", "actor", "action", "note", "detail")
        for values in rows:
            row = dict(zip(names, values, strict=True))
            problem = audit_entry_problem(row)
            if problem is not None:
                raise JournalCorruptError(
                    f"{self.path} holds a damaged audit entry: {problem}; move the journal "
                    "aside and restore a backup",
                    operation_id=operation_id,
                )
            entries.append(_rows.AuditEntry(**row))
        return entries

    # -- the outbox: writes in the application's own transaction ----------------------

    def enqueue_on(self, connection: object, new: NewOperation) -> bool:
        """Insert ``new`` (enqueued, unleased) on the application's ``connection``, inside
        its open transaction; False if the id or key is taken. Nothing is committed
        here: the operation commits or rolls back with the application's own writes."""
        if not isinstance(connection, sqlite3.Connection):
            from idempotently import _outbox_orm

            if _outbox_orm.is_orm(connection):
                return self._enqueue_orm(_outbox_orm.opened(connection, _ids(new)), new)
        conn = self._application_connection(connection, new)
        try:
            if new.group_id is not None:
                return conn.execute(_INSERT_STEP, _insert_step(new, None, 0.0)).rowcount == 1
            return conn.execute(_INSERT_OPERATION, new.row(None, 0.0)).rowcount == 1
        except sqlite3.DatabaseError as error:
            raise self._enqueue_error(error, new) from error

    def find_on(
        self, connection: object, operation_id: str | None, key: str | None
    ) -> Operation | None:
        """`find`, read on the application's ``connection`` (its transaction's view)."""
        if not isinstance(connection, sqlite3.Connection):
            from idempotently import _outbox_orm

            if _outbox_orm.is_orm(connection):
                return self._find_orm(_outbox_orm.opened(connection, {}), operation_id, key)
        return self.find(operation_id, key, self._application_connection(connection, None))

    async def aenqueue_on(self, connection: object, new: NewOperation) -> bool:
        """`enqueue_on` for an async session: on the calling thread, the event loop's,
        where the application runs its own statements on that connection (a sqlite3
        connection is bound to the thread that made it). It commits nothing, so it never
        waits for an fsync; it waits for the write lock only if the application's
        transaction has not written yet, as the application's own next statement would.
        A SQLAlchemy AsyncSession or AsyncConnection runs it awaited on its loop."""
        if not isinstance(connection, sqlite3.Connection):
            from idempotently import _outbox_orm

            if _outbox_orm.is_orm(connection):
                return await _outbox_orm.run_async(
                    connection, _ids(new), lambda orm: self._enqueue_orm(orm, new)
                )
        return self.enqueue_on(connection, new)

    async def afind_on(
        self, connection: object, operation_id: str | None, key: str | None
    ) -> Operation | None:
        """`find_on` for an async session (on the calling thread, as above)."""
        if not isinstance(connection, sqlite3.Connection):
            from idempotently import _outbox_orm

            if _outbox_orm.is_orm(connection):
                return await _outbox_orm.run_async(
                    connection, {}, lambda orm: self._find_orm(orm, operation_id, key)
                )
        return self.find_on(connection, operation_id, key)

    # An ORM's connection (_outbox_orm): the same statements and the same proof that it is
    # on the journal's file, run through the ORM's own API.

    def _enqueue_orm(self, orm: OrmConnection, new: NewOperation) -> bool:
        self._orm_usable(orm, new)
        return cast(bool, self._run_orm(orm, self._enqueue_steps(new), new))

    def _find_orm(
        self, orm: OrmConnection, operation_id: str | None, key: str | None
    ) -> Operation | None:
        from idempotently._outbox_orm import StatementError

        self._orm_usable(orm, None)
        try:
            return self.find(operation_id, key, orm)
        except StatementError as error:
            raise self._orm_error(error, None) from error

    def _enqueue_steps(self, new: NewOperation) -> _Steps:
        rows, _ = yield "PRAGMA database_list", ()
        self._check_same_file(rows, _ids(new))
        if new.group_id is not None:
            # A group step takes its group's next place, as on a sqlite3 connection.
            _, inserted = yield _INSERT_STEP, _insert_step(new, None, 0.0)
            return inserted == 1
        _, inserted = yield _INSERT_OPERATION, new.row(None, 0.0)
        return inserted == 1

    def _run_orm(self, orm: OrmConnection, steps: _Steps, new: NewOperation | None) -> Any:
        # No savepoint on SQLite: RELEASE of a savepoint opened before the application's
        # first write would commit (and a failed insert leaves SQLite's transaction as
        # it was, as on a sqlite3 connection).
        from idempotently._outbox_orm import StatementError

        try:
            return orm.run(steps, "qmark", savepoint=False)
        except StatementError as error:
            raise self._orm_error(error, new) from error

    def _orm_error(self, error: OrmStatementError, new: NewOperation | None) -> Exception:
        if isinstance(error.driver_error, sqlite3.DatabaseError):
            return self._enqueue_error(error.driver_error, new)
        return JournalError(
            f"cannot journal the operation in your transaction on {self.path}: "
            f"{short(str(error.driver_error))}; the operation was not journaled: roll your "
            "transaction back and run it again",
            **_ids(new),
        )

    def _orm_usable(self, orm: OrmConnection, new: NewOperation | None) -> None:
        if orm.dialect != "sqlite":
            raise TypeError(
                f"connection is a {orm.name} on {orm.dialect}, not on the journal's SQLite "
                f"file {self.path}; nothing was journaled"
            )
        self._check_writable()
        if self._file_id is None:
            raise JournalError(
                f"the journal {self.path} is an in-memory database, which no other connection "
                "can open: enqueue with a connection needs a journal file; nothing was journaled",
                **_ids(new),
            )

    def _check_same_file(self, rows: list[dict[str, Any]], ids: ErrorContext) -> None:
        """The proof that the application's connection is on the journal's own file: its
        main database (``PRAGMA database_list``) is the journal's file (the same inode on
        the same device), else a clear error."""
        main = next((str(row["file"]) for row in rows if row["name"] == "main"), "")
        try:
            same = bool(main) and _identity(main) == self._file_id
        except OSError:
            same = False
        if not same:
            raise JournalError(
                f"the connection given to enqueue is open on {main or 'an in-memory database'!r}, "
                f"not on the journal's file {self._abspath}: the operation could not commit "
                "with your transaction; open your connection on the journal's file (your "
                "tables and the journal's live in one database), or leave connection out; "
                "nothing was journaled",
                **ids,
            )

    def _application_connection(
        self, connection: object, new: NewOperation | None
    ) -> sqlite3.Connection:
        """``connection`` as a sqlite3.Connection open on this journal's own file, inside
        (or about to open) a transaction; else a clear error, and nothing written."""
        ids: ErrorContext = (
            {} if new is None else {"operation_id": new.operation_id, "key": new.key}
        )
        utils = sys.modules.get("sqlite_utils")  # a Database given means it is imported
        if utils is not None and isinstance(connection, utils.Database):
            connection = connection.conn  # sqlite-utils wrapping the application's connection
        if not isinstance(connection, sqlite3.Connection):
            raise TypeError(
                f"connection must be the sqlite3.Connection (or sqlite_utils.Database, "
                f"SQLAlchemy Session or Connection, or Django connection) your transaction "
                f"runs on, opened on the journal's file {self.path}, not "
                f"{type(connection).__name__}; nothing was journaled"
            )
        self._check_writable()
        if self._file_id is None:
            raise JournalError(
                f"the journal {self.path} is an in-memory database, which no other connection "
                "can open: enqueue with a connection needs a journal file; nothing was journaled",
                **ids,
            )
        try:
            cursor = connection.cursor()
            cursor.row_factory = None  # tuples, whatever the application's row_factory
            with _text_as_str(connection):
                rows = cursor.execute("PRAGMA database_list").fetchall()
        except sqlite3.ProgrammingError as error:
            raise JournalError(
                f"cannot use the connection given to enqueue ({error}): it must be open, and "
                "used from the thread that made it (or made with check_same_thread=False); "
                "nothing was journaled",
                **ids,
            ) from None
        except sqlite3.DatabaseError as error:
            raise self._enqueue_error(error, new) from error
        self._check_same_file([{"name": row[1], "file": row[2]} for row in rows], ids)
        # Python 3.12's autocommit=True, or the legacy isolation_level=None: no implicit
        # transaction. (autocommit=False always has one open.)
        autocommit = getattr(connection, "autocommit", -1) is True or (
            connection.isolation_level is None and getattr(connection, "autocommit", -1) == -1
        )
        if not connection.in_transaction and autocommit:
            raise JournalError(
                "the connection given to enqueue is in autocommit mode with no transaction "
                "open, so the operation would commit on its own, not with your writes: "
                "execute BEGIN first (or use the connection's default isolation_level), or "
                "leave connection out to journal it on its own; nothing was journaled",
                **ids,
            )
        return connection

    def _enqueue_error(self, error: sqlite3.DatabaseError, new: NewOperation | None) -> Exception:
        """A failed enqueue on the application's connection: what to do, and what stands."""
        failure = self._write_error(error)
        if not isinstance(failure, JournalError):
            return failure
        failure = type(failure)(
            failure.message.replace(" (nothing was lost: the previous state stands)", "")
            + "; the operation was not journaled, and your transaction is as it was: roll it "
            "back and run it again"
        )
        if new is not None:
            failure.operation_id, failure.key = new.operation_id, new.key
        return failure

    # -- reading ---------------------------------------------------------------

    def _query(
        self,
        sql: str,
        params: Sequence[Any] | dict[str, Any] = (),
        conn: sqlite3.Connection | OrmConnection | None = None,
        *,
        checked: bool = True,
    ) -> list[dict[str, Any]]:
        """Rows as dicts, each checked (unless a listing checks them, `_listed`); on
        ``conn`` (an application's connection) if given."""
        if conn is not None and not isinstance(conn, sqlite3.Connection):
            # An ORM's connection: its own statements, never under this store's lock (an
            # async one's run_sync yields to the loop mid-statement).
            rows = conn.rows(sql, params, "qmark")
            if checked:
                for row in rows:
                    self._check_row(row)
            return rows
        with self._lock:
            cursor = None
            try:
                if conn is None:
                    cursor = self._conn.execute(sql, params)
                    fetched = cursor.fetchall()
                else:
                    # Tuples whatever row_factory the application set on its connection,
                    # and text as str whatever its text_factory.
                    cursor = conn.cursor()
                    cursor.row_factory = None
                    with _text_as_str(conn):
                        cursor.execute(sql, params)
                        fetched = cursor.fetchall()
                columns = [description[0] for description in cursor.description]
                rows = [dict(zip(columns, row, strict=True)) for row in fetched]
            except sqlite3.DatabaseError as error:
                if _is_corruption(error):
                    raise self._damaged(error) from error
                raise self._open_error(error) from error
            finally:
                # A statement that failed halfway must not hold its read
                # transaction open (until garbage collection) under later writes.
                if cursor is not None:
                    cursor.close()
        if checked:
            for row in rows:
                self._check_row(row)
        return rows

    def _listed(self, row: dict[str, Any], *, attempts: bool = False) -> Operation:
        """A row of a listing (`operations`: list, the resume queue; a worker's claim):
        one this version cannot decode, or whose attempt_count disagrees with its first
        attempt's columns, is its damaged stand-in, reported by whoever reads it (never
        sent), never an error that stops the listing. (A read of one operation by its id
        stays strict: `_check_row`.)"""
        journaled = row.pop("_attempt1", None)  # a listing's: is attempt 1 in the row?
        first = _first_attempt(row)
        problem = row_problem(row)
        if problem is None and journaled is not None:
            problem = _first_attempt_problem(row["attempt_count"], {} if journaled else None)
        if problem is None and attempts:
            later = self._later_attempts(row, None, checked=False)
            for attempt in ([] if first is None else [first]) + later:
                problem = problem or row_problem(attempt)
            problem = problem or _first_attempt_problem(row["attempt_count"], first)
            if problem is None:
                return self._operation(row, first, later)
        if problem is None:
            return Operation._from_row(row)
        return Operation._damaged_row(row, problem)

    def _later_attempts(
        self,
        row: dict[str, Any],
        conn: sqlite3.Connection | OrmConnection | None,
        *,
        checked: bool = True,
    ) -> list[dict[str, Any]]:
        """The rows of attempts 2..n: read only when the operation counts more than one."""
        count = row["attempt_count"]
        if type(count) is int and count <= 1:
            return []
        return self._query(
            "SELECT number, started_at, elapsed, outcome, status_code, replayed, error, wait "
            "FROM attempts WHERE operation_id = ? ORDER BY number",
            (row["operation_id"],),
            conn,
            checked=checked,
        )

    def _operation(
        self, row: dict[str, Any], first: dict[str, Any] | None, later: list[dict[str, Any]]
    ) -> Operation:
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
            for attempt in ([] if first is None else [first]) + later
        )
        return Operation._from_row(row, attempts)

    def _check_row(self, row: dict[str, Any], found: str | None = None) -> None:
        """Raise JournalCorruptError, naming the operation, if a value cannot be decoded
        (or with the ``found`` problem)."""
        problem = found
        for column, value in row.items():
            problem = problem or column_problem(column, value)
        if problem is not None:
            operation_id, key = row.get("operation_id"), row.get("key")
            raise JournalCorruptError(
                f"{self.path} holds a damaged operation: {problem}; repair that row with "
                "the sqlite3 shell (or restore a backup), or record what happened to it "
                "with `idempotently settle` or `abandon`; the other operations are still "
                "listed, shown and resumed",
                operation_id=operation_id if isinstance(operation_id, str) else None,
                key=key if isinstance(key, str) else None,
            )

    def _damaged(self, error: sqlite3.DatabaseError) -> JournalCorruptError:
        return JournalCorruptError(
            f"the journal {self.path} is damaged ({error}); stop using it: move it aside "
            f"(keep it: `sqlite3 {self.path} .recover` may save its rows) and restore a backup"
        )

    def operation(self, operation_id_or_key: str, *, damaged: bool = False) -> Operation | None:
        """One operation with all its attempts, by operation id or by key; with
        ``damaged``, a row that cannot be decoded as its stand-in (`_listed`)."""
        rows = self._query(
            f"SELECT {_ROW_COLUMNS} FROM operations WHERE operation_id = ? "
            f"UNION ALL SELECT {_ROW_COLUMNS} FROM operations WHERE key = ? "
            "AND operation_id != ? LIMIT 1",
            (operation_id_or_key, operation_id_or_key, operation_id_or_key),
            checked=not damaged,
        )
        if not rows:
            return None
        if damaged:
            return self._listed(rows[0], attempts=True)
        return self._with_attempts(rows[0], whole_history=True)

    def _with_attempts(
        self,
        row: dict[str, Any],
        conn: sqlite3.Connection | OrmConnection | None = None,
        *,
        whole_history: bool = False,
    ) -> Operation:
        """The operation of a checked row, with its attempts (checked too). With
        ``whole_history`` (an audit's read: show, `Journal.operation`), its later attempts
        must be numbered 2..attempt_count too; a call's or a resume's read (`find`) does
        not refuse that, as a listing cannot see it: one such row must not stop a resume."""
        first = _first_attempt(row)
        if first is not None:
            self._check_row(first | {"operation_id": row["operation_id"], "key": row["key"]})
        later = self._later_attempts(row, conn)
        problem = _first_attempt_problem(row["attempt_count"], first)
        if (
            problem is None
            and whole_history
            and _later_attempts_problem(row["attempt_count"], later)
        ):
            # Two reads: a writer may have journaled an attempt (or prune deleted the
            # operation) between them. Only what one snapshot shows is a damaged row.
            alone = conn is None and not self._conn.in_transaction
            with self._snapshot() if alone else nullcontext():
                again = self._query(
                    f"SELECT {_ROW_COLUMNS} FROM operations WHERE operation_id = ?",
                    (row["operation_id"],),
                    conn,
                )
                if again:
                    row = again[0]
                    first = _first_attempt(row)
                    later = self._later_attempts(row, conn)
                    problem = _first_attempt_problem(
                        row["attempt_count"], first
                    ) or _later_attempts_problem(row["attempt_count"], later)
        if problem is not None:
            self._check_row(row, problem)
        return self._operation(row, first, later)

    def find(
        self,
        operation_id: str | None,
        key: str | None,
        conn: sqlite3.Connection | OrmConnection | None = None,
    ) -> Operation | None:
        """The operation with this id, else the one with this key, with its attempts."""
        try:
            for column, value in (("operation_id", operation_id), ("key", key)):
                if value is None:
                    continue
                rows = self._query(
                    f"SELECT {_ROW_COLUMNS} FROM operations WHERE {column} = ?", (value,), conn
                )
                if rows:
                    return self._with_attempts(rows[0], conn)
        except JournalError:
            # A file replaced under this Journal (and its -wal and -shm left behind)
            # reads as a broken journal: say what happened instead.
            self.check_identity()
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
        check_number("since", since, integer=False, low=0, high=MAX_TIMESTAMP)
        check_number("limit", limit, integer=True, low=0, high=MAX_LIMIT)
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
        # One query per status, each walking its index in order and stopping at the
        # limit, merged here: `status IN (...) ORDER BY ...` would sort every match
        # first (a million rows for succeeded + failed). Version 3 lists pending
        # operations by creation and the others by their last change (the order of
        # the indexes it keeps); without a status, by creation (rowid).
        with self._snapshot():
            listings = [self._listing(value, since, limit, newest_first) for value in statuses]
        rows = merge(*listings, key=lambda row: (row["_at"], row["_rowid"]), reverse=newest_first)
        return [
            self._listed(
                {name: value for name, value in row.items() if name not in ("_rowid", "_at")}
            )
            for row in islice(rows, limit)
        ]

    def group(self, group_id: str) -> list[Operation]:
        """The steps of a group (without their attempts) in their order, forks beside the
        steps they replace; a row that cannot be decoded is its damaged stand-in."""
        rows = self._query(
            f"SELECT {_OPERATION_COLUMNS} FROM operations WHERE group_id = ? "
            "ORDER BY step, created_at, operation_id",
            (group_id,),
            checked=False,
        )
        return [self._listed(row) for row in rows]

    def queue(self, statuses: Sequence[Status]) -> list[Operation]:
        """What resume works through: the operations with these statuses, oldest first
        (in the order of `operations`), each with its attempts, read in one snapshot.

        Resume sends from these rows as read here (its lease's compare-and-swap
        proves each one unchanged since), so each row is read once, with its first
        attempt from its own columns: only an operation with later attempts costs
        one more query. A row this version cannot decode is its damaged stand-in."""
        with self._snapshot():
            listings = [
                self._listing(status, None, None, False, columns=_ROW_COLUMNS)
                for status in dict.fromkeys(statuses)
            ]
            rows = merge(*listings, key=lambda row: (row["_at"], row["_rowid"]))
            return [
                self._listed(
                    {name: value for name, value in row.items() if name not in ("_rowid", "_at")},
                    attempts=True,
                )
                for row in rows
            ]

    def _listing(
        self,
        status: Status | None,
        since: float | None,
        limit: int | None,
        newest_first: bool,
        *,
        columns: str = _OPERATION_COLUMNS,
    ) -> list[dict[str, Any]]:
        where: list[str] = []
        params: list[Any] = []
        direction = "DESC" if newest_first else "ASC"
        at, source, order = "rowid", "operations", f"rowid {direction}"
        if status is not None:
            # A literal, not a parameter: SQLite must see that it implies the partial
            # index's WHERE (status was checked against STATUSES).
            where.append(f"status = '{status}'")
            if status == "pending":
                at, index = "created_at", "operations_pending"
                # Ties by rowid: a sort of the pending operations only, which are few.
                order = f"created_at {direction}, rowid {direction}"
            else:
                at, index = "updated_at", "operations_settled"
                order = f"updated_at {direction}, rowid {direction}"
                where.insert(0, _SETTLED)
            source += f" INDEXED BY {index}"
        if since is not None:
            where.append("created_at >= ?")
            params.append(since)
        sql = (
            f"SELECT rowid AS _rowid, {at} AS _at, attempt1_outcome IS NOT NULL AS _attempt1, "
            f"{columns} FROM {source}"
        )
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY {order}"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return self._query(sql, params, checked=False)

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
        (`DEFAULT_EXPIRING_WITHIN`), exactly those ``resume`` no longer resends.
        That count reads one row per pending operation; without it, stats reads the
        pending operations' index alone.
        """
        check_number("now", now, integer=False, low=0, high=MAX_TIMESTAMP)
        check_number("stuck_after", stuck_after, integer=False, low=0, high=MAX_WINDOW)
        if expiring_within is not None:
            check_number("expiring_within", expiring_within, integer=False, low=0, high=MAX_WINDOW)
        with self._snapshot():
            return self._stats(now, stuck_after, expiring_within)

    def _stats(self, now: float, stuck_after: float, expiring_within: float | None) -> JournalStats:
        counters = self._counters()
        counts: dict[str, int] = {status: counters[status] for status in STATUSES}
        attempts = counters
        # This reads operations_pending alone (it covers these columns) unless the
        # expiring keys are asked for: key_expires_at is not in that index, so each
        # pending row costs one lookup (about 20 ms per 10,000 pending). An enqueued
        # operation not sent yet is not expiring: its key's lifetime has not started.
        expiring = (
            "NULL"
            if expiring_within is None
            else "coalesce(sum(key_expires_at <= :soon "
            "AND (first_send_at IS NOT NULL OR enqueued_at IS NULL)), 0)"
        )
        pending = self._query(
            f"""
            SELECT min(created_at) AS oldest,
                   coalesce(sum(lease_until < :now AND updated_at < :idle
                                AND coalesce(not_before, 0) <= :now), 0) AS stuck,
                   {expiring} AS expiring
            FROM operations INDEXED BY operations_pending WHERE status = 'pending'
            """,
            {"now": now, "idle": now - stuck_after, "soon": now + (expiring_within or 0.0)},
        )[0]
        return _rows.JournalStats(
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
            capped=self._capped(),
        )

    def _capped(self) -> int:
        """How many operations reached their ``max_total_attempts`` (`CAPPED_META`)."""
        rows = self._query("SELECT value FROM journal_meta WHERE name = ?", (CAPPED_META,))
        return capped_count(rows[0]["value"] if rows else None, self.path)

    def prune(self, *, older_than: float, now: float, dry_run: bool = False) -> int:
        """Delete finished operations (and their attempts) idle for ``older_than`` seconds.

        Never touches ``pending`` or ``needs_reconcile``: those still need work.
        Returns how many operations were (or, with ``dry_run``, would be) deleted.
        """
        check_number("older_than", older_than, integer=False, low=0, high=MAX_WINDOW)
        check_number("now", now, integer=False, low=0, high=MAX_TIMESTAMP)
        cutoff = now - older_than
        if dry_run:
            with self._snapshot():
                return self._count_prunable(cutoff)
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
                    rows = self._longest_idle(conn, cutoff, batch)
                    counts: dict[str, int] = {}
                    for start in range(0, len(rows), _SQL_VARIABLES):
                        chunk = rows[start : start + _SQL_VARIABLES]
                        marks = ", ".join("?" for _ in chunk)
                        ids = [operation_id for _, operation_id in chunk]
                        rowids = [rowid for rowid, _ in chunk]
                        # What the deleted rows counted, taken off the counts with them.
                        capped = conn.execute(
                            "SELECT count(*) FROM operations "
                            f"WHERE rowid IN ({marks}) AND cap_reason IS NOT NULL",
                            rowids,
                        ).fetchone()[0]
                        if capped:
                            _add_capped(conn, -int(capped))
                        for source, column, where, params in (
                            ("operations", "status", f"rowid IN ({marks})", rowids),
                            ("operations", "attempt1_", f"rowid IN ({marks})", rowids),
                            ("attempts", "", f"operation_id IN ({marks})", ids),
                        ):
                            _uncount(conn, counts, source, column, where, params)
                        conn.execute(f"DELETE FROM attempts WHERE operation_id IN ({marks})", ids)
                        # Audit entries go with their operation, never before it.
                        conn.execute(
                            f"DELETE FROM operation_audit WHERE operation_id IN ({marks})", ids
                        )
                        deleted += conn.execute(
                            f"DELETE FROM operations WHERE rowid IN ({marks})", rowids
                        ).rowcount
                    self._add_counts(counts)
                elapsed = max(time.perf_counter() - started, 1e-6)
                if len(rows) < batch:
                    return deleted
                self._checkpoint()
                time.sleep(elapsed * random.uniform(*_PRUNE_PAUSE))
                batch = min(largest, max(smallest, int(batch * _PRUNE_BATCH_SECONDS / elapsed)))

    def _longest_idle(
        self, conn: sqlite3.Connection, cutoff: float, batch: int
    ) -> list[tuple[int, str]]:
        """(rowid, operation_id) of up to ``batch`` finished operations idle since before
        ``cutoff``, longest idle first."""
        # One walk of operations_settled per finished status, merged: its entries are
        # in (status, updated_at) order.
        found = merge(
            *(
                conn.execute(
                    "SELECT updated_at, rowid, operation_id FROM operations "
                    f"INDEXED BY operations_settled WHERE {_SETTLED} AND status = '{status}' "
                    f"AND updated_at < ?{self._unforked()} ORDER BY updated_at LIMIT ?",
                    (cutoff, batch),
                ).fetchall()
                for status in FINISHED_STATUSES
            )
        )
        return [(rowid, operation_id) for _, rowid, operation_id in islice(found, batch)]

    def _unforked(self, table: str = "operations") -> str:
        """The WHERE clause that keeps prune off an operation a fork still links to (the
        fork goes first; its parent, no longer linked, in a later batch or prune)."""
        return (
            " AND NOT EXISTS (SELECT 1 FROM operations AS fork "
            f"WHERE fork.forked_from = {table}.operation_id)"
        )

    def _linked_prunable(self, cutoff: float) -> int:
        """How many finished operations idle since before ``cutoff`` a fork links to."""
        # From the forks (few, in their partial index) to their parents. An operation has
        # at most one fork (its fork's id is fixed, `<id>~fork<n>`): no DISTINCT, no sort.
        return int(
            self._query(
                "SELECT count(*) AS n "
                "FROM operations AS fork INDEXED BY operations_forks "
                "CROSS JOIN operations AS parent ON parent.operation_id = fork.forked_from "
                "WHERE fork.forked_from IS NOT NULL AND "
                f"{_one_of('parent.status', FINISHED_STATUSES)} AND parent.updated_at < ?",
                (cutoff,),
            )[0]["n"]
        )

    def _count_prunable(self, cutoff: float) -> int:
        """How many finished operations prune would delete: those idle since before
        ``cutoff`` (`_count_idle`), less those a fork links to (kept)."""
        return self._count_idle(cutoff) - self._linked_prunable(cutoff)

    def _count_idle(self, cutoff: float) -> int:
        """How many finished operations were idle since before ``cutoff``.

        Counts whichever side of the cutoff looks smaller in operations_settled (judged
        from its oldest and newest entries, status by status) and, for the newer side,
        subtracts from the counts: a usual window (keep the last week of months) counts
        a few entries.
        """
        counters = self._counters()
        return sum(
            self._count_older(
                "operations INDEXED BY operations_settled",
                f"{_SETTLED} AND status = '{status}'",
                counters[status],
                cutoff,
            )
            for status in FINISHED_STATUSES
        )

    def _count_older(self, finished: str, where: str, total: int, cutoff: float) -> int:
        """How many of the ``total`` entries of ``finished`` matching ``where`` have
        ``updated_at < cutoff``, counting the side of the cutoff that looks smaller."""
        older = f"SELECT count(*) AS n FROM {finished} WHERE {where} AND "
        # Two queries: SQLite answers a lone min() or max() from the index's ends.
        ends = [
            self._query(f"SELECT {end}(updated_at) AS edge FROM {finished} WHERE {where}")[0][
                "edge"
            ]
            for end in ("min", "max")
        ]
        if total == 0:
            return 0
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

    def recount(self) -> None:
        """Count the operations and attempts again from the rows, in one transaction: the
        counts follow the journal's own writes only, so after an edit by hand (the sqlite3
        shell) they may differ from the rows until this runs."""
        with self._write(durable=True) as conn:
            conn.execute(_RECOUNT)
            conn.execute(
                "INSERT OR REPLACE INTO journal_meta (name, value) "
                "SELECT ?, CAST(count(cap_reason) AS TEXT) FROM operations",
                (CAPPED_META,),
            )

    def counts(self) -> dict[str, int]:
        """Operations per status; every status is present, zero included."""
        counters = self._counters()
        return {status: counters[status] for status in STATUSES}

    # -- origin pauses (retry control, version 4) --------------------------------------

    def origin_pauses(self, *, now: float) -> list[OriginPause]:
        """The origin pauses still running at ``now``, soonest over first."""
        check_number("now", now, integer=False, low=0, high=MAX_TIMESTAMP)
        with self._snapshot():
            rows = self._query(
                "SELECT origin, credentials, until, reason, set_at FROM origin_pauses "
                "WHERE until > ? OR reason LIKE 'circuit breaker%' ORDER BY until",
                (now,),
            )
        return [OriginPause(**dict(row)) for row in rows]

    def _counters(self) -> dict[str, int]:
        """The counts each batch of writes keeps: one row, whatever the journal's size."""
        rows = self._query(f"SELECT {', '.join(_COUNTERS)} FROM journal_counts WHERE id = 1")
        values = rows[0] if rows else {}
        if len(values) != len(_COUNTERS) or not all(
            type(value) is int and value >= 0 for value in values.values()
        ):
            # The counts follow the journal's own writes: a row edited by hand (then
            # pruned, say) leaves them wrong, and a recount, not a backup, repairs that.
            raise JournalCorruptError(
                f"{self.path} holds damaged counts ({short(values)}), as after an edit of "
                f"its rows by hand; run `idempotently --journal {self.path} migrate "
                "--recount` to count them again from the rows"
            )
        # Pending operations are counted from their own index: a key's commit then
        # writes no counter page.
        values["pending"] = int(
            self._query(
                "SELECT count(*) AS n FROM operations INDEXED BY operations_pending "
                "WHERE status = 'pending'"
            )[0]["n"]
        )
        if values["unknown_status"]:
            # Name the damaged row, as a scan would have.
            self._query(
                f"SELECT {_OPERATION_COLUMNS} FROM operations "
                f"WHERE NOT {_one_of('status', STATUSES)} "
                "LIMIT 1"
            )
            raise JournalCorruptError(
                f"{self.path} counts {values['unknown_status']} operations with an unknown "
                "status but holds none; move the journal aside and restore a backup"
            )
        return values
