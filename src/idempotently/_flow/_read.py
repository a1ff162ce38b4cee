"""Unjournaled reads (GET, HEAD, OPTIONS): retried as the policy allows, with no key
and no journal.
"""

from __future__ import annotations

import logging

import httpx

from idempotently._budget import origin_of
from idempotently._commands import (
    Discard,
    Send,
)
from idempotently._flow._engine import Engine
from idempotently._flow._operation import Flow
from idempotently._keys import secret_values
from idempotently._pauses import PAUSE_STATUS_CODES
from idempotently._policy import (
    Answer,
    CallState,
    capped_timeouts,
    classify_error,
    classify_read,
    decide_read,
    longest_timeout,
)

logger = logging.getLogger("idempotently")


def retried_read(engine: Engine, request: httpx.Request) -> Flow[httpx.Response]:
    """Send a read (a method the server may repeat) until its answer is final, under
    the same policy, retry budget and origin pauses as the writes; no operation is
    journaled and no key is added. Returns the last answer, its body unread, or
    raises the last error, as they came; an answer it retries is closed unread.

    A journaled pause of the origin for the read's credentials is waited out before
    the first send, or, when longer than the read may wait, is a RetryLaterError
    without sending; a 429 or 503 with Retry-After, or an answer whose trusted
    rate-limit headers say the request quota is spent, pauses the origin for every
    caller, as a write's does."""
    started = engine.clock()
    state = CallState(started_at=started)
    profile = engine.profile
    pause = yield from engine.origin_pause(profile, request, started)
    if pause is not None:
        yield from engine.wait_out(
            profile, request, pause, started, None, operation_id=None, key=None
        )
    budget = engine.policy.budget
    origin = None if budget is None else origin_of(request.url)
    if origin is not None:
        engine.budgets.first_attempt(origin, engine.clock())
    limit = engine.time_limit(state)
    timeouts = request.extensions.get("timeout")
    longest = longest_timeout(timeouts)
    while True:
        paused_until: float | None = None  # the origin pause this answer set
        if limit is not None and limit - engine.clock() < longest:
            request.extensions = {
                **request.extensions,
                "timeout": capped_timeouts(timeouts, limit - engine.clock()),
            }
        reply = yield Send(request)
        now = engine.clock()
        response = reply if isinstance(reply, httpx.Response) else None
        signal = (
            classify_read(profile, response, now=now)
            if response is not None
            else classify_error(
                reply,
                secrets=secret_values(request.headers, engine.redact_headers, request.url),
            )
        )
        breaker = engine.policy.breaker if profile.pause_origin else None
        step = None
        if breaker is not None or engine.pauses.probes:
            # A read's outcome counts for its origin's breaker as a write's does, and a
            # read that took the probe closes or reopens it (`_pauses.after_attempt`):
            # before the server's own pause is journaled, which a probe's close (deleting
            # its claim) must not delete.
            if breaker is not None and (
                not isinstance(signal, Answer) or signal.status_code >= 500
            ):
                yield from engine.fresh_pauses(now)  # opened meanwhile by another process?
            step = engine.breaker_step(request, signal, now, breaker)
            if step is not None and step.write is not None:
                yield step.write
        if (
            isinstance(signal, Answer)
            and (
                signal.quota is not None
                or (signal.server_wait and signal.status_code in PAUSE_STATUS_CODES)
            )
            and profile.pause_origin
        ):
            paused_until = yield from engine.pause(request, signal, now)
        decision = decide_read(engine.policy, state, signal, now=now, rand=engine.rand)
        state = decision.state
        if decision.action == "retry" and step is not None and step.pause is not None:
            logger.info(
                "a %s to %s is not retried: %s is paused (%s); its last answer or error "
                "is returned",
                request.method,
                step.pause.origin,
                step.pause.origin,
                step.pause.reason,
            )
        elif (
            decision.action == "retry"
            and budget is not None
            and origin is not None
            and not engine.budgets.try_retry(budget, origin, now)
        ):
            logger.info(
                "a %s to %s is not retried: the retry budget of that origin is spent "
                "(%s); its last answer or error is returned",
                request.method,
                origin,
                decision.reason,
            )
        elif decision.action == "retry":
            if response is not None:
                yield Discard(response)
            yield from engine.sleep_on(profile, request, decision.wait, paused_until)
            continue
        if response is not None:
            return response
        raise reply
