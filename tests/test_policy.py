"""The retry table (DESIGN §3.2) through the pure ``decide()``, and ``RetryPolicy`` budgets."""

from __future__ import annotations

import json
from collections.abc import Callable

import attrs
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from idempotently._policy import (
    CallState,
    Decision,
    RetryPolicy,
    classify,
    classify_error,
    decide,
)
from idempotently._profiles import BUILTIN_PROFILES, GENERIC, IETF, STRIPE, ServerProfile
from idempotently._retry_after import server_wait
from idempotently._vocabulary import Delivery

NOW = 1_700_000_000.0
POLICY = RetryPolicy()  # 5 attempts, 60 s, 0.25 s .. 8 s backoff, Retry-After up to 30 s


def half() -> float:
    return 0.5


def call(
    attempts: int = 1,
    *,
    in_progress_answers: int = 0,
    elapsed: float = 0.0,
    deadline_at: float | None = None,
    delivery: Delivery = "exactly_once",
) -> CallState:
    """The state before the attempt being decided, the ``attempts``-th of this call
    (and, when it is one, the ``in_progress_answers``-th "in progress" answer)."""
    return CallState(
        started_at=NOW - elapsed,
        attempts=attempts - 1,
        in_progress_answers=max(0, in_progress_answers - 1),
        deadline_at=deadline_at,
        delivery=delivery,
    )


def decide_on(
    policy: RetryPolicy,
    profile: ServerProfile,
    state: CallState,
    outcome: httpx.Response | httpx.TransportError,
    *,
    rand: Callable[[], float] = half,
) -> Decision:
    """Classify one outcome, then decide on it."""
    if isinstance(outcome, httpx.Response):
        signal = classify(profile, outcome, now=NOW)
        return decide(policy, profile, state, signal, now=NOW, rand=rand)
    return decide(policy, profile, state, classify_error(outcome), now=NOW, rand=rand)


def answer(
    status: int, headers: dict[str, str] | None = None, body: bytes | str = b""
) -> httpx.Response:
    content = body.encode() if isinstance(body, str) else body
    return httpx.Response(status, headers=headers, content=content)


def on_response(
    response: httpx.Response,
    state: CallState | None = None,
    *,
    policy: RetryPolicy = POLICY,
    profile: ServerProfile = GENERIC,
) -> Decision:
    return decide_on(policy, profile, state or call(), response)


def on_error(
    error: httpx.TransportError,
    state: CallState | None = None,
    *,
    policy: RetryPolicy = POLICY,
) -> Decision:
    return decide_on(policy, GENERIC, state or call(), error)


NOT_SENT_ERRORS = [
    httpx.ConnectError("connection refused"),
    httpx.ConnectTimeout("connect timed out"),
    httpx.PoolTimeout("no connection available"),
]
MAYBE_DELIVERED_ERRORS = [
    httpx.ReadTimeout("read timed out"),
    httpx.WriteTimeout("write timed out"),
    httpx.ReadError("connection reset by peer"),
    httpx.RemoteProtocolError("server disconnected without sending a response"),
]


# -- network errors ----------------------------------------------------------------


@pytest.mark.parametrize("error", NOT_SENT_ERRORS, ids=lambda error: type(error).__name__)
@pytest.mark.parametrize("delivery", ["exactly_once", "at_most_once"])
def test_not_sent_errors_are_retried(error: httpx.TransportError, delivery: Delivery) -> None:
    """Connect errors and pool timeouts are retried: the server never saw the request."""
    decision = on_error(error, call(delivery=delivery))

    assert "retry" == decision.action
    assert POLICY.backoff(1, half) == decision.wait


@pytest.mark.parametrize("error", MAYBE_DELIVERED_ERRORS, ids=lambda error: type(error).__name__)
def test_maybe_delivered_errors_are_retried_with_the_key(error: httpx.TransportError) -> None:
    """Timeouts, resets and protocol errors after sending are retried: the key makes it safe."""
    assert "retry" == on_error(error).action


@pytest.mark.parametrize("error", MAYBE_DELIVERED_ERRORS, ids=lambda error: type(error).__name__)
def test_maybe_delivered_at_most_once_is_abandoned(error: httpx.TransportError) -> None:
    """An at-most-once send that may have been delivered is never resent (§3.7)."""
    assert "abandon" == on_error(error, call(delivery="at_most_once")).action


@pytest.mark.parametrize(
    "error",
    [httpx.UnsupportedProtocol("ftp://"), httpx.LocalProtocolError("bad header")],
    ids=lambda error: type(error).__name__,
)
def test_unsendable_requests_fail_locally(error: httpx.TransportError) -> None:
    """A request that cannot be sent at all is not retried: it fails locally."""
    assert "fail" == on_error(error).action


# -- answers -----------------------------------------------------------------------


@pytest.mark.parametrize("status", [200, 201, 202, 204, 299, 301, 302, 303, 304, 307, 308])
def test_2xx_and_3xx_succeed(status: int) -> None:
    """2xx and 3xx are final: success."""
    assert "succeed" == on_response(answer(status)).action


@pytest.mark.parametrize("status", [500, 502, 503, 504, 599])
def test_5xx_is_retried(status: int) -> None:
    """A 5xx is retried with the same key."""
    assert "retry" == on_response(answer(status)).action


@pytest.mark.parametrize("marker", ["Idempotent-Replayed", "Idempotency-Replayed"])
def test_replayed_5xx_needs_reconcile(marker: str) -> None:
    """A replayed 5xx replays forever: resending cannot help, a human must look."""
    assert "reconcile" == on_response(answer(500, {marker: "true"})).action


@pytest.mark.parametrize("hint", ["Stripe-Should-Retry", "x-should-retry"])
def test_5xx_with_should_retry_false_needs_reconcile(hint: str) -> None:
    """A 5xx the server says not to retry leaves the outcome unknown: needs_reconcile."""
    decision = on_response(answer(503, {hint: "false"}), profile=STRIPE)

    assert "reconcile" == decision.action


@pytest.mark.parametrize("status", [408, 425])
def test_408_and_425_are_retried(status: int) -> None:
    """408 and 425 mean "come back": retried."""
    assert "retry" == on_response(answer(status)).action


@pytest.mark.parametrize("answers", [1, 2, 3])
def test_409_in_progress_is_retried_within_its_budget(answers: int) -> None:
    """A 409 "key in progress" is retried up to ``in_progress_retries`` answers."""
    decision = on_response(answer(409), call(answers, in_progress_answers=answers))

    assert "retry" == decision.action


def test_409_past_its_budget_stays_pending() -> None:
    """After ``in_progress_retries`` 409s the operation stays pending, not failed."""
    policy = RetryPolicy(in_progress_retries=3, max_attempts=10)
    state = call(4, in_progress_answers=4)

    assert "pending" == on_response(answer(409), state, policy=policy).action


def test_409_budget_zero_stops_at_the_first_409() -> None:
    """With ``in_progress_retries=0`` the first 409 leaves the operation pending."""
    policy = RetryPolicy(in_progress_retries=0)
    state = call(in_progress_answers=1)

    assert "pending" == on_response(answer(409), state, policy=policy).action


@pytest.mark.parametrize(
    "body",
    [
        '{"error": "idempotency key reused with a different payload"}',
        '{"message": "Keys mismatch"}',
        "request with different parameters",
    ],
)
def test_409_with_a_mismatch_body_fails(body: str) -> None:
    """A 409 whose body says the payload differs is a final no, not "in progress"."""
    assert "fail" == on_response(answer(409, body=body), call(in_progress_answers=1)).action


def test_423_fails_on_the_generic_profile() -> None:
    """423 is a final 4xx unless the profile lists it as in progress."""
    assert "fail" == on_response(answer(423)).action


def test_423_is_retried_where_the_profile_says_in_progress() -> None:
    """idemkit-style servers answer 423 while the key is in progress: retried there."""
    profile = attrs.evolve(GENERIC, in_progress_statuses=frozenset({409, 423}))

    decision = on_response(answer(423), call(in_progress_answers=1), profile=profile)

    assert "retry" == decision.action


def test_429_waits_at_least_its_retry_after() -> None:
    """A 429 is retried, not before its Retry-After."""
    decision = on_response(answer(429, {"Retry-After": "1"}))

    assert "retry" == decision.action
    assert decision.wait >= 1.0


def test_429_wait_is_the_larger_of_retry_after_and_backoff() -> None:
    """The wait is ``max(Retry-After, backoff)``."""
    state = call(4)  # backoff ceiling min(8, 0.25 * 2**3) = 2; half of it is 1
    decision = on_response(answer(429, {"Retry-After": "0"}), state)

    assert ("retry", "429", 1.0) == (decision.action, decision.reason, decision.wait)


def test_429_retry_after_ms_wins() -> None:
    """``retry-after-ms`` paces the retry when present."""
    decision = on_response(answer(429, {"Retry-After": "20", "retry-after-ms": "3000"}))

    assert 3.0 == decision.wait


def test_429_above_max_retry_after_is_retry_later() -> None:
    """A Retry-After above ``max_retry_after`` is not slept: retry later, durably."""
    decision = on_response(answer(429, {"Retry-After": "3600"}))

    assert "retry_later" == decision.action
    assert NOW + 3600 == decision.not_before


def test_429_without_retry_after_backs_off() -> None:
    """Without Retry-After a 429 falls back to exponential backoff."""
    decision = on_response(answer(429), call(3))

    assert ("retry", "429", POLICY.backoff(3, half)) == (
        decision.action,
        decision.reason,
        decision.wait,
    )


@pytest.mark.parametrize("value", ["soon", "-5", "nan", "inf", "1e400", "x" * 10_000])
def test_429_with_garbage_retry_after_backs_off(value: str) -> None:
    """A garbage Retry-After is ignored (backoff), never a crash."""
    decision = on_response(answer(429, {"Retry-After": value}), call(2))

    assert ("retry", "429", POLICY.backoff(2, half)) == (
        decision.action,
        decision.reason,
        decision.wait,
    )


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 410, 413, 415, 422, 451])
def test_final_4xx_fail(status: int) -> None:
    """422 and every other 4xx are final: the request is wrong, retrying it is a loop."""
    assert "fail" == on_response(answer(status)).action


@given(
    status=st.integers(min_value=400, max_value=499).filter(
        lambda status: status not in {408, 409, 425, 429}
    ),
    attempts=st.integers(min_value=1, max_value=10),
)
def test_no_other_4xx_is_ever_retried(status: int, attempts: int) -> None:
    """Without a hint, every 4xx but 408/409/425/429 is a final FAIL, whatever the state."""
    assert "fail" == on_response(answer(status), call(attempts)).action


@pytest.mark.parametrize("hint", ["x-should-retry", "Stripe-Should-Retry"])
def test_should_retry_true_makes_a_400_retryable(hint: str) -> None:
    """A hint header wins: a 400 the server says to retry is retried."""
    assert "retry" == on_response(answer(400, {hint: "true"})).action


@pytest.mark.parametrize(
    "profile",
    [
        GENERIC,
        IETF,
        STRIPE,
    ],
    ids=lambda profile: profile.name,
)
def test_422_stays_final_even_with_a_retry_hint(profile: ServerProfile) -> None:
    """422 is never retried, on any built-in profile, even when a hint says true."""
    response = answer(422, {"x-should-retry": "true", "Stripe-Should-Retry": "true"})

    assert "fail" == on_response(response, profile=profile).action


@pytest.mark.parametrize("status", [408, 425, 429])
def test_should_retry_false_stops_a_retryable_4xx(status: int) -> None:
    """A hint saying false wins over a "come back" status: final."""
    assert "fail" == on_response(answer(status, {"x-should-retry": "false"})).action


def test_stripe_idempotency_error_fails() -> None:
    """Stripe's 400 ``idempotency_error`` is a payload mismatch: final, never retried."""
    body = json.dumps({"error": {"type": "idempotency_error", "message": "Keys for ..."}})

    decision = on_response(answer(400, {"Stripe-Should-Retry": "true"}, body), profile=STRIPE)

    assert "fail" == decision.action


def test_stripe_other_400_is_plainly_final() -> None:
    """Any other Stripe 400 is a final FAIL too."""
    body = json.dumps({"error": {"type": "invalid_request_error"}})

    assert "fail" == on_response(answer(400, body=body), profile=STRIPE).action


@pytest.mark.parametrize("status", [500, 503, 409])
def test_at_most_once_never_resends_what_the_server_may_have_acted_on(status: int) -> None:
    """At-most-once: a 5xx or 409 may mean it was acted on, so it is abandoned."""
    state = call(delivery="at_most_once", in_progress_answers=1)

    assert "abandon" == on_response(answer(status), state).action


@pytest.mark.parametrize("status", [408, 425, 429])
def test_at_most_once_retries_what_the_server_did_not_act_on(status: int) -> None:
    """At-most-once may resend after 408/425/429: the server did not act."""
    assert "retry" == on_response(answer(status), call(delivery="at_most_once")).action


# -- budgets -----------------------------------------------------------------------


def test_last_attempt_leaves_the_operation_pending() -> None:
    """With ``max_attempts`` made and the outcome unknown, the operation stays pending."""
    assert "pending" == on_response(answer(503), call(POLICY.max_attempts)).action


def test_last_attempt_on_a_network_error_leaves_it_pending() -> None:
    """A network error on the last attempt leaves the operation pending too."""
    decision = on_error(httpx.ReadTimeout("timed out"), call(POLICY.max_attempts))

    assert "pending" == decision.action


def test_last_attempt_with_a_server_wait_is_retry_later() -> None:
    """Out of attempts on a 429 with Retry-After: pending until then."""
    decision = on_response(answer(429, {"Retry-After": "2"}), call(POLICY.max_attempts))

    assert "retry_later" == decision.action
    assert NOW + 2 == decision.not_before


def test_a_wait_past_the_call_deadline_stops() -> None:
    """The loop never sleeps past the call's deadline: it stops, pending."""
    # backoff ceiling for attempt 4 is 2 s; with rand=1 the wait is 2 s; 0.5 s are left.
    decision = decide_on(POLICY, GENERIC, call(4, elapsed=59.5), answer(503), rand=lambda: 1.0)

    assert "pending" == decision.action


def test_a_server_wait_past_the_call_deadline_is_retry_later() -> None:
    """A Retry-After that would cross the call's deadline is not slept: retry later."""
    decision = on_response(answer(429, {"Retry-After": "10"}), call(2, elapsed=55))

    assert "retry_later" == decision.action
    assert NOW + 10 == decision.not_before


def test_a_wait_ending_just_before_the_deadline_is_allowed() -> None:
    """A wait that ends before the deadline is within budget (tenacity's stop_before_delay)."""
    decision = on_response(answer(429, {"Retry-After": "4.9"}), call(2, elapsed=55))

    assert ("retry", 4.9) == (decision.action, decision.wait)


def test_a_wait_ending_at_the_deadline_stops() -> None:
    """A wait that ends exactly at the deadline leaves no time to attempt: retry later."""
    decision = on_response(answer(429, {"Retry-After": "5"}), call(2, elapsed=55))

    assert ("retry_later", NOW + 5) == (decision.action, decision.not_before)


def test_own_deadline_passed_needs_reconcile() -> None:
    """An operation past its own ``deadline_at`` is not retried: needs_reconcile."""
    decision = on_response(answer(503), call(deadline_at=NOW - 1))

    assert "reconcile" == decision.action


def test_own_deadline_passed_during_the_wait_needs_reconcile() -> None:
    """A retry that could only start after ``deadline_at`` is not made: needs_reconcile."""
    decision = on_response(answer(429, {"Retry-After": "5"}), call(deadline_at=NOW + 1))

    assert "reconcile" == decision.action


def test_own_deadline_passed_needs_reconcile_even_with_a_long_retry_after() -> None:
    """A long Retry-After does not keep an operation past its own deadline pending."""
    decision = on_response(answer(429, {"Retry-After": "3600"}), call(deadline_at=NOW - 1))

    assert "reconcile" == decision.action


policies = st.builds(
    RetryPolicy,
    max_attempts=st.integers(min_value=1, max_value=8),
    deadline=st.floats(min_value=0.001, max_value=1000),
    initial_backoff=st.floats(min_value=0, max_value=10),
    max_backoff=st.floats(min_value=0, max_value=100),
    max_retry_after=st.floats(min_value=0, max_value=100),
    in_progress_retries=st.integers(min_value=0, max_value=5),
)
retry_after_values = st.one_of(
    st.none(),
    st.integers(min_value=0, max_value=200).map(str),
    st.floats(min_value=0, max_value=200).map(repr),
    st.sampled_from(["soon", "-1", "nan", "Wed, 21 Oct 2015 07:28:00 GMT"]),
)


@st.composite
def outcomes(draw: st.DrawFn) -> httpx.Response | httpx.TransportError:
    if draw(st.booleans()):
        return draw(st.sampled_from(NOT_SENT_ERRORS + MAYBE_DELIVERED_ERRORS))
    status = draw(st.sampled_from([408, 409, 423, 425, 429, 500, 502, 503, 504]))
    headers = {}
    retry_after = draw(retry_after_values)
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    if draw(st.booleans()):
        headers["retry-after-ms"] = str(draw(st.integers(min_value=0, max_value=200_000)))
    return answer(status, headers)


@given(
    policy=policies,
    outcome=outcomes(),
    attempts=st.integers(min_value=1, max_value=10),
    in_progress_answers=st.integers(min_value=0, max_value=8),
    elapsed=st.floats(min_value=0, max_value=100),
    deadline_in=st.one_of(st.none(), st.floats(min_value=-10, max_value=200)),
    delivery=st.sampled_from(["exactly_once", "at_most_once"]),
    rand=st.floats(min_value=0, max_value=1, exclude_max=True),
)
def test_a_retry_never_waits_past_a_deadline_nor_less_than_the_server_asks(
    policy: RetryPolicy,
    outcome: httpx.Response | httpx.TransportError,
    attempts: int,
    in_progress_answers: int,
    elapsed: float,
    deadline_in: float | None,
    delivery: Delivery,
    rand: float,
) -> None:
    """Any RETRY fits the call's deadline, the operation's own, and the server's wait."""
    state = call(
        attempts,
        in_progress_answers=in_progress_answers,
        elapsed=elapsed,
        deadline_at=None if deadline_in is None else NOW + deadline_in,
        delivery=delivery,
    )
    decision = decide_on(policy, GENERIC, state, outcome, rand=lambda: rand)
    server = None
    if isinstance(outcome, httpx.Response):
        server = server_wait(outcome.headers, now=NOW)
    if decision.action != "retry":
        return

    assert NOW + decision.wait <= state.started_at + policy.deadline
    assert state.deadline_at is None or NOW + decision.wait <= state.deadline_at
    assert decision.wait >= (server or 0.0)
    assert server is None or server <= policy.max_retry_after
    assert attempts < policy.max_attempts


@given(policy=policies, outcome=outcomes(), attempts=st.integers(min_value=1, max_value=10))
def test_retry_later_is_never_in_the_past(
    policy: RetryPolicy, outcome: httpx.Response | httpx.TransportError, attempts: int
) -> None:
    """A RETRY_LATER carries a ``not_before`` no earlier than now; other actions carry none."""
    decision = decide_on(policy, GENERIC, call(attempts), outcome)

    if decision.action == "retry_later":
        assert decision.not_before is not None
        assert decision.not_before >= NOW
    else:
        assert None is decision.not_before


@pytest.mark.parametrize("profile", BUILTIN_PROFILES.values(), ids=lambda profile: profile.name)
@pytest.mark.parametrize("status", [200, 201, 302])
def test_success_is_success_on_every_profile(profile: ServerProfile, status: int) -> None:
    """Every built-in profile reads 2xx/3xx as success, replayed or not."""
    response = answer(status, {"Idempotent-Replayed": "true"})

    assert "succeed" == on_response(response, profile=profile).action


# -- RetryPolicy -------------------------------------------------------------------


@given(
    initial_backoff=st.floats(min_value=0, max_value=100),
    max_backoff=st.floats(min_value=0, max_value=1000),
    retry_number=st.one_of(
        st.integers(min_value=1, max_value=100),
        st.integers(min_value=1, max_value=10**100),
    ),
    rand=st.floats(min_value=0, max_value=1, exclude_max=True),
)
def test_backoff_is_full_jitter_under_the_cap(
    initial_backoff: float, max_backoff: float, retry_number: int, rand: float
) -> None:
    """``0 <= backoff(n) <= min(max_backoff, initial * 2**(n-1))``, even for huge n."""
    policy = RetryPolicy(initial_backoff=initial_backoff, max_backoff=max_backoff)
    # 2**1000 times any positive initial backoff here is far above the cap; past it,
    # a smaller exponent only tightens the bound.
    bound = min(max_backoff, initial_backoff * 2.0 ** min(retry_number - 1, 1000))

    wait = policy.backoff(retry_number, lambda: rand)

    assert 0 <= wait <= bound


def test_backoff_doubles_then_caps() -> None:
    """The backoff ceiling doubles per retry from ``initial_backoff`` up to ``max_backoff``."""
    policy = RetryPolicy(initial_backoff=0.5, max_backoff=5.0)

    ceilings = [policy.backoff(n, lambda: 1.0) for n in range(1, 7)]

    assert [0.5, 1.0, 2.0, 4.0, 5.0, 5.0] == ceilings


def test_backoff_jitter_reaches_zero() -> None:
    """Full jitter: the wait can be as short as zero."""
    assert 0.0 == RetryPolicy().backoff(3, lambda: 0.0)


def test_backoff_with_a_huge_retry_number_is_the_cap() -> None:
    """A retry number far past any float exponent gives the cap, not an OverflowError."""
    assert 8.0 == RetryPolicy(max_backoff=8.0).backoff(10**100, lambda: 1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"max_attempts": -1},
        {"deadline": 0},
        {"deadline": -1.0},
        {"initial_backoff": -0.1},
        {"max_backoff": -1.0},
        {"max_retry_after": -1.0},
        {"in_progress_retries": -1},
    ],
    ids=lambda kwargs: next(iter(kwargs.items())).__repr__(),
)
def test_policy_rejects_nonsense(kwargs: dict[str, float]) -> None:
    """No attempts, a non-positive deadline or negative waits are refused at construction."""
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_policy_defaults_are_named() -> None:
    """The five fixed names exist with sane defaults."""
    assert (5, 60.0, 0.25, 8.0, 30.0) == (
        POLICY.max_attempts,
        POLICY.deadline,
        POLICY.initial_backoff,
        POLICY.max_backoff,
        POLICY.max_retry_after,
    )


def test_policy_is_frozen() -> None:
    """A policy is a value: it cannot be changed after construction."""
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        POLICY.max_attempts = 3  # type: ignore[misc]


def test_policy_evolves_into_a_new_value() -> None:
    """``attrs.evolve`` gives a new policy and leaves the original alone."""
    longer = attrs.evolve(POLICY, max_attempts=10)

    assert (10, 5) == (longer.max_attempts, POLICY.max_attempts)


def test_after_carries_every_field_of_the_state_over() -> None:
    """``CallState.after`` (written out field by field for speed) keeps every field it
    does not update: a new field must be added there too."""
    assert {
        "started_at",
        "attempts",
        "in_progress_answers",
        "deadline_at",
        "delivery",
        "acted",
        "in_progress_since",
        "resuming",
    } == set(attrs.fields_dict(CallState))
    state = CallState(
        started_at=NOW - 5,
        attempts=2,
        in_progress_answers=1,
        deadline_at=NOW + 100,
        delivery="at_most_once",
        acted=True,
        in_progress_since=NOW - 3,
        resuming=True,
    )
    answer = classify(GENERIC, httpx.Response(409), now=NOW)
    assert attrs.evolve(state, attempts=3, in_progress_answers=2) == state.after(answer, now=NOW)
    ok = classify(GENERIC, httpx.Response(200), now=NOW)
    assert attrs.evolve(state, attempts=3, in_progress_since=None) == state.after(ok, now=NOW)
