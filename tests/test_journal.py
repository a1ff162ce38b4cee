"""The SQLite journal (DESIGN §3.5): private, versioned, shared safely, never silently lost."""

from __future__ import annotations

import contextlib
import json
import os
import random
import sqlite3
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from idempotently import (
    IdempotentlyError,
    Journal,
    JournalCorruptError,
    JournalError,
    JournalMissingError,
    JournalVersionError,
    JournalWriteError,
    Operation,
)
from idempotently._journal import AttemptRecord, NewOperation
from idempotently._journal._sqlite import SCHEMA_VERSION, SqliteStore
from idempotently._rows import headers_json as _headers_json
from idempotently._vocabulary import STATUSES
from tests.journal_commands import insert_operation, record_attempt, take_lease

NOW = 1_700_000_000.0
DAY = 24 * 60 * 60.0


def new_operation(
    operation_id: str = "op-1",
    key: str | None = None,
    *,
    created_at: float = NOW,
    body: bytes = b'{"amount": 1000}',
    deadline_at: float | None = None,
) -> NewOperation:
    return NewOperation(
        operation_id=operation_id,
        key=key if key is not None else f"key-{operation_id}",
        delivery="exactly_once",
        method="POST",
        url="https://api.example.com/v1/charges",
        request_headers=[("content-type", "application/json"), ("idempotency-key", "k")],
        request_body=body,
        fingerprint=f"fp-{operation_id}",
        profile="generic",
        key_header="Idempotency-Key",
        created_at=created_at,
        key_expires_at=created_at + DAY,
        deadline_at=deadline_at,
    )


def insert(journal: Journal, new: NewOperation, *, lease_until: float = 0.0) -> bool:
    return insert_operation(journal, new, owner="test-owner", lease_until=lease_until)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "ops.db"


@pytest.fixture
def journal(journal_target: str) -> Iterator[Journal]:
    """A new journal on each store (SQLite file, PostgreSQL database)."""
    with Journal(journal_target) as opened:
        yield opened


# -- the file ------------------------------------------------------------------------


def test_a_new_journal_is_private(path: Path) -> None:
    """A new journal file is created with mode 0600, whatever the umask allows."""
    previous = os.umask(0o022)
    try:
        Journal(path).close()
    finally:
        os.umask(previous)

    assert 0o600 == mode(path)


def test_the_wal_file_is_private_too(path: Path) -> None:
    """The write-ahead log (and shared-memory index) of an open journal are 0600 too."""
    previous = os.umask(0o022)
    try:
        with Journal(path) as journal:
            insert(journal, new_operation())
            wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")

            assert (True, True) == (wal.exists(), shm.exists())
            assert (0o600, 0o600) == (mode(wal), mode(shm))
    finally:
        os.umask(previous)


def test_journal_is_in_wal_mode(path: Path) -> None:
    """The journal runs in WAL mode, persistently (seen from another connection)."""
    Journal(path).close()
    with contextlib.closing(sqlite3.connect(path)) as other:
        assert "wal" == other.execute("PRAGMA journal_mode").fetchone()[0]


def test_reopening_keeps_the_data(journal_target: str) -> None:
    """Closing and reopening a journal keeps every operation and attempt."""
    with Journal(journal_target) as journal:
        insert(journal, new_operation())
        record_attempt(
            journal,
            "op-1",
            AttemptRecord(started_at=NOW, elapsed=0.1, outcome="not_sent"),
            now=NOW,
        )

    with Journal(journal_target) as reopened:
        operation = reopened.operation("op-1")

    assert operation is not None
    assert ("key-op-1", b'{"amount": 1000}', 1) == (
        operation.key,
        operation.request_body,
        len(operation.attempts),
    )


def test_journal_from_a_newer_version_is_refused_untouched(path: Path) -> None:
    """A journal with a newer schema is refused with a clear error and left byte-for-byte."""
    Journal(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    before = path.read_bytes()

    with pytest.raises(JournalVersionError) as caught:
        Journal(path)

    message = str(caught.value)
    assert str(path) in message
    assert "upgrade" in message.lower()
    assert before == path.read_bytes()


def test_random_bytes_are_not_a_journal(path: Path) -> None:
    """A file of random bytes is reported as corrupt, naming the file, and not rewritten."""
    path.write_bytes(random.Random(0).randbytes(8192))
    before = path.read_bytes()

    with pytest.raises(JournalCorruptError) as caught:
        Journal(path)

    assert str(path) in str(caught.value)
    assert before == path.read_bytes()


def test_another_apps_database_is_not_a_journal(path: Path) -> None:
    """An SQLite database of some other application is refused, not adopted: only
    `idempotently migrate` adopts one, and the error says so."""
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE foo (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO foo (name) VALUES ('bar')")
    conn.close()
    before = path.read_bytes()

    with pytest.raises(JournalMissingError) as caught:
        Journal(path)

    assert str(path) in str(caught.value)
    assert "migrate" in str(caught.value)
    assert before == path.read_bytes()


def test_another_apps_versioned_database_is_not_a_journal(path: Path) -> None:
    """A foreign database with its own ``user_version`` is not mistaken for a newer journal."""
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE foo (id INTEGER PRIMARY KEY)")
        conn.execute("PRAGMA user_version = 7")
    conn.close()

    with pytest.raises(JournalMissingError, match="migrate"):
        Journal(path)


def test_journal_errors_share_one_root() -> None:
    """Every journal error is a JournalError and an IdempotentlyError."""
    for error in (JournalVersionError, JournalCorruptError, JournalWriteError):
        assert issubclass(error, JournalError)
        assert issubclass(error, IdempotentlyError)


# -- writes --------------------------------------------------------------------------


def test_insert_records_a_pending_operation_with_its_lease(journal: Journal) -> None:
    """A new operation is pending, holds its key and bytes, and the inserter's lease."""
    assert insert(journal, new_operation(deadline_at=NOW + 60), lease_until=NOW + 30)

    operation = journal.operation("op-1")

    assert operation is not None
    assert (
        "pending",
        "key-op-1",
        b'{"amount": 1000}',
        (("content-type", "application/json"), ("idempotency-key", "k")),
        "test-owner",
        NOW + 30,
        NOW + 60,
        0,
        (),
    ) == (
        operation.status,
        operation.key,
        operation.request_body,
        operation.request_headers,
        operation.lease_owner,
        operation.lease_until,
        operation.deadline_at,
        operation.attempt_count,
        operation.attempts,
    )


def test_duplicate_operation_id_is_refused(journal: Journal) -> None:
    """A second insert with the same operation id returns False and keeps the first row."""
    assert insert(journal, new_operation("op-1", "key-a", body=b"first"))

    assert not insert(journal, new_operation("op-1", "key-b", body=b"second"))
    operation = journal.operation("op-1")
    assert operation is not None
    assert ("key-a", b"first") == (operation.key, operation.request_body)
    assert None is journal.operation("key-b")


def test_duplicate_key_is_refused(journal: Journal) -> None:
    """A second operation with the same key returns False and keeps the first row."""
    assert insert(journal, new_operation("op-1", "key-a", body=b"first"))

    assert not insert(journal, new_operation("op-2", "key-a", body=b"second"))
    assert None is journal.operation("op-2")
    assert 1 == len(journal.operations())


def test_attempts_are_numbered_and_update_the_operation(journal: Journal) -> None:
    """Each attempt is journaled with its number; the operation carries the latest state."""
    insert(journal, new_operation(), lease_until=NOW + 30)
    record_attempt(
        journal,
        "op-1",
        AttemptRecord(
            started_at=NOW,
            elapsed=0.5,
            outcome="answered",
            status_code=503,
            wait=0.25,
            reason="503",
            lease_until=NOW + 60,
        ),
        now=NOW + 1,
    )
    record_attempt(
        journal,
        "op-1",
        AttemptRecord(
            started_at=NOW + 2,
            elapsed=1.0,
            outcome="maybe_delivered",
            error="ReadTimeout: timed out",
            wait=0.5,
            lease_until=NOW + 60,
        ),
        now=NOW + 3,
    )
    record_attempt(
        journal,
        "op-1",
        AttemptRecord(
            started_at=NOW + 4,
            elapsed=0.2,
            outcome="answered",
            status_code=201,
            replayed=True,
            status="succeeded",
            response_status=201,
            response_headers=[("content-type", "application/json")],
            response_body=b'{"id": "ch_1"}',
        ),
        now=NOW + 5,
    )

    operation = journal.operation("op-1")

    assert operation is not None
    assert [
        (1, "answered", 503, False, None),
        (2, "maybe_delivered", None, False, "ReadTimeout: timed out"),
        (3, "answered", 201, True, None),
    ] == [(a.number, a.outcome, a.status_code, a.replayed, a.error) for a in operation.attempts]
    assert (
        "succeeded",
        3,
        201,
        201,
        (("content-type", "application/json"),),
        b'{"id": "ch_1"}',
        NOW + 5,
        0.0,
        None,
    ) == (
        operation.status,
        operation.attempt_count,
        operation.last_status_code,
        operation.response_status,
        operation.response_headers,
        operation.response_body,
        operation.updated_at,
        operation.lease_until,
        operation.lease_owner,
    )


def test_a_network_error_keeps_the_last_status_code(journal: Journal) -> None:
    """``last_status_code`` remembers the last answer across later network errors."""
    insert(journal, new_operation())
    record_attempt(
        journal,
        "op-1",
        AttemptRecord(started_at=NOW, elapsed=0.1, outcome="answered", status_code=503),
        now=NOW,
    )
    record_attempt(
        journal,
        "op-1",
        AttemptRecord(
            started_at=NOW + 1, elapsed=0.1, outcome="maybe_delivered", not_before=NOW + 9
        ),
        now=NOW + 1,
    )

    operation = journal.operation("op-1")

    assert operation is not None
    assert (503, NOW + 9, "pending") == (
        operation.last_status_code,
        operation.not_before,
        operation.status,
    )


def test_a_retrying_caller_keeps_its_lease(journal: Journal) -> None:
    """An attempt recorded with a lease keeps the owner; one without releases it."""
    insert(journal, new_operation(), lease_until=NOW + 30)
    record_attempt(
        journal,
        "op-1",
        AttemptRecord(started_at=NOW, elapsed=0.1, outcome="not_sent", lease_until=NOW + 60),
        now=NOW,
    )
    kept = journal.operation("op-1")
    record_attempt(
        journal, "op-1", AttemptRecord(started_at=NOW, elapsed=0.1, outcome="not_sent"), now=NOW
    )
    released = journal.operation("op-1")

    assert kept is not None and released is not None
    assert (("test-owner", NOW + 60), (None, 0.0)) == (
        (kept.lease_owner, kept.lease_until),
        (released.lease_owner, released.lease_until),
    )


# -- reading -------------------------------------------------------------------------


@pytest.fixture
def populated(journal: Journal) -> Journal:
    """Five operations created a minute apart: two pending, then one of each end state."""
    settled = {"op-3": "succeeded", "op-4": "failed", "op-5": "needs_reconcile"}
    for number in range(1, 6):
        operation_id = f"op-{number}"
        insert(journal, new_operation(operation_id, created_at=NOW + 60 * number))
        record_attempt(
            journal,
            operation_id,
            AttemptRecord(
                started_at=NOW + 60 * number,
                elapsed=0.1,
                outcome="answered",
                status_code=503,
                status=settled.get(operation_id, "pending"),  # type: ignore[arg-type]
            ),
            now=NOW + 60 * number + 1,
        )
    return journal


def ids(operations: list[Operation]) -> list[str]:
    return [operation.operation_id for operation in operations]


def test_operations_are_listed_newest_first(populated: Journal) -> None:
    """Listing returns every operation, newest first, without attempts."""
    operations = populated.operations()

    assert ["op-5", "op-4", "op-3", "op-2", "op-1"] == ids(operations)
    assert all(() == operation.attempts for operation in operations)


def test_operations_oldest_first(populated: Journal) -> None:
    """``newest_first=False`` lists in creation order."""
    assert ["op-1", "op-2", "op-3", "op-4", "op-5"] == ids(populated.operations(newest_first=False))


def test_operations_by_status(populated: Journal) -> None:
    """``status=`` filters by one status or several."""
    assert ["op-2", "op-1"] == ids(populated.operations(status="pending"))
    assert ["op-4", "op-3"] == ids(populated.operations(status=["succeeded", "failed"]))
    assert [] == populated.operations(status="abandoned")


def test_operations_since(populated: Journal) -> None:
    """``since=`` keeps operations created at or after that moment."""
    assert ["op-5", "op-4"] == ids(populated.operations(since=NOW + 240))
    assert ["op-5", "op-4"] == ids(populated.operations(since=NOW + 181))
    assert [] == populated.operations(since=NOW + 301)


def test_operations_limit(populated: Journal) -> None:
    """``limit=`` caps the listing, after filtering and ordering."""
    assert ["op-5", "op-4"] == ids(populated.operations(limit=2))
    assert ["op-2"] == ids(populated.operations(status="pending", limit=1))


@pytest.mark.parametrize("status", ["bogus", ["pending", "done"], "PENDING"])
def test_unknown_status_is_a_value_error(journal: Journal, status: str | list[str]) -> None:
    """An unknown status is refused, naming the valid ones."""
    with pytest.raises(ValueError, match="needs_reconcile"):
        journal.operations(status=status)  # type: ignore[arg-type]


def test_counts_of_an_empty_journal_are_all_zero(journal: Journal) -> None:
    """Every status is counted, zero included, even in an empty journal."""
    assert dict.fromkeys(STATUSES, 0) == journal.counts()


def test_counts_by_status(populated: Journal) -> None:
    """Counts per status, with the statuses nobody is in shown as zero."""
    assert {
        "pending": 2,
        "succeeded": 1,
        "failed": 1,
        "needs_reconcile": 1,
        "abandoned": 0,
    } == populated.counts()


def test_operation_by_id_or_by_key(populated: Journal) -> None:
    """One operation is found by its id or by its key, with its attempts."""
    by_id = populated.operation("op-3")
    by_key = populated.operation("key-op-3")

    assert by_id is not None
    assert by_id == by_key
    assert [1] == [attempt.number for attempt in by_id.attempts]


def test_unknown_operation_is_none(populated: Journal) -> None:
    """An id or key nobody has gives None."""
    assert None is populated.operation("op-404")


# -- leases --------------------------------------------------------------------------


def test_lease_compare_and_swap_has_one_winner(journal: Journal) -> None:
    """Two resumers reading the same lease: only the first compare-and-swap wins."""
    insert(journal, new_operation(), lease_until=NOW - 10)  # a crashed caller's stale lease
    first_read = journal.operation("op-1")
    second_read = journal.operation("op-1")
    assert first_read is not None and second_read is not None

    won = take_lease(journal, first_read, owner="resumer-a", lease_until=NOW + 30, now=NOW)
    lost = take_lease(journal, second_read, owner="resumer-b", lease_until=NOW + 30, now=NOW)

    operation = journal.operation("op-1")
    assert operation is not None
    assert (True, False) == (won, lost)
    assert ("resumer-a", NOW + 30) == (operation.lease_owner, operation.lease_until)


def test_lease_is_not_taken_on_a_finished_operation(journal: Journal) -> None:
    """A finished operation's lease cannot be taken: nothing to resend."""
    insert(journal, new_operation())
    record_attempt(
        journal,
        "op-1",
        AttemptRecord(started_at=NOW, elapsed=0.1, outcome="answered", status="succeeded"),
        now=NOW,
    )
    operation = journal.operation("op-1")
    assert operation is not None

    assert not take_lease(journal, operation, owner="resumer", lease_until=NOW + 30, now=NOW)


def test_threads_racing_for_a_lease_have_one_winner(journal: Journal) -> None:
    """Eight threads with the same snapshot: exactly one takes the lease."""
    insert(journal, new_operation(), lease_until=NOW - 10)
    snapshot = journal.operation("op-1")
    assert snapshot is not None
    start = threading.Barrier(8)
    results: list[bool] = []

    def race(owner: str) -> None:
        start.wait()
        results.append(take_lease(journal, snapshot, owner=owner, lease_until=NOW + 30, now=NOW))

    threads = [threading.Thread(target=race, args=(f"t{n}",)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert [True] == [result for result in results if result]
    assert 8 == len(results)


# -- failures and concurrency ----------------------------------------------------------


def test_a_locked_journal_raises_a_write_error_and_loses_nothing(path: Path) -> None:
    """A write that cannot get the lock raises JournalWriteError; earlier data stands."""
    with Journal(path, busy_timeout=0.05) as journal:
        insert(journal, new_operation("op-1"))
        blocker = sqlite3.connect(path, isolation_level=None)
        try:
            blocker.execute("BEGIN EXCLUSIVE")
            with pytest.raises(JournalWriteError) as caught:
                insert(journal, new_operation("op-2"))
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()

        message = str(caught.value)
        assert str(path) in message
        assert "busy_timeout" in message
        assert ["op-1"] == ids(journal.operations())
        # usable again once the lock is gone
        assert insert(journal, new_operation("op-3", created_at=NOW + 1))
        assert ["op-3", "op-1"] == ids(journal.operations())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode")
def test_a_read_only_journal_raises_a_write_error(path: Path) -> None:
    """A read-only journal file raises JournalWriteError on write; reads still work."""
    with Journal(path) as journal:
        insert(journal, new_operation("op-1"))
    path.chmod(0o400)
    try:
        with Journal(path) as journal:
            with pytest.raises(JournalWriteError, match="writable"):
                insert(journal, new_operation("op-2"))
            assert ["op-1"] == ids(journal.operations())
    finally:
        path.chmod(0o600)


def test_threads_share_one_journal(journal: Journal) -> None:
    """Four threads inserting 50 operations each into one Journal lose none."""

    def work(thread: int) -> None:
        for number in range(50):
            assert insert(journal, new_operation(f"t{thread}-{number}"))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert 200 == journal.counts()["pending"]


def test_two_journals_on_one_file_lose_nothing(journal_target: str) -> None:
    """Two Journal objects on one store (as two processes) both write; every row is there."""
    first, second = Journal(journal_target), Journal(journal_target)
    try:

        def work(journal: Journal, name: str) -> None:
            for number in range(50):
                operation_id = f"{name}-{number}"
                assert insert(journal, new_operation(operation_id))
                record_attempt(
                    journal,
                    operation_id,
                    AttemptRecord(started_at=NOW, elapsed=0.1, outcome="not_sent"),
                    now=NOW,
                )

        threads = [
            threading.Thread(target=work, args=(first, "a")),
            threading.Thread(target=work, args=(second, "b")),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

        assert 100 == len(first.operations())
        assert 100 == len(second.operations())
        assert all(1 == op.attempt_count for op in second.operations())
    finally:
        first.close()
        second.close()


def test_two_journals_race_for_one_operation(journal_target: str) -> None:
    """Two openers inserting the same operation id: exactly one insert wins."""
    with Journal(journal_target) as first, Journal(journal_target) as second:
        results = [insert(first, new_operation("op-1")), insert(second, new_operation("op-1"))]

    assert [True, False] == results


def test_an_opener_racing_the_creator_opens_the_journal(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes opening one new journal at once both get it, neither calls it corrupt."""
    real_table_names = SqliteStore._table_names
    raced: list[bool] = []

    def table_names(store: SqliteStore) -> set[str]:
        if not raced:
            raced.append(True)
            # The other process creates the journal between our first reads and this one.
            with contextlib.suppress(JournalError):  # it may wait for us; then we create it
                Journal(path, busy_timeout=0.5).close()
        return real_table_names(store)

    monkeypatch.setattr(SqliteStore, "_table_names", table_names)

    with Journal(path) as journal:
        assert dict.fromkeys(STATUSES, 0) == journal.counts()


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [("Content-Type", "application/json")],
        [("X-Quote", 'say "hi" \\ back'), ("X-Ctl", "tab\there\x00\x7f"), ("x", "")],
        [("X-Latin", "caf\xe9 \xff"), ("X-Unicode", "\u20ac \U0001f600"), ("X-Slash", "a/b")],
        (("tuple", "pairs"), ("as", "stored")),
    ],
)
def test_stored_headers_are_written_as_json_dumps_writes_them(
    headers: list[tuple[str, str]],
) -> None:
    """The journal's header text (written by hand for speed) is json.dumps' to the
    character, so rows stay the same whichever version wrote them."""
    assert json.dumps(list(headers)) == _headers_json(headers)


def test_a_closed_journal_says_so_for_every_use(journal_target: str) -> None:
    """After close(), every read and write raises a JournalError naming the file and
    saying what to do, never sqlite3's or psycopg's own error; closing again is harmless."""
    journal = Journal(journal_target)
    insert(journal, new_operation("op-1"))
    journal.close()
    uses = {
        "insert": lambda: insert(journal, new_operation("op-2")),
        "operation": lambda: journal.operation("op-1"),
        "operations": lambda: journal.operations(),
        "counts": lambda: journal.counts(),
        "stats": lambda: journal.stats(now=NOW),
        "prune": lambda: journal.prune(older_than=0, now=NOW),
    }
    for name, use in uses.items():
        with pytest.raises(JournalError) as caught:
            use()
        assert "closed" in str(caught.value), name
        assert journal.path in str(caught.value), name
    journal.close()
    with Journal(journal_target) as reopened:
        assert ["op-1"] == [op.operation_id for op in reopened.operations()]
