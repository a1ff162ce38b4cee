"""Session.resume / AsyncSession.resume: pending operations finished with their stored keys."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import respx

import idempotently
from tests.support import URL, FakeTime, make_session

ONE_TRY = idempotently.RetryPolicy(max_attempts=1)


def leave_pending(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter, operation_id: str, **kw: object
) -> str:
    """Journal an operation whose only attempt timed out; return its key."""
    route = router.post(URL).mock(side_effect=httpx.ReadTimeout("slow"))
    with (
        make_session(tmp_path, fake_time, policy=ONE_TRY) as s,
        pytest.raises(idempotently.OperationPendingError) as caught,
    ):
        s.post(URL, json={"amount": 1}, operation_id=operation_id, **kw)  # type: ignore[arg-type]
    route.side_effect = None
    route.calls.clear()  # respx hands later tests the same route for the same URL
    assert caught.value.key is not None
    return caught.value.key


def test_resume_resends_the_stored_key_and_bytes(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """Resume sends each pending operation again with the key and body it was journaled with."""
    key = leave_pending(tmp_path, fake_time, router, "op")
    route = router.post(URL).mock(
        return_value=httpx.Response(201, headers={"Idempotent-Replayed": "true"})
    )
    with make_session(tmp_path, fake_time) as s:
        results = s.resume()
        operation = s.journal.operation("op")
    assert [("op", "succeeded", "succeeded", True)] == [
        (r.operation_id, r.status, r.action, r.replayed) for r in results
    ]
    assert key == route.calls.last.request.headers["idempotency-key"]
    assert b'{"amount":1}' == route.calls.last.request.content
    assert "Bearer sk_test" == route.calls.last.request.headers["authorization"]
    assert operation is not None and "succeeded" == operation.status


def test_resume_never_resends_a_key_the_server_may_have_forgotten(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """Past the key lifetime minus the margin, the operation needs reconciling, not a resend."""
    leave_pending(tmp_path, fake_time, router, "old")
    route = router.post(URL).mock(return_value=httpx.Response(201))
    fake_time.now += 23.5 * 3600  # inside the default one-hour safety margin
    with make_session(tmp_path, fake_time) as s:
        results = s.resume()
        assert "needs_reconcile" == s.journal.operation("old").status  # type: ignore[union-attr]
    assert ["needs_reconcile"] == [r.status for r in results]
    assert "forgotten" in results[0].detail
    assert 0 == route.call_count


def test_a_reconciler_settles_what_needs_reconciling(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """The reconciler looks the object up and its verdict is journaled."""
    leave_pending(tmp_path, fake_time, router, "old")
    fake_time.now += 30 * 3600
    seen = []

    def reconciler(
        operation: idempotently.Operation, client: httpx.Client
    ) -> idempotently.Settlement:
        seen.append(operation.operation_id)
        found = httpx.Response(200, json={"id": "ch_found"})
        return idempotently.Settlement("succeeded", "charge ch_found exists", found)

    with make_session(tmp_path, fake_time) as s:
        results = s.resume(reconciler=reconciler)
        again = s.post(URL, json={"amount": 1}, operation_id="old")
    assert ["old"] == seen
    assert [("succeeded", "reconciled")] == [(r.status, r.action) for r in results]
    assert {"id": "ch_found"} == again.json()


def test_resume_abandons_at_most_once_operations(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """An at-most-once operation left pending is never resent by resume."""
    route = router.post(URL).mock(side_effect=httpx.ConnectError("refused"))
    with make_session(tmp_path, fake_time, policy=ONE_TRY) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={"sms": "hi"}, operation_id="sms", delivery="at_most_once")
        results = s.resume()
    assert [("abandoned", "abandoned")] == [(r.status, r.action) for r in results]
    assert 1 == route.call_count


def test_resume_waits_for_not_before(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """An operation the server asked to come back to later is skipped until then."""
    route = router.post(URL).mock(
        side_effect=[httpx.Response(429, headers={"Retry-After": "600"}), httpx.Response(201)]
    )
    with make_session(tmp_path, fake_time) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={"amount": 1}, operation_id="op")
        early = s.resume()
        fake_time.now += 601
        late = s.resume()
    assert [("pending", "waiting")] == [(r.status, r.action) for r in early]
    assert [("succeeded", "succeeded")] == [(r.status, r.action) for r in late]
    assert 2 == route.call_count


def test_dry_run_sends_nothing_and_changes_nothing(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """resume(dry_run=True) says what it would do and leaves the journal as it was."""
    leave_pending(tmp_path, fake_time, router, "op")
    route = router.post(URL).mock(return_value=httpx.Response(201))
    with make_session(tmp_path, fake_time) as s:
        results = s.resume(dry_run=True)
        assert "pending" == s.journal.operation("op").status  # type: ignore[union-attr]
    assert ["would_send"] == [r.action for r in results]
    assert 0 == route.call_count


def test_resume_takes_over_the_lease_of_a_dead_process(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A lease whose owner process is gone (same host) is taken at once, not waited out."""
    import subprocess
    import sys

    leave_pending(tmp_path, fake_time, router, "op")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    from idempotently._flow._leases import _HOST

    with make_session(tmp_path, fake_time) as s:
        s.journal._conn.execute(
            "UPDATE operations SET lease_owner = ?, lease_until = ?",
            (f"{_HOST}:{dead.stdout.strip()}:x", fake_time.now + 3600),
        )
        route = router.post(URL).mock(return_value=httpx.Response(201))
        results = s.resume()
    assert ["succeeded"] == [r.status for r in results]
    assert 1 == route.call_count


def test_resume_leaves_a_live_lease_alone(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A lease held by a live process (this one, another session) is respected."""
    leave_pending(tmp_path, fake_time, router, "op")
    with make_session(tmp_path, fake_time) as s:
        s.journal._conn.execute(
            "UPDATE operations SET lease_owner = 'elsewhere:1:x', lease_until = ?",
            (fake_time.now + 3600,),
        )
        route = router.post(URL).mock(return_value=httpx.Response(201))
        results = s.resume()
    assert [("pending", "leased")] == [(r.status, r.action) for r in results]
    assert 0 == route.call_count


@pytest.mark.anyio
async def test_async_resume_resends_with_the_stored_key(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """AsyncSession.resume (asyncio and trio) finishes pending operations like Session."""
    key = leave_pending(tmp_path, fake_time, router, "op")
    route = router.post(URL).mock(return_value=httpx.Response(201))
    async with idempotently.AsyncSession(
        tmp_path / "journal.db", clock=fake_time.clock, sleep=fake_time.async_sleep
    ) as s:
        results = await s.resume()
    assert ["succeeded"] == [r.status for r in results]
    assert key == route.calls.last.request.headers["idempotency-key"]


def test_stuck_counts_idle_pending_operations_but_not_waiting_ones(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """stats().stuck: pending and idle past the window, unless the server asked to wait."""
    leave_pending(tmp_path, fake_time, router, "idle")
    router.post(URL).mock(return_value=httpx.Response(429, headers={"Retry-After": "7200"}))
    with make_session(tmp_path, fake_time) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={"amount": 2}, operation_id="waiting")
        fresh = s.journal.stats(now=fake_time.now)
        later = s.journal.stats(now=fake_time.now + 600)
    assert (0, 0) == (fresh.stuck, fresh.counts["needs_reconcile"])
    assert 1 == later.stuck  # "idle"; "waiting" is not due until its not_before
    assert 2 == later.counts["pending"]


@pytest.mark.anyio
async def test_async_reconciler_settles_what_needs_reconciling(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """AsyncSession.resume awaits the reconciler and journals its verdict."""
    leave_pending(tmp_path, fake_time, router, "old")
    fake_time.now += 30 * 3600

    async def reconciler(
        operation: idempotently.Operation, client: httpx.AsyncClient
    ) -> idempotently.Settlement:
        return idempotently.Settlement("failed", f"no charge for {operation.operation_id}")

    async with idempotently.AsyncSession(
        tmp_path / "journal.db", clock=fake_time.clock, sleep=fake_time.async_sleep
    ) as s:
        results = await s.resume(reconciler=reconciler)
        operation = s.journal.operation("old")
    assert [("failed", "reconciled", "no charge for old")] == [
        (r.status, r.action, r.detail) for r in results
    ]
    assert operation is not None and "reconciled: no charge for old" == operation.reason
