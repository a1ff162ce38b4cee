"""What is retried, and when: the decision core, free of I/O.

``decide()`` turns the outcome of one attempt into an :class:`Decision`; the
sync and async drivers only send, sleep and persist what it says.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable
from typing import Literal

import attrs
import httpx

from idempotently._profiles import ServerProfile
from idempotently._retry_after import server_wait, should_retry_hint

Delivery = Literal["exactly_once", "at_most_once"]

# Statuses that say "nothing happened yet, come back": retried on every server.
RETRY_STATUS_CODES = frozenset({408, 425, 429})
# Final whatever a hint header says: the request itself is wrong.
NEVER_RETRY_STATUS_CODES = frozenset({422})
# The server provably did not act on these: even at-most-once may resend.
NOT_ACTED_STATUS_CODES = frozenset({408, 425, 429})

DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_DEADLINE = 60.0
DEFAULT_INITIAL_BACKOFF = 0.25
DEFAULT_MAX_BACKOFF = 8.0
DEFAULT_RETRY_AFTER_MAX = 30.0
DEFAULT_IN_PROGRESS_RETRIES = 3


class Outcome(str, enum.Enum):
    """What the client can know about one attempt."""

    NOT_SENT = "not_sent"
    """Connect error or pool timeout: the server cannot have seen it."""
    MAYBE_DELIVERED = "maybe_delivered"
    """Timeout, reset or protocol error after sending: it may have been acted on."""
    ANSWERED = "answered"
    """The server answered with a status code."""


class Action(enum.Enum):
    SUCCEED = "succeed"
    """A 2xx/3xx: the operation succeeded."""
    FAIL = "fail"
    """A final 4xx: the server said no, nothing happened."""
    RETRY = "retry"
    """Sleep ``wait`` seconds, then send the same bytes with the same key."""
    PENDING = "pending"
    """Budget spent, outcome unknown: stays pending for resume."""
    RETRY_LATER = "retry_later"
    """The server's wait is longer than allowed: pending until ``not_before``."""
    RECONCILE = "reconcile"
    """Resending cannot settle it: needs_reconcile."""
    ABANDON = "abandon"
    """At-most-once and maybe delivered: never resent."""
    FAIL_LOCALLY = "fail_locally"
    """The request cannot be sent at all (bad URL, bad header): failed, error raised."""


@attrs.frozen
class RetryPolicy:
    """How hard one call tries before it leaves the operation pending.

    Every wait is ``max(server's Retry-After, exponential backoff with full
    jitter)``; no wait ever runs past ``deadline`` (seconds for the whole call)
    or beyond ``max_retry_after``: the call stops instead, the operation stays
    pending, and :class:`~idempotently.RetryLaterError` says when to come back.
    """

    max_attempts: int = attrs.field(default=DEFAULT_MAX_ATTEMPTS, validator=attrs.validators.gt(0))
    deadline: float = attrs.field(default=DEFAULT_DEADLINE, validator=attrs.validators.gt(0))
    initial_backoff: float = attrs.field(
        default=DEFAULT_INITIAL_BACKOFF, validator=attrs.validators.ge(0)
    )
    max_backoff: float = attrs.field(default=DEFAULT_MAX_BACKOFF, validator=attrs.validators.ge(0))
    max_retry_after: float = attrs.field(
        default=DEFAULT_RETRY_AFTER_MAX, validator=attrs.validators.ge(0)
    )
    in_progress_retries: int = attrs.field(
        default=DEFAULT_IN_PROGRESS_RETRIES, validator=attrs.validators.ge(0)
    )
    """How many "key in progress" answers (409) one call waits through."""

    def backoff(self, retry_number: int, rand: Callable[[], float] = random.random) -> float:
        """Full jitter: uniform in ``[0, min(max_backoff, initial * 2**(n-1))]``."""
        exponent = min(retry_number - 1, 62)  # 2**62 is already past any cap
        ceiling = min(self.max_backoff, self.initial_backoff * (2.0**exponent))
        return ceiling * rand()


@attrs.frozen
class Decision:
    action: Action
    reason: str
    wait: float = 0.0
    not_before: float | None = None


@attrs.frozen
class CallState:
    """What one call has done so far (the journal holds the rest)."""

    started_at: float
    attempts: int
    """Attempts made by this call, the one being decided included."""
    in_progress_answers: int
    """409-style answers seen by this call, the one being decided included."""
    deadline_at: float | None = None
    """The operation's own absolute deadline, surviving restarts."""
    delivery: Delivery = "exactly_once"


def error_outcome(error: httpx.TransportError) -> Outcome:
    if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
        return Outcome.NOT_SENT
    if isinstance(error, (httpx.UnsupportedProtocol, httpx.LocalProtocolError)):
        return Outcome.NOT_SENT
    return Outcome.MAYBE_DELIVERED


def decide(
    policy: RetryPolicy,
    profile: ServerProfile,
    state: CallState,
    *,
    now: float,
    response: httpx.Response | None = None,
    error: httpx.TransportError | None = None,
    rand: Callable[[], float] = random.random,
) -> Decision:
    """The next step after one attempt: exactly one of ``response``/``error``."""
    if error is not None:
        return _decide_error(policy, state, error, now=now, rand=rand)
    assert response is not None
    return _decide_response(policy, profile, state, response, now=now, rand=rand)


def _decide_error(
    policy: RetryPolicy,
    state: CallState,
    error: httpx.TransportError,
    *,
    now: float,
    rand: Callable[[], float],
) -> Decision:
    name = type(error).__name__
    if isinstance(error, (httpx.UnsupportedProtocol, httpx.LocalProtocolError)):
        return Decision(Action.FAIL_LOCALLY, f"the request cannot be sent: {name}: {error}")
    outcome = error_outcome(error)
    if outcome is Outcome.MAYBE_DELIVERED and state.delivery == "at_most_once":
        return Decision(
            Action.ABANDON,
            f"{name} after sending: an at-most-once operation that may have been "
            "delivered is never resent",
        )
    return _retry_or_stop(policy, state, f"{name}: {error}", server=None, now=now, rand=rand)


def _decide_response(
    policy: RetryPolicy,
    profile: ServerProfile,
    state: CallState,
    response: httpx.Response,
    *,
    now: float,
    rand: Callable[[], float],
) -> Decision:
    status = response.status_code
    if status < 400:
        return Decision(Action.SUCCEED, f"{status}")
    if profile.is_payload_mismatch(response):
        return Decision(
            Action.FAIL, f"{status}: the server says this key was used with another payload"
        )
    hint = should_retry_hint(response.headers)
    in_progress = profile.is_in_progress(response)
    if status >= 500:
        if profile.is_replay(response):
            return Decision(
                Action.RECONCILE,
                f"the server replays a stored {status}: resending cannot change it; "
                "look the object up to learn what happened",
            )
        if hint is False:
            return Decision(
                Action.RECONCILE,
                f"{status} and the server says not to retry: the outcome is unknown",
            )
    elif status in NEVER_RETRY_STATUS_CODES or not (
        in_progress or status in RETRY_STATUS_CODES or hint is True
    ):
        return Decision(Action.FAIL, f"{status}: a final answer; retrying it would be a loop")
    elif hint is False and in_progress:
        # The first request may still be running: not "nothing happened".
        return Decision(
            Action.PENDING, f"{status}: the key is in progress and the server says not to retry"
        )
    elif hint is False:
        return Decision(Action.FAIL, f"{status} and the server says not to retry")

    if state.delivery == "at_most_once" and status not in NOT_ACTED_STATUS_CODES:
        return Decision(
            Action.ABANDON,
            f"{status}: an at-most-once operation the server may have acted on is never resent",
        )
    if in_progress and state.in_progress_answers > policy.in_progress_retries:
        return Decision(
            Action.PENDING,
            f"{status}: the key is still in progress on the server after "
            f"{state.in_progress_answers} answers",
        )
    return _retry_or_stop(
        policy,
        state,
        f"{status}",
        server=server_wait(response.headers, now=now),
        now=now,
        rand=rand,
    )


def _retry_or_stop(
    policy: RetryPolicy,
    state: CallState,
    what: str,
    *,
    server: float | None,
    now: float,
    rand: Callable[[], float],
) -> Decision:
    wait = max(server or 0.0, policy.backoff(state.attempts, rand))
    resume_at = now + wait
    if state.deadline_at is not None and resume_at > state.deadline_at:
        return Decision(
            Action.RECONCILE,
            f"{what}: the operation's own deadline passes before it could be retried",
        )
    if server is not None and server > policy.max_retry_after:
        return Decision(
            Action.RETRY_LATER,
            f"{what}: the server asks to wait {server:g}s, more than max_retry_after "
            f"({policy.max_retry_after:g}s)",
            not_before=now + server,
        )
    stop = None
    if state.attempts >= policy.max_attempts:
        stop = f"{what}: {state.attempts} attempts made (max_attempts={policy.max_attempts})"
    elif resume_at > state.started_at + policy.deadline:
        stop = (
            f"{what}: waiting {wait:g}s more would pass the call's deadline ({policy.deadline:g}s)"
        )
    if stop is None:
        return Decision(Action.RETRY, what, wait=wait)
    if server is not None:
        return Decision(Action.RETRY_LATER, stop, not_before=now + server)
    return Decision(Action.PENDING, stop)
