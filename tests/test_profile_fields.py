"""Every ServerProfile field changes what a Session does: each test fails if it is ignored."""

from __future__ import annotations

from pathlib import Path

import attrs
import httpx
import pytest
import respx

import idempotently
from idempotently import profiles
from tests.support import URL, FakeTime, make_session

HOUR = 3600.0


def sent_header(route: respx.Route, name: str) -> list[str | None]:
    return [call.request.headers.get(name) for call in route.calls]


def test_key_header_names_the_header_that_carries_the_key(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """The key travels in the profile's key_header, and only there."""
    route = router.post(URL).mock(return_value=httpx.Response(201))
    profile = attrs.evolve(profiles.GENERIC, name="custom", key_header="X-Request-Key")
    with make_session(tmp_path, fake_time, profile=profile) as s:
        response = s.post(URL, json={}, operation_id="op")
    key = response.extensions["idempotently"].key
    assert [key] == sent_header(route, "X-Request-Key")
    assert [None] == sent_header(route, "Idempotency-Key")


def test_key_format_sf_string_quotes_the_key(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """The IETF profile sends the key as an RFC 8941 quoted string."""
    route = router.post(URL).mock(return_value=httpx.Response(201))
    with make_session(tmp_path, fake_time, profile=profiles.IETF) as s:
        s.post(URL, json={}, idempotency_key="k-1")
    assert ['"k-1"'] == sent_header(route, "Idempotency-Key")


def test_max_key_length_rejects_a_longer_key_before_sending(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A key longer than the profile allows is an InvalidKeyError; nothing is sent."""
    route = router.post(URL).mock(return_value=httpx.Response(201))
    profile = attrs.evolve(profiles.GENERIC, name="short", max_key_length=10)
    with make_session(tmp_path, fake_time, profile=profile) as s:
        with pytest.raises(idempotently.InvalidKeyError):
            s.post(URL, json={}, idempotency_key="k" * 11)
        assert [] == s.journal.operations()
    assert 0 == route.call_count


def test_key_lifetime_stops_resending_a_key_the_server_forgot(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """Past key_lifetime minus the margin, a pending operation is not resent: needs_reconcile."""
    route = router.post(URL).mock(side_effect=[httpx.ReadTimeout("lost"), httpx.Response(201)])
    profile = attrs.evolve(profiles.GENERIC, name="short-lived", key_lifetime=2 * HOUR)
    policy = idempotently.RetryPolicy(max_attempts=1)
    with make_session(tmp_path, fake_time, profile=profile, policy=policy) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={}, operation_id="op")
        # Within 24 h, one second past 2 h minus its default margin (a tenth: 12 min).
        fake_time.now += 2 * HOUR - 0.2 * HOUR + 1
        with pytest.raises(idempotently.NeedsReconcileError):
            s.post(URL, json={}, operation_id="op")
        operation = s.journal.operation("op")
    assert operation is not None and "needs_reconcile" == operation.status
    assert 1 == route.call_count


def test_in_progress_statuses_make_a_423_a_wait_not_an_answer(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A status the profile lists as in progress is retried; elsewhere it is final."""
    profile = attrs.evolve(profiles.GENERIC, name="idemkit", in_progress_statuses=frozenset({423}))
    route = router.post(URL).mock(side_effect=[httpx.Response(423), httpx.Response(201)])
    with make_session(tmp_path, fake_time, profile=profile) as s:
        assert 201 == s.post(URL, json={}).status_code
    assert 2 == route.call_count


def test_in_progress_timeout_sends_an_endless_lock_to_reconciliation(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """'In progress' for longer than in_progress_timeout (across calls) is needs_reconcile."""
    router.post(URL).mock(return_value=httpx.Response(409))
    profile = attrs.evolve(profiles.GENERIC, name="stuck-lock", in_progress_timeout=60.0)
    policy = idempotently.RetryPolicy(in_progress_retries=2, initial_backoff=5, max_backoff=5)
    with make_session(tmp_path, fake_time, profile=profile, policy=policy) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={}, operation_id="op")  # three 409s, ~10 s
        fake_time.now += 120
        with pytest.raises(idempotently.NeedsReconcileError):
            s.post(URL, json={}, operation_id="op")
        operation = s.journal.operation("op")
    assert operation is not None and "needs_reconcile" == operation.status


def test_no_in_progress_timeout_keeps_waiting(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """With in_progress_timeout=None, a long 'in progress' stays pending."""
    router.post(URL).mock(return_value=httpx.Response(409))
    profile = attrs.evolve(profiles.GENERIC, name="patient", in_progress_timeout=None)
    policy = idempotently.RetryPolicy(in_progress_retries=2, initial_backoff=5, max_backoff=5)
    with make_session(tmp_path, fake_time, profile=profile, policy=policy) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={}, operation_id="op")
        fake_time.now += 120
        with pytest.raises(idempotently.OperationPendingError) as caught:
            s.post(URL, json={}, operation_id="op")
    assert not isinstance(caught.value, idempotently.NeedsReconcileError)


def test_mismatch_statuses_make_a_status_a_payload_mismatch(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A status in mismatch_statuses is a final "another payload": never retried."""
    profile = attrs.evolve(profiles.GENERIC, name="m", mismatch_statuses=frozenset({409}))
    route = router.post(URL).mock(return_value=httpx.Response(409))
    with make_session(tmp_path, fake_time, profile=profile) as s:
        assert 409 == s.post(URL, json={}, operation_id="op").status_code
        operation = s.journal.operation("op")
    assert 1 == route.call_count
    assert operation is not None and "failed" == operation.status


def test_mismatch_matcher_is_replaceable(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A server whose 409 body says 'reused' is read as a mismatch by a custom matcher."""
    profile = attrs.evolve(
        profiles.GENERIC, name="reused", mismatch_matcher=profiles.body_mentions("reused")
    )
    route = router.post(URL).mock(
        return_value=httpx.Response(409, json={"error": "key reused with other params"})
    )
    with make_session(tmp_path, fake_time, profile=profile) as s:
        assert 409 == s.post(URL, json={}).status_code
    assert 1 == route.call_count


def broken(response: httpx.Response) -> bool:
    """A user's matcher that raises (importable by name, so it can be journaled)."""
    raise KeyError("oops")


def test_a_mismatch_matcher_that_raises_is_no_match(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A broken user matcher never turns an answer into a crash: the 409 is 'in progress'."""
    profile = attrs.evolve(profiles.GENERIC, name="broken", mismatch_matcher=broken)
    route = router.post(URL).mock(side_effect=[httpx.Response(409), httpx.Response(201)])
    with make_session(tmp_path, fake_time, profile=profile) as s:
        assert 201 == s.post(URL, json={}).status_code
    assert 2 == route.call_count


def test_stores_server_errors_false_sends_a_500_to_reconciliation(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A server that releases the key on a 5xx may have acted: a 500 is not resent."""
    profile = attrs.evolve(profiles.GENERIC, name="releases", stores_server_errors=False)
    route = router.post(URL).mock(side_effect=[httpx.Response(500), httpx.Response(201)])
    with make_session(tmp_path, fake_time, profile=profile) as s:
        with pytest.raises(idempotently.NeedsReconcileError):
            s.post(URL, json={}, operation_id="op")
        operation = s.journal.operation("op")
    assert 1 == route.call_count
    assert operation is not None and "needs_reconcile" == operation.status


def test_stores_server_errors_false_still_retries_gateway_errors(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """502, 503 and 504 come from a gateway, not the handler: retried on every server."""
    profile = attrs.evolve(profiles.GENERIC, name="releases", stores_server_errors=False)
    route = router.post(URL).mock(
        side_effect=[
            httpx.Response(502),
            httpx.Response(503),
            httpx.Response(504),
            httpx.Response(201),
        ]
    )
    with make_session(tmp_path, fake_time, profile=profile) as s:
        assert 201 == s.post(URL, json={}).status_code
    assert 4 == route.call_count


def test_replay_headers_name_the_replay_marker(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """Only the profile's replay headers mark an answer as the server's stored one."""
    profile = attrs.evolve(profiles.GENERIC, name="x", replay_headers=("X-Replayed",))
    router.post(URL).mock(
        side_effect=[
            httpx.Response(201, headers={"X-Replayed": "true"}),
            httpx.Response(201, headers={"Idempotent-Replayed": "true"}),
        ]
    )
    with make_session(tmp_path, fake_time, profile=profile) as s:
        marked = s.post(URL, json={"n": 1}).extensions["idempotently"].replayed
        unmarked = s.post(URL, json={"n": 2}).extensions["idempotently"].replayed
    assert (True, False) == (marked, unmarked)


def test_a_replayed_500_by_the_profiles_marker_needs_reconcile(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A 500 marked replayed by the profile's header replays forever: not resent."""
    profile = attrs.evolve(profiles.GENERIC, name="x", replay_headers=("X-Replayed",))
    route = router.post(URL).mock(return_value=httpx.Response(500, headers={"X-Replayed": "1"}))
    with (
        make_session(tmp_path, fake_time, profile=profile) as s,
        pytest.raises(idempotently.NeedsReconcileError),
    ):
        s.post(URL, json={})
    assert 1 == route.call_count


def test_a_replay_marker_may_name_its_own_value(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """``X-Idempotency-Status: hit`` marks a replay by that value (any case), and only
    by it: ``miss`` and ``true`` under that header do not."""
    profile = attrs.evolve(
        profiles.GENERIC, name="x", replay_headers=("X-Idempotency-Status: hit",)
    )
    router.post(URL).mock(
        side_effect=[
            httpx.Response(201, headers={"X-Idempotency-Status": "HIT"}),
            httpx.Response(201, headers={"X-Idempotency-Status": "miss"}),
            httpx.Response(201, headers={"X-Idempotency-Status": "true"}),
        ]
    )
    with make_session(tmp_path, fake_time, profile=profile) as s:
        replayed = [
            s.post(URL, json={"n": n}).extensions["idempotently"].replayed for n in range(3)
        ]
    assert [True, False, False] == replayed


def test_a_replay_marker_by_value_proves_a_4xx_after_a_maybe_delivered_attempt(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A read timeout, then a 400 with ``X-Idempotency-Status: hit``: the server's stored
    answer for this key, so the operation is failed (without the value it would stay
    pending, the answer proving nothing about the first attempt)."""
    profile = attrs.evolve(
        profiles.GENERIC, name="x", replay_headers=("X-Idempotency-Status: hit",)
    )
    router.post(URL).mock(
        side_effect=[
            httpx.ReadTimeout("lost"),
            httpx.Response(400, headers={"X-Idempotency-Status": "hit"}),
        ]
    )
    with make_session(tmp_path, fake_time, profile=profile) as s:
        assert 400 == s.post(URL, json={}, operation_id="op").status_code
        assert "failed" == s.journal.operation("op").status


def test_a_replay_marker_by_name_alone_still_means_true_1_or_sf_true() -> None:
    """The earlier form, a bare header name, keeps its meaning: true, 1 or ?1."""
    profile = attrs.evolve(profiles.GENERIC, name="x", replay_headers=("X-Replayed",))
    marked = [
        profile.is_replay(httpx.Response(201, headers={"X-Replayed": value}))
        for value in ("true", "1", "?1", "hit", "false")
    ]
    assert [True, True, True, False, False] == marked


@pytest.mark.parametrize(
    "marker", ["X-Idempotency-Status: ", "X Status: hit", "X-Idempotency-Status: a,b", ""]
)
def test_a_malformed_replay_marker_is_refused(marker: str) -> None:
    """A marker is a header name, optionally with one value (no comma, not empty)."""
    with pytest.raises(ValueError, match="replay_headers"):
        attrs.evolve(profiles.GENERIC, name="x", replay_headers=(marker,))


def test_retry_hint_headers_name_the_hint(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """The profile's hint header saying false stops a 503; another header's hint is ignored."""
    profile = attrs.evolve(profiles.GENERIC, name="x", retry_hint_headers=("X-Retry",))
    stopped = router.post(URL, json={"n": 1}).mock(
        return_value=httpx.Response(503, headers={"X-Retry": "false"})
    )
    retried = router.post(URL, json={"n": 2}).mock(
        side_effect=[httpx.Response(503, headers={"X-Should-Retry": "false"}), httpx.Response(201)]
    )
    with make_session(tmp_path, fake_time, profile=profile) as s:
        with pytest.raises(idempotently.NeedsReconcileError):
            s.post(URL, json={"n": 1})
        assert 201 == s.post(URL, json={"n": 2}).status_code
    assert (1, 2) == (stopped.call_count, retried.call_count)


def test_name_chooses_how_resume_reads_an_operations_answers(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """An operation journaled under Stripe's profile is read as Stripe by any resumer."""
    policy = idempotently.RetryPolicy(max_attempts=1)
    router.post(URL).mock(side_effect=httpx.ReadTimeout("lost"))
    with (
        make_session(tmp_path, fake_time, profile=profiles.STRIPE, policy=policy) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(URL, json={}, operation_id="op")
    router.post(URL).mock(
        return_value=httpx.Response(400, json={"error": {"type": "idempotency_error"}})
    )
    with make_session(tmp_path, fake_time) as generic:  # the default, GENERIC
        results = generic.resume()
    # Stripe's "key reused with another payload" after a maybe-delivered attempt: a human
    # must look. Read as generic, the 400 would leave it pending.
    assert [("needs_reconcile", "needs_reconcile")] == [(r.status, r.action) for r in results]
