"""What happens to an operation, as typed events: for hooks, logs and OpenTelemetry.

The flow (``_flow/``) makes one event when it starts sending an operation,
one per attempt, one per retry decision and one when it stops; it logs each on
the ``idempotently`` logger with the event's fields and, when the Session or
Transport has ``hooks=``, yields an `Emit` command
that the driver carries out by calling them. No event holds a header, a body
or a URL: only ids, counts, outcomes and the reasons already written to the
journal (secrets scrubbed).

This module loads when the first event is made, not with the package: with no hooks
and the logger quiet (the usual case) a call makes none. Who hears them (the hooks,
checked and called, and the logger) is ``_hooks.py``, loaded with the package.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

import attrs

from idempotently._vocabulary import Action, Delivery, Outcome, Status, finished_level

logger = logging.getLogger("idempotently")


@attrs.frozen(kw_only=True)
class OperationStarted:
    """This call (or resume) holds the operation and is about to send its first attempt.

    Made after the key is journaled (a new operation) or the lease is taken (a
    pending one); never for an operation answered from the journal.
    """

    name: ClassVar[str] = "operation_started"
    operation_id: str
    """The operation's id."""
    key: str
    """The operation's idempotency key."""
    method: str
    """The HTTP method (the URL is left out: its query may hold a secret)."""
    delivery: Delivery
    """`exactly_once` or `at_most_once`."""
    resuming: bool
    """Sent by ``resume``, not by a call."""
    attempts: int
    """Attempts already journaled for the operation (0 for a new one)."""
    at: float
    """When, by the session's clock (seconds since the epoch)."""


@attrs.frozen(kw_only=True)
class AttemptFinished:
    """One attempt ended and is journaled."""

    name: ClassVar[str] = "attempt_finished"
    operation_id: str
    """The operation's id."""
    key: str
    """The operation's idempotency key."""
    attempt: int
    """Its number among the operation's attempts, across calls and restarts (1 first)."""
    outcome: Outcome
    """``answered``, ``maybe_delivered`` or ``not_sent``."""
    status_code: int | None
    """The HTTP status of the answer; None without one."""
    replayed: bool
    """The server marked its answer as the stored one for this key."""
    error: str | None
    """Why it ended without an answer (``Type: message``, secrets scrubbed); else None."""
    action: Action
    """What the decision made of it (``succeed``, ``retry``, ``pending``, ...)."""
    status: Status
    """The operation's status in the journal after it."""
    started_at: float
    """When the attempt began, by the session's clock (seconds since the epoch)."""
    elapsed: float
    """Seconds the attempt took, by the session's clock."""


@attrs.frozen(kw_only=True)
class RetryScheduled:
    """The decision after an attempt: send the same bytes with the same key after ``wait``."""

    name: ClassVar[str] = "retry_scheduled"
    operation_id: str
    """The operation's id."""
    key: str
    """The operation's idempotency key."""
    attempt: int
    """The attempt that is retried (the next one is ``attempt + 1``)."""
    wait: float
    """Seconds until the next attempt."""
    reason: str
    """Why: the status code (``503``), or the transport error (``ConnectError: ...``)."""


@attrs.frozen(kw_only=True)
class OperationFinished:
    """This call (or resume) stopped sending the operation: what the journal now says."""

    name: ClassVar[str] = "operation_finished"
    operation_id: str
    """The operation's id."""
    key: str
    """The operation's idempotency key."""
    status: Status
    """``succeeded`` or ``failed`` (settled), ``pending`` (outcome unknown, or waiting:
    a resume continues it), ``needs_reconcile`` or ``abandoned``."""
    action: Action
    """The last decision (``succeed``, ``fail``, ``pending``, ``retry_later``, ...)."""
    reason: str
    """Why it stopped there, in words (the journal's `reason`)."""
    attempts: int
    """Attempts journaled for the operation, across calls and restarts."""
    status_code: int | None
    """The HTTP status of the last answer; None if the last attempt got none."""
    replayed: bool
    """The last answer was the server's stored one for this key."""
    not_before: float | None
    """For ``retry_later``: when the server allows the next attempt."""
    elapsed: float
    """Seconds since `OperationStarted`, by the session's clock."""


@attrs.frozen(kw_only=True)
class RetryRefused:
    """The process's retry budget for ``origin`` refused a retry the policy allowed:
    it is not sent, and the operation stays pending with its key."""

    name: ClassVar[str] = "retry_refused"
    operation_id: str
    """The operation whose retry was refused."""
    key: str
    """Its idempotency key (it stays pending with it)."""
    attempt: int
    """The attempt that would have been retried."""
    origin: str
    """``scheme://host:port`` whose budget is spent."""
    reason: str
    """Why, in words (the budget's figures)."""


@attrs.frozen
class BreakerChanged:
    """An attempt's outcome opened, reopened or closed its origin's circuit breaker
    (`idempotently.Breaker`), journaled for every process sharing the journal."""

    name: ClassVar[str] = "breaker_changed"
    operation_id: str
    """The operation whose attempt changed it."""
    key: str
    """Its idempotency key."""
    origin: str
    """``scheme://host:port`` whose breaker changed."""
    change: Literal["opened", "reopened", "closed"]
    """Opened by failures in a row, reopened by a failed probe, closed by an answered one."""
    until: float | None
    """When the open breaker's pause ends (seconds since the epoch; None: closed)."""
    reason: str
    """Why, in words."""


Event = (
    OperationStarted
    | AttemptFinished
    | RetryScheduled
    | OperationFinished
    | RetryRefused
    | BreakerChanged
)
"""One of the six events a hook receives."""


def fields(event: Event) -> dict[str, Any]:
    """The event as log record fields: its name and every field, by name."""
    return {"event": event.name, **attrs.asdict(event)}


def log(event: Event) -> None:
    """One log record on the ``idempotently`` logger, its fields at ``record.idempotently``."""
    if isinstance(event, (RetryScheduled, RetryRefused, BreakerChanged)):
        level = logging.INFO
    elif isinstance(event, OperationFinished):
        level = finished_level(event.status)
    else:
        level = logging.DEBUG
    if not logger.isEnabledFor(level):
        return  # no record: skip building its fields (every call logs up to four events)
    extra = {"idempotently": fields(event)}
    ids = (event.operation_id, event.key)
    if isinstance(event, OperationStarted):
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "operation %s (key %s) started: %s, %s, %d attempt%s journaled before",
                *ids,
                event.method,
                "resuming" if event.resuming else "called",
                event.attempts,
                "" if event.attempts == 1 else "s",
                extra=extra,
            )
    elif isinstance(event, AttemptFinished):
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "operation %s (key %s) attempt %d: %s -> %s",
                *ids,
                event.attempt,
                event.error or f"{event.outcome} {event.status_code}",
                event.action,
                extra=extra,
            )
    elif isinstance(event, RetryScheduled):
        logger.info(
            "operation %s (key %s) attempt %d: %s -> retry in %.3fs",
            *ids,
            event.attempt,
            event.reason,
            event.wait,
            extra=extra,
        )
    elif isinstance(event, RetryRefused):
        logger.info(
            "operation %s (key %s) attempt %d: retry refused by the retry budget of %s",
            *ids,
            event.attempt,
            event.origin,
            extra=extra,
        )
    elif isinstance(event, BreakerChanged):
        logger.info(
            "operation %s (key %s): circuit breaker of %s %s: %s",
            *ids,
            event.origin,
            event.change,
            event.reason,
            extra=extra,
        )
    else:
        logger.log(
            level,
            "operation %s (key %s) finished %s after %d attempt%s: %s",
            *ids,
            event.status,
            event.attempts,
            "" if event.attempts == 1 else "s",
            event.reason,
            extra=extra,
        )
