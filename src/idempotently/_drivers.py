"""The two drivers of the operation flow: they only send, sleep and persist.

Every decision is the flow's (``_flow.py``). The sync driver runs each command
inline. The async driver runs every journal command in a worker thread, so
that neither a lock held by another process nor an fsync ever stalls its event
loop; a cancelled call still finishes the journal write in progress (nothing
is half-written) and then releases its lease.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import httpx

from idempotently._exceptions import IdempotentlyError, JournalError
from idempotently._flow import Flow, Held
from idempotently._store import (
    Command,
    Reconcile,
    Release,
    Report,
    Send,
    Sleep,
    Store,
)

T = TypeVar("T")

# What a send may raise that still means "this attempt ended": transport errors,
# and answers httpx could not finish reading (undecodable body, redirect loop).
SEND_ERRORS = (httpx.HTTPError,)


def run(
    flow: Flow[T],
    held: Held,
    store: Store,
    *,
    send: Callable[[httpx.Request], httpx.Response],
    sleep: Callable[[float], object],
    reconcile: Callable[[Any], Any] | None = None,
    report: Callable[[Any], object] | None = None,
) -> T:
    """Run ``flow`` to its end with blocking I/O."""
    reply: Any = None
    try:
        while True:
            try:
                command: Command = flow.send(reply)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            if isinstance(command, Send):
                try:
                    reply = send(command.request)
                except SEND_ERRORS as error:
                    reply = error
            elif isinstance(command, Sleep):
                reply = sleep(command.seconds)
            elif isinstance(command, Reconcile):
                reply = reconcile(command.operation) if reconcile is not None else None
            elif isinstance(command, Report):
                reply = report(command.result) if report is not None else None
            else:
                reply = _with_ids(command, command.run, store)
    finally:
        flow.close()
        if held.lease is not None:
            # If the journal cannot take this write either, the lease simply
            # expires; the error that ended the call is the one to report.
            with suppress(JournalError):
                Release(*held.lease).run(store)
            held.lease = None


async def arun(
    flow: Flow[T],
    held: Held,
    store: Store,
    *,
    send: Callable[[httpx.Request], Awaitable[httpx.Response]],
    sleep: Callable[[float], Awaitable[object]],
    reconcile: Callable[[Any], Awaitable[Any]] | None = None,
    report: Callable[[Any], object] | None = None,
) -> T:
    """Run ``flow`` to its end on asyncio or trio; journal commands off the event loop."""
    reply: Any = None
    try:
        while True:
            try:
                command: Command = flow.send(reply)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            if isinstance(command, Send):
                try:
                    reply = await send(command.request)
                except SEND_ERRORS as error:
                    reply = error
            elif isinstance(command, Sleep):
                reply = await sleep(command.seconds)
            elif isinstance(command, Reconcile):
                reply = await reconcile(command.operation) if reconcile is not None else None
            elif isinstance(command, Report):
                reply = report(command.result) if report is not None else None
            else:
                # Not abandoned on cancellation: the write completes, then the
                # cancellation is delivered.
                reply = await anyio.to_thread.run_sync(_with_ids, command, command.run, store)
    finally:
        flow.close()
        if held.lease is not None:
            lease, held.lease = held.lease, None
            with anyio.CancelScope(shield=True), suppress(JournalError):
                await anyio.to_thread.run_sync(Release(*lease).run, store)


def _with_ids(command: Any, run: Callable[[Store], T], store: Store) -> T:
    """Run a journal command; its error names the operation it was for."""
    try:
        return run(store)
    except IdempotentlyError as error:
        operation = getattr(command, "operation", None) or getattr(command, "new", None)
        operation_id = getattr(command, "operation_id", None) or getattr(
            operation, "operation_id", None
        )
        error.operation_id = error.operation_id or operation_id
        error.key = error.key or getattr(operation, "key", None)
        raise
