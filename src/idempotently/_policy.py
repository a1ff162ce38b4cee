"""What is retried, and when: each answer classified once, one pure decision.

`classify` turns a response into an `Answer` and
`classify_error` a transport error into a `Failure`, once;
`decide` turns one of them and the call's `CallState` into a
`Decision` that carries the next state (as urllib3's
``Retry.increment`` returns the next ``Retry``). Nothing here does I/O.

tenacity supplies the budget: the wait and stop strategies (composable, and
replaceable through `RetryPolicy`'s ``wait=`` and ``stop=``) are
evaluated on a ``tenacity.RetryCallState`` built from the call's own clock.
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import attrs
import httpx

from idempotently._budget import RetryBudget
from idempotently._numbers import as_float
from idempotently._pauses import PAUSE_STATUS_CODES
from idempotently._profiles import (
    VERDICTS,
    ServerProfile,
    Verdict,
    default_key_expiry_margin,
)
from idempotently._retry_after import server_wait
from idempotently._text import storable_text
from idempotently._vocabulary import Action, Delivery, Outcome

if TYPE_CHECKING:
    import tenacity as _t

    from idempotently._breaker import Breaker
    from idempotently._rate_limits import QuotaReader, QuotaReset
    from idempotently._rows import Operation, OriginPause

    WaitStrategy: TypeAlias = Callable[[_t.RetryCallState], float]
    StopStrategy: TypeAlias = Callable[[_t.RetryCallState], bool]

# Statuses that say "nothing happened yet, come back": retried on every server.
RETRY_STATUS_CODES = frozenset({408, 425, 429})
# Final whatever a hint header says: the request itself is wrong.
NEVER_RETRY_STATUS_CODES = frozenset({422})
# The server provably did not act on these: even at-most-once may resend them,
# and they do not make a later final 4xx ambiguous.
NOT_ACTED_STATUS_CODES = frozenset({408, 425, 429})
# What a server that releases the key on a 5xx may still safely be asked again:
# the gateway answered, the handler did not run.
GATEWAY_STATUS_CODES = frozenset({502, 503, 504})
# Answers about the client's credentials, not about the operation: a resume
# that gets one keeps the operation as it was.
CREDENTIAL_STATUS_CODES = frozenset({401, 403, 407})

DEFAULT_MAX_ATTEMPTS = 5
DEFAULT_DEADLINE = 60.0
DEFAULT_INITIAL_BACKOFF = 0.25
DEFAULT_MAX_BACKOFF = 8.0
DEFAULT_RETRY_AFTER_MAX = 30.0
DEFAULT_IN_PROGRESS_RETRIES = 3


# Named converters (mypy's attrs plugin takes no other): each field read as a float
# first, so an int past a float's range (10**400) is a ValueError naming it.
def _deadline_seconds(value: float) -> float:
    return as_float(value, "deadline")


def _initial_backoff_seconds(value: float) -> float:
    return as_float(value, "initial_backoff")


def _max_backoff_seconds(value: float) -> float:
    return as_float(value, "max_backoff")


def _max_retry_after_seconds(value: float) -> float:
    return as_float(value, "max_retry_after")


MAX_TOTAL_ATTEMPTS_LIMIT = 1_000_000
"""The largest ``max_total_attempts``: a cap past it would never be reached."""


def _check_total_attempts(_: object, __: object, value: int | None) -> None:
    """``max_total_attempts`` is None or an int from 1 to `MAX_TOTAL_ATTEMPTS_LIMIT`: a
    bool, a float or an int past that is refused here, before anything is journaled."""
    if value is None:
        return
    if type(value) is not int:
        raise TypeError(
            f"max_total_attempts must be an int from 1 to {MAX_TOTAL_ATTEMPTS_LIMIT} or None "
            f"(no cap), not {type(value).__name__}"
        )
    if not 1 <= value <= MAX_TOTAL_ATTEMPTS_LIMIT:
        shown = repr(value) if value.bit_length() < 64 else "an integer that large"
        raise ValueError(
            f"max_total_attempts must be an int from 1 to {MAX_TOTAL_ATTEMPTS_LIMIT} or None "
            f"(no cap), not {shown}"
        )


@attrs.frozen
class RetryPolicy:
    """How hard one call tries before it leaves the operation pending.

    Every wait is ``max(server's Retry-After, backoff)``, the backoff being
    exponential with full jitter; no wait runs past ``deadline`` (seconds for
    the whole call) or beyond ``max_retry_after``: the call stops instead, the
    operation stays pending, and `RetryLaterError` says
    when to come back.

    ``wait=`` and ``stop=`` take tenacity strategies instead of the defaults
    (``full_jitter(initial_backoff, max_backoff)`` and
    ``stop_after_attempt(max_attempts) | stop_before_delay(deadline)``), e.g.
    ``RetryPolicy(stop=tenacity.stop_after_attempt(3) | tenacity.stop_after_delay(10))``.
    The server's Retry-After and the operation's own deadline still apply.

    ``budget=`` bounds the retries of the whole process per origin (default
    ``RetryBudget()``; None turns it off): a retry it refuses is not sent, and
    `idempotently.RetryBudgetError` says which origin's budget ran out.

    ``breaker=`` (`idempotently.Breaker`, default None: off) opens a journaled pause of
    an origin after failures in a row: the retry it refuses is not sent, the operation
    stays pending and `idempotently.RetryLaterError` names the origin.
    ``max_total_attempts=`` caps the attempts an operation makes across restarts (off
    by default): counted from the journal, over every call, process and resume.
    """

    max_attempts: int = attrs.field(
        default=DEFAULT_MAX_ATTEMPTS,
        validator=[attrs.validators.instance_of(int), attrs.validators.gt(0)],
    )
    """Attempts one call makes at most, the first included (a resume's call too)."""
    deadline: float = attrs.field(
        default=DEFAULT_DEADLINE,
        converter=_deadline_seconds,
        validator=[attrs.validators.gt(0), attrs.validators.lt(float("inf"))],
    )
    """Seconds the whole call may take, waits and attempts included; each attempt's timeouts are
    capped by what is left."""
    initial_backoff: float = attrs.field(
        default=DEFAULT_INITIAL_BACKOFF,
        converter=_initial_backoff_seconds,
        validator=[attrs.validators.ge(0), attrs.validators.lt(float("inf"))],
    )
    """Seconds of the first backoff's cap: retry n waits a random time up to `initial_backoff *
    2**(n-1)` (full jitter)."""
    max_backoff: float = attrs.field(
        default=DEFAULT_MAX_BACKOFF,
        converter=_max_backoff_seconds,
        validator=[attrs.validators.ge(0), attrs.validators.lt(float("inf"))],
    )
    """Seconds no backoff exceeds, however many retries came before."""
    max_retry_after: float = attrs.field(
        default=DEFAULT_RETRY_AFTER_MAX,
        converter=_max_retry_after_seconds,
        validator=[attrs.validators.ge(0), attrs.validators.lt(float("inf"))],
    )
    """The longest Retry-After (seconds) the call sleeps through; a longer one stops the call,
    keeps the operation pending with a durable `not_before`, and raises `RetryLaterError`."""
    in_progress_retries: int = attrs.field(
        default=DEFAULT_IN_PROGRESS_RETRIES,
        validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)],
    )
    """How many "key in progress" answers (409) one call waits through."""
    wait: WaitStrategy | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )
    """A tenacity wait strategy replacing the default backoff."""
    stop: StopStrategy | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )
    """A tenacity stop strategy replacing ``max_attempts`` and ``deadline``."""
    budget: RetryBudget | None = attrs.field(
        factory=RetryBudget,
        validator=attrs.validators.optional(attrs.validators.instance_of(RetryBudget)),
    )
    """The process's retry budget per origin (`idempotently.RetryBudget`);
    None: every retry this policy allows is sent."""
    breaker: Breaker | None = attrs.field(
        default=None,
        validator=lambda policy, attribute, value: _check_breaker(value),
    )
    """The circuit breaker per origin and credentials (`idempotently.Breaker`),
    journaled as an origin pause; None (the default): off for calls. A resume without
    one runs with ``Breaker()``'s defaults."""
    max_total_attempts: int | None = attrs.field(default=None, validator=_check_total_attempts)
    """Attempts that reached the server the operation may make in all, counted from the
    journal across every call, process, resume and watch worker (None: no cap). Only
    attempts answered or maybe delivered count; one not sent, or a send refused by the
    budget or a pause, never does. At the cap the operation goes to ``needs_reconcile``
    (``failed`` when no attempt may have been acted on) with its ``cap_reason``, and
    `idempotently.AttemptsCapError` says so. A resume applies the smaller of the cap
    journaled with the operation and its own."""

    def backoff(self, retry_number: int, rand: Callable[[], float] = random.random) -> float:
        """The backoff before retry number ``retry_number`` (1 for the first retry)."""
        from idempotently._waits import retry_call_state

        return self._wait_strategy(rand)(retry_call_state(retry_number, 0.0, 0.0))

    def _wait_strategy(self, rand: Callable[[], float]) -> WaitStrategy:
        if self.wait is not None:
            return self.wait
        from idempotently._waits import full_jitter  # tenacity: loaded on the first retry

        return full_jitter(self.initial_backoff, self.max_backoff, rand)

    def _stop_strategy(self) -> StopStrategy:
        if self.stop is not None:
            return self.stop
        from idempotently._waits import stop_after

        return stop_after(self.max_attempts, self.deadline)


# -- classification: each answer once --------------------------------------------------


@attrs.frozen
class Answer:
    """One response, classified once by the operation's server profile."""

    status_code: int
    replayed: bool = False
    """The server marked it as its stored answer for this key."""
    in_progress: bool = False
    """The server says the key's first request is still running."""
    mismatch: bool = False
    """The server says the key was used with another payload."""
    hint: bool | None = None
    """The server's explicit "retry this?" header, if any."""
    server_wait: float | None = None
    """Seconds the server asks to wait (Retry-After, retry-after-ms, or until a spent
    request quota the profile trusts resets), clamped."""
    verdict: Verdict | None = None
    """What the profile's ``classify`` made of it (None: the built-in table decides)."""
    classifier_error: str | None = None
    """Why the profile's ``classify`` gave no usable verdict (it raised, or returned
    something else): the operation stays pending."""
    quota: QuotaReset | None = None
    """A request quota the answer's trusted rate-limit headers report spent (0 left, or
    a 429/503 without Retry-After), and when it resets: it pauses the origin."""

    @property
    def outcome(self) -> Outcome:
        return "answered"


def origin_wait(answer: Answer, max_retry_after: float) -> tuple[float, str] | None:
    """How long an answer pauses its origin, and why, or None: a 429 or 503 with
    Retry-After for as long as it says (a longer one than a call may wait too: the
    server said so); a spent request quota until it resets, only when that is within
    ``max_retry_after`` (headers that say how a quota is counted are not an order to
    stop the whole fleet for longer than any call would wait)."""
    quota = answer.quota
    if quota is None:
        wait = answer.server_wait or 0.0
        return wait, f"{answer.status_code} with Retry-After {wait:g}s"
    if not 0 < quota.wait <= max_retry_after:
        return None
    return (
        quota.wait,
        f"{answer.status_code} with {quota.header} {quota.wait:g}s: request quota spent",
    )


@attrs.frozen
class Failure:
    """One attempt that ended without an answer, classified once."""

    outcome: Outcome
    """``not_sent`` (the server cannot have seen it) or ``maybe_delivered``."""
    text: str
    """``Type: message``, with every secret header value scrubbed out."""
    unsendable: bool = False
    """The request cannot be sent at all (bad URL scheme, illegal header)."""
    unreadable: bool = False
    """The server answered, but httpx could not read the answer (an undecodable body,
    a redirect loop): resending would meet the same answer."""
    refused: bool = False
    """The request was held back as it left (``_gate``: a hook changed its credentials,
    body or key): sending it again would meet the same refusal."""


Signal = Answer | Failure


def maybe_acted(status_code: int | None, outcome: Outcome) -> bool:
    """Whether an attempt may have been acted on by the server: sent and not answered,
    or answered with anything but "not now" (408, 425, 429)."""
    if outcome == "maybe_delivered":
        return True
    return outcome == "answered" and status_code not in NOT_ACTED_STATUS_CODES


def never_sent(operation: Operation) -> bool:
    """An enqueued operation whose first send has not begun: nothing of it went out.

    A row from before ``first_send_at`` existed has ``enqueued_at`` NULL too: never
    taken for unsent."""
    return (
        operation.enqueued_at is not None
        and operation.first_send_at is None
        and operation.attempt_count == 0
    )


def may_have_been_delivered(operation: Operation) -> bool:
    """Whether the server may have acted on a journaled operation: then a final 4xx
    that is not a replay proves nothing (it is never ``failed``, the promise that
    nothing happened), and an at-most-once operation is never sent again.

    True when any recorded attempt may have been acted on (`maybe_acted`), and
    when no attempt is recorded at all: the key is committed just before the first
    send begins, so an operation without attempts is one whose process died (SIGKILL,
    power cut) during its first attempt, which may have reached the server and acted.
    Attempts the operation counts but does not carry (a listing) count as maybe
    delivered too.

    The one exception: an operation enqueued (``Session.enqueue``) and not sent
    since. Its row says so, not its attempt count: ``enqueued_at`` set and
    ``first_send_at`` still NULL (it is set by the very write that takes the lease to
    send, before any byte goes out), so nothing can have reached the server.
    """
    if never_sent(operation):
        return False
    attempts = operation.attempts
    if operation.attempt_count == 0 or len(attempts) < operation.attempt_count:
        return True
    return any(maybe_acted(attempt.status_code, attempt.outcome) for attempt in attempts)


def key_born_at(operation: Operation) -> float:
    """When the operation's key began to live: its first send for an enqueued one (a
    key no server had seen before), else its creation."""
    if operation.enqueued_at is not None and operation.first_send_at is not None:
        return operation.first_send_at
    return operation.created_at


def key_expiry_margin(
    operation: Operation, profile: ServerProfile | None, given: float | None
) -> float:
    """The margin kept before ``operation``'s key expires: the one journaled with its
    profile (its own ``key_expiry_margin``, else the default for the lifetime journaled
    with the row), or ``given`` (a resume's ``--key-expiry-margin``) when that is larger.
    ``profile`` None: the journaled one cannot be read, so the default stands."""
    own = None if profile is None else profile.key_expiry_margin
    if own is None:
        own = default_key_expiry_margin(operation.key_expires_at - key_born_at(operation))
    return own if given is None else max(own, given)


_INFINITY = float("inf")


def key_past_margin(operation: Operation, now: float, margin: float) -> bool:
    """Whether the server may have forgotten the operation's key (less than ``margin``
    seconds of its lifetime left): it is never resent. An enqueued operation never sent
    has a key no server has seen, so none can have forgotten it. An expiry that is no
    finite number (a damaged row) may have passed: the key is never resent under it."""
    alive = now <= operation.key_expires_at - margin < _INFINITY  # false for NaN too
    return not never_sent(operation) and not alive


def may_be_retried(profile: ServerProfile, status: int) -> bool:
    """Whether the built-in table may retry a write's answer with ``status`` (every 5xx,
    408, 425, 429, and the profile's "in progress" statuses): such an answer is read no
    further than an excerpt before the flow decides, for a server can make its body
    endless. A classifier may still make another answer a retry, or one of these final."""
    return status >= 500 or status in RETRY_STATUS_CODES or status in profile.in_progress_statuses


def classify(profile: ServerProfile, response: httpx.Response, *, now: float) -> Answer:
    status = response.status_code
    verdict, failure = (None, None) if profile.classify is None else _verdict(profile, response)
    if verdict is not None:
        mismatch = verdict == "mismatch"
        in_progress = verdict == "in_progress"
    else:
        mismatch = profile.is_payload_mismatch(response)
        in_progress = status in profile.in_progress_statuses and not mismatch
    waits = status >= 400 or verdict in ("retry", "in_progress")
    wait = server_wait(response.headers, now=now) if waits and profile._reads_retry_after else None
    quota = None
    if profile._quota_reader is not None:
        wait, quota = _rate_limited(profile._quota_reader, response, status, wait, waits, now)
    return Answer(
        status_code=status,
        replayed=profile.is_replay(response),
        in_progress=in_progress,
        mismatch=mismatch,
        hint=profile.retry_hint(response),
        server_wait=wait,
        verdict=verdict,
        classifier_error=failure,
        quota=quota,
    )


def _rate_limited(
    read: QuotaReader,
    response: httpx.Response,
    status: int,
    wait: float | None,
    waits: bool,
    now: float,
) -> tuple[float | None, QuotaReset | None]:
    """The answer's wait and spent request quota, read from the rate-limit headers the
    profile trusts besides Retry-After. A 429 or 503 with Retry-After: that is the
    server's word, and it alone pauses. Otherwise an answer that may be retried
    (``waits``) waits at least until a spent quota resets: a retry sent sooner would
    only spend a request to be refused."""
    limited = status in PAUSE_STATUS_CODES
    if limited and wait is not None:
        return wait, None
    quota = read(response.headers.raw, now=now, limited=limited)
    if waits and quota is not None:
        wait = quota.wait if wait is None else max(wait, quota.wait)
    return wait, quota


def _verdict(profile: ServerProfile, response: httpx.Response) -> tuple[Verdict | None, str | None]:
    """The profile's classifier on ``response``: its verdict, or why it gave none usable."""
    assert profile.classify is not None
    name = getattr(profile.classify, "__qualname__", repr(profile.classify))
    try:
        verdict = profile.classify(response.status_code, response.headers, response.content)
    except Exception as error:  # the user's code: whatever it raises, the answer is kept
        return None, storable_text(
            f"the profile's classify ({name}) raised {type(error).__name__}: {_message(error)}"
        )
    if verdict is not None and verdict not in VERDICTS:
        return None, storable_text(
            f"the profile's classify ({name}) returned {verdict!r:.60}, not one of "
            "'retry', 'final', 'in_progress', 'mismatch' or None"
        )
    return cast("Verdict | None", verdict), None


_NOT_SENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_UNSENDABLE_ERRORS = (httpx.UnsupportedProtocol, httpx.LocalProtocolError)


def classify_error(error: BaseException, *, secrets: Collection[str] = ()) -> Failure:
    """What ended an attempt without an answer, as a `Failure`.

    A transport error says whether the request can have reached the server. Any
    other error (an undecodable body, a redirect loop, a response hook of the
    caller's that raised, ``raise_for_status()`` in a hook) came after the server
    answered: the attempt may have been acted on, and sending it again would meet
    the same end, so it is not retried.
    """
    # The message may quote undecodable server bytes or a NUL: made storable here,
    # once, so events, logs and both journal stores all see the same text.
    text = storable_text(scrub(f"{type(error).__name__}: {_message(error)}", secrets))
    if isinstance(error, _UNSENDABLE_ERRORS):
        return Failure("not_sent", text, unsendable=True)
    if isinstance(error, _NOT_SENT_ERRORS):
        return Failure("not_sent", text)
    if isinstance(error, httpx.TransportError):
        return Failure("maybe_delivered", text)
    return Failure("maybe_delivered", text, unreadable=True)


def _message(error: BaseException) -> str:
    """``str(error)``, or what it is when even that raises (a hostile ``__str__``)."""
    try:
        return str(error)
    except Exception:  # an error's own __str__ may fail; the attempt must still be recorded
        return f"(unprintable {type(error).__name__})"


def scrub(text: str, secrets: Collection[str]) -> str:
    """``text`` with every secret value (and its stripped form) replaced by ``[redacted]``.

    httpx quotes an illegal header value in its error, token included.
    """
    forms: set[str] = set()
    for secret in secrets:
        for value in (secret, secret.strip()):
            forms.update((value, repr(value)[1:-1]))
            for encoding in ("latin-1", "utf-8"):
                with contextlib.suppress(UnicodeEncodeError):
                    forms.add(repr(value.encode(encoding))[2:-1])
    for form in sorted(forms, key=len, reverse=True):
        if len(form) >= 4:
            text = text.replace(form, "[redacted]")
    return _BEARER.sub(r"\1[redacted]", text)


_BEARER = re.compile(r"(?i)\b(bearer |basic |token )[^\s'\"\\]+")


# -- the decision ------------------------------------------------------------------------


@attrs.frozen
class CallState:
    """What the operation's attempts have shown so far, as one decision needs it."""

    started_at: float
    """When this call (or this resume of the operation) started."""
    attempts: int = 0
    """Attempts made by this call."""
    in_progress_answers: int = 0
    """"In progress" answers seen by this call."""
    deadline_at: float | None = None
    """The operation's own absolute deadline, surviving restarts."""
    delivery: Delivery = "exactly_once"
    acted: bool = False
    """An attempt so far (this call's or an earlier one's) may have been acted on."""
    in_progress_since: float | None = None
    """Since when the server has answered "in progress" without interruption."""
    resuming: bool = False

    def after(self, signal: Signal, *, now: float) -> CallState:
        """The state once ``signal`` (this call's next attempt) is known."""
        code = None if isinstance(signal, Failure) else signal.status_code
        acted = maybe_acted(code, signal.outcome)
        in_progress = isinstance(signal, Answer) and signal.in_progress
        # Every field spelt out rather than attrs.evolve, which costs several times more
        # (one per attempt).
        return CallState(
            started_at=self.started_at,
            attempts=self.attempts + 1,
            in_progress_answers=self.in_progress_answers + in_progress,
            deadline_at=self.deadline_at,
            delivery=self.delivery,
            acted=self.acted or acted,
            in_progress_since=(self.in_progress_since or now) if in_progress else None,
            resuming=self.resuming,
        )


@attrs.frozen
class Decision:
    action: Action
    reason: str
    state: CallState
    """The call's state after this attempt, for the next decision."""
    wait: float = 0.0
    not_before: float | None = None
    refused_by: str | None = None
    """The origin whose retry budget refused the retry this decision would have been."""
    cap_reason: str | None = None
    """Set when the operation reached its ``max_total_attempts`` (`_flow._cap`)."""


def refused(decision: Decision, origin: str) -> Decision:
    """The retry ``decision`` was, refused by ``origin``'s retry budget: not sent, the
    operation stays pending with its key."""
    return Decision(
        "pending",
        f"{decision.reason}: the retry budget of {origin} is spent (too many retries to "
        "it from this process in the last 10s); the retry was not sent",
        decision.state,
        refused_by=origin,
    )


def _check_breaker(value: object) -> None:
    """None or an `idempotently.Breaker` (its class loaded only when one is given)."""
    if value is None:
        return
    from idempotently._breaker import Breaker

    if not isinstance(value, Breaker):
        raise TypeError(
            f"breaker must be an idempotently.Breaker or None, not {type(value).__name__}"
        )


def breaker_refused(decision: Decision, pause: OriginPause) -> Decision:
    """The retry ``decision`` was, refused because its origin's circuit breaker is open
    (or another pause holds it): not sent, the operation stays pending until it ends."""
    return Decision(
        "retry_later",
        f"{decision.reason}: {pause.origin} is paused ({pause.reason}), so the retry was "
        f"not sent; `idempotently unpause {pause.origin}` lifts the pause",
        decision.state,
        not_before=pause.until,
    )


def decide(
    policy: RetryPolicy,
    profile: ServerProfile,
    state: CallState,
    signal: Signal,
    *,
    now: float,
    rand: Callable[[], float] = random.random,
) -> Decision:
    """The next step after one attempt whose result is ``signal``."""
    before = state
    state = state.after(signal, now=now)

    def decision(action: Action, reason: str, **extra: float | None) -> Decision:
        return Decision(action, reason, state, **extra)  # type: ignore[arg-type]

    def final(signal: Answer, what: str) -> Decision:
        """A final answer: failed only when it proves nothing happened."""
        if signal.replayed:
            return decision("fail", f"{what} (the server's stored answer for this key)")
        if state.resuming and signal.status_code in CREDENTIAL_STATUS_CODES:
            return decision(
                "unresolved",
                f"{what}: the server refused the credentials this resume sent; the "
                "operation keeps its state (pass the right ones, e.g. --header-env)",
            )
        if before.acted:
            return decision(
                "unresolved",
                f"{what} after an earlier attempt that may have been delivered: this answer "
                "says nothing about that attempt, so the operation stays pending with its key",
            )
        return decision("fail", f"{what}: a final answer; retrying it would be a loop")

    if isinstance(signal, Failure):
        if signal.unsendable:
            reason = f"the request cannot be sent: {signal.text}"
            if before.acted or state.resuming:
                return decision("unsent", reason + "; the operation keeps its state")
            return decision("fail", reason)
        if signal.outcome == "maybe_delivered" and state.delivery == "at_most_once":
            return decision(
                "abandon",
                f"{signal.text} after sending: an at-most-once operation that may have "
                "been delivered is never resent",
            )
        if signal.refused:
            return decision("unsent" if signal.outcome == "not_sent" else "pending", signal.text)
        if signal.unreadable:
            return decision(
                "pending",
                f"the answer could not be read ({signal.text}): the server may have acted, "
                "and resending would meet the same end",
            )
        return _retry_or_stop(policy, state, signal.text, None, now=now, rand=rand)

    status = signal.status_code
    if signal.classifier_error is not None:
        return decision(
            "pending",
            f"{status}: {signal.classifier_error}; the answer is journaled and the operation "
            "stays pending with its key (fix the classifier, then resume)",
        )
    verdict = signal.verdict
    if verdict == "final":
        what = f"{status} (final, says the profile's classify)"
        if status < 400:
            return decision("succeed", what)
        if status >= 500:
            # A 5xx may have acted (a function behind API Gateway that charged, then
            # raised, answers 502): a classifier cannot make it the promise that nothing
            # happened.
            return decision(
                "reconcile",
                f"{what}: a server error may have acted, so it is no proof that nothing "
                "happened; look the object up",
            )
        if before.acted and signal.replayed:
            # A classifier's "final" is never `failed` after an attempt that may have
            # acted, a replay marker notwithstanding: the table's own rule, stated once.
            return final(attrs.evolve(signal, replayed=False), what)
        return final(signal, what)
    if verdict == "retry":
        return _retry_verdict(policy, state, signal, now=now, rand=rand)
    if status < 400 and verdict is None:
        return decision("succeed", f"{status}")
    if signal.mismatch:
        if status >= 500:
            # As with "final": a server error may have acted, whatever it is called.
            return decision(
                "reconcile",
                f"{status}: called a payload mismatch, but a server error may have acted, "
                "so it is no proof that nothing happened; look the object up",
            )
        if before.acted and not signal.replayed:
            return decision(
                "reconcile",
                f"{status}: the server says this key was used with another payload after "
                "an attempt that may have been delivered; look the object up",
            )
        return decision("fail", f"{status}: the server says this key was used with another payload")
    hint = signal.hint
    if status >= 500 and verdict is None:
        if signal.replayed:
            return decision(
                "reconcile",
                f"the server replays a stored {status}: resending cannot change it; "
                "look the object up to learn what happened",
            )
        if hint is False:
            return decision(
                "reconcile", f"{status} and the server says not to retry: the outcome is unknown"
            )
        if not profile.stores_server_errors and (
            status not in GATEWAY_STATUS_CODES or status in profile.handler_errors
        ):
            return decision(
                "reconcile",
                f"{status} from a server that does not store errors under the key: its "
                "handler may have acted, and a resend would run it again",
            )
    elif signal.in_progress:
        if hint is False:
            return decision(
                "pending", f"{status}: the key is in progress and the server says not to retry"
            )
        timeout = profile.in_progress_timeout
        since = state.in_progress_since
        if timeout is not None and since is not None and now - since > timeout:
            return decision(
                "reconcile",
                f"{status}: the server has said 'in progress' for {now - since:g}s, longer "
                f"than the profile allows ({timeout:g}s): its lock may never expire",
            )
        if state.in_progress_answers > policy.in_progress_retries:
            return decision(
                "pending",
                f"{status}: the key is still in progress on the server after "
                f"{state.in_progress_answers} answers",
            )
    elif status in NEVER_RETRY_STATUS_CODES or hint is False:
        return final(
            signal, f"{status}" + (" and the server says not to retry" if hint is False else "")
        )
    elif not (status in RETRY_STATUS_CODES or hint is True):
        return final(signal, f"{status}")

    if state.delivery == "at_most_once" and status not in NOT_ACTED_STATUS_CODES:
        return decision(
            "abandon",
            f"{status}: an at-most-once operation the server may have acted on is never resent",
        )
    return _retry_or_stop(policy, state, f"{status}", signal.server_wait, now=now, rand=rand)


# -- reads: no journal, no key ------------------------------------------------------------

READ_RETRY_STATUS_CODES = frozenset({408, 425, 429})
"""Besides every 5xx: the statuses a read is retried on."""


def read_is_retryable(status: int) -> bool:
    """Whether a read's answer with ``status`` is one a retry may change."""
    return status >= 500 or status in READ_RETRY_STATUS_CODES


def classify_read(profile: ServerProfile, response: httpx.Response, *, now: float) -> Answer:
    """A read's answer: only its status, hint header and Retry-After matter."""
    status = response.status_code
    retryable = read_is_retryable(status)
    wait = (
        server_wait(response.headers, now=now) if retryable and profile._reads_retry_after else None
    )
    quota = None
    if profile._quota_reader is not None:
        wait, quota = _rate_limited(profile._quota_reader, response, status, wait, retryable, now)
    return Answer(
        status_code=status,
        hint=profile.retry_hint(response) if retryable else None,
        server_wait=wait,
        quota=quota,
    )


def decide_read(
    policy: RetryPolicy,
    state: CallState,
    signal: Signal,
    *,
    now: float,
    rand: Callable[[], float] = random.random,
) -> Decision:
    """The next step after one attempt of a read (GET, HEAD, OPTIONS; PUT and DELETE when
    asked): a method the server may repeat, so any network error, 5xx, 408, 425 or 429 is
    retried under the policy; anything else is the answer. ``retry`` or ``succeed`` (the
    last answer or error is let through)."""
    state = state.after(signal, now=now)
    if isinstance(signal, Failure):
        if signal.unsendable or signal.unreadable:
            return Decision("succeed", signal.text, state)
        what = signal.text
    else:
        if not read_is_retryable(signal.status_code) or signal.hint is False:
            return Decision("succeed", f"{signal.status_code}", state)
        what = f"{signal.status_code}"
    decision = _retry_or_stop(
        policy,
        state,
        what,
        None if isinstance(signal, Failure) else signal.server_wait,
        now=now,
        rand=rand,
    )
    if decision.action == "retry":
        return decision
    return Decision("succeed", decision.reason, state)


def _retry_verdict(
    policy: RetryPolicy,
    state: CallState,
    signal: Answer,
    *,
    now: float,
    rand: Callable[[], float],
) -> Decision:
    """The classifier says "try again": retried like a 503 (an at-most-once operation
    the server may have acted on is not)."""
    what = f"{signal.status_code} (retry, says the profile's classify)"
    if state.delivery == "at_most_once" and signal.status_code not in NOT_ACTED_STATUS_CODES:
        return Decision(
            "abandon",
            f"{what}: an at-most-once operation the server may have acted on is never resent",
            state,
        )
    return _retry_or_stop(policy, state, what, signal.server_wait, now=now, rand=rand)


def _retry_or_stop(
    policy: RetryPolicy,
    state: CallState,
    what: str,
    server: float | None,
    *,
    now: float,
    rand: Callable[[], float],
) -> Decision:
    from idempotently._waits import retry_call_state

    elapsed = now - state.started_at
    backoff = policy._wait_strategy(rand)(retry_call_state(state.attempts, elapsed, 0.0))
    wait = max(server or 0.0, backoff)
    if state.deadline_at is not None and now + wait > state.deadline_at:
        return Decision(
            "reconcile",
            f"{what}: the operation's own deadline passes before it could be retried",
            state,
        )
    if server is not None and server > policy.max_retry_after:
        return Decision(
            "retry_later",
            f"{what}: the server asks to wait {server:g}s, more than max_retry_after "
            f"({policy.max_retry_after:g}s)",
            state,
            not_before=now + server,
        )
    if policy._stop_strategy()(retry_call_state(state.attempts, elapsed, wait)):
        stop = (
            f"{what}: stopped after {state.attempts} attempt"
            f"{'' if state.attempts == 1 else 's'} and {elapsed:.3g}s "
            f"(max_attempts={policy.max_attempts}, deadline={policy.deadline:g}s)"
        )
        if server is not None:
            return Decision("retry_later", stop, state, not_before=now + server)
        return Decision("pending", stop, state)
    return Decision("retry", what, state, wait=wait)


_SHORTEST_TIMEOUT = 0.001
"""An attempt started at (or past) the deadline still gets this long: its connect
fails fast and it is recorded, instead of a send with no timeout at all."""


def longest_timeout(timeouts: Any) -> float:
    """The longest of the request's timeouts (infinite if a phase has none): while more
    time than that is left, the timeouts need no cap (the common case, not rebuilt)."""
    if not isinstance(timeouts, dict) or len(timeouts) < 4:
        return _INFINITY
    values = timeouts.values()
    return _INFINITY if None in values else float(max(values))


def capped_timeouts(timeouts: Any, remaining: float) -> dict[str, float | None]:
    """The request's timeouts (httpx's ``timeout`` extension), each capped by the
    ``remaining`` seconds of the call: an attempt never waits past the deadline for any
    phase (connect, write, read, pool). A timeout so cut after the request may have
    been sent is ``maybe_delivered``: the operation stays pending."""
    cap = max(remaining, _SHORTEST_TIMEOUT)
    phases = timeouts if isinstance(timeouts, dict) else {}
    return {
        phase: cap if (value := phases.get(phase)) is None else min(value, cap)
        for phase in ("connect", "read", "write", "pool")
    }
