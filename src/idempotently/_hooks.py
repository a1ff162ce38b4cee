"""Who hears what happens to an operation: the hooks a Session or Transport is given
(checked, called, their failures logged) and the ``idempotently`` logger.

Loaded with the package. The events themselves (``_events.py``) load when the first
one is made: the flow asks `heard` before it makes one, and with no hooks and the
logger quiet (the usual case) a call makes none.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, TypeAlias

from idempotently._vocabulary import Status

if TYPE_CHECKING:
    from idempotently._events import Event, OperationFinished, OperationStarted

logger = logging.getLogger("idempotently")

Hook: TypeAlias = "Callable[[Event], object]"
"""A hook: called with each event, in the caller's thread (or on the event loop)."""
AsyncHook: TypeAlias = "Callable[[Event], Awaitable[object] | object]"
"""A hook of an async Session or Transport: a plain function or an async one."""


def heard(hooks: tuple[AsyncHook, ...], level: int) -> bool:
    """Whether an event logged at ``level`` reaches anyone: a hook, or the logger.

    The flow asks before it builds an event: with no hooks and the logger quiet (the
    usual case), nobody would ever see it.
    """
    return bool(hooks) or logger.isEnabledFor(level)


def _hook_failed(hook: object, event: Event) -> None:
    from idempotently._events import fields

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
            from idempotently._events import fields

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
        from idempotently._events import AttemptFinished, OperationFinished, OperationStarted

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
        if not self._open:
            return []  # the usual end: no operation left open, no event to make (or load)
        from idempotently._events import OperationFinished

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
