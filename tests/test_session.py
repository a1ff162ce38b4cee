"""Session and AsyncSession policy, driven through respx with a fake clock and sleep."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import httpx
import pytest
import respx

import idempotently
from idempotently import profiles
from idempotently._commands import Record, Send
from idempotently._flow._operation import Call, Held
from idempotently._keys import fingerprint
from tests.faults import around_commit
from tests.support import URL, FakeTime, make_session


def keys_and_bodies(route: respx.Route) -> set[tuple[str | None, bytes]]:
    return {
        (call.request.headers.get("idempotency-key"), call.request.content) for call in route.calls
    }


def test_network_errors_and_5xx_are_retried_with_one_key(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """Connect error, read timeout, reset and 503 are retried; one key, one body throughout."""
    route = router.post(URL).mock(
        side_effect=[
            httpx.ConnectError("refused"),
            httpx.ReadTimeout("slow"),
            httpx.RemoteProtocolError("reset"),
            httpx.Response(503),
            httpx.Response(201, json={"id": "ch_1"}),
        ]
    )
    with make_session(tmp_path, fake_time) as s:
        response = s.post(URL, json={"amount": 1000}, operation_id="op")
        operation = s.journal.operation("op")
    assert 201 == response.status_code
    assert 5 == route.call_count
    assert 1 == len(keys_and_bodies(route))
    assert operation is not None and "succeeded" == operation.status
    assert ["not_sent", "maybe_delivered", "maybe_delivered", "answered", "answered"] == [
        attempt.outcome for attempt in operation.attempts
    ]
    assert 4 == len(fake_time.sleeps)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_final_4xx_is_returned_after_one_attempt(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter, status: int
) -> None:
    """A final 4xx is returned (not raised), journaled as failed, and never retried."""
    route = router.post(URL).mock(return_value=httpx.Response(status, json={"error": "no"}))
    with make_session(tmp_path, fake_time) as s:
        response = s.post(URL, json={"amount": 1}, operation_id="op")
        operation = s.journal.operation("op")
    assert status == response.status_code
    assert 1 == route.call_count
    assert operation is not None and "failed" == operation.status
    assert [] == fake_time.sleeps


@pytest.mark.parametrize("status", [408, 409, 425, 500, 502, 503, 504])
def test_retryable_statuses_are_retried(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter, status: int
) -> None:
    """408, 409 (in progress), 425 and 5xx are retried until the answer comes."""
    route = router.post(URL).mock(side_effect=[httpx.Response(status), httpx.Response(201)])
    with make_session(tmp_path, fake_time) as s:
        assert 201 == s.post(URL, json={"amount": 1}).status_code
    assert 2 == route.call_count


def test_429_waits_for_its_retry_after(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """The wait after a 429 is at least its Retry-After."""
    router.post(URL).mock(
        side_effect=[httpx.Response(429, headers={"Retry-After": "3"}), httpx.Response(201)]
    )
    with make_session(tmp_path, fake_time) as s:
        assert 201 == s.post(URL, json={"amount": 1}).status_code
    # In slices of at most a second, each a look whether the origin was unpaused.
    assert sum(fake_time.sleeps) >= 3


def test_garbage_retry_after_falls_back_to_backoff(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A Retry-After the client cannot read is ignored, never an exception."""
    router.post(URL).mock(
        side_effect=[httpx.Response(429, headers={"Retry-After": "soon-ish"}), httpx.Response(201)]
    )
    policy = idempotently.RetryPolicy(initial_backoff=0.5, max_backoff=0.5)
    with make_session(tmp_path, fake_time, policy=policy) as s:
        assert 201 == s.post(URL, json={"amount": 1}).status_code
    assert 1 == len(fake_time.sleeps)
    assert 0 <= fake_time.sleeps[0] <= 0.5


def test_huge_retry_after_keeps_the_operation_pending_with_not_before(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A wait beyond max_retry_after is not slept: RetryLaterError, not_before journaled."""
    route = router.post(URL).mock(return_value=httpx.Response(429, headers={"Retry-After": "3600"}))
    with make_session(tmp_path, fake_time) as s:
        with pytest.raises(idempotently.RetryLaterError) as caught:
            s.post(URL, json={"amount": 1}, operation_id="op")
        operation = s.journal.operation("op")
        # Calling again before not_before sends nothing.
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={"amount": 1}, operation_id="op")
    assert [] == fake_time.sleeps
    assert 1 == route.call_count
    assert fake_time.now + 3600 == caught.value.not_before
    assert operation is not None
    assert ("pending", caught.value.not_before) == (operation.status, operation.not_before)
    assert "op" == caught.value.operation_id and operation.key == caught.value.key


def test_exhausted_budget_leaves_the_operation_pending_and_says_how_to_resume(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """When attempts run out with the outcome unknown, the operation stays pending."""
    error = httpx.ReadTimeout("slow")
    route = router.post(URL).mock(side_effect=error)
    policy = idempotently.RetryPolicy(max_attempts=3)
    with make_session(tmp_path, fake_time, policy=policy) as s:
        with pytest.raises(idempotently.OperationPendingError) as caught:
            s.post(URL, json={"amount": 1}, operation_id="op")
        operation = s.journal.operation("op")
    assert 3 == route.call_count
    assert operation is not None and "pending" == operation.status
    assert operation.lease_owner is None  # released: resume may take it at once
    message = str(caught.value)
    assert "resume" in message and "op" in message and operation.key in message
    assert caught.value.__cause__ is error


def test_deadline_is_never_slept_past(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """The call retries while it can, and the total of its waits stays within the deadline."""
    router.post(URL).mock(return_value=httpx.Response(503))
    policy = idempotently.RetryPolicy(
        max_attempts=100, deadline=10, initial_backoff=1, max_backoff=4
    )
    with (
        make_session(tmp_path, fake_time, policy=policy) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(URL, json={"amount": 1})
    assert len(fake_time.sleeps) >= 3  # it did back off and retry, more than once
    assert sum(fake_time.sleeps) <= 10


def test_completed_operation_returns_the_stored_response_without_a_call(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """The same operation_id after success replays locally: no network call."""
    route = router.post(URL).mock(return_value=httpx.Response(201, json={"id": "ch_1"}))
    with make_session(tmp_path, fake_time) as s:
        first = s.post(URL, json={"amount": 1}, operation_id="op")
        again = s.post(URL, json={"amount": 1}, operation_id="op")
    assert 1 == route.call_count
    assert (201, {"id": "ch_1"}) == (again.status_code, again.json())
    assert again.extensions["idempotently"].replayed_locally
    assert not first.extensions["idempotently"].replayed_locally


def test_pending_operation_continues_with_its_stored_key_and_bytes(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A pending operation called again resends its journaled key and body bytes."""
    route = router.post(URL).mock(
        side_effect=[httpx.ReadTimeout("slow"), httpx.Response(201, json={"id": "ch_1"})]
    )
    policy = idempotently.RetryPolicy(max_attempts=1)
    with make_session(tmp_path, fake_time, policy=policy) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(
                URL,
                content=b'{"amount": 1,  "currency": "usd"}',
                operation_id="op",
                headers={"Content-Type": "application/json"},
            )
        # Same JSON, other key order and spacing: the same operation, sent as first journaled.
        response = s.post(URL, json={"currency": "usd", "amount": 1}, operation_id="op")
    assert 201 == response.status_code
    assert 1 == len(keys_and_bodies(route))
    assert b'{"amount": 1,  "currency": "usd"}' == route.calls[1].request.content


def test_same_operation_id_with_another_payload_raises_before_sending(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """Reusing an operation_id for a different request is KeyReuseError, nothing sent."""
    route = router.post(URL).mock(return_value=httpx.Response(201))
    with make_session(tmp_path, fake_time) as s:
        s.post(URL, json={"amount": 100}, operation_id="op")
        with pytest.raises(idempotently.KeyReuseError) as caught:
            s.post(URL, json={"amount": 100000}, operation_id="op")
    assert 1 == route.call_count
    assert "op" == caught.value.operation_id


def test_an_operation_journaled_with_a_canonical_fingerprint_is_still_checked(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A row from an earlier version holds the canonical fingerprint, not a raw digest:
    the same JSON in another key order continues it, another payload is KeyReuseError."""
    route = router.post(URL).mock(return_value=httpx.Response(503))
    with make_session(tmp_path, fake_time, policy=idempotently.RetryPolicy(max_attempts=1)) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={"amount": 100, "currency": "usd"}, operation_id="op")
        request = route.calls[0].request
        legacy = fingerprint("POST", request.url, request.content, request.headers)
        assert s.journal.operation("op").fingerprint.startswith("raw:")  # type: ignore[union-attr]
        with sqlite3.connect(s.journal.path) as db:
            db.execute("UPDATE operations SET fingerprint = ?", (legacy,))
        route.mock(return_value=httpx.Response(201))
        reordered = s.post(
            URL,
            content=b'{"currency":"usd","amount":100}',
            operation_id="op",
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(idempotently.KeyReuseError):
            s.post(URL, json={"amount": 100000, "currency": "usd"}, operation_id="op")
    assert 201 == reordered.status_code
    assert 2 == route.call_count


def test_a_fingerprinted_secret_header_is_compared_though_never_journaled(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """Authorization named in fingerprint_headers is part of the request's identity: the
    same JSON reordered under the same token continues the operation, another token is
    KeyReuseError, though the journal never holds the token."""
    route = router.post(URL).mock(side_effect=[httpx.Response(503), httpx.Response(201)])
    with make_session(
        tmp_path,
        fake_time,
        policy=idempotently.RetryPolicy(max_attempts=1),
        fingerprint_headers=["Authorization"],
    ) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={"amount": 100, "currency": "usd"}, operation_id="op")
        with pytest.raises(idempotently.KeyReuseError):
            s.post(
                URL,
                json={"amount": 100, "currency": "usd"},
                operation_id="op",
                headers={"Authorization": "Bearer sk_other"},
            )
        response = s.post(URL, json={"currency": "usd", "amount": 100}, operation_id="op")
        operation = s.journal.operation("op")
    assert 201 == response.status_code
    assert 2 == route.call_count
    assert operation is not None
    assert "sk_test" not in repr(operation) and "sk_other" not in repr(operation)


def test_explicit_key_is_sent_verbatim_and_owned_by_one_operation(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """idempotency_key= is used as given; giving it to another operation is KeyReuseError."""
    route = router.post(URL).mock(return_value=httpx.Response(201))
    with make_session(tmp_path, fake_time) as s:
        s.post(URL, json={"amount": 1}, idempotency_key="order-42-charge", operation_id="a")
        with pytest.raises(idempotently.KeyReuseError):
            s.post(URL, json={"amount": 1}, idempotency_key="order-42-charge", operation_id="b")
        with pytest.raises(idempotently.InvalidKeyError):
            s.post(URL, json={"amount": 1}, idempotency_key='bad "key"')
    assert ["order-42-charge"] == [c.request.headers["idempotency-key"] for c in route.calls]


def test_ietf_profile_sends_the_key_as_a_quoted_string(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """The IETF profile renders the key as an RFC 8941 string, the same on every attempt."""
    route = router.post(URL).mock(side_effect=[httpx.Response(503), httpx.Response(201)])
    with make_session(tmp_path, fake_time, profile=profiles.IETF) as s:
        s.post(URL, json={"amount": 1}, idempotency_key="abc-123")
    assert ['"abc-123"', '"abc-123"'] == [c.request.headers["idempotency-key"] for c in route.calls]


def test_stripe_mismatch_answer_is_final(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """Stripe's 400 idempotency_error is a final answer, never retried."""
    body = {"error": {"type": "idempotency_error", "message": "Keys for idempotent requests..."}}
    route = router.post(URL).mock(return_value=httpx.Response(400, json=body))
    with make_session(tmp_path, fake_time, profile=profiles.STRIPE) as s:
        assert 400 == s.post(URL, json={"amount": 1}).status_code
    assert 1 == route.call_count


def test_server_replay_is_detected_and_journaled(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A response marked Idempotent-Replayed is flagged on the receipt and the attempt."""
    router.post(URL).mock(return_value=httpx.Response(201, headers={"Idempotent-Replayed": "true"}))
    with make_session(tmp_path, fake_time) as s:
        response = s.post(URL, json={"amount": 1}, operation_id="op")
        operation = s.journal.operation("op")
    assert response.extensions["idempotently"].replayed
    assert operation is not None and operation.attempts[0].replayed


def test_replayed_5xx_needs_reconciling_and_is_never_resent(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A stored 5xx replayed by the server ends in needs_reconcile, not in a retry loop."""
    route = router.post(URL).mock(
        return_value=httpx.Response(500, headers={"Idempotent-Replayed": "true"})
    )
    with make_session(tmp_path, fake_time) as s:
        with pytest.raises(idempotently.NeedsReconcileError):
            s.post(URL, json={"amount": 1}, operation_id="op")
        with pytest.raises(idempotently.NeedsReconcileError):
            s.post(URL, json={"amount": 1}, operation_id="op")
        assert "needs_reconcile" == s.journal.operation("op").status  # type: ignore[union-attr]
    assert 1 == route.call_count


def test_at_most_once_never_resends_what_may_have_been_delivered(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """delivery='at_most_once': a read timeout abandons the operation; no second send."""
    route = router.post(URL).mock(side_effect=[httpx.ReadTimeout("slow"), httpx.Response(201)])
    with make_session(tmp_path, fake_time) as s:
        with pytest.raises(idempotently.OperationAbandonedError):
            s.post(
                URL, json={"sms": "you were charged"}, operation_id="sms", delivery="at_most_once"
            )
        with pytest.raises(idempotently.OperationAbandonedError):
            s.post(
                URL, json={"sms": "you were charged"}, operation_id="sms", delivery="at_most_once"
            )
        assert "abandoned" == s.journal.operation("sms").status  # type: ignore[union-attr]
    assert 1 == route.call_count


def test_at_most_once_retries_what_was_never_sent(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """delivery='at_most_once' still retries a connect error: the server never saw it."""
    route = router.post(URL).mock(side_effect=[httpx.ConnectError("refused"), httpx.Response(201)])
    with make_session(tmp_path, fake_time) as s:
        assert 201 == s.post(URL, json={"sms": "hi"}, delivery="at_most_once").status_code
    assert 2 == route.call_count


def test_live_lease_of_another_caller_blocks_a_second_sender(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """While one caller holds an operation's lease, another waits for it, then gets
    OperationInProgressError: never a second send."""
    route = router.post(URL).mock(return_value=httpx.Response(201))
    with make_session(tmp_path, fake_time) as first, make_session(tmp_path, fake_time) as second:
        # The first caller journaled the operation and is (as far as anyone knows) sending it.
        request = first.client.build_request("POST", URL, json={"amount": 1})
        request.read()
        flow = first._engine.call(Call(request, operation_id="op"), first._build, Held())
        command = next(flow)
        while not isinstance(command, Send):
            command = flow.send(first.journal._execute(command))  # type: ignore[arg-type]
        with pytest.raises(idempotently.OperationInProgressError):
            second.post(URL, json={"amount": 1}, operation_id="op")
    assert 0 == route.call_count
    assert 60 >= sum(fake_time.sleeps) > 50  # it waited for the first, within its deadline


def test_operation_deadline_passed_needs_reconciling(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """deadline_at survives the call: once past, the operation is not resent."""
    route = router.post(URL).mock(side_effect=httpx.ReadTimeout("slow"))
    policy = idempotently.RetryPolicy(max_attempts=1)
    with make_session(tmp_path, fake_time, policy=policy) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={"a": 1}, operation_id="op", deadline_at=fake_time.now + 60)
        fake_time.now += 120
        with pytest.raises(idempotently.NeedsReconcileError):
            s.post(URL, json={"a": 1}, operation_id="op", deadline_at=fake_time.now + 60)
    assert 1 == route.call_count


def test_the_key_row_is_fsynced_before_the_first_send(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """The INSERT naming the key commits under synchronous=FULL before the request goes out."""
    statements: list[tuple[str, str]] = []

    with make_session(tmp_path, fake_time) as s:
        store = s.journal._store

        def record(request: httpx.Request) -> httpx.Response:
            statements.append(("SEND", "in a transaction" if store._conn.in_transaction else ""))
            return httpx.Response(201)

        router.post(URL).mock(side_effect=record)
        store._conn.set_trace_callback(
            lambda sql: statements.append((" ".join(sql.split()), store._synchronous))
        )
        s.post(URL, json={"amount": 1})
    insert = next(i for i, (sql, _) in enumerate(statements) if sql.startswith("INSERT INTO op"))
    send = statements.index(("SEND", ""))  # committed: no transaction open while it is sent
    assert "FULL" == statements[insert][1]
    assert insert < send


def test_a_journal_that_cannot_be_written_stops_the_call_before_sending(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """If the key cannot be journaled, nothing is sent and the error says what to check."""
    route = router.post(URL).mock(return_value=httpx.Response(201))
    with make_session(tmp_path, fake_time) as s:
        s.journal._conn.execute("PRAGMA busy_timeout = 10")
        blocker = sqlite3.connect(tmp_path / "journal.db")
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            with pytest.raises(idempotently.JournalWriteError) as caught:
                s.post(URL, json={"amount": 1}, operation_id="op")
        finally:
            blocker.rollback()
            blocker.close()
    assert 0 == route.call_count
    assert "journal.db" in str(caught.value) and "op" == caught.value.operation_id


@pytest.mark.anyio
async def test_async_session_follows_the_same_table(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """AsyncSession retries, waits Retry-After and journals exactly like Session."""
    route = router.post(URL).mock(
        side_effect=[
            httpx.ConnectError("refused"),
            httpx.Response(429, headers={"Retry-After": "2"}),
            httpx.Response(201, json={"id": "ch_1"}),
        ]
    )
    async with idempotently.AsyncSession(
        tmp_path / "journal.db", clock=fake_time.clock, sleep=fake_time.async_sleep
    ) as s:
        response = await s.post(URL, json={"amount": 1}, operation_id="op")
        again = await s.post(URL, json={"amount": 1}, operation_id="op")
        with pytest.raises(idempotently.KeyReuseError):
            await s.post(URL, json={"amount": 2}, operation_id="op")
    assert 201 == response.status_code and json.loads(again.content) == {"id": "ch_1"}
    assert 3 == route.call_count
    assert 1 == len(keys_and_bodies(route))
    assert sum(fake_time.sleeps[1:]) >= 2


@pytest.mark.anyio
async def test_async_session_raises_retry_later_without_sleeping(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """AsyncSession does not sleep a Retry-After beyond max_retry_after."""
    router.post(URL).mock(return_value=httpx.Response(503, headers={"Retry-After": "9999"}))
    async with idempotently.AsyncSession(
        tmp_path / "journal.db", clock=fake_time.clock, sleep=fake_time.async_sleep
    ) as s:
        with pytest.raises(idempotently.RetryLaterError):
            await s.post(URL, json={"amount": 1})
    assert [] == fake_time.sleeps


def test_public_names_are_exported() -> None:
    """__all__ lists exactly the public names and is sorted."""
    public = {name for name in dir(idempotently) if name.isidentifier() and name[0] != "_"}
    assert sorted(idempotently.__all__) == idempotently.__all__
    assert set(idempotently.__all__) == public - {"annotations", "cli", "otel", "testing"}


def test_a_full_disk_before_sending_loses_nothing_and_says_so(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """SQLITE_FULL on the key's commit: JournalWriteError naming the cause, nothing sent."""
    route = router.post(URL).mock(return_value=httpx.Response(201))
    with make_session(tmp_path, fake_time) as s:
        s.post(URL, json={"amount": 1}, operation_id="before")
        pages = s.journal._conn.execute("PRAGMA page_count").fetchone()[0]
        s.journal._conn.execute(f"PRAGMA max_page_count = {pages}")  # the disk is now "full"
        with pytest.raises(idempotently.JournalWriteError) as caught:
            s.post(URL, json={"amount": 2, "pad": "x" * 20_000}, operation_id="after")
        s.journal._conn.execute("PRAGMA max_page_count = 1073741823")
        assert "disk is full" in str(caught.value)
        assert ("after", 1) == (caught.value.operation_id, route.call_count)
        assert s.journal.operation("after") is None  # no half-written row
        assert "succeeded" == s.journal.operation("before").status  # type: ignore[union-attr]
        assert 201 == s.post(URL, json={"amount": 2}, operation_id="after").status_code


def test_a_full_disk_after_the_answer_keeps_the_operation_pending_with_the_response(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """If the answer cannot be journaled, the error carries it and resume can still settle it."""
    big = {"id": "ch_1", "receipt": "r" * 50_000}
    route = router.post(URL).mock(return_value=httpx.Response(201, json=big))
    with make_session(tmp_path, fake_time) as s:

        def full_disk(write: object) -> None:
            pages = s.journal._conn.execute("PRAGMA page_count").fetchone()[0]
            s.journal._conn.execute(f"PRAGMA max_page_count = {pages}")

        with (
            around_commit(s.journal, Record, before=full_disk),
            pytest.raises(idempotently.JournalWriteError) as caught,
        ):
            s.post(URL, json={"amount": 1}, operation_id="op")
        s.journal._conn.execute("PRAGMA max_page_count = 1073741823")
        assert caught.value.operation_id == "op"
        journaled = s.journal.operation("op")
        assert journaled is not None
        assert journaled.key == caught.value.key  # every error names the key too
        assert "pending" == journaled.status
        results = s.resume()
    assert [("op", "succeeded")] == [(r.operation_id, r.status) for r in results]
    assert 2 == route.call_count  # the resume resent the same key; the server replays


def test_durability_os_commits_the_key_without_an_fsync(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """Journal(durability="os") still commits the key before sending, but under NORMAL."""
    statements: list[tuple[str, str]] = []
    journal = idempotently.Journal(tmp_path / "journal.db", durability="os")
    store = journal._store
    router.post(URL).mock(
        side_effect=lambda request: (
            statements.append(("SEND", "in a transaction" if store._conn.in_transaction else ""))
            or httpx.Response(201)
        )
    )
    store._conn.set_trace_callback(
        lambda sql: statements.append((" ".join(sql.split()), store._synchronous))
    )
    with idempotently.Session(journal, clock=fake_time.clock, sleep=fake_time.sleep) as s:
        s.post(URL, json={"amount": 1}, operation_id="op")
    journal.close()
    insert = next(i for i, (sql, _) in enumerate(statements) if sql.startswith("INSERT INTO op"))
    assert insert < statements.index(("SEND", ""))
    assert {"NORMAL"} == {
        level for sql, level in statements if sql != "SEND" and "synchronous" not in sql
    }


def test_one_session_shared_by_threads_journals_every_operation_once(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """8 threads x 25 calls through one Session: 200 operations, 200 distinct keys, all settled."""
    from concurrent.futures import ThreadPoolExecutor

    route = router.post(URL).mock(side_effect=[httpx.Response(503), *[httpx.Response(201)] * 200])
    with make_session(tmp_path, fake_time) as s, ThreadPoolExecutor(8) as pool:
        responses = list(
            pool.map(
                lambda i: s.post(URL, json={"order": i}, operation_id=f"order-{i}"), range(200)
            )
        )
        counts = s.journal.counts()
    assert {201} == {response.status_code for response in responses}
    assert 200 == counts["succeeded"] and 200 == sum(counts.values())
    assert 200 == len({c.request.headers["idempotency-key"] for c in route.calls})
    assert 201 == route.call_count  # the one 503 was retried, nothing else resent


@pytest.mark.anyio
async def test_one_async_session_shared_by_tasks_journals_every_operation_once(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """50 concurrent tasks through one AsyncSession (asyncio and trio): 50 settled operations."""
    import anyio

    route = router.post(URL).mock(return_value=httpx.Response(201))
    async with (
        idempotently.AsyncSession(
            tmp_path / "journal.db", clock=fake_time.clock, sleep=fake_time.async_sleep
        ) as s,
        anyio.create_task_group() as group,
    ):
        for i in range(50):
            group.start_soon(lambda i=i: s.post(URL, json={"order": i}, operation_id=f"o-{i}"))
    with idempotently.Journal(tmp_path / "journal.db") as journal:
        assert 50 == journal.counts()["succeeded"]
    assert 50 == len({c.request.headers["idempotency-key"] for c in route.calls})
