"""Races of the exactly-once machinery (found by an adversarial review): a derived key
taken by another operation, a second caller during a long attempt, a late attempt
after a settlement, a cancellation after the answer was journaled."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import httpx
import pytest

import idempotently
from idempotently._commands import Insert, Record
from tests.faults import around_commit
from tests.journal_commands import record_attempt
from tests.support import URL, FakeTime, make_session


def test_a_named_call_whose_derived_key_belongs_to_another_operation_does_not_spin(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A derived key already used by another operation is an error, never an endless loop."""
    with make_session(
        tmp_path, fake_time, transport=httpx.MockTransport(lambda r: httpx.Response(201))
    ) as s:
        derived = str(uuid.uuid5(s.journal.namespace, "order-b"))
        s.post(URL, json={}, operation_id="order-a", idempotency_key=derived)
        inserts = 0

        def counted(write: object) -> None:
            nonlocal inserts
            inserts += 1
            if inserts > 50:
                raise RuntimeError("spinning: 50 inserts without a sleep")

        with (
            around_commit(s.journal, Insert, before=counted),
            pytest.raises(idempotently.KeyReuseError),
        ):
            s.post(URL, json={}, operation_id="order-b")
        assert 1 <= inserts <= 2  # it tried its key, found it taken, and said so


def _slow_first_send(fake_time: FakeTime, inner: Any, first_status: int) -> Any:
    """A server whose first answer takes longer than the lease; meanwhile ``inner`` runs."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["Idempotency-Key"])
        if len(seen) == 1:
            fake_time.now += 61.0  # the attempt outlives its 60 s lease
            inner()
            return httpx.Response(first_status)
        return httpx.Response(201)

    handler.seen = seen  # type: ignore[attr-defined]
    return handler


def test_a_second_caller_never_sends_while_a_long_attempt_is_in_flight(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """One operation is in flight at most once, however long its attempt takes."""
    outcomes: list[str] = []
    box: dict[str, idempotently.Session] = {}

    def second_caller() -> None:
        try:
            box["s"].post(URL, json={}, operation_id="order-42")
            outcomes.append("sent")
        except idempotently.OperationInProgressError:
            outcomes.append("in progress")

    handler = _slow_first_send(fake_time, second_caller, 201)
    with make_session(tmp_path, fake_time, transport=httpx.MockTransport(handler)) as s:
        box["s"] = s
        s.post(URL, json={}, operation_id="order-42")
    assert 1 == len(handler.seen)


def test_a_late_attempt_never_overwrites_a_settled_operation(tmp_path: Path) -> None:
    """Once another caller took the lease over (another process, after it expired) and
    settled the operation, the first caller's late answer joins the history and changes
    nothing else: the operation stays succeeded with its 201."""
    from idempotently._journal import AttemptRecord
    from tests.test_journal import NOW, insert, new_operation

    journal = idempotently.Journal(tmp_path / "journal.db")
    insert(journal, new_operation(), lease_until=NOW + 60)  # first caller: "test-owner"
    journal._conn.execute(
        "UPDATE operations SET lease_owner = 'other-host:1:b', lease_until = ?", (NOW + 200,)
    )
    settled = AttemptRecord(
        started_at=NOW + 70,
        elapsed=0.1,
        outcome="answered",
        status_code=201,
        status="succeeded",
        response_status=201,
        response_headers=(),
        response_body=b"{}",
    )
    record_attempt(journal, "op-1", settled, now=NOW + 71, owner="other-host:1:b")
    late = AttemptRecord(
        started_at=NOW, elapsed=75.0, outcome="answered", status_code=400, status="failed"
    )
    record_attempt(journal, "op-1", late, now=NOW + 75, owner="test-owner")
    operation = journal.operation("op-1")
    journal.close()
    assert operation is not None
    assert ("succeeded", 201, 2) == (
        operation.status,
        operation.response_status,
        operation.attempt_count,
    )
    assert [201, 400] == [attempt.status_code for attempt in operation.attempts]


@pytest.mark.anyio
async def test_a_call_cancelled_after_its_answer_is_journaled_keeps_it(
    tmp_path: Path, fake_time: FakeTime, anyio_backend: str
) -> None:
    """A cancellation that lands after the answer was journaled changes nothing in the
    journal."""
    journal = idempotently.Journal(tmp_path / "journal.db")
    scopes: list[anyio.CancelScope] = []

    loop = anyio.lowlevel.current_token()

    def cancel(write: object) -> None:
        # In the journal's worker thread: e.g. a timeout firing now.
        anyio.from_thread.run_sync(scopes[0].cancel, token=loop)

    async with idempotently.AsyncSession(
        journal,
        transport=httpx.MockTransport(lambda r: httpx.Response(201)),
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
    ) as s:
        with _cancelling_after(journal, cancel), anyio.CancelScope() as scope:
            scopes.append(scope)
            await s.post(URL, json={}, operation_id="order-42")
    operation = journal.operation("order-42")
    journal.close()
    assert operation is not None
    assert ("succeeded", 201, 1) == (
        operation.status,
        operation.response_status,
        operation.attempt_count,
    )


def _cancelling_after(journal: idempotently.Journal, cancel: Any) -> Any:
    return around_commit(journal, Record, after=cancel)
