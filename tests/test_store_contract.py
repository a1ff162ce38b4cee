"""The Store contract: what every journal store promises the writer and the flow, run on
SQLite, PostgreSQL and the in-memory store alike (tests/memory_store.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from idempotently._commands import (
    BindCredentials,
    ClaimDue,
    Enqueue,
    ExtendLeases,
    Insert,
    PauseOrigin,
    RebaseOperation,
    Record,
    Release,
    RenewLease,
    SetStatus,
    TakeLease,
)
from idempotently._commands_rare import Act, AuditNote, LookUpLater, SwapPause, Write
from idempotently._journal._sqlite import SqliteStore
from idempotently._journal._store import Store
from idempotently._rows import AttemptRecord, Failed, NewOperation, OriginPause
from idempotently._vocabulary import Status
from tests.memory_store import MemoryStore

NOW = 1_800_000_000.0


@pytest.fixture(params=["sqlite", "postgres", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """An empty store of each kind."""
    opened: Store
    if request.param == "sqlite":
        opened = SqliteStore(tmp_path / "journal.db")
    elif request.param == "postgres":
        from idempotently._journal._postgres import PostgresStore

        opened = PostgresStore(str(request.getfixturevalue("postgres_url")))
    else:
        opened = MemoryStore()
    try:
        yield opened
    finally:
        opened.close()


def new(operation_id: str, created_at: float = NOW, key: str | None = None) -> NewOperation:
    return NewOperation(
        operation_id=operation_id,
        key=key or f"key-{operation_id}",
        delivery="exactly_once",
        method="POST",
        url="https://api.example.test/v1/charges",
        request_headers=(("content-type", "application/json"),),
        request_body=b'{"amount": 1000}',
        fingerprint="f",
        profile="generic",
        key_header="Idempotency-Key",
        created_at=created_at,
        key_expires_at=created_at + 86400,
        deadline_at=None,
    )


def answer(status: int = 201, *, final: bool = True) -> AttemptRecord:
    return AttemptRecord(
        started_at=NOW,
        elapsed=0.1,
        outcome="answered",
        status_code=status,
        status="succeeded" if final else "pending",
        response_status=status if final else None,
        response_headers=(("content-type", "application/json"),) if final else None,
        response_body=b'{"id": "ch_1"}' if final else None,
    )


def one(store: Store, write: Write, durable: bool = False) -> Any:
    (outcome,) = store.commit([write], durable)
    assert not isinstance(outcome, Failed), outcome.error
    return outcome


def test_an_insert_is_found_by_id_and_by_key_and_taken_only_once(store: Store) -> None:
    """A new operation is found pending, leased to its owner; a second insert of its id or
    of its key is refused (False), never a second row."""
    assert True is one(store, Insert(new("op-1"), "me", NOW + 30), durable=True)
    assert False is one(store, Insert(new("op-1"), "you", NOW + 30))
    assert False is one(store, Insert(new("op-2", key="key-op-1"), "you", NOW + 30))
    by_id, by_key = store.find("op-1", None), store.find(None, "key-op-1")
    assert by_id is not None and by_key is not None
    assert ("pending", "me", NOW + 30) == (by_id.status, by_id.lease_owner, by_id.lease_until)
    assert by_id.operation_id == by_key.operation_id
    assert None is store.find("op-2", None)
    assert b'{"amount": 1000}' == by_id.request_body


def test_an_enqueued_operation_is_unleased_and_unsent_until_a_lease_is_taken(
    store: Store,
) -> None:
    """An enqueue journals the operation pending, unleased and without a first send (its
    id or key taken is refused, as an insert's); the lease that is taken to send it marks
    its first send and starts its key's lifetime then. An insert's first send is its
    creation."""
    queued = attrs.evolve(new("op-1"), enqueued_at=NOW)
    assert True is one(store, Enqueue(queued), durable=True)
    assert False is one(store, Enqueue(queued))
    assert False is one(store, Insert(new("op-1"), "me", NOW + 30))
    found = store.find("op-1", None)
    assert found is not None
    assert (None, 0.0, NOW, None) == (
        found.lease_owner,
        found.lease_until,
        found.enqueued_at,
        found.first_send_at,
    )
    later = NOW + 2 * 86400
    assert True is one(store, TakeLease(found, "relay", later + 30, later))
    taken = store.find("op-1", None)
    assert taken is not None
    assert (later, later + 86400) == (taken.first_send_at, taken.key_expires_at)
    one(store, Insert(new("op-2"), "me", NOW + 30))
    posted = store.find("op-2", None)
    assert posted is not None and (None, NOW) == (posted.enqueued_at, posted.first_send_at)


def test_a_record_settles_only_while_its_owner_holds_the_lease(store: Store) -> None:
    """The lease holder's answer settles the operation; a late answer from a caller that
    lost the lease is counted as an attempt and changes nothing else."""
    one(store, Insert(new("op-1"), "me", NOW + 30))
    one(store, Insert(new("op-2"), "me", NOW + 30))
    one(store, Record("op-1", answer(), NOW + 1, "me"))
    one(store, Record("op-2", answer(), NOW + 1, "someone-else"))
    settled, untouched = store.find("op-1", None), store.find("op-2", None)
    assert settled is not None and untouched is not None
    assert ("succeeded", 201, b'{"id": "ch_1"}', None) == (
        settled.status,
        settled.response_status,
        settled.response_body,
        settled.lease_owner,
    )
    assert [201] == [attempt.status_code for attempt in settled.attempts]
    assert ("pending", 1, "me") == (
        untouched.status,
        untouched.attempt_count,
        untouched.lease_owner,
    )


def test_a_lease_is_taken_by_one_compare_and_swap_only(store: Store) -> None:
    """Two callers swapping the lease they both read: exactly one wins."""
    one(store, Insert(new("op-1"), "me", NOW - 1))
    read = store.find("op-1", None)
    assert read is not None
    first = one(store, TakeLease(read, "a", NOW + 30, NOW))
    second = one(store, TakeLease(read, "b", NOW + 30, NOW))
    assert (True, False) == (first, second)
    held = store.find("op-1", None)
    assert held is not None and "a" == held.lease_owner


def test_a_breakers_row_is_swapped_only_as_read_and_kept_until_closed(store: Store) -> None:
    """A circuit breaker's pause row: listed while it runs and after it ended (until it is
    closed); a probe's claim swaps it only if its reason is the one read and it has
    ended, so of two claims of the same read exactly one wins; a swap that loses replies
    the row as it stands; closing deletes it."""
    origin = "https://api.example.test:443"
    opened = "circuit breaker open 5s: 5 failures in a row"
    one(store, PauseOrigin(origin, "", NOW + 5, opened, NOW))
    assert [opened] == [pause.reason for pause in store.origin_pauses(now=NOW + 60)]
    early = OriginPause(origin, "", NOW + 6, "circuit breaker half-open 5s: a", NOW + 1)
    assert opened == one(store, SwapPause(origin, "", opened, NOW + 1, early)).reason
    mine = OriginPause(origin, "", NOW + 15, "circuit breaker half-open 5s: a", NOW + 10)
    theirs = OriginPause(origin, "", NOW + 15, "circuit breaker half-open 5s: b", NOW + 10)
    first = one(store, SwapPause(origin, "", opened, NOW + 10, mine))
    second = one(store, SwapPause(origin, "", opened, NOW + 10, theirs))
    assert (mine, mine) == (first, second)
    assert None is one(store, SwapPause(origin, "", mine.reason or "", None, None))
    assert [] == store.origin_pauses(now=NOW)


def test_a_lease_is_renewed_only_by_its_owner_and_only_while_pending(store: Store) -> None:
    """RenewLease succeeds for the owner (expired or not), fails for anyone else and once
    the operation is settled."""
    one(store, Insert(new("op-1"), "me", NOW - 100))
    assert True is one(store, RenewLease("op-1", "me", NOW + 30, NOW))
    assert False is one(store, RenewLease("op-1", "you", NOW + 60, NOW))
    one(store, SetStatus("op-1", "needs_reconcile", "key expired", NOW))
    assert False is one(store, RenewLease("op-1", "me", NOW + 90, NOW))


def test_a_claim_that_waited_never_rebases_a_lease_taken_while_it_waited(store: Store) -> None:
    """A claim that read its clock (NOW), then waited 5 s behind another worker's write
    lock, finds a row that worker leased meanwhile (written at NOW + 2): a live lease,
    not one from a clock ahead. It is left as written, so its owner keeps it."""
    one(store, Insert(new("op-1", created_at=NOW + 2), "other", NOW + 2 + 120))
    waited = ClaimDue("worker", NOW, NOW + 99, 10, made=time.monotonic() - 5)
    assert [] == one(store, waited)
    read = store.find("op-1", None)
    assert read is not None
    assert (NOW + 2 + 120, NOW + 2) == (read.lease_until, read.updated_at)


def test_a_lease_written_by_a_clock_ahead_is_counted_from_the_readers_now_only_sooner(
    store: Store,
) -> None:
    """RebaseOperation moves a row whose updated_at is in the reader's future onto the
    reader's clock (its lease keeps its length from that write), once, by a
    compare-and-swap on the updated_at read; heartbeats and renewals stamp their own now
    as the lease's write time; an attempt recorded by a caller that lost the lease leaves
    the holder's updated_at alone."""
    ahead = NOW + 1000
    one(store, Insert(new("op-1", created_at=ahead), "fast", ahead + 30))
    assert None is one(store, RebaseOperation("op-1", ahead - 1, NOW))  # not the row read
    assert (None, NOW + 30) == one(store, RebaseOperation("op-1", ahead, NOW))
    assert None is one(store, RebaseOperation("op-1", NOW, NOW))  # once: no longer ahead
    one(store, ExtendLeases((("op-1", "fast"),), ahead + 10 + 30, ahead + 10))
    one(store, Record("op-1", answer(final=False), ahead + 99, "lost"))
    read = store.find("op-1", None)
    assert read is not None
    assert (ahead + 40, ahead + 10, 1) == (read.lease_until, read.updated_at, read.attempt_count)
    assert (None, NOW + 5 + 30) == one(store, RebaseOperation("op-1", ahead + 10, NOW + 5))
    one(store, RenewLease("op-1", "fast", ahead + 20 + 30, ahead + 20))
    assert [] == one(store, ClaimDue("worker", NOW + 34, NOW + 99, 10))  # from NOW + 34
    assert [] == one(store, ClaimDue("worker", NOW + 63, NOW + 99, 10))
    claimed = one(store, ClaimDue("worker", NOW + 64, NOW + 99, 10))
    assert [("op-1", "worker")] == [(op.operation_id, op.lease_owner) for op in claimed]


def test_credentials_are_bound_once_by_the_lease_holder_of_a_pending_operation(
    store: Store,
) -> None:
    """BindCredentials writes the record only for the owner of the lease, only while the
    operation is pending and bound to nothing; every other bind is refused (False) and
    leaves the first record in place."""
    one(store, Insert(new("op-1"), "me", NOW + 30))
    one(store, Insert(new("op-2"), "me", NOW + 30))
    assert False is one(store, BindCredentials("op-1", "you", "record-of-you"))
    assert True is one(store, BindCredentials("op-1", "me", "record-1"), durable=True)
    assert False is one(store, BindCredentials("op-1", "me", "record-2"))
    one(store, SetStatus("op-2", "needs_reconcile", "key expired", NOW))
    assert False is one(store, BindCredentials("op-2", "me", "record-3"))
    bound, settled = store.find("op-1", None), store.find("op-2", None)
    assert bound is not None and settled is not None
    assert ("record-1", None) == (bound.credentials_digest, settled.credentials_digest)


def test_statuses_move_only_from_the_one_expected(store: Store) -> None:
    """SetStatus needs the expected status, and releases the lease."""
    one(store, Insert(new("op-1"), "me", NOW + 30))
    assert False is one(store, SetStatus("op-1", "failed", None, NOW, expect="needs_reconcile"))
    assert True is one(store, SetStatus("op-1", "needs_reconcile", "expired", NOW))
    assert False is one(store, SetStatus("op-1", "failed", "again", NOW, expect="pending"))
    assert True is one(
        store, SetStatus("op-1", "failed", "looked up", NOW + 1, expect="needs_reconcile")
    )
    settled = store.find("op-1", None)
    assert settled is not None
    assert ("failed", "looked up", None, 0.0) == (
        settled.status,
        settled.reason,
        settled.lease_owner,
        settled.lease_until,
    )


def test_a_lease_is_released_and_extended_only_by_its_owner(store: Store) -> None:
    """Release by another owner changes nothing; ExtendLeases counts only the leases still
    held by their owners on pending operations, and never shortens one."""
    for name in ("op-1", "op-2", "op-3"):
        one(store, Insert(new(name), "me", NOW + 30))
    one(store, Release("op-1", "you"))
    one(store, Record("op-3", answer(), NOW, "me"))
    extended = one(
        store, ExtendLeases((("op-1", "me"), ("op-2", "you"), ("op-3", "me")), NOW + 10, NOW)
    )
    one(store, ExtendLeases((("op-2", "me"),), NOW + 90, NOW))
    one(store, Release("op-1", "me"))
    first, second = store.find("op-1", None), store.find("op-2", None)
    assert first is not None and second is not None
    assert 1 == extended  # op-1 only: op-2 is not yours, op-3 is settled
    assert (None, 0.0) == (first.lease_owner, first.lease_until)
    assert ("me", NOW + 90) == (second.lease_owner, second.lease_until)


def test_claims_take_due_operations_oldest_first_and_never_twice(store: Store) -> None:
    """ClaimDue leases pending operations whose lease and not_before passed, oldest first,
    up to its limit; a second claim gets the rest."""
    for number, created in enumerate([NOW - 3, NOW - 1, NOW - 2, NOW - 4]):
        one(store, Insert(new(f"op-{number}", created_at=created), "old", NOW - 10))
    one(store, Insert(new("leased"), "alive", NOW + 30))
    first = one(store, ClaimDue("w1", NOW, NOW + 30, 2))
    second = one(store, ClaimDue("w2", NOW, NOW + 30, 10))
    assert ["op-3", "op-0"] == [operation.operation_id for operation in first]
    assert ["op-2", "op-1"] == [operation.operation_id for operation in second]
    assert {"w1"} == {operation.lease_owner for operation in first}


def test_several_writes_commit_together_each_with_its_own_result(store: Store) -> None:
    """One batch: each write's own result, in order, as if committed one by one."""
    outcomes = store.commit(
        [
            Insert(new("op-1"), "me", NOW + 30),
            Insert(new("op-1"), "you", NOW + 30),
            Record("op-1", answer(), NOW, "me"),
            Insert(new("op-2"), "me", NOW + 30),
        ],
        True,
    )
    assert [True, False, None, True] == outcomes
    assert {"pending": 1, "succeeded": 1} == {
        status: count for status, count in store.counts().items() if count
    }


def test_listings_counts_stats_and_prune_agree(store: Store) -> None:
    """operations() filters by status and age, newest first or oldest; counts() and
    stats() count every status; prune deletes finished operations only."""
    for number in range(4):
        one(store, Insert(new(f"op-{number}", created_at=NOW + number), "me", NOW - 1))
    one(store, Record("op-0", answer(), NOW + 10, "me"))
    one(store, Record("op-1", answer(), NOW + 11, "me"))
    one(store, SetStatus("op-2", "needs_reconcile", "expired", NOW + 12))

    def ids(operations: Sequence[Any]) -> list[str]:
        return [operation.operation_id for operation in operations]

    assert ["op-3", "op-2", "op-1", "op-0"] == ids(store.operations())
    assert ["op-0", "op-1"] == ids(store.operations(status="succeeded", newest_first=False))
    assert ["op-3"] == ids(store.operations(status="pending"))
    assert ["op-3", "op-2"] == ids(store.operations(since=NOW + 2))
    assert ["op-3"] == ids(store.operations(limit=1))
    assert {"pending": 1, "succeeded": 2, "needs_reconcile": 1} == {
        status: count for status, count in store.counts().items() if count
    }
    stats = store.stats(now=NOW + 100, stuck_after=10)
    assert (4, 2, 2, NOW + 3, 1) == (
        stats.operations,
        stats.attempts,
        stats.answered_attempts,
        stats.oldest_pending_created_at,
        stats.stuck,
    )
    assert 2 == store.prune(older_than=0, now=NOW + 100, dry_run=True)
    assert 2 == store.prune(older_than=0, now=NOW + 100)
    assert ["op-3", "op-2"] == ids(store.operations())


def test_an_inserts_data_at_rest_columns_round_trip(store: Store) -> None:
    """The codec's name, the redacted query parameters and the credentials record an insert
    carries are read back as written, by id, by key and in listings; an insert without
    them reads None."""
    written = attrs.evolve(
        new("op-1"),
        codec="fernet",
        secret_params='["api_key"]',
        credentials_digest='{"names":["header:authorization"],"digest":"ab"}',
    )
    one(store, Insert(written, "me", NOW + 30))
    one(store, Insert(new("op-2"), "me", NOW + 30))
    by_id, by_key = store.find("op-1", None), store.find(None, "key-op-1")
    listed = {operation.operation_id: operation for operation in store.operations()}
    expected = (written.codec, written.secret_params, written.credentials_digest)
    for found in (by_id, by_key, listed["op-1"]):
        assert found is not None
        assert expected == (found.codec, found.secret_params, found.credentials_digest)
    plain = listed["op-2"]
    assert (None, None, None) == (plain.codec, plain.secret_params, plain.credentials_digest)


# -- the operator's journal: actions, lookup backoff, audit entries -----------------------


def act(
    store: Store,
    operation_id: str,
    status: Status,
    *,
    fork: NewOperation | None = None,
    due_now: bool = False,
    response: tuple[int, bytes] | None = None,
    now: float = NOW + 5,
) -> Act:
    """An Act on the operation exactly as the store holds it now."""
    row = store.find(operation_id, None)
    assert row is not None
    notes = [AuditNote(operation_id, "alice@ops", "settle", "checked", '{"to": "x"}')]
    if fork is not None:
        notes.append(AuditNote(fork.operation_id, "alice@ops", "forked", "checked", None))
    return Act(
        operation_id=operation_id,
        expect_status=row.status,
        expect_lease_owner=row.lease_owner,
        expect_lease_until=row.lease_until,
        expect_updated_at=row.updated_at,
        status=status,
        reason="by alice",
        now=now,
        audit=tuple(notes),
        due_now=due_now,
        sets_answer=response is not None,
        response_status=None if response is None else response[0],
        response_headers=None if response is None else [("content-type", "application/json")],
        response_body=None if response is None else response[1],
        fork=fork,
    )


def test_an_act_applies_once_on_the_row_as_read_with_its_audit_entries(store: Store) -> None:
    """An Act is a compare-and-swap on the row as read: applied once, with its audit
    entries and stored answer; the same Act again (the row has changed) writes nothing."""
    one(store, Insert(new("op-1"), "me", NOW - 1))
    one(store, SetStatus("op-1", "needs_reconcile", "expired", NOW))
    write = act(store, "op-1", "succeeded", response=(200, b'{"id": "ch_1"}'))
    assert True is one(store, write)
    assert False is one(store, write)
    settled = store.find("op-1", None)
    assert settled is not None
    assert ("succeeded", "by alice", 200, b'{"id": "ch_1"}', NOW + 5) == (
        settled.status,
        settled.reason,
        settled.response_status,
        settled.response_body,
        settled.updated_at,
    )
    entries = store.audit("op-1")
    assert [("alice@ops", "settle", "checked", '{"to": "x"}', NOW + 5)] == [
        (entry.actor, entry.action, entry.note, entry.detail, entry.at) for entry in entries
    ]
    assert [] == store.audit("op-2")


def test_an_act_is_refused_once_a_lease_is_taken_after_the_read(store: Store) -> None:
    """A live call that takes the lease between the operator's read and write wins: the
    Act changes nothing and writes no audit entry."""
    one(store, Insert(new("op-1"), "old", NOW - 1))
    write = act(store, "op-1", "abandoned")
    row = store.find("op-1", None)
    assert row is not None
    assert True is one(store, TakeLease(row, "caller", NOW + 60, NOW + 1))
    assert False is one(store, write)
    after = store.find("op-1", None)
    assert after is not None
    assert ("pending", "caller") == (after.status, after.lease_owner)
    assert [] == store.audit("op-1")


def test_a_fork_is_inserted_linked_and_unleased_with_the_parent_settled(store: Store) -> None:
    """A forking Act settles the parent and inserts the fork (pending, unleased, linked,
    enqueued now) in one transaction; a second fork under the same id changes nothing."""
    one(store, Insert(new("op-1"), "me", NOW - 1))
    one(store, SetStatus("op-1", "needs_reconcile", "expired", NOW))
    fork = new("op-1~fork1", created_at=NOW + 5)
    assert True is one(store, act(store, "op-1", "failed", fork=fork))
    again = act(store, "op-1", "failed", fork=fork, now=NOW + 6)
    assert False is one(store, again)
    parent, child = store.find("op-1", None), store.find("op-1~fork1", None)
    assert parent is not None and child is not None
    assert "failed" == parent.status
    assert ("pending", None, 0.0, "op-1", NOW + 5, b'{"amount": 1000}', 0) == (
        child.status,
        child.lease_owner,
        child.lease_until,
        child.forked_from,
        child.enqueued_at,
        child.request_body,
        child.attempt_count,
    )
    assert ["forked"] == [entry.action for entry in store.audit("op-1~fork1")]
    assert ["settle"] == [entry.action for entry in store.audit("op-1")]


def test_retry_clears_the_wait_and_the_lookup_backoff(store: Store) -> None:
    """A due-now Act clears not_before and lookup_after, leaving the status pending."""
    one(store, Insert(new("op-1"), "me", NOW - 1))
    one(
        store,
        Record(
            "op-1",
            AttemptRecord(NOW, 0.1, "answered", 429, not_before=NOW + 3600),
            NOW,
            "me",
        ),
    )
    assert True is one(store, act(store, "op-1", "pending", due_now=True))
    row = store.find("op-1", None)
    assert row is not None
    assert ("pending", None, None) == (row.status, row.not_before, row.lookup_after)


def test_a_lookup_backoff_is_written_only_on_a_needs_reconcile_operation(store: Store) -> None:
    """LookUpLater sets lookup_after and writes its audit entry only while the operation
    needs reconciling."""
    one(store, Insert(new("op-1"), "me", NOW - 1))
    note = AuditNote("op-1", "lookup", "lookup", "absent, within the window", None)
    assert False is one(store, LookUpLater("op-1", NOW + 60, NOW, note))
    one(store, SetStatus("op-1", "needs_reconcile", "expired", NOW))
    assert True is one(store, LookUpLater("op-1", NOW + 60, NOW, note))
    row = store.find("op-1", None)
    assert row is not None
    assert NOW + 60 == row.lookup_after
    assert ["absent, within the window"] == [entry.note for entry in store.audit("op-1")]


def test_prune_deletes_audit_entries_with_their_operation_and_never_breaks_a_link(
    store: Store,
) -> None:
    """Prune keeps a finished operation a fork links to, and deletes an operation's audit
    entries with it; once the fork is gone, the parent goes too."""
    for name in ("op-1", "op-2"):
        one(store, Insert(new(name), "me", NOW - 1))
        one(store, SetStatus(name, "needs_reconcile", "expired", NOW))
    one(store, act(store, "op-1", "failed", fork=new("op-1~fork1", created_at=NOW + 5)))
    one(store, act(store, "op-2", "failed"))
    assert 1 == store.prune(older_than=0, now=NOW + 100, dry_run=True)
    assert 1 == store.prune(older_than=0, now=NOW + 100)
    assert None is store.find("op-2", None)
    assert [] == store.audit("op-2")
    assert store.find("op-1", None) is not None
    assert ["settle"] == [entry.action for entry in store.audit("op-1")]
    one(store, Record("op-1~fork1", answer(), NOW + 10, None))
    assert 2 == store.prune(older_than=0, now=NOW + 100) + store.prune(older_than=0, now=NOW + 100)
    assert [] == store.operations()


def set_columns(store: Store, operation_id: str, **values: object) -> None:
    """Write columns no write command of the operator's sets (another feature's)."""
    if isinstance(store, MemoryStore):
        store.rows[operation_id] = attrs.evolve(store.rows[operation_id], **values)  # type: ignore[arg-type]
        return
    assignments = ", ".join(f"{name} = %s" for name in values)
    if isinstance(store, SqliteStore):
        store._conn.execute(
            f"UPDATE operations SET {assignments.replace('%s', '?')} WHERE operation_id = ?",
            (*values.values(), operation_id),
        )
        return
    import psycopg

    with psycopg.connect(store._url, autocommit=True) as conn:  # type: ignore[attr-defined]
        conn.execute(
            f"UPDATE idempotently.operations SET {assignments} WHERE operation_id = %s",
            (*values.values(), operation_id),
        )


def test_a_fork_takes_what_describes_its_bytes_from_its_parent(store: Store) -> None:
    """The same request bytes mean the same encoding: a fork has its parent's codec,
    redacted parameters, credential binding and overrides."""
    inherited = {
        "codec": "fernet",
        "secret_params": '["api_key"]',
        "credentials_digest": "scrypt$c2FsdA$ZGlnZXN0",
        "overrides": '{"timeout": 3.0}',
    }
    one(store, Insert(new("op-1"), "me", NOW - 1))
    one(store, SetStatus("op-1", "needs_reconcile", "expired", NOW))
    set_columns(store, "op-1", **inherited)
    one(store, act(store, "op-1", "failed", fork=new("op-1~fork1", created_at=NOW + 5)))
    child = store.find("op-1~fork1", None)
    assert child is not None
    assert inherited == {name: getattr(child, name) for name in inherited}
