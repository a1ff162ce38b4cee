"""What happens to an operation, as typed events: for hooks, logs and OpenTelemetry.

The flow (``_flow/``) makes one event when it starts sending an operation,
one per attempt, one per retry decision and one when it stops; it logs each on
the ``idempotently`` logger with the event's fields and, when the Session or
Transport has ``hooks=``, yields an `Emit` command
that the driver carries out by calling them. No event holds a header, a body
or a URL: only ids, counts, outcomes and the reasons already written to the
journal (secrets scrubbed).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, ClassVar

import attrs

from idempotently._vocabulary import Action, Delivery, Outcome, Status

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


Event = OperationStarted | AttemptFinished | RetryScheduled | OperationFinished | RetryRefused
"""One of the five events a hook receives."""

Hook = Callable[[Event], object]
"""A hook: called with each event, in the caller's thread (or on the event loop)."""
AsyncHook = Callable[[Event], Awaitable[object] | object]
"""A hook of an async Session or Transport: a plain function or an async one."""


def fields(event: Event) -> dict[str, Any]:
    """The event as log record fields: its name and every field, by name."""
    return {"event": event.name, **attrs.asdict(event)}


def finished_level(status: Status) -> int:
    """The log level of an `OperationFinished` with ``status``: what the caller did
    not get (pending, needs reconciling, abandoned) is worth a line at INFO; a settled
    answer is the caller's to report."""
    return logging.DEBUG if status in ("succeeded", "failed") else logging.INFO


def heard(hooks: tuple[AsyncHook, ...], level: int) -> bool:
    """Whether an event logged at ``level`` reaches anyone: a hook, or the logger.

    The flow asks before it builds an event: with no hooks and the logger quiet (the
    usual case), nobody would ever see it.
    """
    return bool(hooks) or logger.isEnabledFor(level)


def log(event: Event) -> None:
    """One log record on the ``idempotently`` logger, its fields at ``record.idempotently``."""
    if isinstance(event, (RetryScheduled, RetryRefused)):
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


def _hook_failed(hook: object, event: Event) -> None:
    logger.error(
        "hook %r raised on %s of operation %s (key %s); ignored, the call goes on",
        hook,
        event.name,
        event.operation_id,
        event.key,
        exc_info=True,
        extra={"idempotently": {**fields(event), "hook": repr(hook)}},
    )


def deliver(event: Event, hooks: Iterable[Hook]) -> None:
    """Call every hook with ``event``; one that raises is logged and skipped."""
    for hook in hooks:
        try:
            result = hook(event)
        except Exception:
            _hook_failed(hook, event)
            continue
        if inspect.isawaitable(result):  # an async hook on a sync session: never awaited
            close = getattr(result, "close", None)
            if close is not None:
                close()
            logger.error(
                "hook %r returned an awaitable on a sync Session or Transport; it was not "
                "awaited: give a plain function",
                hook,
                extra={"idempotently": {**fields(event), "hook": repr(hook)}},
            )


async def adeliver(event: Event, hooks: Iterable[AsyncHook]) -> None:
    """Call every hook with ``event`` on the event loop, awaiting async ones; one that
    raises is logged and skipped."""
    for hook in hooks:
        try:
            result = hook(event)
            if inspect.isawaitable(result):
                await result
        except Exception:
            _hook_failed(hook, event)


def check_hooks(hooks: object, *, asynchronous: bool) -> tuple[AsyncHook, ...]:
    """``hooks=``: a list of callables (async ones only for an async session or transport)."""
    if isinstance(hooks, (str, bytes)) or callable(hooks) or not isinstance(hooks, Iterable):
        raise TypeError(
            f"hooks must be a list of callables taking an event, not {type(hooks).__name__}"
            + (" (wrap a single hook in a list: hooks=[hook])" if callable(hooks) else "")
        )
    checked = tuple(hooks)
    for hook in checked:
        if not callable(hook):
            raise TypeError(f"hooks must hold callables taking an event, not {hook!r}")
        if not asynchronous and inspect.iscoroutinefunction(hook):
            raise TypeError(
                f"hooks of a sync Session or Transport must be plain functions; {hook!r} is "
                "async and would never run"
            )
    return checked


class Unfinished:
    """The operations a driver delivered ``OperationStarted`` for and no ``OperationFinished``.

    A call that ends early (cancelled, Ctrl-C, an error raised by the flow) makes no
    ``OperationFinished``; the driver then delivers one from its cleanup, so a hook
    (an OpenTelemetry span, a metric) never waits for an end that will not come.
    """

    __slots__ = ("_open",)

    def __init__(self) -> None:
        # operation id -> (its start, attempts journaled, hooks, time.monotonic() at start)
        self._open: dict[str, tuple[OperationStarted, int, tuple[AsyncHook, ...], float]] = {}

    def saw(self, event: Event, hooks: Iterable[AsyncHook]) -> None:
        if isinstance(event, OperationStarted):
            self._open[event.operation_id] = (
                event,
                event.attempts,
                tuple(hooks),
                time.monotonic(),
            )
        elif isinstance(event, AttemptFinished) and event.operation_id in self._open:
            started, _, known, since = self._open[event.operation_id]
            self._open[event.operation_id] = (started, event.attempt, known, since)
        elif isinstance(event, OperationFinished):
            self._open.pop(event.operation_id, None)

    def endings(self, status: Status) -> list[tuple[OperationFinished, tuple[AsyncHook, ...]]]:
        """The ``OperationFinished`` of each operation left open, and whom to give it
        (its ``elapsed`` is real time, whatever clock the session was given)."""
        ended = [
            (
                OperationFinished(
                    operation_id=started.operation_id,
                    key=started.key,
                    status=status,
                    action="pending",
                    reason="the call was interrupted (cancelled, stopped or failed) before it "
                    "ended; what was sent is journaled and a later call or resume continues it",
                    attempts=attempts,
                    status_code=None,
                    replayed=False,
                    not_before=None,
                    elapsed=time.monotonic() - since,
                ),
                hooks,
            )
            for started, attempts, hooks, since in self._open.values()
        ]
        self._open.clear()
        return ended
