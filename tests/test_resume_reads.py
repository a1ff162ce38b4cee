"""Resume reads each operation once: it sends from the row its queue read, and a row
written since that read is read again and decided on afresh, never sent from stale."""

from __future__ import annotations

from pathlib import Path

import pytest

import idempotently
from tests.scripted_server import Answer, ScriptedApp

ONE_TRY = idempotently.RetryPolicy(max_attempts=1)


def leave_pending(target: str, url: str, app: ScriptedApp, operation_ids: list[str]) -> None:
    """Journal each operation with one attempt the server answered 503: pending."""
    app.answer(*[Answer(status=503) for _ in operation_ids])
    with idempotently.Session(target, base_url=url, policy=ONE_TRY) as session:
        for operation_id in operation_ids:
            with pytest.raises(idempotently.OperationPendingError):
                session.post("/v1/charges", json={"id": operation_id}, operation_id=operation_id)


def test_resume_reads_each_operation_once(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """Resuming three pending operations reads the operations table once (the queue),
    not once more per operation; each is still sent once with its own key."""
    app, url = scripted
    target = str(tmp_path / "journal.db")
    leave_pending(target, url, app, ["op-1", "op-2", "op-3"])
    app.arrivals.clear()
    selects: list[str] = []

    def trace(statement: str) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "FROM operations" in statement:
            selects.append(statement)

    with idempotently.Session(target, base_url=url) as session:
        session.journal._conn.set_trace_callback(trace)
        results = session.resume()
        session.journal._conn.set_trace_callback(None)
        keys = {operation.operation_id: operation.key for operation in session.journal.operations()}
    assert [("op-1", "succeeded"), ("op-2", "succeeded"), ("op-3", "succeeded")] == [
        (result.operation_id, result.action) for result in results
    ]
    assert 1 == len(selects)
    assert sorted(keys.values()) == sorted(arrival.key for arrival in app.arrivals)


def test_a_row_written_after_the_queue_read_is_read_again_before_it_is_sent(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """Between resume's queue read and its send of op-2, another caller sends op-2 and the
    server asks it to come back in ten minutes (its lease given back, as the queue read
    it): resume's lease on the row it read fails, it reads op-2 again and leaves it
    waiting, instead of sending it against the server's word."""
    app, url = scripted
    leave_pending(journal_target, url, app, ["op-1", "op-2"])
    app.arrivals.clear()
    app.answer(Answer(status=201), Answer(status=409, headers=(("Retry-After", "600"),)))
    other = idempotently.Session(journal_target, base_url=url, policy=ONE_TRY)

    def meanwhile(result: idempotently.ResumeResult) -> None:
        if result.operation_id == "op-1":
            with pytest.raises(idempotently.IdempotentlyError):
                other.post("/v1/charges", json={"id": "op-2"}, operation_id="op-2")

    with other, idempotently.Session(journal_target, base_url=url) as session:
        results = session.resume(on_result=meanwhile)
        operation = session.journal.operation("op-2")
    assert operation is not None
    assert [("op-1", "succeeded", "succeeded"), ("op-2", "pending", "waiting")] == [
        (result.operation_id, result.status, result.action) for result in results
    ]
    assert 1 == [arrival.key for arrival in app.arrivals].count(operation.key)
    assert operation.not_before is not None


def test_the_lease_is_never_taken_on_a_row_written_since_it_was_read(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """A lease's compare-and-swap on a row read before another caller journaled an
    attempt of it (and gave its lease back) fails: nothing is sent from that read."""
    from idempotently._commands import TakeLease

    app, url = scripted
    leave_pending(journal_target, url, app, ["op"])
    with idempotently.Journal(journal_target) as journal:
        read = journal.operation("op")
        assert read is not None
        app.answer(Answer(status=503))
        with (
            idempotently.Session(journal, base_url=url, policy=ONE_TRY) as other,
            pytest.raises(idempotently.OperationPendingError),
        ):
            other.post("/v1/charges", json={"id": "op"}, operation_id="op")
        again = journal.operation("op")
        assert again is not None
        now = again.updated_at + 1
        assert (read.lease_owner, read.lease_until) == (again.lease_owner, again.lease_until)
        assert False is journal._execute(TakeLease(read, "stale", now + 30, now))
        assert True is journal._execute(TakeLease(again, "fresh", now + 30, now))
