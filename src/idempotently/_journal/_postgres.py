"""The PostgreSQL journal store: the same operations and attempts, shared by a fleet.

``Journal("postgresql://user@host/db")`` opens one (the Journal facade picks
this store for a ``postgresql://`` or ``postgres://`` URL), so everything that
takes a journal takes it: Session, AsyncSession, Transport, the CLI. It is a
sibling of the SQLite store (``_sqlite.py``), not a kind of it: both implement
``Store`` (``_store.py``).

Its tables live in their own schema, ``idempotently``: a journal often shares
a database with the application. Each journal command is one short
transaction on a connection from a psycopg pool (``psycopg_pool.ConnectionPool``);
the async driver runs each in a worker thread, as it does for SQLite, so sync
pools serve Session and AsyncSession on asyncio and on trio alike.

Round trips: a read (``find``) is one statement, the operation joined with its
attempts; a lone write is one autocommitted statement; a batch is one
transaction, each write in a savepoint, sent as one pipeline. A named POST
answered at once costs three round trips: find, insert, record.

Durability: a batch holding a key to be made durable commits with
``synchronous_commit = on`` (the commit waits for the WAL flush) under
``durability="fsync"``, and ``off`` under ``"os"``, whatever the server's
default. Leases, statuses and verdicts commit with ``on``; a batch of attempts
alone (and the completions they carry) with ``off``: losing one to a server
crash only means a resume gets a replay from the server, which the key makes
harmless. The setting is the connection's, set once when it connects: there is
one pool for each (the ``on`` one opens its first connection at the first
write that needs it).

Counts (``counts()``, ``stats()``) are kept per write, not counted at each read
(``GROUP BY status`` takes seconds at a million operations): every write that moves
a status or journals an attempt adds its change to ``journal_counts`` in its own
transaction. One counter row would serialise every writer of a fleet on its row
lock, held through the commit's WAL flush: the table has 16 slots, each connection
writes slot ``pg_backend_pid() % 16`` and a reader sums them. A lone write adds to
its slot in its own statement; a batch sums its writes' changes in a
transaction-local setting and adds them once, in the last statement of its pipeline
(so the slot's lock is the last one any transaction takes: none waits for a slot while
holding a row another holder of that slot needs). Pending operations are counted from their
partial index, as on SQLite, so journaling a key writes no counter.
"""

from __future__ import annotations

import functools
import random
import re
import time
import urllib.parse
import uuid
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager, suppress
from heapq import merge
from itertools import islice
from typing import TYPE_CHECKING, Any, Final, cast, get_args

import attrs

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
from idempotently._commands_rare import Act, LookUpLater, SwapPause, Unpause, Write
from idempotently._exceptions import (
    ErrorContext,
    JournalCorruptError,
    JournalError,
    JournalMissingError,
    JournalVersionError,
    JournalWriteError,
)
from idempotently._journal._sqlite import _first_attempt_problem, _later_attempts_problem
from idempotently._rows import (
    CAPPED_DIGITS,
    CAPPED_META,
    DURABILITIES,
    MAX_LIMIT,
    MAX_TIMESTAMP,
    MAX_WINDOW,
    Attempt,
    AuditEntry,
    Durability,
    Failed,
    JournalStats,
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
from idempotently._vocabulary import FINISHED_STATUSES, STATUSES, Outcome, Status

if TYPE_CHECKING:
    import psycopg
    import psycopg_pool

    from idempotently._outbox_orm import OrmConnection
    from idempotently._outbox_orm import StatementError as OrmStatementError

URL_SCHEMES: Final = ("postgresql://", "postgres://")
INSTALL_HINT: Final = "pip install 'idempotently[postgres]'"

SCHEMA: Final = "idempotently"
"""The PostgreSQL schema holding the journal's tables."""
SCHEMA_VERSION: Final = 10
"""The one schema before 0.1.0, as the SQLite journal's 10: development builds wrote 1 to 3,
which this build refuses (`development_journal_error`)."""
_ADVISORY_LOCK: Final = 0x49444D50  # "IDMP", as the SQLite application_id
"""pg_advisory_xact_lock key held while the schema is created or migrated."""

_Steps = Generator[tuple[Any, Any], tuple[list[dict[str, Any]], int], Any]
"""Statements to run on an application's connection: each yields (sql, params) and
receives (rows, rowcount); the generator's value is the result."""

_POOL_MAX = 16
"""Connections per Journal: enough for an AsyncSession at concurrency 16."""
_PRUNE_BATCH = 1000
"""Operations one prune transaction deletes (rows only: other writers never wait)."""


def is_postgres_url(path: object) -> bool:
    """True for a ``postgresql://`` or ``postgres://`` URL (the journal goes to PostgreSQL)."""
    return isinstance(path, str) and path.startswith(URL_SCHEMES)


_SHOWN_URL = 200
"""The longest a URL is shown in messages and ``repr()``."""


def redact_url(url: str) -> str:
    """``url`` with any password (in the user info or a ``password=`` parameter) as ``***``."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = userinfo.partition(":")[0] + ":***@" + hosts
    query = re.sub(r"(?i)(^|&)(password)=[^&]*", r"\1\2=***", parts.query)
    # Rebuilt by hand: urlunsplit drops the "//" of a URL with an empty host.
    shown = f"{parts.scheme}://{netloc}{parts.path}"
    shown += f"?{query}" if query else ""
    shown += f"#{parts.fragment}" if parts.fragment else ""
    if len(shown) > _SHOWN_URL:
        # A URL fills a message, not a screen: its start (scheme, host) and its end.
        half = (_SHOWN_URL - 3) // 2
        shown = shown[:half] + "..." + shown[-half:]
    return shown


def _password(url: str) -> str | None:
    """The password in ``url``, decoded, so that no message can ever echo it."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        value = conninfo_to_dict(url).get("password")
    except Exception:  # a malformed URL: libpq will say so, without the password
        value = urllib.parse.urlsplit(url).password
    return str(value) if value else None


def _ddl(statuses: Sequence[str]) -> str:
    return ", ".join(f"'{status}'" for status in statuses)


_SLOTS: Final = 16
"""Rows of journal_counts: a connection adds to slot ``pg_backend_pid() % 16``, so two
connections' commits wait for one another's row lock only when their slots collide."""
_SLOT: Final = f"pg_backend_pid() %% {_SLOTS}"
"""This connection's slot, in a statement with parameters (so its % doubled)."""
_COUNTERS: Final = (
    *STATUSES,
    "unknown_status",
    "attempts",
    "answered_attempts",
    "replayed_attempts",
    "in_progress_attempts",
)
"""journal_counts' figures, as the SQLite journal's (its pending one is written by a
recount only: pending operations are counted from operations_pending)."""
_STATUS_COUNTERS: Final = tuple(status for status in STATUSES if status != "pending")
"""The statuses a write's change moves (unknown_status is written by a recount alone: the
status column's CHECK keeps every other word out)."""
_ATTEMPT_COUNTERS: Final = _COUNTERS[len(STATUSES) + 1 :]
_CHANGED: Final = _STATUS_COUNTERS + _ATTEMPT_COUNTERS
"""What a write's change is, in this order: the array `_counted` makes."""


# Columns as in the SQLite journal (timestamps in seconds since the epoch,
# bodies as bytea, headers as JSON text), so rows decode the same way. `seq`
# orders listings by creation, as SQLite's rowid does. A first attempt lives in its
# operation's row (attempt1_*), later ones in attempts; group_id, step, successor and
# cap_reason are carried NULL for the issues that come next.
_SCHEMA_DDL: Final = f"""
CREATE SCHEMA IF NOT EXISTS {SCHEMA};
CREATE TABLE {SCHEMA}.journal_meta (
    name  text PRIMARY KEY,
    value text NOT NULL
);
CREATE TABLE {SCHEMA}.operations (
    seq              bigint GENERATED ALWAYS AS IDENTITY,
    operation_id     text PRIMARY KEY,
    key              text NOT NULL UNIQUE,
    status           text NOT NULL CHECK (status IN ({_ddl(STATUSES)})),
    delivery         text NOT NULL CHECK (delivery IN ('exactly_once', 'at_most_once')),
    method           text NOT NULL,
    url              text NOT NULL,
    request_headers  text NOT NULL,
    request_body     bytea NOT NULL,
    fingerprint      text NOT NULL,
    profile          text NOT NULL,
    key_header       text NOT NULL,
    created_at       double precision NOT NULL,
    updated_at       double precision NOT NULL,
    key_expires_at   double precision NOT NULL,
    deadline_at      double precision,
    not_before       double precision,
    lease_owner      text,
    lease_until      double precision NOT NULL DEFAULT 0,
    attempt_count    integer NOT NULL DEFAULT 0,
    last_status_code integer,
    response_status  integer,
    response_headers text,
    response_body    bytea,
    reason           text,
    codec              text,
    secret_params      text,
    credentials_digest text,
    body_digest        bytea,
    overrides          text,
    forked_from        text,
    lookup_after       double precision,
    enqueued_at        double precision,
    first_send_at      double precision,
    attempt1_started_at  double precision,
    attempt1_elapsed     double precision,
    attempt1_outcome     text CHECK (attempt1_outcome IN ({_ddl(get_args(Outcome))})),
    attempt1_status_code integer,
    attempt1_replayed    integer,
    attempt1_error       text,
    attempt1_wait        double precision,
    group_id   text,
    step       integer,
    successor  text,
    cap_reason text
);
CREATE INDEX operations_by_seq ON {SCHEMA}.operations (seq);
CREATE INDEX operations_by_status ON {SCHEMA}.operations (status, seq);
CREATE INDEX operations_pending ON {SCHEMA}.operations (created_at)
    INCLUDE (lease_until, updated_at, not_before) WHERE status = 'pending';
CREATE INDEX operations_finished ON {SCHEMA}.operations (updated_at)
    WHERE status IN ({_ddl(FINISHED_STATUSES)});
CREATE INDEX operations_forks ON {SCHEMA}.operations (forked_from)
    WHERE forked_from IS NOT NULL;
CREATE INDEX operations_by_group ON {SCHEMA}.operations (group_id, step)
    WHERE group_id IS NOT NULL;
CREATE TABLE {SCHEMA}.attempts (
    operation_id text NOT NULL,
    number       integer NOT NULL CHECK (number >= 2),
    started_at   double precision NOT NULL,
    elapsed      double precision NOT NULL,
    outcome      text NOT NULL CHECK (outcome IN ({_ddl(get_args(Outcome))})),
    status_code  integer,
    replayed     integer NOT NULL DEFAULT 0,
    error        text,
    wait         double precision,
    PRIMARY KEY (operation_id, number)
);
CREATE TABLE {SCHEMA}.origin_pauses (
    origin      text NOT NULL,
    credentials text NOT NULL DEFAULT '',
    until       double precision NOT NULL,
    reason      text,
    set_at      double precision NOT NULL,
    PRIMARY KEY (origin, credentials)
);
CREATE TABLE {SCHEMA}.operation_audit (
    seq          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    operation_id text NOT NULL,
    at           double precision NOT NULL,
    actor        text NOT NULL,
    action       text NOT NULL,
    note         text,
    detail       text
);
CREATE INDEX operation_audit_by_operation ON {SCHEMA}.operation_audit (operation_id, seq);
CREATE TABLE {SCHEMA}.journal_counts (
    slot                 integer PRIMARY KEY CHECK (slot >= 0 AND slot < {_SLOTS}),
    pending              bigint NOT NULL DEFAULT 0,
    succeeded            bigint NOT NULL DEFAULT 0,
    failed               bigint NOT NULL DEFAULT 0,
    needs_reconcile      bigint NOT NULL DEFAULT 0,
    abandoned            bigint NOT NULL DEFAULT 0,
    unknown_status       bigint NOT NULL DEFAULT 0,
    attempts             bigint NOT NULL DEFAULT 0,
    answered_attempts    bigint NOT NULL DEFAULT 0,
    replayed_attempts    bigint NOT NULL DEFAULT 0,
    in_progress_attempts bigint NOT NULL DEFAULT 0
) WITH (fillfactor = 20);
INSERT INTO {SCHEMA}.journal_counts (slot) SELECT generate_series(0, {_SLOTS - 1});
"""

_NAMESPACE_READ: Final = (
    f"SELECT value, current_database() AS db FROM {SCHEMA}.journal_meta WHERE name = 'namespace'"
)
"""The journal's key namespace and the database it is read in (the outbox's proof that
an application's connection is on the journal's own database, not a copy of it)."""

_NAMESPACE_INSERT: Final = (
    f"INSERT INTO {SCHEMA}.journal_meta (name, value) VALUES ('namespace', %s)"
)
"""The journal's random key namespace: a uuid4 bound by the store, drawn by the server
(gen_random_uuid) in the script ``migrate --sql`` prints."""


@functools.cache
def _schema_parts() -> dict[str, str]:
    """Every part of `_SCHEMA_DDL` as `_CATALOG` names it (each table, each
    ``table.column``, each index, those its PRIMARY KEY and UNIQUE constraints make
    included: a journal without operations_key_key would journal a key twice), with the
    table it belongs to. What a journal at this version must have; made at the first
    open, not at import."""
    parts = {
        index: table
        for index, table in re.findall(rf"CREATE INDEX (\w+) ON {SCHEMA}\.(\w+)", _SCHEMA_DDL)
    }
    for table, body in re.findall(rf"CREATE TABLE {SCHEMA}\.(\w+) \((.*?)\n\)", _SCHEMA_DDL, re.S):
        parts[table] = table
        for line in body.strip().splitlines():
            column = line.split()[0]
            if column != "PRIMARY":
                parts[f"{table}.{column}"] = table
            if "PRIMARY KEY" in line:
                parts[f"{table}_pkey"] = table
            if " UNIQUE" in line:
                parts[f"{table}_{column}_key"] = table
    return parts


_CATALOG: Final = """
SELECT c.relname AS name, array_remove(array_agg(a.attname::text), NULL) AS columns
FROM pg_catalog.pg_class AS c
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
LEFT JOIN pg_catalog.pg_attribute AS a
    ON a.attrelid = c.oid AND c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped
WHERE n.nspname = %s AND c.relkind IN ('r', 'i')
GROUP BY c.relname
"""
"""The tables in the journal's schema, each with its columns, and its indexes: one catalog
query, which sees what committed before it (as a creator we waited for just did)."""


def development_journal_error(path: str, store: str, version: int) -> JournalVersionError:
    """The SQLite journal's refusal of a development journal, worded once."""
    from idempotently._journal._sqlite import development_journal_error as refusal

    return refusal(path, store, version)


def upgrade_statements(version: int) -> list[str]:
    """Every statement from schema ``version`` (0: no journal) to SCHEMA_VERSION, in order:
    what opening the journal to write runs, in one transaction under the advisory lock."""
    statements = []
    if version == 0:
        statements += [_SCHEMA_DDL, _NAMESPACE_INSERT]
    statements.append(
        f"INSERT INTO {SCHEMA}.journal_meta (name, value) "
        f"VALUES ('schema_version', '{SCHEMA_VERSION}') "
        "ON CONFLICT (name) DO UPDATE SET value = excluded.value"
    )
    return statements


def migration_sql(version: int, path: str = "the journal") -> str:
    """The script that brings a PostgreSQL journal from ``version`` (0: a database without
    one) to this version, for applications that run their own migrations: one
    transaction, under the advisory lock every opener takes."""
    if version >= SCHEMA_VERSION:
        return f"-- The journal is at schema version {version}: nothing to do.\n"
    if version > 0:
        raise development_journal_error(path, "PostgreSQL", version)
    lines = [
        f"-- idempotently journal (PostgreSQL, schema {SCHEMA}): version {version} to "
        f"{SCHEMA_VERSION}.",
        "BEGIN;",
        f"SELECT pg_advisory_xact_lock({_ADVISORY_LOCK});",
    ]
    for statement in upgrade_statements(version):
        if statement == _NAMESPACE_INSERT:
            statement = statement.replace("%s", "gen_random_uuid()::text")
        lines.append(re.sub(r"(?m)^    ", "", statement).strip().rstrip(";") + ";")
    lines.append("COMMIT;")
    return "\n".join(lines) + "\n"


_OPERATION_COLUMNS: Final = tuple(
    field.name
    for field in attrs.fields(Operation)
    if field.name != "attempts" and field.metadata.get("column", True)
)
_SELECT_OPERATION: Final = ", ".join(_OPERATION_COLUMNS)
_ATTEMPT1: Final = tuple(
    f"attempt1_{name}"
    for name in ("started_at", "elapsed", "outcome", "status_code", "replayed", "error", "wait")
)
"""The columns holding an operation's first attempt (its later ones are rows of attempts)."""
_FINISHED_SQL: Final = f"status IN ({_ddl(FINISHED_STATUSES)})"

_INSERT_OPERATION: Final = f"""
INSERT INTO {SCHEMA}.operations (
    operation_id, key, status, delivery, method, url, request_headers, request_body,
    fingerprint, profile, key_header, created_at, updated_at, key_expires_at, deadline_at,
    lease_owner, lease_until, enqueued_at, first_send_at,
    codec, secret_params, credentials_digest,
    overrides, body_digest
) VALUES (%s, %s, 'pending', %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,
    %s, %s, %s, %s, %s)
ON CONFLICT DO NOTHING
"""

# Operation groups (``_flow/_groups.py``), as the SQLite journal's: a step's place is the
# group's next one, and a live call's insert waits for every step already in the group
# to have succeeded, in the same statement. Two inserts into one group are serialised by
# a transaction-scoped advisory lock taken by the statement before (`_LOCK_GROUP`): each
# statement then reads the other's committed row (read committed), so no two steps share
# a place.
_INSERT_STEP: Final = (
    _INSERT_OPERATION.replace(
        "overrides, body_digest\n)", "overrides, body_digest, group_id, step\n)"
    )
    .replace("VALUES (%s, %s, 'pending',", "SELECT %s, %s, 'pending',")
    .replace(
        "%s, %s, %s, %s, %s)\nON CONFLICT",
        "%s, %s, %s, %s, %s, %s::text,\n"
        f"    (SELECT coalesce(max(step), 0) + 1 FROM {SCHEMA}.operations WHERE group_id = %s)\n"
        f"WHERE NOT %s OR NOT EXISTS (SELECT 1 FROM {SCHEMA}.operations WHERE group_id = %s\n"
        "    AND status != 'succeeded' AND successor IS NULL)\nON CONFLICT",
    )
)
_LOCK_GROUP: Final = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 7041))"
_EARLIER_UNSETTLED: Final = (
    f" AND NOT EXISTS (SELECT 1 FROM {SCHEMA}.operations AS earlier"
    " WHERE earlier.group_id = %(group_id)s AND earlier.step < %(step)s"
    " AND earlier.status != 'succeeded' AND earlier.successor IS NULL)"
)
"""A group step's lease is taken only while every earlier step has succeeded: appended to
`_TAKE_LEASE`, one statement (a settled step never becomes unsettled, so no lock)."""


def _locks_group(write: Write) -> bool:
    """A write that takes its group's lock first: two statements, so a transaction."""
    return isinstance(write, (Insert, Enqueue)) and write.new.group_id is not None


def _insert_step(new: NewOperation, owner: str | None, lease_until: float) -> tuple[Any, ...]:
    return (*new.row(owner, lease_until), new.group_id, new.group_id, new.in_order, new.group_id)


# As the SQLite journal's: the lease to send is taken here, so an enqueued operation's
# first send begins with it (first_send_at, and its key's lifetime from now).
_TAKE_LEASE: Final = f"""
UPDATE {SCHEMA}.operations SET lease_owner = %(owner)s, lease_until = %(lease_until)s,
    updated_at = %(now)s,
    key_expires_at = CASE WHEN first_send_at IS NULL AND enqueued_at IS NOT NULL
                          THEN %(now)s + (key_expires_at - created_at) ELSE key_expires_at END,
    first_send_at = coalesce(first_send_at,
                             CASE WHEN enqueued_at IS NOT NULL THEN %(now)s END)
WHERE operation_id = %(operation_id)s AND status = 'pending'
  AND lease_until = %(read_until)s AND lease_owner IS NOT DISTINCT FROM %(read_owner)s::text
  AND updated_at = %(read_at)s::double precision AND attempt_count = %(read_attempts)s::integer
"""
"""The lease taken on the row as it was read (as the SQLite journal's: a row changed since
the read fails the swap, and the reader reads it again)."""


# -- counts: each write's change, in its own statement ---------------------------------


def _moved_by(status: str) -> str:
    """SQL: what the count of ``status`` changes by over rows of ``changes`` whose status
    went from ``before`` to ``after`` (NULL: no row, as for a deleted one)."""
    return f"count(after = '{status}' OR NULL) - count(before = '{status}' OR NULL)"


def _compact(sql: str) -> str:
    """``sql`` without comments and runs of white space: psycopg parses a statement longer
    than 4 KB again at every call (it caches shorter ones), which Record's would be."""
    return " ".join(re.sub(r"--[^\n]*", "", sql).split())


_NOTED: Final = "idempotently.counts"
"""The transaction-local setting in which a batch's writes add up their count changes
(a savepoint rolled back takes its write's change back with it)."""
_NOTED_SO_FAR: Final = (
    f"string_to_array(nullif(current_setting('{_NOTED}', true), ''), ',')::bigint[]"
)
_NO_CHANGE: Final = "'{" + ",".join("0" for _ in _CHANGED) + "}'::bigint[]"


def _counted(changes: str) -> str:
    """The CTEs ``delta`` (``v``: the change of each of `_CHANGED`, from ``changes``, a
    query of rows ``before, after, attempts, answered_attempts, replayed_attempts,
    in_progress_attempts``), ``counted``, which adds it to this connection's slot when
    ``%(here)s`` (a lone write), and ``noted``, which adds it to the batch's sum in
    `_NOTED` when not (`_ADD_NOTED` writes that once, at the batch's end). The main
    query must read ``noted`` (`_NOTED_READ`): a CTE that only reads runs when read."""
    sums = [_moved_by(name) for name in _STATUS_COUNTERS] + [
        f"coalesce(sum({name}), 0)" for name in _ATTEMPT_COUNTERS
    ]
    added = ", ".join(f"{name} = c.{name} + v[{index + 1}]" for index, name in enumerate(_CHANGED))
    return f"""delta AS (
    SELECT ARRAY[{", ".join(sums)}]::bigint[] AS v FROM ({changes}) AS changes
), counted AS (
    UPDATE {SCHEMA}.journal_counts AS c SET {added}
    FROM delta WHERE c.slot = {_SLOT} AND %(here)s AND v <> {_NO_CHANGE}
), noted AS (
    SELECT set_config('{_NOTED}', array_to_string(ARRAY(
        SELECT a + b FROM unnest(coalesce({_NOTED_SO_FAR}, {_NO_CHANGE}), v)
            WITH ORDINALITY AS t(a, b, n) ORDER BY n), ','), true)
    FROM delta WHERE NOT %(here)s
)"""


_COUNTING: Final = (Record, SetStatus, Act)
"""The writes that may change the counts (a status moved, an attempt journaled)."""
_NOTED_READ: Final = "(SELECT count(*) FROM noted) AS noted"
_ADD_NOTED: Final = (
    f"UPDATE {SCHEMA}.journal_counts AS c SET "
    + ", ".join(f"{name} = c.{name} + noted.a[{index + 1}]" for index, name in enumerate(_CHANGED))
    + f" FROM (SELECT {_NOTED_SO_FAR} AS a) AS noted"
    + f" WHERE c.slot = pg_backend_pid() % {_SLOTS} AND noted.a <> {_NO_CHANGE}"
)
"""A batch's count changes (`_NOTED`), added to its connection's slot once, at its end,
in the same pipeline as its writes: the slot's lock is the last one the batch takes."""
_SLOT_ROWS: Final = (
    f"INSERT INTO {SCHEMA}.journal_counts (slot) SELECT generate_series(0, {_SLOTS - 1}) "
    "ON CONFLICT (slot) DO NOTHING"
)
"""The 16 slots, wherever one was deleted by hand (a recount writes them all again)."""


def _attempt_figures(prefix: str, sign: str = "") -> str:
    """SQL: the attempt counters of an attempt held in columns ``prefix + "outcome"``
    etc. ("attempt1_" for a first attempt, "" for a row of attempts), as a change of
    the counts (``sign`` "-": taken off)."""
    return (
        f"{sign}({prefix}outcome IS NOT NULL)::int AS attempts, "
        f"{sign}({prefix}status_code IS NOT NULL)::int AS answered_attempts, "
        f"{sign}coalesce({prefix}replayed, 0) AS replayed_attempts, "
        f"{sign}coalesce({prefix}status_code IN (409, 423), false)::int AS in_progress_attempts"
    )


_COUNTS: Final = (
    "SELECT count(*) AS slots, "
    + ", ".join(f"sum({name}) AS {name}" for name in _COUNTERS if name != "pending")
    + f", (SELECT count(*) FROM {SCHEMA}.operations WHERE status = 'pending') AS pending "
    f"FROM {SCHEMA}.journal_counts"
)
"""Every count: the 16 slots summed (a slot alone may be negative: a prune takes off
its slot what others added), pending operations from operations_pending."""

# The counts, from the rows (`idempotently migrate --recount`): slot 0 gets the totals,
# the others zero. Updated in place, never deleted and inserted: a writer waiting for
# the table's lock then adds its change to the recounted row.
_RECOUNT: Final = f"""
UPDATE {SCHEMA}.journal_counts AS c
SET {", ".join(f"{name} = CASE WHEN c.slot = 0 THEN t.{name} ELSE 0 END" for name in _COUNTERS)}
FROM (
    SELECT s.*, o.attempts + a.attempts AS attempts,
           o.answered_attempts + a.answered_attempts AS answered_attempts,
           o.replayed_attempts + a.replayed_attempts AS replayed_attempts,
           o.in_progress_attempts + a.in_progress_attempts AS in_progress_attempts
    FROM (
        SELECT {
    ", ".join(f"count(*) FILTER (WHERE status = '{name}') AS {name}" for name in STATUSES)
},
               count(*) FILTER (WHERE status NOT IN ({_ddl(STATUSES)})) AS unknown_status
        FROM {SCHEMA}.operations
    ) AS s, (
        SELECT count(attempt1_outcome) AS attempts,
               count(attempt1_status_code) AS answered_attempts,
               coalesce(sum(attempt1_replayed), 0) AS replayed_attempts,
               count(*) FILTER (WHERE attempt1_status_code IN (409, 423)) AS in_progress_attempts
        FROM {SCHEMA}.operations
    ) AS o, (
        SELECT count(*) AS attempts, count(status_code) AS answered_attempts,
               coalesce(sum(replayed), 0) AS replayed_attempts,
               count(*) FILTER (WHERE status_code IN (409, 423)) AS in_progress_attempts
        FROM {SCHEMA}.attempts
    ) AS a
) AS t
"""


def _if_held(column: str, value: str) -> str:
    """``column`` set to ``value`` where the caller holds the lease (`before`), else as it was."""
    return f"{column} = CASE WHEN held THEN {value} ELSE {column} END"


def _if_first(column: str, value: str) -> str:
    """``column`` set to ``value`` by an operation's first attempt (attempt_count is the
    value before this UPDATE), else as it was."""
    return f"{column} = CASE WHEN attempt_count = 0 THEN {value} ELSE {column} END"


_FIRST_ATTEMPT: Final = ",\n        ".join(
    (
        _if_first("attempt1_started_at", "%(started_at)s::float8"),
        _if_first("attempt1_elapsed", "%(elapsed)s::float8"),
        _if_first(
            "attempt1_outcome",
            "CASE WHEN attempt1_outcome IS NULL THEN %(outcome)s::text "
            "ELSE 'attempt_count lowered by hand' END",
        ),
        _if_first("attempt1_status_code", "%(status_code)s::int"),
        _if_first("attempt1_replayed", "%(replayed)s::int"),
        _if_first("attempt1_error", "%(error)s::text"),
        _if_first("attempt1_wait", "%(wait)s::float8"),
    )
)

# A first attempt is journaled in its operation's row by the UPDATE that sets the state
# after it (the common call: one row written); a later one is a row of attempts, whose
# number is the attempt_count the UPDATE returns (the row is locked first: two writers
# can never both claim number n). A row whose attempt_count was lowered by hand to 0
# while its first attempt is journaled would have it overwritten: its outcome is set to
# a word attempt1_outcome's CHECK refuses instead, so the write fails as a corrupt row.
#
# The counts need the status the state moved from, and RETURNING sees new values only:
# `before` reads it, and whether the caller holds the lease, under the row's lock first
# (the newest row version, which the UPDATE then writes: nothing moves in between).
_RECORD_ATTEMPT: Final = _compact(f"""
WITH before AS (
    SELECT status AS old_status, (%(owner)s::text IS NULL
        OR (status = 'pending' AND lease_owner = %(owner)s::text)) AS held
    FROM {SCHEMA}.operations WHERE operation_id = %(operation_id)s FOR NO KEY UPDATE
), op AS (
    UPDATE {SCHEMA}.operations SET
        attempt_count = attempt_count + 1,
        {_if_held("updated_at", "%(now)s::float8")},
        {_if_held("status", "%(status)s::text")},
        {_if_held("reason", "%(reason)s::text")},
        {_if_held("not_before", "%(not_before)s::float8")},
        {_if_held("last_status_code", "coalesce(%(status_code)s::int, last_status_code)")},
        {_if_held("response_status", "%(response_status)s::int")},
        {_if_held("response_headers", "%(response_headers)s::text")},
        {_if_held("response_body", "%(response_body)s::bytea")},
        {_if_held("lease_until", "%(lease_until)s::float8")},
        lease_owner = CASE WHEN held AND %(lease_until)s::float8 <= 0 THEN NULL
                           ELSE lease_owner END,
        {_FIRST_ATTEMPT}
    FROM before WHERE operation_id = %(operation_id)s
    RETURNING operation_id, attempt_count, old_status,
        CASE WHEN held THEN %(status)s::text ELSE old_status END AS new_status
), attempted AS (
    INSERT INTO {SCHEMA}.attempts (
        operation_id, number, started_at, elapsed, outcome, status_code, replayed, error, wait
    ) SELECT operation_id, attempt_count, %(started_at)s, %(elapsed)s, %(outcome)s,
             %(status_code)s::int, %(replayed)s, %(error)s::text, %(wait)s::float8
    FROM op WHERE attempt_count > 1
), {
    _counted(
        "SELECT old_status AS before, new_status AS after, 1 AS attempts, "
        "(%(status_code)s::int IS NOT NULL)::int AS answered_attempts, "
        "%(replayed)s::int AS replayed_attempts, "
        "coalesce(%(status_code)s::int IN (409, 423), false)::int AS in_progress_attempts "
        "FROM op"
    )
}
SELECT {_NOTED_READ}
""")


_COUNTED: Final = f"^[0-9]{{1,{CAPPED_DIGITS}}}$"
"""A `CAPPED_META` value the writes add to: one that ::bigint can read (a damaged one,
past its range too, is left for stats to name, never the error of the write that caps)."""


def _capped_once(source: str) -> str:
    """A CTE adding one to the `CAPPED_META` count for each row of ``source`` (an
    operation that reached its cap for the first time)."""
    return (
        f"capped AS (INSERT INTO {SCHEMA}.journal_meta (name, value) "
        f"SELECT '{CAPPED_META}', count(*)::text FROM {source} HAVING count(*) > 0 "
        "ON CONFLICT (name) DO UPDATE SET value = "
        f"({SCHEMA}.journal_meta.value::bigint + excluded.value::bigint)::text "
        f"WHERE {SCHEMA}.journal_meta.value ~ '{_COUNTED}')"
    )


def _with_cte(statement: str, cte: str) -> str:
    """``statement`` (WITH ... SELECT ...) with ``cte`` added last among its CTEs."""
    head, tail = statement.rsplit(" SELECT ", 1)
    return f"{head}, {cte} SELECT {tail}"


_CAPPED_RECORD: Final = _with_cte(
    _RECORD_ATTEMPT.replace(
        "attempt_count = attempt_count + 1,",
        "attempt_count = attempt_count + 1, "
        + _if_held("cap_reason", "%(cap_reason)s::text")
        + ",",
        1,
    ).replace(
        "SELECT status AS old_status,",
        "SELECT status AS old_status, cap_reason IS NULL AS uncapped,",
        1,
    ),
    _capped_once("before WHERE held AND uncapped"),
)
"""`_RECORD_ATTEMPT` for the attempt that brings its operation to ``max_total_attempts``:
the reason written with the state (another statement, so the common one binds nothing more)."""

_ATTEMPT_COLUMNS: Final = tuple(field.name for field in attrs.fields(Attempt))
_ATTEMPTS_JOINED: Final = f"""
SELECT {", ".join(f"o.{column}" for column in (*_OPERATION_COLUMNS, *_ATTEMPT1))},
       {", ".join(f"a.{column}" for column in _ATTEMPT_COLUMNS)}
FROM {{operations}} AS o LEFT JOIN {SCHEMA}.attempts AS a ON a.operation_id = o.operation_id
ORDER BY {{order}}a.number
"""
"""Operations with their attempts in one statement: a row per attempt (the operation's
columns repeated), or one with NULL attempt columns; _with_attempts decodes them."""

# The row with this id, else the one with this key (ids first: false sorts first).
_FIND_ROW: Final = f"""(
    SELECT {{columns}} FROM {SCHEMA}.operations
    WHERE operation_id = %(operation_id)s::text OR key = %(key)s::text
    ORDER BY operation_id IS DISTINCT FROM %(operation_id)s::text
    LIMIT 1
)"""
_FIND: Final = _ATTEMPTS_JOINED.format(
    operations=_FIND_ROW.format(columns=", ".join((*_OPERATION_COLUMNS, *_ATTEMPT1))),
    order="",
)

_QUEUE: Final = _ATTEMPTS_JOINED.format(
    operations=f"""(
    SELECT {", ".join((*_OPERATION_COLUMNS, *_ATTEMPT1))}, seq FROM {SCHEMA}.operations
    WHERE status = ANY(%(statuses)s::text[])
)""",
    order="o.seq, ",
)
"""What resume works through, oldest first, each operation with its attempts: one
statement (`PostgresStore.queue`)."""

# Every time a pending row holds is written with its updated_at, by one clock: moved by
# the same amount, they all keep their length from that write. An unleased row's
# lease_until stays 0.
_REBASE_TIMES: Final = f"""
UPDATE {SCHEMA}.operations SET not_before = %(now)s + (not_before - updated_at),
    lease_until = CASE WHEN lease_until > 0 THEN %(now)s + (lease_until - updated_at)
                       ELSE lease_until END,
    updated_at = %(now)s
WHERE status = 'pending' AND updated_at > %(ahead)s"""
"""Every pending row written by a clock ahead of ours, counted from our now."""

_CLAIM_DUE: Final = f"""
WITH due AS (
    SELECT operation_id FROM {SCHEMA}.operations
    WHERE status = 'pending' AND lease_until <= %(now)s AND coalesce(not_before, 0) <= %(now)s
      AND (group_id IS NULL OR NOT EXISTS (
          SELECT 1 FROM {SCHEMA}.operations AS earlier
          WHERE earlier.group_id = operations.group_id AND earlier.step < operations.step
            AND earlier.successor IS NULL
            AND earlier.status IN ('pending', 'needs_reconcile')))
    ORDER BY created_at
    LIMIT %(limit)s
    FOR NO KEY UPDATE SKIP LOCKED
), claimed AS (
    UPDATE {SCHEMA}.operations AS o
    SET lease_owner = %(owner)s, lease_until = %(lease_until)s, updated_at = %(now)s
    FROM due WHERE o.operation_id = due.operation_id
    RETURNING {", ".join(f"o.{column}" for column in (*_OPERATION_COLUMNS, *_ATTEMPT1))}, o.seq
)
""" + _ATTEMPTS_JOINED.format(operations="claimed", order="o.created_at, o.seq, ")

# An operation a fork links to is kept (the fork goes first); audit entries go with
# their operation.
_PRUNE: Final = _compact(f"""
WITH doomed AS (
    SELECT operation_id FROM {SCHEMA}.operations
    WHERE {_FINISHED_SQL} AND updated_at < %(cutoff)s
      AND NOT EXISTS (SELECT 1 FROM {SCHEMA}.operations AS fork
                      WHERE fork.forked_from = {SCHEMA}.operations.operation_id)
    ORDER BY updated_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), attempts_gone AS (
    DELETE FROM {SCHEMA}.attempts WHERE operation_id IN (SELECT operation_id FROM doomed)
    RETURNING outcome, status_code, replayed
), audit_gone AS (
    DELETE FROM {SCHEMA}.operation_audit WHERE operation_id IN (SELECT operation_id FROM doomed)
), gone AS (
    DELETE FROM {SCHEMA}.operations WHERE operation_id IN (SELECT operation_id FROM doomed)
    RETURNING status, attempt1_outcome, attempt1_status_code, attempt1_replayed, cap_reason
), uncapped AS (
    UPDATE {SCHEMA}.journal_meta
    SET value = (value::bigint - (SELECT count(*) FROM gone WHERE cap_reason IS NOT NULL))::text
    WHERE name = '{CAPPED_META}' AND value ~ '{_COUNTED}'
      AND EXISTS (SELECT 1 FROM gone WHERE cap_reason IS NOT NULL)
), {
    _counted(
        f"SELECT status AS before, NULL::text AS after, {_attempt_figures('attempt1_', '-')} "
        "FROM gone UNION ALL "
        f"SELECT NULL, NULL, {_attempt_figures('', '-')} FROM attempts_gone"
    )
}
SELECT count(*) AS deleted FROM gone
""")

# -- the operator's journal: an action, a lookup's backoff, audit entries -------------

# One statement (pipelined like every write): the compare-and-swap on the row as read,
# the fork and the audit entries; nothing of it if the row changed or the fork is taken.
_ACT: Final = _compact(f"""
WITH free AS (
    SELECT 1 WHERE %(fork_id)s::text IS NULL OR NOT EXISTS (
        SELECT 1 FROM {SCHEMA}.operations
        WHERE operation_id = %(fork_id)s::text OR key = %(fork_key)s::text
    )
), acted AS (
    UPDATE {SCHEMA}.operations SET
        status = %(status)s, reason = %(reason)s::text, updated_at = %(now)s,
        not_before = CASE WHEN %(due_now)s THEN NULL ELSE not_before END,
        lookup_after = CASE WHEN %(due_now)s THEN NULL ELSE lookup_after END,
        response_status = CASE WHEN %(responds)s THEN %(response_status)s::integer
                               ELSE response_status END,
        response_headers = CASE WHEN %(responds)s THEN %(response_headers)s::text
                                ELSE response_headers END,
        response_body = CASE WHEN %(responds)s THEN %(response_body)s::bytea
                             ELSE response_body END,
        lease_owner = NULL, lease_until = 0,
        -- A forked group step's fork takes its place in the group (the link journaled).
        successor = CASE WHEN group_id IS NOT NULL AND %(fork_id)s::text IS NOT NULL
                         THEN %(fork_id)s::text ELSE successor END
    WHERE operation_id = %(operation_id)s AND status = %(expect_status)s
      AND lease_owner IS NOT DISTINCT FROM %(expect_owner)s::text
      AND lease_until = %(expect_lease_until)s AND updated_at = %(expect_updated_at)s
      AND EXISTS (SELECT 1 FROM free)
    RETURNING operation_id
), forked AS (
    INSERT INTO {SCHEMA}.operations (
        operation_id, key, status, delivery, method, url, request_headers, request_body,
        fingerprint, profile, key_header, created_at, updated_at, key_expires_at, deadline_at,
        lease_owner, lease_until, forked_from, enqueued_at,
        codec, secret_params, credentials_digest, overrides, body_digest, group_id, step
    ) SELECT %(fork_id)s, %(fork_key)s, 'pending', %(fork_delivery)s, %(fork_method)s,
             %(fork_url)s, %(fork_headers)s, %(fork_body)s, %(fork_fingerprint)s,
             %(fork_profile)s, %(fork_key_header)s, %(now)s, %(now)s, %(fork_expires_at)s,
             NULL, NULL, 0, acted.operation_id, %(now)s,
             -- The same bytes mean the same encoding: what describes them goes along.
             parent.codec, parent.secret_params, parent.credentials_digest, parent.overrides,
             parent.body_digest, parent.group_id, parent.step
    FROM acted JOIN {SCHEMA}.operations AS parent ON parent.operation_id = acted.operation_id
    WHERE %(fork_id)s::text IS NOT NULL
    RETURNING operation_id
), audited AS (
    INSERT INTO {SCHEMA}.operation_audit (operation_id, at, actor, action, note, detail)
    SELECT entry.operation_id, %(now)s, entry.actor, entry.action, entry.note, entry.detail
    FROM acted, unnest(%(audit_ids)s::text[], %(audit_actors)s::text[],
                       %(audit_actions)s::text[], %(audit_notes)s::text[],
                       %(audit_details)s::text[])
         AS entry(operation_id, actor, action, note, detail)
    RETURNING seq
), {
    _counted(
        "SELECT %(expect_status)s::text AS before, %(status)s::text AS after, 0 AS attempts, "
        "0 AS answered_attempts, 0 AS replayed_attempts, 0 AS in_progress_attempts FROM acted"
    )
}
SELECT (SELECT count(*) FROM acted) AS applied, (SELECT count(*) FROM forked) AS forks,
       (SELECT count(*) FROM audited) AS entries, {_NOTED_READ}
""")

_SET_STATUS: Final = _compact(f"""
WITH moved AS (
    UPDATE {SCHEMA}.operations SET status = %(status)s, reason = %(reason)s::text,
        updated_at = %(now)s, lease_owner = NULL, lease_until = 0
    WHERE operation_id = %(operation_id)s AND status = %(expect)s
    RETURNING operation_id
), {
    _counted(
        "SELECT %(expect)s::text AS before, %(status)s::text AS after, 0 AS attempts, "
        "0 AS answered_attempts, 0 AS replayed_attempts, 0 AS in_progress_attempts FROM moved"
    )
}
SELECT (SELECT count(*) FROM moved) AS applied, {_NOTED_READ}
""")

_STOPPED_STATUS: Final = _SET_STATUS.replace(
    "WHERE operation_id = %(operation_id)s AND status = %(expect)s",
    "WHERE operation_id = %(operation_id)s AND status = %(expect)s AND first_send_at IS NULL"
    f" AND EXISTS (SELECT 1 FROM {SCHEMA}.operations AS halted"
    " WHERE halted.operation_id = %(stopped_at)s AND halted.status IN ('failed', 'abandoned')"
    " AND halted.successor IS NULL)",
    1,
)
"""A stopped group's never-sent step settled abandoned, as SQLite's `_STILL_STOPPED`."""

_CAPPED_STATUS: Final = _with_cte(
    _SET_STATUS.replace(
        "lease_owner = NULL, lease_until = 0",
        "lease_owner = NULL, lease_until = 0, cap_reason = %(cap_reason)s::text",
        1,
    ).replace(
        "WITH moved AS (",
        f"WITH was AS (SELECT cap_reason IS NULL AS uncapped FROM {SCHEMA}.operations "
        "WHERE operation_id = %(operation_id)s), moved AS (",
        1,
    ),
    _capped_once("moved, was WHERE was.uncapped"),
)
"""`_SET_STATUS` for a move made for the policy's ``max_total_attempts``."""

_LOOK_UP_LATER: Final = f"""
WITH later AS (
    UPDATE {SCHEMA}.operations SET lookup_after = %(lookup_after)s
    WHERE operation_id = %(operation_id)s AND status = 'needs_reconcile'
    RETURNING operation_id
), audited AS (
    INSERT INTO {SCHEMA}.operation_audit (operation_id, at, actor, action, note, detail)
    SELECT operation_id, %(now)s, %(actor)s, %(action)s, %(note)s::text, %(detail)s::text
    FROM later
    RETURNING seq
)
SELECT (SELECT count(*) FROM later) AS applied, (SELECT count(*) FROM audited) AS entries
"""

_AUDIT: Final = (
    f"SELECT seq, operation_id, at, actor, action, note, detail FROM {SCHEMA}.operation_audit "
    "WHERE operation_id = %s ORDER BY seq"
)


# What to do, by SQLSTATE (or by kind of failure).
_ADVICE: Final = {
    "28P01": "authentication failed: check the user and password in the URL",
    "28000": "the server refused this user: check the user in the URL and pg_hba.conf",
    "3D000": "the database does not exist: create it (createdb) or fix the URL",
    "42501": f"the user lacks a privilege: grant it USAGE on schema {SCHEMA} and SELECT, "
    "INSERT, UPDATE, DELETE on its tables (and, to create the journal, CREATE on the "
    "database, or let a user that has it open the journal once)",
    "55P03": "another transaction held a lock past busy_timeout: look for a stuck session "
    "(pg_stat_activity), or raise busy_timeout",
    "57014": "a statement ran past busy_timeout: look for a stuck session (pg_stat_activity), "
    "or raise busy_timeout",
    "25006": "the journal was opened read-only (or the server is a read-only standby): open it "
    "without readonly=True, on the primary",
    "53300": "the server has no connection slot left: raise max_connections or use fewer pools",
    "pool": "no connection to the server became free within busy_timeout: check the server is "
    "up and reachable from here",
    "connect": "cannot reach the server: check it is running and the host and port in the URL",
    "other": "check the server's log",
}

_CONNECT_MESSAGES: Final = (
    ("password authentication failed", "28P01"),
    ("no password supplied", "28P01"),
    ("no pg_hba.conf entry", "28000"),
    ("does not exist", "3D000"),
    ("too many clients", "53300"),
)


def _problem(error: Exception) -> str:
    import psycopg_pool

    if isinstance(error, psycopg_pool.PoolTimeout):
        return "pool"
    sqlstate = getattr(error, "sqlstate", None)
    if sqlstate in _ADVICE:
        return str(sqlstate)
    message = str(error)
    # A failed connection carries no SQLSTATE: libpq's message says what went wrong.
    for text, problem in _CONNECT_MESSAGES if sqlstate is None else ():
        if text in message:
            return problem
    if sqlstate is None and ("connection" in message or "server" in message):
        return "connect"
    return "other"


def _orm_given(connection: object) -> bool:
    """Whether ``connection`` is a SQLAlchemy or Django object (the outbox's ORM room)."""
    from idempotently import _outbox_orm

    return _outbox_orm.is_orm(connection)


def _ids(new: NewOperation | None) -> ErrorContext:
    """The ids an outbox error names: the operation's, when there is one."""
    return {} if new is None else {"operation_id": new.operation_id, "key": new.key}


def _psycopg() -> tuple[Any, Any]:
    try:
        import psycopg
        import psycopg_pool
    except ImportError as error:
        raise JournalError(
            "a PostgreSQL journal needs psycopg 3 and psycopg_pool, which are not installed; "
            f"run: {INSTALL_HINT}"
        ) from error
    return psycopg, psycopg_pool


_DEADLOCK_TRIES: Final = 5
"""Times a transaction the server ended as a deadlock's victim is run in all."""


def _roll_back(conn: psycopg.Connection[Any]) -> None:
    """End a transaction left open by a failure, so the pool gets the connection idle."""
    from psycopg.pq import TransactionStatus

    if not conn.closed and conn.pgconn.transaction_status != TransactionStatus.IDLE:
        with suppress(Exception):
            conn.execute(b"ROLLBACK")


def _first_error(error: Exception) -> Exception:
    """The error a failed pipeline stopped at, not the "pipeline aborted" of what followed it
    (psycopg may raise that one while fetching the rest, with the first as its context)."""
    import psycopg

    while isinstance(error, psycopg.errors.PipelineAborted) and isinstance(
        error.__context__, Exception
    ):
        error = error.__context__
    return error


class PostgresStore:
    """The journal in a PostgreSQL database (schema ``idempotently``); shared by many processes.

    Open it as ``Journal("postgresql://user@host:5432/db")``: the same options
    and methods as the SQLite journal. ``path`` is the URL with its password
    replaced by ``***``; it is what every message and repr shows.
    """

    def __init__(
        self,
        path: str,
        *,
        create: bool = True,
        readonly: bool = False,
        busy_timeout: float = 30.0,
        durability: Durability = "fsync",
    ) -> None:
        """Connect, and create (or upgrade) the schema unless ``create=False`` or ``readonly``.

        ``busy_timeout`` bounds every wait: for a row lock (``lock_timeout``),
        a statement (``statement_timeout``), and a free connection of the pool.
        ``readonly=True`` sets ``default_transaction_read_only``: nothing is
        ever written. ``durability`` is ``synchronous_commit`` for the row
        naming a key: ``"fsync"`` on, ``"os"`` off.
        """
        if not is_postgres_url(path):
            raise ValueError("a PostgreSQL journal needs a postgresql:// or postgres:// URL")
        check_number("busy_timeout", busy_timeout, integer=False, low=0, high=MAX_WINDOW)
        if durability not in DURABILITIES:
            raise ValueError(
                f"durability must be one of {', '.join(map(repr, DURABILITIES))}, "
                f"not {durability!r}"
            )
        self.path = redact_url(path)
        self.durability = durability
        self.readonly = readonly
        self._create = create and not readonly
        self._busy_timeout = busy_timeout
        self._version = SCHEMA_VERSION
        self._namespace: uuid.UUID | None = None
        self._database: str | None = None
        self._secret = _password(path)
        pg, pool_module = _psycopg()
        from psycopg.rows import dict_row

        self._url = path
        # lock_timeout = 0 would mean "wait forever": the shortest wait instead.
        timeout_ms = max(1, int(busy_timeout * 1000))
        options = {"autocommit": True, "row_factory": dict_row}
        settings = [
            f"SET lock_timeout = {timeout_ms}",
            f"SET statement_timeout = {timeout_ms}",
            "SET application_name = 'idempotently'",
        ]
        if readonly:
            settings.append("SET default_transaction_read_only = on")
        self._settings = settings
        connect_timeout = {"connect_timeout": max(2, int(busy_timeout) or 2)}
        self._connect_options = {**options, **connect_timeout}
        try:
            first = pg.connect(path, **options, **connect_timeout)
        except pg.Error as error:
            raise self._error("cannot open the journal", error, JournalError) from None
        try:
            self._configure(first)
            self._check_schema_on(first)
        except pg.Error as error:
            raise self._error("cannot open the journal", error, JournalError) from None
        finally:
            first.close()
        # Two pools, one per synchronous_commit, each set once per connection: a lone
        # write then runs as one autocommitted statement, one round trip, on a
        # connection whose commit already waits (or not) for the WAL flush. Setting it
        # per write instead costs a second round trip, or a pipeline that measured
        # 2.6x the CPU of the bare statement (docs/performance.md).
        self._pool: psycopg_pool.ConnectionPool[Any] = self._open_pool(pool_module, False)
        """Reads, and the writes that need no flush (attempts; keys under "os")."""
        try:
            # No connection until the first flushed write: a reader never opens one.
            self._flushed_pool: psycopg_pool.ConnectionPool[Any] = self._open_pool(
                pool_module, True
            )
            """Keys under "fsync", leases, statuses, verdicts: commits wait for the flush."""
        except BaseException:
            self._pool.close()
            raise

    def _open_pool(self, pool_module: Any, synchronous: bool) -> psycopg_pool.ConnectionPool[Any]:
        setting = "on" if synchronous else "off"

        def configure(conn: psycopg.Connection[Any]) -> None:
            self._configure(conn)
            # Session-wide, set once: nothing here ever changes it (a batch or prune
            # picks the pool with the setting it needs), and a rollback cannot undo it.
            conn.execute(f"SET synchronous_commit = {setting}".encode())

        return cast(
            "psycopg_pool.ConnectionPool[Any]",
            pool_module.ConnectionPool(
                self._url,
                kwargs=self._connect_options,
                min_size=0 if synchronous else 1,
                max_size=_POOL_MAX,
                configure=configure,
                timeout=max(self._busy_timeout, 0.001),
                name=f"idempotently-{setting}",
                open=True,
            ),
        )

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        for statement in self._settings:
            conn.execute(statement)

    def _check_schema_on(self, conn: psycopg.Connection[Any]) -> None:
        version = self._read_version(conn)
        if version is None and not self._create:
            raise JournalMissingError(
                f"no journal in {self.path} (the database has no {SCHEMA}.journal_meta table; "
                "it was left as it is); point --journal (or Journal(url)) at the database your "
                "Session writes"
            )
        if version is not None and version > SCHEMA_VERSION:
            raise self._newer(version)
        if version and version < SCHEMA_VERSION:
            # A development build's journal: never read, never upgraded, never touched.
            raise development_journal_error(self.path, "PostgreSQL", version)
        if version != SCHEMA_VERSION and not self.readonly:
            # Every opener of a fresh database gets here at once: the first
            # creates the schema, the others wait and find it made.
            with conn.transaction():
                conn.execute("SET LOCAL synchronous_commit = on")
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_ADVISORY_LOCK,))
                version = self._read_version(conn) or 0
                if version > SCHEMA_VERSION:
                    raise self._newer(version)
                if 0 < version < SCHEMA_VERSION:
                    raise development_journal_error(self.path, "PostgreSQL", version)
                for statement in upgrade_statements(version):
                    params = (str(uuid.uuid4()),) if statement == _NAMESPACE_INSERT else None
                    conn.execute(statement, params)
                version = SCHEMA_VERSION
        if version is None:
            raise JournalMissingError(f"no journal in {self.path}")
        self._version = version
        row = conn.execute(_NAMESPACE_READ).fetchone()
        value = None if row is None else row["value"]
        self._database = None if row is None else row["db"]
        try:
            self._namespace = uuid.UUID(value)
        except (TypeError, ValueError, AttributeError) as error:
            raise JournalCorruptError(
                f"{self.path} has no valid key namespace ({short(value)}); restore "
                f"{SCHEMA}.journal_meta from a backup"
            ) from error

    def _read_version(self, conn: psycopg.Connection[Any]) -> int | None:
        """The schema version, or None when the database holds no journal. A journal at
        this version missing a part of its schema is refused (`_check_parts`)."""
        found = set()
        for row in conn.execute(_CATALOG, (SCHEMA,)).fetchall():
            found.add(row["name"])
            found.update(f"{row['name']}.{column}" for column in row["columns"])
        if "journal_meta" not in found:
            return None
        if not {"journal_meta.name", "journal_meta.value"} <= found:
            self._check_parts(found)  # its version cannot be read: name what is missing
        row = conn.execute(
            f"SELECT value FROM {SCHEMA}.journal_meta WHERE name = 'schema_version'"
        ).fetchone()
        value = None if row is None else row["value"]
        try:
            version = 0 if value is None else int(value)
        except ValueError:
            raise JournalCorruptError(
                f"{self.path} has a damaged schema version ({short(value)}); restore "
                f"{SCHEMA}.journal_meta from a backup"
            ) from None
        if version == SCHEMA_VERSION:
            self._check_parts(found)
        return version

    def _check_parts(self, found: set[str]) -> None:
        """Refuse a journal at this version missing a table, a column or an index (a
        damaged or half-made schema) before anything reads or writes it: never "column
        does not exist" from the first statement that needs one, never a key journaled
        twice for want of its unique index."""
        parts = _schema_parts()
        missing = parts.keys() - found
        if missing:
            # A missing table is named, not each of its columns and indexes.
            named = sorted(
                part for part in missing if part == parts[part] or parts[part] not in missing
            )
            raise JournalCorruptError(
                f"{self.path} is missing parts of its journal (schema {SCHEMA}: "
                f"{', '.join(named)}): a damaged or half-made journal; restore it from a "
                "backup (it was left as it is)"
            )

    def _newer(self, version: int) -> JournalVersionError:
        return JournalVersionError(
            f"{self.path} has PostgreSQL journal schema version {version}, but this "
            f"idempotently reads up to version {SCHEMA_VERSION}; upgrade idempotently "
            "(pip install -U idempotently). The database was not modified."
        )

    def _error(
        self, doing: str, error: Exception, kind: type[JournalError] = JournalWriteError
    ) -> JournalError:
        """One line naming the journal (never its password) and what to do."""
        import psycopg

        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if self._secret:
            reason = reason.replace(self._secret, "***")
        if isinstance(error, psycopg.IntegrityError) and kind is JournalWriteError:
            # Our statements never break a constraint on a sound row: a row edited by
            # hand (an attempt_count lowered below its attempts) does.
            return JournalCorruptError(
                f"{self.path} holds a damaged operation ({reason}): its row disagrees with "
                f"its attempts, as after an edit by hand; repair it (psql, {SCHEMA}.operations) "
                "or restore a backup (nothing was written)"
            )
        return kind(f"{doing} {self.path}: {reason}; {_ADVICE[_problem(error)]}")

    def close(self) -> None:
        for name in ("_pool", "_flushed_pool"):
            pool = getattr(self, name, None)
            if pool is not None:
                pool.close()

    def __repr__(self) -> str:
        return f"PostgresStore({self.path!r})"

    @property
    def schema_version(self) -> int:
        return self._version

    @property
    def namespace(self) -> uuid.UUID:
        """The journal's own random namespace (made with the schema, never changed)."""
        assert self._namespace is not None  # read when the store opened
        return self._namespace

    def check_identity(self) -> None:
        """Nothing to check: a database cannot be moved from under its URL."""

    def after_fork(self) -> None:
        """Nothing to reset: the Journal refuses every command in a forked child, and
        the pool's connections are the parent's."""

    def _check_writable(self) -> None:
        if self.readonly:
            raise JournalWriteError(
                f"the journal {self.path} was opened read-only; open it without readonly=True"
            )

    # -- transactions -----------------------------------------------------------------

    @contextmanager
    def _errors(self, doing: str, kind: type[JournalError]) -> Iterator[None]:
        import psycopg

        try:
            yield
        except psycopg.Error as error:
            raise self._error(doing, error, kind) from None

    def _pool_for(self, synchronous: bool) -> psycopg_pool.ConnectionPool[Any]:
        """The pool whose connections' commits wait for the WAL flush (or do not)."""
        return self._flushed_pool if synchronous else self._pool

    @contextmanager
    def _transaction(self, *, synchronous: bool) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        """One short write transaction; ``synchronous`` makes the commit wait for the WAL flush."""
        self._check_writable()
        with self._block(b"BEGIN", writing=True, synchronous=synchronous) as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        """Several reads as one consistent view (a repeatable-read, read-only transaction)."""
        begin = b"BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"
        with self._block(begin, writing=False) as conn:
            yield conn

    @contextmanager
    def _block(
        self, begin: bytes, *, writing: bool, synchronous: bool = False
    ) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        """A pooled connection inside a transaction opened by ``begin``; committed at the end."""
        doing, kind = (
            ("cannot write the journal", JournalWriteError)
            if writing
            else ("cannot read the journal", JournalError)
        )
        with self._errors(doing, kind), self._pool_for(synchronous).connection() as conn:
            conn.execute(begin)
            try:
                yield conn
            except BaseException:
                _roll_back(conn)
                raise
            conn.execute(b"COMMIT")

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        """A pooled connection for single-statement reads (each its own snapshot)."""
        with self._errors("cannot read the journal", JournalError), self._pool.connection() as conn:
            yield conn

    def _rows(
        self,
        conn: psycopg.Connection[dict[str, Any]],
        sql: str,
        params: Any = (),
        *,
        checked: bool = True,
    ) -> list[dict[str, Any]]:
        """Rows as dicts, each checked (unless a listing checks them, `_listed`)."""
        rows = conn.execute(sql, params).fetchall()
        if checked:
            for row in rows:
                self._check_row(row)
        return rows

    def _check_row(self, row: dict[str, Any], operation: dict[str, Any] | None = None) -> None:
        """Raise JournalCorruptError, naming the operation, if a value cannot be decoded.

        ``operation`` is the row of the operation an attempt's ``row`` belongs to.
        """
        for column, value in row.items():
            problem = column_problem(column, value)
            if problem is not None:
                raise self._damaged_operation(row if operation is None else operation, problem)

    def _damaged_operation(self, operation: dict[str, Any], problem: str) -> JournalCorruptError:
        """The refusal of the damaged row of ``operation``, naming it and what is wrong."""
        operation_id, key = operation.get("operation_id"), operation.get("key")
        return JournalCorruptError(
            f"{self.path} holds a damaged operation: {problem}; repair that row "
            f"(psql, table {SCHEMA}.operations or {SCHEMA}.attempts) or restore a "
            "backup, or record what happened to it with `idempotently settle` or "
            "`abandon`; the other operations are still listed, shown and resumed",
            operation_id=operation_id if isinstance(operation_id, str) else None,
            key=key if isinstance(key, str) else None,
        )

    # -- the writes -------------------------------------------------------------------

    def commit(self, writes: Sequence[Write], durable: bool) -> list[Any]:
        """Run ``writes`` in one transaction; each one's result, or a `Failed`.

        ``durable`` makes the commit wait for the WAL flush (``synchronous_commit =
        on``). A lone write is one autocommitted statement: one round trip. Several run
        in one transaction, each in a savepoint, sent as one pipeline: one round trip,
        plus one per write that fails (it fails alone, the others commit). Raises if
        the transaction itself cannot begin or commit: then none was written.
        """
        self._check_writable()
        if not writes:
            return []
        # A fleet's leases and statuses wait for the flush too (a database server that
        # restarts must not hand a live lease to another host); attempts need not.
        synchronous = durable or any(write.synchronous for write in writes)
        with (
            self._errors("cannot write the journal", JournalWriteError),
            self._pool_for(synchronous).connection() as conn,
        ):
            return self._committed(conn, writes)

    def _committed(
        self, conn: psycopg.Connection[dict[str, Any]], writes: Sequence[Write]
    ) -> list[Any]:
        """`commit` on one connection: a transaction the server ended as a deadlock's
        victim (two fleets' batches locking the same rows, a pause's row, in other
        orders) wrote nothing, so it runs again, as PostgreSQL asks of its clients, a
        few times after a short random wait; then the error stands."""
        import psycopg

        for tries in range(_DEADLOCK_TRIES, 0, -1):
            try:
                if len(writes) == 1 and not _locks_group(writes[0]):
                    # Autocommit: the statement is its own transaction (Record's update,
                    # its insert and its counts are one statement), committed as the
                    # connection's setting says.
                    return [self._result(writes[0], self._send(conn, writes[0], here=True))]
                return self._commit_batch(conn, writes)
            except psycopg.errors.DeadlockDetected:
                _roll_back(conn)
                if tries == 1:
                    raise
                time.sleep(random.uniform(0.0, 0.02))
            except BaseException:
                _roll_back(conn)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _commit_batch(
        self, conn: psycopg.Connection[dict[str, Any]], writes: Sequence[Write]
    ) -> list[Any]:
        """``writes`` in one transaction, each in a savepoint, pipelined.

        The server skips what follows a failed statement until the pipeline's end, so a
        write that fails ends the round: the writes before it stand, its savepoint
        undoes it, and the ones after it go again in the next round, in the same
        transaction. A batch that may change the counts adds its writes' changes (summed
        in `_NOTED` as they run) to its slot in one statement before the commit, in the
        same pipeline.
        """
        import psycopg

        results: list[Any] = [None] * len(writes)
        counting = any(isinstance(write, _COUNTING) for write in writes)
        start, first = 0, True
        while True:
            sent: list[psycopg.Cursor[dict[str, Any]] | None] = []
            refused: tuple[int, Exception] | None = None
            try:
                with conn.pipeline():
                    conn.execute(b"BEGIN" if first else b"ROLLBACK TO SAVEPOINT write")
                    for index, write in enumerate(writes[start:]):
                        conn.execute(b"SAVEPOINT write")
                        try:
                            sent.append(self._send(conn, write, here=False))
                        except (psycopg.DataError, psycopg.IntegrityError) as unsendable:
                            # A value psycopg cannot send (a NUL in text): nothing of it
                            # left; the round ends here, as after a server's refusal.
                            refused = (index, unsendable)
                            break
                        conn.execute(b"RELEASE SAVEPOINT write")
                    else:
                        if counting:
                            conn.execute(_ADD_NOTED.encode())
                        conn.execute(b"COMMIT")
            except psycopg.Error as raised:
                # The server refused a write: the first without a result.
                failed = next(
                    (
                        index
                        for index, cursor in enumerate(sent)
                        if cursor is not None and cursor.pgresult is None
                    ),
                    None,
                )
                refusal = _first_error(raised)
                deadlock = next(
                    (
                        error
                        for error in (refusal, raised)
                        if isinstance(error, psycopg.errors.DeadlockDetected)
                    ),
                    None,
                )
                if deadlock is not None:
                    # The transaction's, not one write's: `_committed` runs it again.
                    raise deadlock from None
                # A "pipeline aborted" with no first error attached (psycopg may report the
                # refusal that way): still that one write's refusal, not the batch's.
                if failed is None or not isinstance(
                    refusal,
                    (psycopg.DataError, psycopg.IntegrityError, psycopg.errors.PipelineAborted),
                ):
                    raise refusal from None
            else:
                if refused is None:
                    for index, cursor in enumerate(sent):
                        results[start + index] = self._result_or_failed(
                            writes[start + index], cursor
                        )
                    return results
                failed, refusal = refused
            for index in range(failed):
                results[start + index] = self._result_or_failed(writes[start + index], sent[index])
            results[start + failed] = Failed(self._error("cannot write the journal", refusal))
            start, first = start + failed + 1, False

    def _result_or_failed(self, write: Write, cursor: psycopg.Cursor[dict[str, Any]] | None) -> Any:
        """A write's result, or a Failed for one whose rows cannot be decoded (a claim
        that met a damaged row): it fails alone, as in its savepoint on SQLite; what it
        leased runs out with its lease, and nothing of it is sent."""
        try:
            return self._result(write, cursor)
        except JournalError as error:
            return Failed(error)

    def _send(
        self, conn: psycopg.Connection[dict[str, Any]], write: Write, *, here: bool
    ) -> psycopg.Cursor[dict[str, Any]] | None:
        """Send ``write``'s one statement; its cursor (None if there is nothing to send).

        In a pipeline the cursor's results arrive later: `_result` reads them. ``here``:
        a statement that changes the counts adds its change to the slot itself (a lone
        write); else the batch adds them up at its end.
        """
        match write:
            case Insert():
                if write.new.group_id is not None:
                    conn.execute(_LOCK_GROUP, (write.new.group_id,))
                    return conn.execute(
                        _INSERT_STEP, _insert_step(write.new, write.owner, write.lease_until)
                    )
                return conn.execute(
                    _INSERT_OPERATION, write.new.row(write.owner, write.lease_until)
                )
            case Enqueue():
                if write.new.group_id is not None:
                    conn.execute(_LOCK_GROUP, (write.new.group_id,))
                    return conn.execute(_INSERT_STEP, _insert_step(write.new, None, 0.0))
                return conn.execute(_INSERT_OPERATION, write.new.row(None, 0.0))
            case Record():
                record = write.record
                response_headers = (
                    None
                    if record.response_headers is None
                    else headers_json(record.response_headers)
                )
                return conn.execute(
                    _RECORD_ATTEMPT if record.cap_reason is None else _CAPPED_RECORD,
                    {
                        "cap_reason": record.cap_reason,
                        "operation_id": write.operation_id,
                        "owner": write.owner,
                        "now": write.now,
                        "status": record.status,
                        "reason": record.reason,
                        "not_before": record.not_before,
                        "status_code": record.status_code,
                        "response_status": record.response_status,
                        "response_headers": response_headers,
                        "response_body": record.response_body,
                        "lease_until": record.lease_until,
                        "started_at": record.started_at,
                        "elapsed": record.elapsed,
                        "outcome": record.outcome,
                        "replayed": int(record.replayed),
                        "error": record.error,
                        "wait": record.wait,
                        "here": here,
                    },
                )
            case PauseOrigin():
                # Retry control: the longer of two pauses wins, whoever wrote first.
                return conn.execute(
                    f"""
                    INSERT INTO {SCHEMA}.origin_pauses (origin, credentials, until, reason, set_at)
                    VALUES (%s, %s, %s, %s, %s)
                    ON CONFLICT (origin, credentials) DO UPDATE SET
                        until = excluded.until, reason = excluded.reason, set_at = excluded.set_at
                    WHERE excluded.until > {SCHEMA}.origin_pauses.until
                    """,
                    (write.origin, write.credentials, write.until, write.reason, write.set_at),
                )
            case RebaseOperation():
                # A clock ahead of ours wrote it: counted from our now, never later.
                return conn.execute(
                    _REBASE_TIMES
                    + " AND operation_id = %(operation_id)s AND updated_at = %(read)s"
                    + " RETURNING not_before, lease_until",
                    {
                        "now": write.now,
                        "ahead": write.now,
                        "operation_id": write.operation_id,
                        "read": write.updated_at,
                    },
                )
            case RebasePause():
                # A clock ahead of ours wrote it: count it from our now, never longer. The
                # pause as it stands after. One UPDATE of the row whether or not it is still
                # ahead: it waits for a reader rebasing it at the same time and then reads
                # its committed row (a SELECT would read the statement's snapshot, the pause
                # still ten years away); the extra row version is written only on this rare
                # path.
                return conn.execute(
                    f"""
                    UPDATE {SCHEMA}.origin_pauses
                    SET until = CASE WHEN set_at > %(now)s
                                     THEN %(now)s + (until - set_at) ELSE until END,
                        set_at = CASE WHEN set_at > %(now)s THEN %(now)s ELSE set_at END
                    WHERE origin = %(origin)s AND credentials = %(credentials)s
                    RETURNING origin, credentials, until, reason, set_at
                    """,
                    {"now": write.now, "origin": write.origin, "credentials": write.credentials},
                )
            case SwapPause():
                # A circuit breaker's compare-and-swap on its row; the row as it stands
                # after: the swapped one, or (not swapped) the one that stopped it.
                new = write.new
                match = {
                    "origin": write.origin,
                    "credentials": write.credentials,
                    "expect": write.expect,
                    "ended_by": write.ended_by,
                }
                where = (
                    "WHERE origin = %(origin)s AND credentials = %(credentials)s AND "
                    "reason = %(expect)s AND (%(ended_by)s::float8 IS NULL "
                    "OR until <= %(ended_by)s::float8)"
                )
                if new is None:
                    return conn.execute(
                        f"DELETE FROM {SCHEMA}.origin_pauses {where} RETURNING origin", match
                    )
                return conn.execute(
                    f"""
                    WITH swapped AS (
                        UPDATE {SCHEMA}.origin_pauses
                        SET until = %(until)s, reason = %(reason)s, set_at = %(set_at)s
                        {where}
                        RETURNING origin, credentials, until, reason, set_at
                    )
                    SELECT * FROM swapped
                    UNION ALL
                    SELECT origin, credentials, until, reason, set_at
                    FROM {SCHEMA}.origin_pauses
                    WHERE origin = %(origin)s AND credentials = %(credentials)s
                      AND NOT EXISTS (SELECT 1 FROM swapped)
                    """,
                    {**match, "until": new.until, "reason": new.reason, "set_at": new.set_at},
                )
            case Unpause():
                return conn.execute(
                    f"DELETE FROM {SCHEMA}.origin_pauses WHERE origin = %s "
                    "RETURNING origin, credentials, until, reason, set_at",
                    (write.origin,),
                )
            case SetStatus():
                statement = _SET_STATUS if write.cap_reason is None else _CAPPED_STATUS
                if write.stopped_at is not None:
                    statement = _STOPPED_STATUS
                return conn.execute(
                    statement,
                    {
                        "stopped_at": write.stopped_at,
                        "cap_reason": write.cap_reason,
                        "status": write.status,
                        "reason": write.reason,
                        "now": write.now,
                        "operation_id": write.operation_id,
                        "expect": write.expect,
                        "here": here,
                    },
                )
            case TakeLease():
                operation = write.operation
                if operation.group_id is not None:
                    return conn.execute(
                        _TAKE_LEASE + _EARLIER_UNSETTLED,
                        {
                            "owner": write.owner,
                            "lease_until": write.lease_until,
                            "now": write.now,
                            "operation_id": operation.operation_id,
                            "read_until": operation.lease_until,
                            "read_owner": operation.lease_owner,
                            "read_at": operation.updated_at,
                            "read_attempts": operation.attempt_count,
                            "group_id": operation.group_id,
                            "step": operation.step or 0,
                        },
                    )
                return conn.execute(
                    _TAKE_LEASE,
                    {
                        "owner": write.owner,
                        "lease_until": write.lease_until,
                        "now": write.now,
                        "operation_id": operation.operation_id,
                        "read_until": operation.lease_until,
                        "read_owner": operation.lease_owner,
                        "read_at": operation.updated_at,
                        "read_attempts": operation.attempt_count,
                    },
                )
            case BindCredentials():
                return conn.execute(
                    f"UPDATE {SCHEMA}.operations SET credentials_digest = %s "
                    "WHERE operation_id = %s AND lease_owner = %s AND status = 'pending' "
                    "AND credentials_digest IS NULL",
                    (write.record, write.operation_id, write.owner),
                )
            case RenewLease():
                return conn.execute(
                    f"UPDATE {SCHEMA}.operations SET lease_until = %s, updated_at = %s "
                    "WHERE operation_id = %s AND lease_owner = %s AND status = 'pending'",
                    (write.lease_until, write.now, write.operation_id, write.owner),
                )
            case Release():
                return conn.execute(
                    f"UPDATE {SCHEMA}.operations SET lease_owner = NULL, lease_until = 0 "
                    "WHERE operation_id = %s AND lease_owner = %s",
                    (write.operation_id, write.owner),
                )
            case ClaimDue():
                # FOR NO KEY UPDATE SKIP LOCKED: workers claiming at once never get one
                # operation twice, and never wait for each other.
                if write.limit <= 0:
                    return None
                # A row written by a clock ahead of ours (a not_before, a dead host's lease):
                # counted from our now first.
                conn.execute(_REBASE_TIMES, {"now": write.now, "ahead": write.written_ahead()})
                return conn.execute(
                    _CLAIM_DUE,
                    {
                        "owner": write.owner,
                        "now": write.now,
                        "lease_until": write.lease_until,
                        "limit": write.limit,
                    },
                )
            case Act():
                return conn.execute(_ACT, {**self._act_parameters(write), "here": here})
            case LookUpLater():
                note = write.audit
                return conn.execute(
                    _LOOK_UP_LATER,
                    {
                        "operation_id": write.operation_id,
                        "lookup_after": write.lookup_after,
                        "now": write.now,
                        "actor": note.actor,
                        "action": note.action,
                        "note": note.note,
                        "detail": note.detail,
                    },
                )
            case ExtendLeases():
                return conn.execute(
                    f"""
                    UPDATE {SCHEMA}.operations AS o
                    SET lease_until = greatest(o.lease_until, %s), updated_at = %s
                    FROM unnest(%s::text[], %s::text[]) AS held(operation_id, owner)
                    WHERE o.operation_id = held.operation_id AND o.lease_owner = held.owner
                      AND o.status = 'pending'
                    """,
                    (
                        write.lease_until,
                        write.now,
                        [operation_id for operation_id, _ in write.leases],
                        [owner for _, owner in write.leases],
                    ),
                )
            case _:
                assert_never(write)

    def _result(self, write: Write, cursor: psycopg.Cursor[dict[str, Any]] | None) -> Any:
        """What ``write`` returns, read from the cursor `_send` gave."""
        match write:
            case Record() | Release() | PauseOrigin():
                return None
            case Insert() | Enqueue() | TakeLease() | BindCredentials() | RenewLease():
                assert cursor is not None
                return cursor.rowcount == 1
            case Unpause():
                return [] if cursor is None else [OriginPause(**row) for row in cursor.fetchall()]
            case RebaseOperation():
                row = None if cursor is None else cursor.fetchone()
                if row is None:
                    return None
                not_before = row["not_before"]
                return (
                    None if not_before is None else float(not_before),
                    float(row["lease_until"]),
                )
            case RebasePause():
                row = None if cursor is None else cursor.fetchone()
                return None if row is None else OriginPause(**row)
            case SwapPause():
                if write.new is None:
                    return None
                row = None if cursor is None else cursor.fetchone()
                return None if row is None else OriginPause(**row)
            case ClaimDue():
                return [] if cursor is None else self._with_attempts(cursor.fetchall(), listed=True)
            case SetStatus() | Act() | LookUpLater():
                assert cursor is not None
                row = cursor.fetchone()
                return row is not None and int(row["applied"]) == 1
            case ExtendLeases():
                assert cursor is not None
                return cursor.rowcount
            case _:
                assert_never(write)

    # -- the operator's journal ----------------------------------------------------------

    def _act_parameters(self, write: Act) -> dict[str, Any]:
        fork = write.fork
        responds = write.sets_answer
        return {
            "operation_id": write.operation_id,
            "expect_status": write.expect_status,
            "expect_owner": write.expect_lease_owner,
            "expect_lease_until": write.expect_lease_until,
            "expect_updated_at": write.expect_updated_at,
            "status": write.status,
            "reason": write.reason,
            "now": write.now,
            "due_now": write.due_now,
            "responds": responds,
            "response_status": write.response_status,
            "response_headers": None
            if write.response_headers is None
            else headers_json(write.response_headers),
            "response_body": write.response_body,
            "fork_id": None if fork is None else fork.operation_id,
            "fork_key": None if fork is None else fork.key,
            "fork_delivery": None if fork is None else fork.delivery,
            "fork_method": None if fork is None else fork.method,
            "fork_url": None if fork is None else fork.url,
            "fork_headers": None if fork is None else headers_json(fork.request_headers),
            "fork_body": None if fork is None else fork.request_body,
            "fork_fingerprint": None if fork is None else fork.fingerprint,
            "fork_profile": None if fork is None else fork.profile,
            "fork_key_header": None if fork is None else fork.key_header,
            "fork_expires_at": None if fork is None else fork.key_expires_at,
            "audit_ids": [note.operation_id for note in write.audit],
            "audit_actors": [note.actor for note in write.audit],
            "audit_actions": [note.action for note in write.audit],
            "audit_notes": [note.note for note in write.audit],
            "audit_details": [note.detail for note in write.audit],
        }

    def audit(self, operation_id: str) -> list[AuditEntry]:
        """The operation's audit entries, oldest first."""
        with self._connection() as conn:
            rows = conn.execute(_AUDIT, (operation_id,)).fetchall()
        entries = []
        for row in rows:
            problem = audit_entry_problem(row)
            if problem is not None:
                raise JournalCorruptError(
                    f"{self.path} holds a damaged audit entry: {problem}; repair it (psql, "
                    f"table {SCHEMA}.operation_audit) or restore a backup",
                    operation_id=operation_id,
                )
            entries.append(AuditEntry(**row))
        return entries

    # -- the outbox: writes in the application's own transaction -------------------------
    #
    # The application's connection is its own: its transaction, its settings, its
    # row factory. Each step runs in a savepoint, so a statement of ours that fails
    # leaves the application's transaction as it was, never aborted; nothing is
    # committed here. The steps are written once (plain generators of statements) and
    # run by a sync driver for psycopg.Connection and an async one for AsyncConnection.

    def enqueue_on(self, connection: object, new: NewOperation) -> bool:
        """Insert ``new`` (enqueued, unleased) in the application's open transaction on
        ``connection``; False if the id or key is taken. Nothing is committed here."""
        orm = self._orm(connection, new)
        if orm is not None:
            return cast(bool, self._run_orm(orm, self._enqueue_steps(new), new))
        conn = self._application_connection(connection, new, asynchronous=False)
        return cast(bool, self._run_on(conn, self._enqueue_steps(new), new))

    def find_on(
        self, connection: object, operation_id: str | None, key: str | None
    ) -> Operation | None:
        """`find`, read in the application's transaction on ``connection``."""
        orm = self._orm(connection, None)
        if orm is not None:
            return cast("Operation | None", self._run_orm(orm, self._find_steps(operation_id, key)))
        conn = self._application_connection(connection, None, asynchronous=False)
        return cast("Operation | None", self._run_on(conn, self._find_steps(operation_id, key)))

    async def aenqueue_on(self, connection: object, new: NewOperation) -> bool:
        """`enqueue_on` on psycopg's AsyncConnection (or a SQLAlchemy AsyncSession or
        AsyncConnection), awaited on its event loop."""
        if _orm_given(connection):
            from idempotently import _outbox_orm

            return cast(
                bool,
                await _outbox_orm.run_async(
                    connection,
                    _ids(new),
                    lambda orm: self._run_orm(self._orm_usable(orm), self._enqueue_steps(new), new),
                ),
            )
        conn = self._application_connection(connection, new, asynchronous=True)
        return cast(bool, await self._arun_on(conn, self._enqueue_steps(new), new))

    async def afind_on(
        self, connection: object, operation_id: str | None, key: str | None
    ) -> Operation | None:
        """`find_on` on psycopg's AsyncConnection (or a SQLAlchemy async one)."""
        if _orm_given(connection):
            from idempotently import _outbox_orm

            return cast(
                "Operation | None",
                await _outbox_orm.run_async(
                    connection,
                    {},
                    lambda orm: self._run_orm(
                        self._orm_usable(orm), self._find_steps(operation_id, key)
                    ),
                ),
            )
        conn = self._application_connection(connection, None, asynchronous=True)
        return cast(
            "Operation | None", await self._arun_on(conn, self._find_steps(operation_id, key))
        )

    # An ORM's connection (_outbox_orm): the same steps (the namespace read that proves
    # it is on the journal's database, then the insert), through the ORM's own API, in a
    # savepoint of the application's transaction.

    def _orm(self, connection: object, new: NewOperation | None) -> OrmConnection | None:
        """``connection`` as a checked ORM connection, or None if it is no ORM's."""
        if not _orm_given(connection):
            return None
        from idempotently import _outbox_orm

        return self._orm_usable(_outbox_orm.opened(connection, _ids(new)))

    def _orm_usable(self, orm: OrmConnection) -> OrmConnection:
        if orm.dialect != "postgresql":
            raise TypeError(
                f"connection is a {orm.name} on {orm.dialect}, not on the journal's PostgreSQL "
                f"database {self.path}; nothing was journaled"
            )
        self._check_writable()
        return orm

    def _run_orm(self, orm: OrmConnection, steps: _Steps, new: NewOperation | None = None) -> Any:
        from idempotently._outbox_orm import StatementError

        try:
            return orm.run(steps, "format", savepoint=True)
        except StatementError as error:
            raise self._orm_error(error, new) from None

    def _orm_error(self, error: OrmStatementError, new: NewOperation | None) -> JournalError:
        """A failed statement on an ORM's connection as `_application_errors` says it of
        psycopg's, by its SQLSTATE (whatever the driver)."""
        if error.sqlstate == "42P01":  # undefined_table
            return JournalError(
                "the connection given to enqueue is on a database without the journal's "
                f"tables (schema {SCHEMA}), so not on {self.path}: connect it to the "
                "journal's database, or create the tables there with `idempotently --journal "
                "URL migrate`; nothing was journaled, your transaction is as it was",
                **_ids(new),
            )
        if error.sqlstate == "25P02":  # in_failed_sql_transaction
            return JournalError(
                "cannot enqueue on the connection given: its transaction has already failed "
                "(a statement in it raised): roll it back and run it again; nothing was "
                "journaled",
                **_ids(new),
            )
        reason = (str(error.driver_error).strip().splitlines() or ["error"])[0]
        if self._secret:
            reason = reason.replace(self._secret, "***")
        return JournalError(
            f"cannot journal the operation in your transaction on {self.path}: {reason}; "
            "nothing was journaled, and your transaction is as it was (or, if the connection "
            "broke, gone): roll it back and run it again",
            **_ids(new),
        )

    def _enqueue_steps(self, new: NewOperation) -> _Steps:
        rows, _ = yield _NAMESPACE_READ, ()
        found = rows[0]["value"] if rows else None
        if found == str(self.namespace) and rows[0]["db"] != self._database:
            # A copy of the journal's database (CREATE DATABASE ... TEMPLATE, as test
            # suites clone theirs) carries its namespace: the operation would commit in
            # the copy, which this journal never reads.
            raise JournalError(
                f"the connection given to enqueue is on the database {short(rows[0]['db'])}, "
                f"a copy of the journal's ({short(self._database)}, same key namespace), not "
                f"on {self.path}: the operation could not commit with your transaction; "
                "connect it to the journal's database; nothing was journaled",
                operation_id=new.operation_id,
                key=new.key,
            )
        if found != str(self.namespace):
            raise JournalError(
                f"the connection given to enqueue is on another journal's database (its key "
                f"namespace is {short(found)}, this journal's {str(self.namespace)!r}), not on "
                f"{self.path}: the operation could not commit with your transaction; connect "
                "it to the journal's database (or open the Journal on your database's URL); "
                "nothing was journaled",
                operation_id=new.operation_id,
                key=new.key,
            )
        if new.group_id is not None:
            yield _LOCK_GROUP, (new.group_id,)
            _, inserted = yield _INSERT_STEP, _insert_step(new, None, 0.0)
            return inserted == 1
        _, inserted = yield _INSERT_OPERATION, new.row(None, 0.0)
        return inserted == 1

    def _find_steps(self, operation_id: str | None, key: str | None) -> _Steps:
        rows, _ = yield _FIND, {"operation_id": operation_id, "key": key}
        found = self._with_attempts(rows)
        return found[0] if found else None

    def _application_connection(
        self, connection: object, new: NewOperation | None, *, asynchronous: bool
    ) -> Any:
        """``connection`` as a usable psycopg connection of the right kind, inside (or about
        to begin) a transaction; else a clear error, and nothing written."""
        pg, _ = _psycopg()
        from psycopg.pq import TransactionStatus

        ids: ErrorContext = (
            {} if new is None else {"operation_id": new.operation_id, "key": new.key}
        )
        wanted = pg.AsyncConnection if asynchronous else pg.Connection
        if not isinstance(connection, wanted):
            if isinstance(connection, pg.AsyncConnection):
                hint = "a psycopg.AsyncConnection goes to AsyncSession.enqueue"
            elif isinstance(connection, pg.Connection):
                hint = "a psycopg.Connection goes to Session.enqueue"
            else:
                hint = f"not {type(connection).__name__}"
            orms = (
                "a SQLAlchemy AsyncSession or AsyncConnection"
                if asynchronous
                else "a SQLAlchemy Session or Connection, or Django's connection"
            )
            raise TypeError(
                f"connection must be the psycopg.{wanted.__name__} (or {orms}) your "
                f"transaction runs on, connected to the journal's database {self.path} "
                f"({hint}); nothing was journaled"
            )
        self._check_writable()
        if connection.closed:
            raise JournalError(
                "the connection given to enqueue is closed; pass the open connection your "
                "transaction runs on; nothing was journaled",
                **ids,
            )
        status = connection.info.transaction_status
        problem = None
        if status == TransactionStatus.INERROR:
            problem = (
                "its transaction has already failed (a statement in it raised): roll it back "
                "and run it again"
            )
        elif status == TransactionStatus.IDLE and connection.autocommit:
            problem = (
                "it is in autocommit mode with no transaction open, so the operation would "
                "commit on its own, not with your writes: open one (with conn.transaction(): "
                "...), or leave connection out to journal it on its own"
            )
        elif status not in (TransactionStatus.IDLE, TransactionStatus.INTRANS):
            problem = (
                "it is busy (a query or pipeline in progress) or its link to the server is broken"
            )
        if problem is not None:
            raise JournalError(
                f"cannot enqueue on the connection given: {problem}; nothing was journaled",
                **ids,
            )
        return connection

    def _run_on(self, conn: Any, steps: _Steps, new: NewOperation | None = None) -> Any:
        """Run ``steps`` on the application's sync connection, in a savepoint."""
        import psycopg
        from psycopg.rows import dict_row

        with self._application_errors(new):
            conn.execute(b"SAVEPOINT idempotently_enqueue")
            try:
                reply: Any = None
                while True:
                    try:
                        sql, params = steps.send(reply)
                    except StopIteration as stop:
                        result = stop.value
                        break
                    cursor = conn.cursor(row_factory=dict_row)
                    cursor.execute(sql, params)
                    reply = (cursor.fetchall() if cursor.description else [], cursor.rowcount)
            except BaseException:
                with suppress(psycopg.Error):
                    conn.execute(b"ROLLBACK TO SAVEPOINT idempotently_enqueue")
                    conn.execute(b"RELEASE SAVEPOINT idempotently_enqueue")
                raise
            conn.execute(b"RELEASE SAVEPOINT idempotently_enqueue")
        return result

    async def _arun_on(self, conn: Any, steps: _Steps, new: NewOperation | None = None) -> Any:
        """`_run_on` on the application's AsyncConnection."""
        import anyio
        import psycopg
        from psycopg.rows import dict_row

        with self._application_errors(new):
            await conn.execute(b"SAVEPOINT idempotently_enqueue")
            try:
                reply: Any = None
                while True:
                    try:
                        sql, params = steps.send(reply)
                    except StopIteration as stop:
                        result = stop.value
                        break
                    cursor = conn.cursor(row_factory=dict_row)
                    await cursor.execute(sql, params)
                    rows = await cursor.fetchall() if cursor.description else []
                    reply = (rows, cursor.rowcount)
            except BaseException:
                # Shielded: a cancelled enqueue still leaves the transaction as it was.
                with anyio.CancelScope(shield=True), suppress(psycopg.Error):
                    await conn.execute(b"ROLLBACK TO SAVEPOINT idempotently_enqueue")
                    await conn.execute(b"RELEASE SAVEPOINT idempotently_enqueue")
                raise
            await conn.execute(b"RELEASE SAVEPOINT idempotently_enqueue")
        return result

    @contextmanager
    def _application_errors(self, new: NewOperation | None) -> Iterator[None]:
        """A psycopg error on the application's connection as one clear JournalError."""
        import psycopg

        try:
            yield
        except psycopg.errors.UndefinedTable:
            raise JournalError(
                "the connection given to enqueue is on a database without the journal's "
                f"tables (schema {SCHEMA}), so not on {self.path}: connect it to the "
                "journal's database, or create the tables there with `idempotently --journal "
                "URL migrate`; nothing was journaled, your transaction is as it was",
                operation_id=None if new is None else new.operation_id,
                key=None if new is None else new.key,
            ) from None
        except psycopg.Error as error:
            failure = self._error("cannot journal the operation in your transaction on", error)
            raise type(failure)(
                f"{failure.message}; nothing was journaled, and your transaction is as it "
                "was (or, if the connection broke, gone): roll it back and run it again",
                operation_id=None if new is None else new.operation_id,
                key=None if new is None else new.key,
            ) from None

    # -- reading ------------------------------------------------------------------------

    def _with_attempts(
        self,
        rows: Sequence[dict[str, Any]],
        *,
        listed: bool = False,
        whole_history: bool = False,
    ) -> list[Operation]:
        """Operations from rows of an operation joined with its attempts (_ATTEMPTS_JOINED).

        Each operation's columns are checked once, each attempt's as it comes; an
        operation without attempts is one row whose attempt columns are NULL. Its
        attempt_count must agree with attempt 1 in its row, as on SQLite. ``listed`` (the
        resume queue, a worker's claim): a damaged operation is its stand-in (`_listed`),
        not an error. ``whole_history`` (an audit's read: show, `Journal.operation`): the
        later attempts must be numbered 2..attempt_count too. As on SQLite, a call's or a
        resume's read does not refuse that (a listing cannot see it), and one statement
        is one snapshot: a writer cannot make a sound row look damaged between two reads.
        """
        found: dict[str, tuple[dict[str, Any], list[Attempt], list[dict[str, Any]]]] = {}
        damaged: dict[str, str] = {}
        for row in rows:
            entry = found.get(row["operation_id"])
            if entry is None:
                operation = {column: row[column] for column in _OPERATION_COLUMNS}
                values = {column.removeprefix("attempt1_"): row[column] for column in _ATTEMPT1}
                first = None if values["outcome"] is None else values
                if listed:
                    damaged[row["operation_id"]] = (
                        row_problem(operation)
                        or _first_attempt_problem(operation["attempt_count"], first)
                        or ""
                    )
                else:
                    self._check_row(operation)
                    problem = _first_attempt_problem(operation["attempt_count"], first)
                    if problem is not None:
                        raise self._damaged_operation(operation, problem)
                entry = found[row["operation_id"]] = (operation, [], [])
                if first is not None and not damaged.get(row["operation_id"]):
                    first["number"] = 1
                    if listed and row_problem(first) is not None:
                        damaged[row["operation_id"]] = cast(str, row_problem(first))
                    else:
                        self._check_row(first, operation)
                        first["replayed"] = bool(first["replayed"])
                        entry[1].append(Attempt(**first))
            if row["number"] is None or damaged.get(row["operation_id"]):
                continue
            attempt = {column: row[column] for column in _ATTEMPT_COLUMNS}
            if listed and row_problem(attempt) is not None:
                damaged[row["operation_id"]] = cast(str, row_problem(attempt))
                continue
            self._check_row(attempt, entry[0])
            entry[2].append(attempt)
            attempt["replayed"] = bool(attempt["replayed"])
            entry[1].append(Attempt(**attempt))
        if whole_history:
            for operation, _, later in found.values():
                problem = _later_attempts_problem(operation["attempt_count"], later)
                if problem is not None:
                    raise self._damaged_operation(operation, problem)
        return [
            self._listed(operation, damaged.get(operation["operation_id"]), tuple(attempts))
            for operation, attempts, _ in found.values()
        ]

    def _listed(
        self,
        row: dict[str, Any],
        problem: str | None = None,
        attempts: tuple[Attempt, ...] = (),
    ) -> Operation:
        """A row of a listing (`operations`: list, the resume queue; a worker's claim):
        one this version cannot decode, or whose attempt_count disagrees with attempt 1
        in its row, is its damaged stand-in, reported by whoever reads it (never sent),
        never an error that stops the listing. (A read of one operation by its id stays
        strict: `_check_row`.)"""
        journaled = row.pop("_attempt1", None)  # a listing's: is attempt 1 in the row?
        problem = problem or row_problem(row)
        if not problem and journaled is not None:
            problem = _first_attempt_problem(row["attempt_count"], {} if journaled else None)
        if problem:
            return Operation._damaged_row(row, problem)
        return Operation._from_row(row, attempts)

    def operation(self, operation_id_or_key: str, *, damaged: bool = False) -> Operation | None:
        """One operation with all its attempts, by operation id or by key; with
        ``damaged``, a row that cannot be decoded as its stand-in (`_listed`)."""
        return self.find(
            operation_id_or_key, operation_id_or_key, damaged=damaged, whole_history=not damaged
        )

    def find(
        self,
        operation_id: str | None,
        key: str | None,
        *,
        damaged: bool = False,
        whole_history: bool = False,
    ) -> Operation | None:
        """The operation with this id, else the one with this key, with its attempts
        (``damaged`` and ``whole_history``: `_with_attempts`' ``listed`` and its own).

        One statement, one round trip: the operation and its attempts, joined.
        """
        if operation_id is None and key is None:
            return None
        with self._connection() as conn:
            rows = conn.execute(
                _FIND,
                {"operation_id": operation_id, "key": key},
            ).fetchall()
        found = self._with_attempts(rows, listed=damaged, whole_history=whole_history)
        return found[0] if found else None

    def group(self, group_id: str) -> list[Operation]:
        """The steps of a group (without their attempts) in their order, forks beside the
        steps they replace; a row that cannot be decoded is its damaged stand-in."""
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {_SELECT_OPERATION} FROM {SCHEMA}.operations WHERE group_id = %s "
                "ORDER BY step, created_at, operation_id",
                (group_id,),
            ).fetchall()
        return [self._listed(dict(row)) for row in rows]

    def queue(self, statuses: Sequence[Status]) -> list[Operation]:
        """What resume works through: the operations with these statuses, oldest first,
        each with its attempts, in one statement (resume sends from these rows as read:
        its lease's compare-and-swap proves each one unchanged since). A row this
        version cannot decode is its damaged stand-in."""
        with self._read() as conn:
            rows = conn.execute(_QUEUE, {"statuses": list(dict.fromkeys(statuses))}).fetchall()
        return self._with_attempts(rows, listed=True)

    def operations(
        self,
        *,
        status: Status | Sequence[Status] | None = None,
        since: float | None = None,
        limit: int | None = None,
        newest_first: bool = True,
    ) -> list[Operation]:
        """Operations (without their attempts), filtered by status and age."""
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
        # One query per status, each walking operations_by_status in creation
        # order and stopping at the limit, merged here (as the SQLite journal does).
        with self._read() as conn:
            listings = [
                self._list_rows(conn, value, since, limit, newest_first) for value in statuses
            ]
        rows = merge(*listings, key=lambda row: row["_seq"], reverse=newest_first)
        return [
            self._listed({name: value for name, value in row.items() if name != "_seq"})
            for row in islice(rows, limit)
        ]

    def _list_rows(
        self,
        conn: psycopg.Connection[dict[str, Any]],
        status: Status | None,
        since: float | None,
        limit: int | None,
        newest_first: bool,
    ) -> list[dict[str, Any]]:
        where: list[str] = []
        params: list[Any] = []
        if status is not None:
            where.append("status = %s")
            params.append(status)
        if since is not None:
            where.append("created_at >= %s")
            params.append(since)
        sql = (
            "SELECT seq AS _seq, attempt1_outcome IS NOT NULL AS _attempt1, "
            f"{_SELECT_OPERATION} FROM {SCHEMA}.operations"
        )
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq " + ("DESC" if newest_first else "ASC")
        if limit is not None:
            sql += " LIMIT %s"
            params.append(limit)
        return self._rows(conn, sql, params, checked=False)

    def counts(self) -> dict[str, int]:
        """Operations per status; every status is present, zero included."""
        with self._read() as conn:
            return self._counts(conn)

    def origin_pauses(self, *, now: float) -> list[OriginPause]:
        """The origin pauses still running at ``now``, soonest over first."""
        with self._read() as conn:
            rows = self._rows(
                conn,
                f"SELECT origin, credentials, until, reason, set_at FROM {SCHEMA}.origin_pauses "
                "WHERE until > %s OR reason LIKE 'circuit breaker%%' ORDER BY until",
                (now,),
            )
        return [OriginPause(**row) for row in rows]

    def _counters(self, conn: psycopg.Connection[dict[str, Any]]) -> dict[str, int]:
        """Every count the writes keep, summed over the 16 slots, and pending operations
        counted from their index: a few rows, whatever the journal's size."""
        row = conn.execute(_COUNTS).fetchone() or {}
        values = {name: row.get(name) for name in _COUNTERS}
        if row.get("slots") != _SLOTS or not all(
            value is not None and int(value) >= 0 for value in values.values()
        ):
            shown = {name: None if value is None else int(value) for name, value in values.items()}
            raise JournalCorruptError(
                f"{self.path} holds damaged counts ({row.get('slots')} of {_SLOTS} slots in "
                f"{SCHEMA}.journal_counts, sums {short(shown)}); count them again from the "
                "rows with `idempotently migrate --recount` (the operations are untouched)"
            )
        if values["unknown_status"]:
            # The status CHECK keeps them out: a table altered by hand let one in.
            raise JournalCorruptError(
                f"{self.path} counts {values['unknown_status']} operations with an unknown "
                f"status; repair those rows (psql, {SCHEMA}.operations) or restore a backup"
            )
        return {name: int(cast(int, value)) for name, value in values.items()}

    def _counts(self, conn: psycopg.Connection[dict[str, Any]]) -> dict[str, int]:
        counters = self._counters(conn)
        return {status: counters[status] for status in STATUSES}

    def recount(self) -> None:
        """Count the operations and attempts again from the rows, in one transaction:
        slot 0 gets the totals, the others zero. The counts follow the journal's own
        writes only, so after an edit by hand (psql) they may differ from the rows until
        this runs. The table lock waits for every transaction that has changed the
        counts and holds off the ones that would, until the commit: none is lost."""
        with self._transaction(synchronous=True) as conn:
            conn.execute(f"LOCK TABLE {SCHEMA}.journal_counts IN EXCLUSIVE MODE")
            conn.execute(_SLOT_ROWS)
            conn.execute(_RECOUNT)
            conn.execute(
                f"INSERT INTO {SCHEMA}.journal_meta (name, value) "
                f"SELECT '{CAPPED_META}', count(cap_reason)::text FROM {SCHEMA}.operations "
                "ON CONFLICT (name) DO UPDATE SET value = excluded.value"
            )

    def stats(
        self,
        *,
        now: float,
        stuck_after: float = 60.0,
        expiring_within: float | None = None,
    ) -> JournalStats:
        """Counts, rates and the stuck count (pending, unleased, idle ``stuck_after`` s).

        With ``expiring_within`` (seconds), also how many pending operations have a
        key that expires by ``now + expiring_within``.
        """
        check_number("now", now, integer=False, low=0, high=MAX_TIMESTAMP)
        check_number("stuck_after", stuck_after, integer=False, low=0, high=MAX_WINDOW)
        if expiring_within is not None:
            check_number("expiring_within", expiring_within, integer=False, low=0, high=MAX_WINDOW)
        with self._read() as conn:
            counters = self._counters(conn)
            counts: dict[str, int] = {status: counters[status] for status in STATUSES}
            # An enqueued operation not sent yet: its key's lifetime has not started.
            # operations_pending alone (it covers these columns) unless the expiring keys
            # are asked for: key_expires_at is not in it, so each pending row is read.
            expiring = (
                "NULL"
                if expiring_within is None
                else "count(*) FILTER (WHERE key_expires_at <= %(soon)s "
                "AND (first_send_at IS NOT NULL OR enqueued_at IS NULL))"
            )
            pending = self._rows(
                conn,
                f"""
                SELECT min(created_at) AS oldest,
                       count(*) FILTER (WHERE lease_until < %(now)s AND updated_at < %(idle)s
                                        AND coalesce(not_before, 0) <= %(now)s) AS stuck,
                       {expiring} AS expiring
                FROM {SCHEMA}.operations WHERE status = 'pending'
                """,
                {"now": now, "idle": now - stuck_after, "soon": now + (expiring_within or 0.0)},
            )[0]
            capped = self._rows(
                conn,
                f"SELECT value FROM {SCHEMA}.journal_meta WHERE name = '{CAPPED_META}'",
            )
        return JournalStats(
            counts=counts,
            operations=sum(counts.values()),
            attempts=counters["attempts"],
            answered_attempts=counters["answered_attempts"],
            replayed_attempts=counters["replayed_attempts"],
            in_progress_attempts=counters["in_progress_attempts"],
            oldest_pending_created_at=pending["oldest"],
            stuck=int(pending["stuck"]),
            now=now,
            expiring=None if expiring_within is None else int(pending["expiring"]),
            expiring_within=expiring_within,
            capped=capped_count(capped[0]["value"] if capped else None, self.path),
        )

    def _count_prunable(self, conn: psycopg.Connection[dict[str, Any]], cutoff: float) -> int:
        """How many finished operations prune would delete: those idle since before
        ``cutoff``, less those a fork links to (kept). As on SQLite, operations_finished
        is counted on whichever side of the cutoff looks smaller (judged from its ends),
        and the newer side is taken off the counts: a usual window counts few entries."""
        counters = self._counters(conn)
        total = sum(counters[status] for status in FINISHED_STATUSES)
        ends = self._rows(
            conn,
            f"SELECT min(updated_at) AS oldest, max(updated_at) AS newest "
            f"FROM {SCHEMA}.operations WHERE {_FINISHED_SQL}",
        )[0]
        oldest, newest = ends["oldest"], ends["newest"]
        if total == 0 or oldest is None or cutoff <= oldest:
            return 0
        count = f"SELECT count(*) AS n FROM {SCHEMA}.operations WHERE {_FINISHED_SQL} AND "
        if cutoff > newest:
            idle = total
        elif cutoff - oldest <= newest - cutoff:
            idle = int(self._rows(conn, count + "updated_at < %s", (cutoff,))[0]["n"])
        else:
            idle = total - int(self._rows(conn, count + "updated_at >= %s", (cutoff,))[0]["n"])
        # The few a fork links to, found from the forks' own index.
        linked = self._rows(
            conn,
            count + "updated_at < %s AND operation_id IN (SELECT forked_from FROM "
            f"{SCHEMA}.operations WHERE forked_from IS NOT NULL)",
            (cutoff,),
        )[0]
        return idle - int(linked["n"])

    def prune(self, *, older_than: float, now: float, dry_run: bool = False) -> int:
        """Delete finished operations (and their attempts) idle for ``older_than`` seconds.

        Never touches ``pending`` or ``needs_reconcile``. Deletes in batches of
        1000, longest idle first, each its own short transaction.
        """
        check_number("older_than", older_than, integer=False, low=0, high=MAX_WINDOW)
        check_number("now", now, integer=False, low=0, high=MAX_TIMESTAMP)
        cutoff = now - older_than
        if dry_run:
            with self._read() as conn:
                return self._count_prunable(conn, cutoff)
        deleted = 0
        while True:
            with self._transaction(synchronous=True) as conn:
                pruned = conn.execute(
                    _PRUNE, {"cutoff": cutoff, "batch": _PRUNE_BATCH, "here": True}
                ).fetchone()
                batch = 0 if pruned is None else int(pruned["deleted"])
            deleted += batch
            if batch < _PRUNE_BATCH:
                return deleted
