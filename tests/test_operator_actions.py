"""Operator actions in the library: Journal.settle, abandon, retry_now and fork, each one
audited write, refused when it makes no sense or while a live caller holds the lease; on
SQLite and PostgreSQL, against a real loopback mock server where something is sent."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import idempotently
from idempotently import Journal, OperationInProgressError
from idempotently._exceptions import OperatorActionError
from idempotently._keys import derived_key
from idempotently._operator import default_actor
from idempotently._rows import AttemptRecord, NewOperation
from idempotently.testing import Fault, MockServer
from tests.journal_commands import insert_operation, record_attempt, set_status

BODY = b'{"amount":1000,"currency":"usd","customer":"cus_1"}'


@pytest.fixture
def journal(journal_target: str) -> Iterator[Journal]:
    with Journal(journal_target) as opened:
        yield opened


def make(
    journal: Journal,
    operation_id: str,
    status: str = "needs_reconcile",
    *,
    url: str = "https://api.example.test/v1/charges",
    owner: str = "gone",
    lease_until: float = 0.0,
    created_at: float | None = None,
    key_lifetime: float = 86400.0,
    body: bytes = BODY,
    codec: str | None = None,
) -> idempotently.Operation:
    """An operation journaled as a Session would (its key derived, the key header kept),
    then moved to ``status``."""
    now = time.time() if created_at is None else created_at
    key = derived_key(journal.namespace, operation_id)
    new = NewOperation(
        operation_id=operation_id,
        key=key,
        delivery="exactly_once",
        method="POST",
        url=url,
        request_headers=(
            ("content-type", "application/json"),
            ("Idempotency-Key", key),
        ),
        request_body=body,
        fingerprint="f",
        profile="generic",
        key_header="Idempotency-Key",
        created_at=now,
        key_expires_at=now + key_lifetime,
        deadline_at=None,
        codec=codec,
    )
    assert insert_operation(journal, new, owner=owner, lease_until=lease_until)
    if status == "succeeded":
        record_attempt(
            journal,
            operation_id,
            AttemptRecord(now, 0.1, "answered", 201, status="succeeded", response_status=201),
            now=now,
        )
    elif status != "pending":
        assert set_status(journal, operation_id, status, reason="expired", now=now)  # type: ignore[arg-type]
    found = journal.operation(operation_id)
    assert found is not None
    return found


def test_settle_records_the_operators_word_in_the_audit_trail(journal: Journal) -> None:
    """settle moves a needs_reconcile operation to the status the operator says, with an
    audit entry naming who, when and why; the default actor is user@host."""
    make(journal, "op-1")
    before = time.time()
    settled = journal.settle("op-1", "succeeded", note="charge ch_1 in the dashboard")
    (entry,) = journal.audit("op-1")
    assert ("succeeded", None) == (settled.status, settled.lease_owner)
    assert f"settled succeeded by {default_actor()}: charge ch_1 in the dashboard" == (
        settled.reason
    )
    assert (default_actor(), "settle", "charge ch_1 in the dashboard") == (
        entry.actor,
        entry.action,
        entry.note,
    )
    assert {"from": "needs_reconcile", "to": "succeeded"} == json.loads(entry.detail or "")
    assert before <= entry.at <= time.time()
    assert "@" in default_actor()


@pytest.mark.parametrize(
    ("status", "action", "words"),
    [
        ("succeeded", "settle", "already succeeded"),
        ("failed", "settle", "already failed"),
        ("abandoned", "abandon", "already abandoned"),
        ("succeeded", "abandon", "already succeeded"),
        ("pending", "fork", "it is pending"),
        ("succeeded", "fork", "forking would do it a second time"),
        ("needs_reconcile", "retry", "retry makes a pending operation due now"),
        ("failed", "retry", "it is failed"),
    ],
)
def test_a_senseless_transition_is_refused_with_one_clear_line(
    journal: Journal, status: str, action: str, words: str
) -> None:
    """Settling a completed operation, forking a pending or succeeded one, retrying one
    that is not pending: refused with one line naming the operation and key; nothing
    written."""
    operation = make(journal, "op-1", status)
    run = {
        "settle": lambda: journal.settle("op-1", "failed", note="n"),
        "abandon": lambda: journal.abandon("op-1", note="n"),
        "fork": lambda: journal.fork("op-1", note="n"),
        "retry": lambda: journal.retry_now("op-1"),
    }[action]
    with pytest.raises(OperatorActionError) as raised:
        run()
    message = str(raised.value)
    assert words in message
    assert "nothing was written" in message
    assert "\n" not in message
    assert ("op-1", operation.key) == (raised.value.operation_id, raised.value.key)
    after = journal.operation("op-1")
    assert after is not None and after.status == status
    assert [] == journal.audit("op-1")
    assert None is journal.operation("op-1~fork1")


def test_an_unknown_operation_is_refused_by_name(journal: Journal) -> None:
    with pytest.raises(OperatorActionError, match="no operation 'nope'"):
        journal.abandon("nope", note="n")


def test_every_action_is_refused_while_a_live_lease_is_held(journal: Journal) -> None:
    """A lease held by a live caller (another host's, not yet expired) refuses every
    action with OperationInProgressError; nothing is written."""
    make(journal, "op-1", "pending", owner="other-host:1:abc", lease_until=time.time() + 60)
    for run in (
        lambda: journal.settle("op-1", "failed", note="n"),
        lambda: journal.abandon("op-1", note="n"),
        lambda: journal.retry_now("op-1"),
    ):
        with pytest.raises(
            OperationInProgressError, match="other-host:1:abc holds this operation's lease"
        ):
            run()
    assert [] == journal.audit("op-1")
    after = journal.operation("op-1")
    assert after is not None and "other-host:1:abc" == after.lease_owner


def test_a_lease_whose_process_is_gone_does_not_block_an_operator(journal: Journal) -> None:
    """A lease held by a process of this host that has exited is no live lease."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    from idempotently._flow._leases import _HOST

    owner = f"{_HOST}:{pid}:dead00"
    make(journal, "op-1", "pending", owner=owner, lease_until=time.time() + 60)
    assert "abandoned" == journal.abandon("op-1", note="its worker was killed").status


def test_a_dry_run_checks_everything_and_writes_nothing(journal: Journal) -> None:
    """dry_run returns the operation as it would be, refuses what would be refused, and
    leaves the journal as it was."""
    make(journal, "op-1")
    would = journal.settle("op-1", "failed", note="n", dry_run=True)
    fork = journal.fork("op-1", note="n", dry_run=True)
    assert "failed" == would.status
    assert ("op-1~fork1", "pending", "op-1") == (fork.operation_id, fork.status, fork.forked_from)
    after = journal.operation("op-1")
    assert after is not None and "needs_reconcile" == after.status
    assert None is journal.operation("op-1~fork1")
    assert [] == journal.audit("op-1")
    make(journal, "op-2", "succeeded")
    with pytest.raises(OperatorActionError):
        journal.settle("op-2", "failed", note="n", dry_run=True)


def test_a_fork_has_a_new_derived_key_the_same_bytes_and_settles_its_parent(
    journal: Journal,
) -> None:
    """fork makes <id>~fork1: pending, unleased, the same request bytes under a key
    derived from its own id (the key header rewritten), linked to its parent, which is
    settled failed in the same transaction; both have an audit entry."""
    parent = make(journal, "op-1")
    fork = journal.fork("op-1", note="no charge in the dashboard", actor="alice@ops")
    settled = journal.operation("op-1")
    assert settled is not None
    assert derived_key(journal.namespace, "op-1~fork1") == fork.key != parent.key
    assert (
        "op-1~fork1",
        "pending",
        None,
        "op-1",
        parent.request_body,
        parent.fingerprint,
        parent.method,
        parent.url,
    ) == (
        fork.operation_id,
        fork.status,
        fork.lease_owner,
        fork.forked_from,
        fork.request_body,
        fork.fingerprint,
        fork.method,
        fork.url,
    )
    assert (("content-type", "application/json"), ("Idempotency-Key", fork.key)) == (
        fork.request_headers
    )
    assert "failed" == settled.status
    assert "settled failed by alice@ops when forking it as op-1~fork1" in (settled.reason or "")
    assert [("fork", {"from": "needs_reconcile", "to": "failed", "fork": "op-1~fork1"})] == [
        (entry.action, json.loads(entry.detail or "")) for entry in journal.audit("op-1")
    ]
    assert [("forked", "alice@ops")] == [
        (entry.action, entry.actor) for entry in journal.audit("op-1~fork1")
    ]


def test_a_failed_operation_is_forked_once_and_a_fork_forks_on(journal: Journal) -> None:
    """A failed operation stays failed when forked; forking it again is refused (fork the
    fork instead), and the fork's fork is <id>~fork2."""
    make(journal, "op-1", "failed")
    journal.fork("op-1", note="retry it")
    with pytest.raises(OperatorActionError, match="forked already, as 'op-1~fork1'"):
        journal.fork("op-1", note="again")
    journal.settle("op-1~fork1", "failed", note="declined again")
    second = journal.fork("op-1~fork1", note="third time")
    parent = journal.operation("op-1")
    assert parent is not None and "failed" == parent.status
    assert ("op-1~fork2", "op-1~fork1") == (second.operation_id, second.forked_from)


def test_retry_now_makes_a_waiting_operation_due_but_never_revives_an_expired_key(
    journal: Journal,
) -> None:
    """retry_now clears not_before; an operation whose key is past its lifetime (minus the
    margin) is refused: fork it instead."""
    make(journal, "op-1", "pending")
    record_attempt(
        journal,
        "op-1",
        AttemptRecord(time.time(), 0.1, "answered", 429, not_before=time.time() + 3600),
        now=time.time(),
    )
    assert None is journal.retry_now("op-1", note="the rate limit was lifted").not_before
    make(journal, "op-2", "pending", created_at=time.time() - 86000, key_lifetime=86400)
    with pytest.raises(OperatorActionError, match="fork it"):
        journal.retry_now("op-2")


def test_two_operators_at_once_one_wins_and_the_other_is_told(journal: Journal) -> None:
    """Two operators who read the same row and act at once: one action is written, the
    other is refused with what the first one did; one audit entry."""
    make(journal, "op-1")
    barrier = threading.Barrier(2)
    read = journal._store.operation
    first_reads = [0]

    def both_read_first(operation_id: str, **options: Any) -> Any:
        found = read(operation_id, **options)
        first_reads[0] += 1
        if first_reads[0] <= 2:  # each operator's first read, then both go on
            barrier.wait(timeout=5)
        return found

    journal._store.operation = both_read_first  # type: ignore[method-assign]
    outcomes: list[str] = []

    def act(status: str) -> None:
        try:
            journal.settle("op-1", status, note=status)  # type: ignore[arg-type]
            outcomes.append("won")
        except OperatorActionError as error:
            outcomes.append(str(error))

    threads = [threading.Thread(target=act, args=(s,)) for s in ("succeeded", "failed")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    journal._store.operation = read  # type: ignore[method-assign]
    assert 1 == outcomes.count("won")
    (refusal,) = [outcome for outcome in outcomes if outcome != "won"]
    assert "it is already" in refusal
    assert 1 == len(journal.audit("op-1"))


def test_an_operator_cannot_act_on_an_operation_a_live_call_is_sending(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    """While a Session's attempt is in flight (the server holds it), abandon is refused;
    once it succeeded, settling it is refused; the server charged once."""
    server = idempotently_mock_server
    server.faults.push(Fault.delay(1.5))
    with idempotently.Session(
        journal_target, base_url=server.url, headers={"Authorization": "Bearer user_1"}
    ) as session:
        call = threading.Thread(
            target=session.post,
            args=("/v1/charges",),
            kwargs={
                "json": {"amount": 1000, "currency": "usd", "customer": "cus_1"},
                "operation_id": "order-1",
            },
        )
        call.start()
        with Journal(journal_target) as operator:
            deadline = time.monotonic() + 10
            while not server.faults.applied and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.faults.applied, "the call never reached the server"
            with pytest.raises(OperationInProgressError):
                operator.abandon("order-1", note="looks stuck")
            call.join(10)
            with pytest.raises(OperatorActionError, match="already succeeded"):
                operator.settle("order-1", "failed", note="n")
            assert [] == operator.audit("order-1")
    assert 1 == len(server.charges())


def test_a_fork_is_sent_once_under_its_new_key_and_its_parent_never(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    """The fork of a needs_reconcile operation the server never saw is sent by resume
    once, with its own key; the parent is not resent."""
    server = idempotently_mock_server
    with Journal(journal_target) as journal:
        make(journal, "order-1", url=f"{server.url}/v1/charges")
        fork = journal.fork("order-1", note="no charge on the server")
    with idempotently.Session(
        journal_target, base_url=server.url, headers={"Authorization": "Bearer user_1"}
    ) as session:
        results = session.resume()
        again = session.resume()
    assert [("order-1~fork1", "succeeded")] == [(r.operation_id, r.action) for r in results]
    assert [] == again
    (charge,) = server.charges()
    assert fork.key == charge.key
    with Journal(journal_target) as journal:
        parent = journal.operation("order-1")
        assert parent is not None and ("failed", 0) == (parent.status, parent.attempt_count)


def test_a_call_again_after_an_operator_settled_it_says_what_happened(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    """Calling again with the id of an operation an operator settled sends nothing and says
    what the operator recorded: succeeded without a stored answer is never "failed before
    anything reached the server" (which would invite a second charge)."""
    server = idempotently_mock_server
    body = {"amount": 1000, "currency": "usd", "customer": "cus_1"}
    with idempotently.Session(
        journal_target, base_url=server.url, headers={"Authorization": "Bearer user_1"}
    ) as session:
        for name in ("op-ok", "op-no"):
            server.faults.push(Fault.server_error())  # stored, then replayed: needs_reconcile
            with pytest.raises(idempotently.NeedsReconcileError):
                session.post("/v1/charges", json=body, operation_id=name)
        session.journal.settle("op-ok", "succeeded", note="ch_1 in the dashboard")
        session.journal.settle("op-no", "failed", note="refunded by hand")
        requests = len(server.requests)
        # Not the replayed 500 that left it undecided: that is no success's answer.
        with pytest.raises(idempotently.NoStoredAnswerError, match="never sent again"):
            session.post("/v1/charges", json=body, operation_id="op-ok")
        with pytest.raises(idempotently.RequestNotSentError, match="settled failed by"):
            session.post("/v1/charges", json=body, operation_id="op-no")
    assert requests == len(server.requests)


def test_a_settled_success_without_an_answer_is_never_called_unsent(journal: Journal) -> None:
    """An operation settled succeeded with no answer stored raises NoStoredAnswerError."""
    from idempotently._flow._engine import Engine
    from idempotently._flow._operation import stored_response

    make(journal, "op-1")
    settled = journal.settle("op-1", "succeeded", note="found it")
    with pytest.raises(idempotently.NoStoredAnswerError, match="never sent again"):
        stored_response(Engine(), settled, lambda *parts: None)  # type: ignore[arg-type, return-value]


FORKING_CHILD = """
import sys
from idempotently import Journal

with Journal(sys.argv[1]) as journal:
    for number in range(int(sys.argv[2])):
        journal.fork(f"op-{number}", note="resend", actor="child@ops")
"""


@pytest.mark.slow
def test_a_process_killed_while_forking_leaves_no_half_fork(journal_target: str) -> None:
    """SIGKILL a process forking operation after operation: every operation is either
    settled failed with its fork and both audit entries, or untouched, never in between."""
    import signal
    import subprocess
    import sys

    count = 300
    with Journal(journal_target) as journal:
        for number in range(count):
            make(journal, f"op-{number}")
    child = subprocess.Popen(
        [sys.executable, "-c", FORKING_CHILD, journal_target, str(count)],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        with Journal(journal_target, readonly=True) as watcher:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and child.poll() is None:
                if watcher.counts()["failed"] >= 20:
                    break
                time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(10)
    assert -signal.SIGKILL == child.returncode, "the child finished before it was killed"
    with Journal(journal_target) as journal:
        forked = 0
        for number in range(count):
            parent = journal.operation(f"op-{number}")
            fork = journal.operation(f"op-{number}~fork1")
            assert parent is not None
            parent_entries = [entry.action for entry in journal.audit(f"op-{number}")]
            if parent.status == "failed":
                forked += 1
                assert fork is not None and f"op-{number}" == fork.forked_from
                assert ["fork"] == parent_entries
                assert ["forked"] == [e.action for e in journal.audit(fork.operation_id)]
            else:
                assert ("needs_reconcile", None, []) == (parent.status, fork, parent_entries)
    assert 20 <= forked < count


def test_a_fork_never_takes_the_number_of_a_pruned_fork(journal: Journal) -> None:
    """A failed operation whose fork was pruned is forked again as <id>~fork2, under a
    new derived key: the server may still remember the pruned fork's key, and would
    replay its old answer instead of doing the work. Its audit trail names both forks."""
    make(journal, "op-1", "failed")
    first = journal.fork("op-1", note="declined, retry")
    now = time.time()
    # Sent and settled by a resume worker whose clock runs two hours behind: idle for
    # longer than the prune window, while its parent, forked just now, is not.
    record_attempt(
        journal,
        first.operation_id,
        AttemptRecord(now - 7200, 0.1, "answered", 402, status="failed", reason="declined"),
        now=now - 7200,
    )
    assert 1 == journal.prune(older_than=3600, now=now)
    assert None is journal.operation(first.operation_id)
    dry = journal.fork("op-1", note="declined again, retry", dry_run=True)
    second = journal.fork("op-1", note="declined again, retry")
    assert ("op-1~fork2", "op-1~fork2") == (dry.operation_id, second.operation_id)
    assert derived_key(journal.namespace, "op-1~fork2") == second.key != first.key
    assert ["op-1~fork1", "op-1~fork2"] == [
        json.loads(entry.detail or "{}")["fork"]
        for entry in journal.audit("op-1")
        if entry.action == "fork"
    ]


def test_the_forks_of_a_refork_count_on_and_a_live_fork_blocks_another(
    journal: Journal,
) -> None:
    """The chain keeps being numbered under its root: the fork of the second fork
    (op-1~fork2, made once op-1~fork1 was pruned) is op-1~fork3; and while a fork of
    an operation is in the journal, forking it again is refused, naming that fork."""
    make(journal, "op-1", "failed")
    first = journal.fork("op-1", note="retry")
    now = time.time()
    record_attempt(
        journal,
        first.operation_id,
        AttemptRecord(now - 7200, 0.1, "answered", 402, status="failed"),
        now=now - 7200,
    )
    journal.prune(older_than=3600, now=now)
    second = journal.fork("op-1", note="retry again")
    journal.settle(second.operation_id, "failed", note="declined")
    third = journal.fork(second.operation_id, note="third time")
    assert ("op-1~fork3", second.operation_id) == (third.operation_id, third.forked_from)
    with pytest.raises(OperatorActionError, match="forked already, as 'op-1~fork2'"):
        journal.fork("op-1", note="and again")
