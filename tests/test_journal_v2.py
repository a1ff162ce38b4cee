"""Journal schema version 2 (DESIGN §3.5): durability modes, the key namespace, fast audits."""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from idempotently import Journal, JournalCorruptError, JournalStats, JournalVersionError
from idempotently._journal import AttemptRecord, _sqlite
from idempotently._journal._sqlite import APPLICATION_ID, SCHEMA_VERSION, SqliteStore
from idempotently._vocabulary import STATUSES
from tests.journal_commands import (
    insert_operation,
    record_attempt,
    release_lease,
    set_status,
    take_lease,
)
from tests.test_journal import DAY, NOW, insert, new_operation

FINISHED = ("succeeded", "failed", "abandoned")

# Version 1's schema, as idempotently 0.x before schema version 2 wrote it.
V1_SCHEMA = """
CREATE TABLE operations (
    operation_id     TEXT PRIMARY KEY,
    key              TEXT NOT NULL UNIQUE,
    status           TEXT NOT NULL CHECK (status IN
                         ('pending', 'succeeded', 'failed', 'needs_reconcile', 'abandoned')),
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
    outcome     TEXT NOT NULL CHECK (outcome IN ('not_sent', 'maybe_delivered', 'answered')),
    status_code INTEGER,
    replayed    INTEGER NOT NULL DEFAULT 0,
    error       TEXT,
    wait        REAL,
    PRIMARY KEY (operation_id, number)
) WITHOUT ROWID;
PRAGMA application_id = {APPLICATION_ID};
PRAGMA user_version = 1;
PRAGMA journal_mode = WAL;
"""

# (status, created_at, lease_until, not_before, attempts as (status_code, replayed))
V1_ROWS: list[tuple[str, float, float, float | None, list[tuple[int | None, int]]]] = [
    ("pending", NOW, 0.0, None, [(None, 0), (503, 0)]),
    ("pending", NOW + 10, NOW + 99_999, None, [(409, 0)]),
    ("pending", NOW + 20, 0.0, NOW + 99_999, []),
    ("succeeded", NOW + 30, 0.0, None, [(423, 0), (201, 1)]),
    ("failed", NOW + 40, 0.0, None, [(400, 0)]),
    ("needs_reconcile", NOW + 50, 0.0, None, [(500, 1)]),
    ("abandoned", NOW + 60, 0.0, None, [(None, 0)]),
]


def v1_journal(path: Path) -> None:
    """A version-1 journal as the previous idempotently left it: schema, rows, no namespace."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.executescript(V1_SCHEMA.format(APPLICATION_ID=APPLICATION_ID))
        for number, (status, created, lease_until, not_before, attempts) in enumerate(V1_ROWS):
            operation_id = f"op-{number}"
            conn.execute(
                "INSERT INTO operations (operation_id, key, status, delivery, method, url,"
                " request_headers, request_body, fingerprint, profile, key_header, created_at,"
                " updated_at, key_expires_at, not_before, lease_until, attempt_count)"
                " VALUES (?, ?, ?, 'exactly_once', 'POST', 'https://api.example.com/v1/charges',"
                " '[]', x'7b7d', 'fp', 'generic', 'Idempotency-Key', ?, ?, ?, ?, ?, ?)",
                (
                    operation_id,
                    f"key-{operation_id}",
                    status,
                    created,
                    created,
                    created + DAY,
                    not_before,
                    lease_until,
                    len(attempts),
                ),
            )
            for attempt, (status_code, replayed) in enumerate(attempts, start=1):
                conn.execute(
                    "INSERT INTO attempts (operation_id, number, started_at, elapsed, outcome,"
                    " status_code, replayed) VALUES (?, ?, ?, 0.1, ?, ?, ?)",
                    (
                        operation_id,
                        attempt,
                        created,
                        "maybe_delivered" if status_code is None else "answered",
                        status_code,
                        replayed,
                    ),
                )


def user_version(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])


def schema_names(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}


def recount(conn: sqlite3.Connection, *, now: float, stuck_after: float = 60.0) -> JournalStats:
    """Every figure of stats(), the way version 1 computed it: by scanning the tables."""
    counts = dict.fromkeys(STATUSES, 0)
    for status, count in conn.execute("SELECT status, count(*) FROM operations GROUP BY status"):
        counts[status] = count
    attempts, answered, replayed, in_progress = conn.execute(
        "SELECT count(*), count(status_code), coalesce(sum(replayed), 0),"
        " coalesce(sum(status_code IN (409, 423)), 0) FROM attempts"
    ).fetchone()
    oldest, stuck = conn.execute(
        "SELECT min(created_at), coalesce(sum(lease_until < :now AND updated_at < :idle"
        " AND coalesce(not_before, 0) <= :now), 0) FROM operations WHERE status = 'pending'",
        {"now": now, "idle": now - stuck_after},
    ).fetchone()
    return JournalStats(
        counts=counts,
        operations=sum(counts.values()),
        attempts=attempts,
        answered_attempts=answered,
        replayed_attempts=replayed,
        in_progress_attempts=in_progress,
        oldest_pending_created_at=oldest,
        stuck=stuck,
        now=now,
    )


def prunable(conn: sqlite3.Connection, cutoff: float) -> int:
    return int(
        conn.execute(
            "SELECT count(*) FROM operations WHERE status IN ('succeeded', 'failed', 'abandoned')"
            " AND updated_at < ?",
            (cutoff,),
        ).fetchone()[0]
    )


def listed(
    conn: sqlite3.Connection,
    statuses: list[str] | None,
    since: float | None,
    limit: int | None,
    newest_first: bool,
) -> list[str]:
    """The listing as one query would give it: by creation (rowid) without a status; with
    statuses, pending operations by creation and the others by their last change."""
    sql, params = "SELECT operation_id FROM operations WHERE 1", []
    if statuses is not None:
        sql += f" AND status IN ({', '.join('?' for _ in statuses)})"
        params += statuses
    if since is not None:
        sql += " AND created_at >= ?"
        params.append(since)
    direction = "DESC" if newest_first else "ASC"
    if statuses is not None:
        at = "CASE WHEN status = 'pending' THEN created_at ELSE updated_at END"
        sql += f" ORDER BY {at} {direction}, rowid {direction}"
    else:
        sql += f" ORDER BY rowid {direction}"
    if limit is not None:
        sql += " LIMIT ?"
        params.append(limit)
    return [row[0] for row in conn.execute(sql, params)]


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "ops.db"


@contextlib.contextmanager
def traced(journal: Journal) -> Iterator[list[tuple[str, str]]]:
    """Each statement run, with the synchronous level in force when it ran."""
    statements: list[tuple[str, str]] = []
    store = journal._store
    store._conn.set_trace_callback(
        lambda sql: statements.append((" ".join(sql.split()), store._synchronous))
    )
    try:
        yield statements
    finally:
        store._conn.set_trace_callback(None)


# -- durability ----------------------------------------------------------------------


def test_durability_is_fsync_by_default(path: Path) -> None:
    """By default the row naming a key is committed under synchronous=FULL: fsync'd."""
    with Journal(path) as journal, traced(journal) as statements:
        insert(journal, new_operation())

    assert "fsync" == journal.durability
    row = next(level for sql, level in statements if sql.startswith("INSERT INTO operations"))
    assert "FULL" == row
    assert not journal._conn.in_transaction  # committed


def test_durability_os_commits_the_key_without_an_fsync(path: Path) -> None:
    """durability="os" commits the key's row (synchronous=NORMAL), never under FULL."""
    with Journal(path, durability="os") as journal, traced(journal) as statements:
        insert(journal, new_operation())

    assert "os" == journal.durability
    assert {"NORMAL"} == {
        level for sql, level in statements if not sql.startswith("PRAGMA synchronous")
    }
    with Journal(path, readonly=True) as reader:
        assert 1 == reader.counts()["pending"]


@pytest.mark.parametrize("durability", ["sync", "FSYNC", "", None, True])
def test_an_unknown_durability_is_a_value_error(path: Path, durability: object) -> None:
    """A durability other than "fsync" or "os" is refused, naming the argument and both values."""
    with pytest.raises(ValueError) as caught:
        Journal(path, durability=durability)  # type: ignore[arg-type]

    assert f"durability must be one of 'fsync', 'os', not {durability!r}" == str(caught.value)
    assert not path.exists()


# -- the key namespace -----------------------------------------------------------------


def test_a_new_journal_has_its_own_random_namespace(tmp_path: Path) -> None:
    """Each new journal draws a random (version 4) UUID namespace; no two share one."""
    with Journal(tmp_path / "a.db") as first, Journal(tmp_path / "b.db") as second:
        assert (4, 4) == (first.namespace.version, second.namespace.version)
        assert first.namespace != second.namespace
    with Journal(":memory:") as in_memory:
        assert 4 == in_memory.namespace.version


def test_the_namespace_never_changes(path: Path) -> None:
    """Reopened, read-only, written to or pruned: a journal keeps the namespace it began with."""
    with Journal(path) as journal:
        made = journal.namespace
        insert(journal, new_operation())
        set_status(journal, "op-1", "succeeded", reason=None, now=NOW)
        journal.prune(older_than=0, now=NOW + 1)
    with Journal(path) as reopened, Journal(path, readonly=True) as reader:
        assert (made, made) == (reopened.namespace, reader.namespace)


def test_a_missing_namespace_is_a_corrupt_error(path: Path) -> None:
    """A v2 journal whose namespace was lost is refused: its derived keys would change."""
    Journal(path).close()
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE journal_meta SET value = 'not-a-uuid'")

    with pytest.raises(JournalCorruptError, match="no valid key namespace"):
        Journal(path)


# -- version 1 journals ------------------------------------------------------------------


def test_a_version_1_journal_is_upgraded_when_opened_to_write(path: Path) -> None:
    """Opened to write, a v1 journal becomes v2: its rows intact, counts right, a namespace."""
    v1_journal(path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        before = recount(conn, now=NOW + 600)
        rows = conn.execute("SELECT * FROM operations ORDER BY rowid").fetchall()

    with Journal(path) as journal:
        namespace = journal.namespace
        after = journal.stats(now=NOW + 600)
        dry_run = journal.prune(older_than=0, now=NOW + 600, dry_run=True)

    assert 5 == SCHEMA_VERSION == user_version(path)
    assert 4 == namespace.version
    assert before == after
    assert 3 == dry_run
    with contextlib.closing(sqlite3.connect(path)) as conn:
        upgraded = conn.execute("SELECT * FROM operations ORDER BY rowid").fetchall()
    # Every row intact; the columns later versions add read as NULL.
    assert rows == [row[: len(rows[0])] for row in upgraded]
    assert all(value is None for row in upgraded for value in row[len(rows[0]) :])
    with Journal(path) as reopened:
        assert namespace == reopened.namespace


def test_an_upgraded_journal_counts_what_follows(path: Path) -> None:
    """After the upgrade, new writes and prunes keep every figure equal to a recount."""
    v1_journal(path)
    with Journal(path) as journal:
        insert(journal, new_operation("op-new", created_at=NOW + 70))
        record_attempt(
            journal,
            "op-0",
            AttemptRecord(
                started_at=NOW, elapsed=0.1, outcome="answered", status_code=409, status="failed"
            ),
            now=NOW + 80,
        )
        journal.prune(older_than=0, now=NOW + 65)

        assert recount(journal._conn, now=NOW + 600) == journal.stats(now=NOW + 600)


def test_the_upgrade_is_all_or_nothing(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An upgrade that fails halfway leaves the v1 journal as it was; the next open upgrades it."""
    v1_journal(path)

    def fail() -> uuid.UUID:
        raise RuntimeError("no entropy")

    with monkeypatch.context() as patch:
        patch.setattr(uuid, "uuid4", fail)
        with pytest.raises(RuntimeError, match="no entropy"):
            Journal(path)

    assert 1 == user_version(path)
    assert {"journal_meta", "journal_counts", "operations_pending"}.isdisjoint(schema_names(path))
    with Journal(path) as journal:
        assert 4 == journal.namespace.version
        assert 7 == sum(journal.counts().values())


def test_a_version_1_journal_opened_read_only_is_read_not_upgraded(path: Path) -> None:
    """readonly=True reads a v1 journal in full, leaves it v1, and has no namespace to give."""
    v1_journal(path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        expected = recount(conn, now=NOW + 600)
    before = path.read_bytes()

    with Journal(path, readonly=True) as journal:
        assert expected == journal.stats(now=NOW + 600)
        assert expected.counts == journal.counts()
        assert 3 == journal.prune(older_than=0, now=NOW + 600, dry_run=True)
        assert ["op-2", "op-1", "op-0"] == [
            operation.operation_id for operation in journal.operations(status="pending")
        ]
        operation = journal.operation("op-3")
        assert operation is not None
        assert [423, 201] == [attempt.status_code for attempt in operation.attempts]
        with pytest.raises(JournalVersionError, match="open it once without readonly=True"):
            journal.namespace  # noqa: B018

    assert before == path.read_bytes()
    assert 1 == user_version(path)


def test_two_openers_upgrade_a_version_1_journal_once(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process upgrading the file while we open it: one upgrade, one namespace."""
    v1_journal(path)
    real_table_names = SqliteStore._table_names
    others: list[Journal] = []
    raced: list[bool] = []

    def table_names(store: SqliteStore) -> set[str]:
        if not raced:
            raced.append(True)
            # Between our read of version 1 and our upgrade, another opener upgrades it.
            others.append(Journal(path))
        return real_table_names(store)

    monkeypatch.setattr(SqliteStore, "_table_names", table_names)

    with Journal(path) as journal:
        assert others[0].namespace == journal.namespace
        assert 7 == sum(journal.counts().values())
    others[0].close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert [("namespace",)] == conn.execute("SELECT name FROM journal_meta").fetchall()


def test_an_older_version_creating_the_file_first_is_upgraded(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older idempotently creating the same new journal first: we upgrade what it made."""
    real_ensure_wal = SqliteStore._ensure_wal
    raced: list[bool] = []

    def ensure_wal(journal: SqliteStore) -> None:
        real_ensure_wal(journal)
        if not raced:
            raced.append(True)
            v1_journal(path)  # between our look at the empty file and our schema

    monkeypatch.setattr(SqliteStore, "_ensure_wal", ensure_wal)

    with Journal(path) as journal:
        assert 4 == journal.namespace.version
        assert 7 == sum(journal.counts().values())
    assert [True] == raced
    assert SCHEMA_VERSION == user_version(path)


def test_a_journal_without_its_counts_is_a_corrupt_error(path: Path) -> None:
    """A version-2 journal missing a table, index or trigger its audits rely on is refused."""
    Journal(path).close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("DROP TRIGGER count_new_attempt")

    with pytest.raises(JournalCorruptError, match="missing journal tables"):
        Journal(path)


def test_damaged_counts_are_a_corrupt_error(path: Path) -> None:
    """A count that no journal could hold (negative) is a JournalCorruptError, not a figure."""
    with Journal(path) as journal:
        insert(journal, new_operation())
        journal._conn.execute("UPDATE journal_counts SET pending = -1")

        for call in (journal.counts, lambda: journal.stats(now=NOW)):
            with pytest.raises(JournalCorruptError, match="damaged counts"):
                call()


# -- the counts stay exact ---------------------------------------------------------------

IDS = [f"op-{number}" for number in range(4)]
TIMES = st.sampled_from([NOW + 10 * step for step in range(8)])
MAYBE_TIMES = st.none() | TIMES
STATUS = st.sampled_from(STATUSES)
CODES = st.sampled_from([None, 201, 400, 404, 409, 423, 500, 503])

ACTIONS = st.one_of(
    st.tuples(st.just("insert"), st.sampled_from(IDS), TIMES, st.sampled_from(["", "x"]), TIMES),
    st.tuples(
        st.just("attempt"),
        st.sampled_from(IDS),
        CODES,
        st.booleans(),
        STATUS,
        st.sampled_from([0.0, NOW + 35]),
        MAYBE_TIMES,
        TIMES,
    ),
    st.tuples(st.just("set_status"), st.sampled_from(IDS), STATUS, STATUS, TIMES),
    st.tuples(st.just("take_lease"), st.sampled_from(IDS), TIMES, TIMES),
    st.tuples(st.just("settle"), st.sampled_from(IDS), STATUS, TIMES),
    st.tuples(st.just("release"), st.sampled_from(IDS), st.sampled_from(["owner", "other"])),
    st.tuples(st.just("prune"), st.sampled_from([0.0, 15.0, 40.0]), TIMES),
    st.tuples(
        st.just("list"),
        st.none() | st.lists(STATUS, max_size=3),
        MAYBE_TIMES,
        st.none() | st.integers(1, 4),
        st.booleans(),
    ),
)


def apply(journal: Journal, action: tuple[Any, ...]) -> None:
    """One journal write the flow performs (or an audit), as drawn."""
    match action:
        case ("insert", operation_id, created, key_suffix, lease_until):
            insert_operation(
                journal,
                new_operation(operation_id, f"key-{operation_id}{key_suffix}", created_at=created),
                owner="owner",
                lease_until=lease_until,
            )
        case ("attempt", operation_id, code, replayed, status, lease_until, not_before, now):
            record_attempt(
                journal,
                operation_id,
                AttemptRecord(
                    started_at=now,
                    elapsed=0.1,
                    outcome="maybe_delivered" if code is None else "answered",
                    status_code=code,
                    replayed=replayed,
                    status=status,
                    lease_until=lease_until,
                    not_before=not_before,
                    response_status=code,
                ),
                now=now,
            )
        case ("set_status", operation_id, status, expect, now):
            set_status(journal, operation_id, status, reason="drawn", now=now, expect=expect)
        case ("take_lease", operation_id, lease_until, now):
            operation = journal.operation(operation_id)
            if operation is not None:
                take_lease(journal, operation, owner="owner", lease_until=lease_until, now=now)
        case ("settle", operation_id, status, now):
            set_status(
                journal,
                operation_id,
                status,
                reason="reconciled",
                now=now,
                expect="needs_reconcile",
            )
        case ("release", operation_id, owner):
            release_lease(journal, operation_id, owner=owner)
        case ("prune", older_than, now):
            expected = prunable(journal._conn, now - older_than)
            assert expected == journal.prune(older_than=older_than, now=now, dry_run=True)
            assert expected == journal.prune(older_than=older_than, now=now)
        case ("list", statuses, since, limit, newest_first):
            got = journal.operations(
                status=statuses, since=since, limit=limit, newest_first=newest_first
            )
            assert listed(journal._conn, statuses, since, limit, newest_first) == [
                operation.operation_id for operation in got
            ]


# Every counter moved at least once, and listings that interleave two statuses.
@example(
    actions=[
        ("insert", "op-0", NOW, "", NOW + 30),
        ("insert", "op-1", NOW + 10, "", 0.0),
        ("insert", "op-2", NOW + 20, "", 0.0),
        ("insert", "op-3", NOW + 20, "", 0.0),
        ("attempt", "op-1", 423, True, "failed", 0.0, None, NOW + 30),
        ("attempt", "op-0", 409, False, "succeeded", 0.0, None, NOW + 40),
        ("attempt", "op-2", None, False, "succeeded", 0.0, None, NOW + 50),
        ("attempt", "op-3", 500, False, "needs_reconcile", 0.0, None, NOW + 50),
        ("list", ["succeeded", "failed", "succeeded"], None, None, True),
        ("list", ["failed", "succeeded"], None, 2, False),
        ("settle", "op-3", "failed", NOW + 60),
        ("prune", 15.0, NOW + 50),
    ],
    now=NOW + 70,
    stuck_after=0.0,
)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(ACTIONS, max_size=40), now=TIMES, stuck_after=st.sampled_from([0.0, 25.0]))
def test_every_figure_equals_a_recount(
    actions: list[tuple[Any, ...]], now: float, stuck_after: float
) -> None:
    """After any mix of the flow's writes and prunes, stats() equals a scan of the tables."""
    # Batches of one or two: each prune takes several transactions.
    with mock.patch.object(_sqlite, "_PRUNE_BATCH_SIZES", (1, 2)), Journal(":memory:") as journal:
        for action in actions:
            apply(journal, action)
            assert recount(journal._conn, now=now, stuck_after=stuck_after) == journal.stats(
                now=now, stuck_after=stuck_after
            )


# -- prune in short transactions -----------------------------------------------------------


def finished_operations(journal: Journal, count: int) -> None:
    for number in range(count):
        operation_id = f"op-{number:03}"
        insert(journal, new_operation(operation_id, created_at=NOW + number))
        record_attempt(
            journal,
            operation_id,
            AttemptRecord(started_at=NOW, elapsed=0.1, outcome="answered", status="succeeded"),
            now=NOW + number,
        )


@contextlib.contextmanager
def deleted_per_transaction(journal: Journal) -> Iterator[list[int]]:
    """How many operations each write transaction removed."""
    real = journal._store._write
    removed: list[int] = []

    def count() -> int:
        return int(journal._conn.execute("SELECT count(*) FROM operations").fetchone()[0])

    @contextlib.contextmanager
    def write(**options: Any) -> Iterator[sqlite3.Connection]:
        before = count()
        with real(**options) as conn:
            yield conn
        removed.append(before - count())

    with mock.patch.object(journal._store, "_write", write):
        yield removed


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (1e9, [2, 8, 8, 8, 4]),  # quick batches grow to the largest
        (0.0, [2] * 15 + [0]),  # slow ones stay at the smallest, until a short batch
    ],
    ids=["quick", "slow"],
)
def test_prune_deletes_in_batches_sized_by_time(
    path: Path, seconds: float, expected: list[int]
) -> None:
    """prune holds the write lock per batch, sized from the last batch's time, to the end."""
    with (
        mock.patch.object(_sqlite, "_PRUNE_BATCH_SIZES", (2, 8)),
        mock.patch.object(_sqlite, "_PRUNE_BATCH_SECONDS", seconds),
        Journal(path) as journal,
    ):
        finished_operations(journal, 30)
        insert(journal, new_operation("pending", created_at=NOW))
        with deleted_per_transaction(journal) as removed:
            assert 30 == journal.prune(older_than=0, now=NOW + 100)

        assert expected == removed
        assert ["pending"] == [operation.operation_id for operation in journal.operations()]
        assert [] == journal._conn.execute("SELECT * FROM attempts").fetchall()


def test_prune_deletes_the_longest_idle_first(path: Path) -> None:
    """Each batch takes the operations idle longest, so a prune cut short frees the oldest."""
    with mock.patch.object(_sqlite, "_PRUNE_BATCH_SIZES", (3, 3)), Journal(path) as journal:
        for number in range(6):
            insert(journal, new_operation(f"op-{number}", created_at=NOW))
            set_status(journal, f"op-{number}", "succeeded", reason=None, now=NOW + 6 - number)
        real = journal._store._write
        calls = 0

        @contextlib.contextmanager
        def one_batch_only(**options: Any) -> Iterator[sqlite3.Connection]:
            nonlocal calls
            calls += 1
            if calls > 1:
                raise RuntimeError("interrupted")
            with real(**options) as conn:
                yield conn

        with (
            mock.patch.object(journal._store, "_write", one_batch_only),
            pytest.raises(RuntimeError),
        ):
            journal.prune(older_than=0, now=NOW + 100)

        assert ["op-0", "op-1", "op-2"] == [
            operation.operation_id for operation in journal.operations(newest_first=False)
        ]


# -- the audits read indexes, never whole tables ---------------------------------------------


def plans(journal: Journal, call: Callable[[], object]) -> list[str]:
    """SQLite's plan for every SELECT ``call`` runs."""
    with traced(journal) as statements:
        call()
    found = []
    for sql, _ in statements:
        if sql.startswith("SELECT"):
            found += [row[3] for row in journal._conn.execute(f"EXPLAIN QUERY PLAN {sql}")]
    return found


# Each audit, and the index (or table) it must be answered from.
AUDIT_CALLS: dict[str, tuple[Callable[[Journal], object], str]] = {
    "counts": (lambda journal: journal.counts(), "journal_counts"),
    "stats": (lambda journal: journal.stats(now=NOW), "COVERING INDEX operations_pending"),
    "prune dry run, older side": (
        lambda journal: journal.prune(older_than=0, now=NOW + 0.5, dry_run=True),
        "COVERING INDEX operations_settled (status=? AND updated_at<?)",
    ),
    "prune dry run, newer side": (
        lambda journal: journal.prune(older_than=0, now=NOW + 1.5, dry_run=True),
        "COVERING INDEX operations_settled (status=? AND updated_at>?)",
    ),
    "show by id": (lambda journal: journal.operation("op-001"), "(operation_id=?)"),
    "show by key": (lambda journal: journal.operation("key-op-001"), "(key=?)"),
    **{
        f"list {status} {order}": (
            lambda journal, status=status, newest_first=order == "newest": journal.operations(
                status=status, limit=50, newest_first=newest_first
            ),
            "INDEX operations_pending" if status == "pending" else "INDEX operations_settled",
        )
        for status in (*STATUSES, ("succeeded", "failed"))
        for order in ("newest", "oldest")
    },
}


@pytest.mark.parametrize(("call", "index"), AUDIT_CALLS.values(), ids=list(AUDIT_CALLS))
def test_audits_never_scan_a_table_or_sort_it(
    path: Path, call: Callable[[Journal], object], index: str
) -> None:
    """counts, stats, the prune dry run, show and list --status search their index, unsorted.

    Scanning the pending operations' own partial index is the one scan allowed:
    it holds only the pending operations.
    """
    with Journal(path) as journal:
        finished_operations(journal, 3)  # idle since NOW, NOW + 1, NOW + 2
        found = plans(journal, lambda: call(journal))

    assert any(index in line for line in found), found
    # Listing pending operations sorts ties of their creation time by rowid: a sort of
    # the pending operations only.
    ties = "USE TEMP B-TREE FOR RIGHT PART OF ORDER BY"
    assert [] == [
        line
        for line in found
        if (line.startswith("SCAN") and not line.endswith("INDEX operations_pending"))
        or ("TEMP B-TREE" in line and line != ties)
    ]


@pytest.mark.parametrize(
    "cutoff", [NOW - 1, NOW, NOW + 0.5, NOW + 3, NOW + 7, NOW + 9, NOW + 9.5, NOW + 20]
)
def test_the_prune_dry_run_counts_exactly_on_either_side(
    journal_target: str, cutoff: float
) -> None:
    """The dry run's count equals the rows a prune deletes, wherever the window falls."""
    expected = sum(NOW + number < cutoff for number in range(10))
    with Journal(journal_target) as journal:
        finished_operations(journal, 10)  # idle since NOW, NOW + 1, ... NOW + 9
        insert(journal, new_operation("pending", created_at=NOW - 100))

        assert expected == journal.prune(older_than=0, now=cutoff, dry_run=True)
        assert expected == journal.prune(older_than=0, now=cutoff)
        assert 10 - expected + 1 == len(journal.operations())


@contextlib.contextmanager
def a_write_after_the_counts(
    monkeypatch: pytest.MonkeyPatch, path: Path, write: Callable[[Journal], object]
) -> Iterator[None]:
    """Another process writes once, just after an audit has read the counts."""
    real = SqliteStore._counters
    written: list[bool] = []

    def counters(journal: SqliteStore) -> dict[str, int]:
        values = real(journal)
        if not written:
            written.append(True)
            with Journal(path) as other:
                write(other)
        return values

    monkeypatch.setattr(SqliteStore, "_counters", counters)
    yield
    assert written


def test_stats_is_one_view_while_others_write(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key journaled while stats() runs is in none of its figures or in all of them."""
    with Journal(path) as journal:
        with a_write_after_the_counts(
            monkeypatch, path, lambda other: insert(other, new_operation(created_at=NOW - 600))
        ):
            stats = journal.stats(now=NOW)

        assert (0, 0, None) == (
            stats.counts["pending"],
            stats.stuck,
            stats.oldest_pending_created_at,
        )


def test_the_prune_dry_run_is_one_view_while_others_write(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operation finishing while the dry run counts does not skew its count."""

    def finish_one(other: Journal) -> None:
        insert(other, new_operation("late", created_at=NOW))
        set_status(other, "late", "succeeded", reason=None, now=NOW + 8)

    with Journal(path) as journal:
        finished_operations(journal, 10)  # idle since NOW, NOW + 1, ... NOW + 9
        with a_write_after_the_counts(monkeypatch, path, finish_one):
            assert 7 == journal.prune(older_than=0, now=NOW + 7, dry_run=True)
