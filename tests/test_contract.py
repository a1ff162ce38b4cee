"""The client contract (DESIGN §3), one table run on every driver.

Each row is a server's answers and what the caller must see: the answer or the
error, how many sends, the journal's status, the sleeps. Every row runs on
Session, AsyncSession (asyncio, trio), Transport and AsyncTransport (asyncio,
trio): one table, no copy per driver, so no driver can drift from the others.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import httpx
import pytest
import tenacity

import idempotently
from idempotently import profiles
from idempotently._vocabulary import Delivery, Status
from tests.drivers import DRIVERS, Driver, Script, Step, answer, fail
from tests.support import FakeTime

OPERATION_ID = "order-42:charge"
CHARGE = {"amount": 1000, "currency": "usd"}
CREATED = {"id": "ch_1", "amount": 1000}
BACKOFF = 0.5
# A fixed backoff: every sleep of the table is exact.
POLICY = idempotently.RetryPolicy(wait=tenacity.wait_fixed(BACKOFF))
START = FakeTime().now


@attrs.frozen
class Row:
    """One promise: the server's answers, and what the caller and the journal show."""

    id: str
    promise: str
    steps: tuple[Step, ...]
    sends: int
    """Sends made by the call under test (after ``earlier``, if any)."""
    status: Status
    returns: int | None = None
    raises: type[idempotently.IdempotentlyError] | None = None
    error_status: int | None = None
    """The status of the response the raised error carries."""
    sleeps: tuple[float, ...] = ()
    not_before: float | None = None
    policy: idempotently.RetryPolicy = POLICY
    profile: idempotently.ServerProfile = profiles.GENERIC
    delivery: Delivery = "exactly_once"
    body: Any = CHARGE
    earlier: Any = None
    """The body of an earlier call of the same operation that succeeded (one send)."""
    replayed_locally: bool = False


ok = answer(201, json=CREATED)

ROWS = [
    Row(
        "clean_201",
        "A 201 is returned after one send and the operation succeeds.",
        (ok,),
        sends=1,
        status="succeeded",
        returns=201,
    ),
    Row(
        "connect_error_then_201",
        "A connect error (never sent) is retried after a backoff.",
        (fail(httpx.ConnectError), ok),
        sends=2,
        status="succeeded",
        returns=201,
        sleeps=(BACKOFF,),
    ),
    Row(
        "read_timeout_then_201",
        "A read timeout (maybe delivered) is retried with the same key and bytes.",
        (fail(httpx.ReadTimeout), ok),
        sends=2,
        status="succeeded",
        returns=201,
        sleeps=(BACKOFF,),
    ),
    Row(
        "503_503_201",
        "Each 503 is retried after a backoff until the 201.",
        (answer(503), answer(503), ok),
        sends=3,
        status="succeeded",
        returns=201,
        sleeps=(BACKOFF, BACKOFF),
    ),
    Row(
        "429_retry_after_then_201",
        "A 429 is retried no sooner than its Retry-After.",
        (answer(429, headers={"Retry-After": "2"}), ok),
        sends=2,
        status="succeeded",
        returns=201,
        # The 429 paused its origin: the wait comes in slices of at most a second, each
        # a look whether the pause was lifted (`idempotently unpause`).
        sleeps=(1.0, 1.0),
    ),
    Row(
        "409_in_progress_then_201",
        "A 409 'key in progress' is waited through.",
        (answer(409), ok),
        sends=2,
        status="succeeded",
        returns=201,
        sleeps=(BACKOFF,),
    ),
    Row(
        "409_past_in_progress_retries",
        "409s beyond in_progress_retries leave the operation pending and raise.",
        (answer(409), answer(409), answer(409)),
        sends=3,
        status="pending",
        raises=idempotently.OperationPendingError,
        error_status=409,
        sleeps=(BACKOFF, BACKOFF),
        policy=attrs.evolve(POLICY, in_progress_retries=2),
    ),
    Row(
        "422_final",
        "A 422 is returned after one send and the operation fails.",
        (answer(422, json={"error": "mismatch"}),),
        sends=1,
        status="failed",
        returns=422,
    ),
    Row(
        "400_first_attempt",
        "A 400 as the server's first word on the key is returned and the operation fails.",
        (answer(400, json={"error": "bad amount"}),),
        sends=1,
        status="failed",
        returns=400,
    ),
    Row(
        "read_timeout_then_401",
        "A 401 after a maybe-delivered attempt says nothing of it: pending, raised.",
        (fail(httpx.ReadTimeout), answer(401)),
        sends=2,
        status="pending",
        raises=idempotently.OperationPendingError,
        error_status=401,
        sleeps=(BACKOFF,),
    ),
    Row(
        "read_timeout_then_404",
        "A 404 after a maybe-delivered attempt says nothing of it: pending, raised.",
        (fail(httpx.ReadTimeout), answer(404)),
        sends=2,
        status="pending",
        raises=idempotently.OperationPendingError,
        error_status=404,
        sleeps=(BACKOFF,),
    ),
    Row(
        "replayed_500",
        "A replayed 500 can never change: it goes to reconciliation, never resent.",
        (answer(500, headers={"Idempotent-Replayed": "true"}),),
        sends=1,
        status="needs_reconcile",
        raises=idempotently.NeedsReconcileError,
        error_status=500,
    ),
    Row(
        "retry_after_3600",
        "A Retry-After beyond max_retry_after is not slept: pending until not_before.",
        (answer(503, headers={"Retry-After": "3600"}),),
        sends=1,
        status="pending",
        raises=idempotently.RetryLaterError,
        error_status=503,
        not_before=START + 3600,
        # A budget long enough to wait: only max_retry_after (30 s) stops the call.
        policy=attrs.evolve(POLICY, deadline=7200),
    ),
    Row(
        "max_attempts_503",
        "503s until max_attempts leave the operation pending and raise.",
        (answer(503), answer(503), answer(503)),
        sends=3,
        status="pending",
        raises=idempotently.OperationPendingError,
        error_status=503,
        sleeps=(BACKOFF, BACKOFF),
        policy=attrs.evolve(POLICY, max_attempts=3),
    ),
    Row(
        "same_id_after_success",
        "The same operation again returns the stored answer without a send.",
        (ok,),
        sends=0,
        status="succeeded",
        returns=201,
        earlier=CHARGE,
        replayed_locally=True,
    ),
    Row(
        "same_id_other_body",
        "The same operation with another body raises KeyReuseError before sending.",
        (ok,),
        sends=0,
        status="succeeded",
        raises=idempotently.KeyReuseError,
        body={"amount": 100000, "currency": "usd"},
        earlier=CHARGE,
    ),
    Row(
        "at_most_once_read_timeout",
        "At-most-once never resends what may have been delivered: abandoned.",
        (fail(httpx.ReadTimeout),),
        sends=1,
        status="abandoned",
        raises=idempotently.OperationAbandonedError,
        delivery="at_most_once",
    ),
    Row(
        "stripe_400_idempotency_error",
        "Stripe's 400 idempotency_error is final: returned, failed, one send.",
        (answer(400, json={"error": {"type": "idempotency_error", "message": "reused"}}),),
        sends=1,
        status="failed",
        returns=400,
        profile=profiles.STRIPE,
    ),
    Row(
        "stripe_idempotency_error_after_timeout",
        "Stripe's mismatch after a maybe-delivered attempt goes to reconciliation.",
        (
            fail(httpx.ReadTimeout),
            answer(400, json={"error": {"type": "idempotency_error", "message": "reused"}}),
        ),
        sends=2,
        status="needs_reconcile",
        raises=idempotently.NeedsReconcileError,
        error_status=400,
        sleeps=(BACKOFF,),
        profile=profiles.STRIPE,
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
@pytest.mark.parametrize("kind", DRIVERS)
def test_contract(kind: str, row: Row, journal_target: str) -> None:
    """Every driver keeps every promise of the table on every store, with one key and one body."""
    time = FakeTime()
    script = Script(list(row.steps))
    with idempotently.Journal(journal_target) as journal:
        driver = Driver(
            kind,
            journal,
            script,
            time,
            policy=row.policy,
            profile=row.profile,
            delivery=row.delivery,
        )
        if row.earlier is not None:
            first = driver.post(json=row.earlier, operation_id=OPERATION_ID)
            assert 201 == first.status_code
        before = len(script.sent)
        response: httpx.Response | None = None
        error: idempotently.IdempotentlyError | None = None
        try:
            response = driver.post(json=row.body, operation_id=OPERATION_ID)
        except idempotently.IdempotentlyError as raised:
            error = raised
        operation = journal.operation(OPERATION_ID)

    assert operation is not None, row.promise
    assert row.returns == (None if response is None else response.status_code), row.promise
    assert row.raises == (None if error is None else type(error)), row.promise
    assert row.sends == len(script.sent) - before, row.promise
    assert row.status == operation.status, row.promise
    assert list(row.sleeps) == time.sleeps, row.promise
    assert len(script.sent) == operation.attempt_count, "every send is journaled as an attempt"
    # Every send of the operation, earlier call included: its one journaled key and bytes.
    assert {(operation.key, operation.request_body)} == {
        (request.headers["Idempotency-Key"], request.content) for request in script.sent
    }, row.promise
    if response is not None:
        receipt = response.extensions["idempotently"]
        assert (OPERATION_ID, operation.key) == (receipt.operation_id, receipt.key)
        assert row.replayed_locally == receipt.replayed_locally
        assert operation.attempt_count == receipt.attempts
        if response.status_code == 201:
            assert CREATED == json.loads(response.content)
    if error is not None:
        assert (OPERATION_ID, operation.key) == (error.operation_id, error.key), row.promise
        error_response = error.response
        assert row.error_status == (
            None if error_response is None else error_response.status_code
        ), row.promise
    if row.raises is idempotently.RetryLaterError:
        assert isinstance(error, idempotently.RetryLaterError)
        assert row.not_before == error.not_before == operation.not_before
