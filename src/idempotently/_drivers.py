"""The two drivers of the operation flow: they only send, sleep and persist.

Every decision is the flow's (``_flow.py``). The sync driver runs each command
inline. The async driver runs a journal command on its event loop only when
nothing there can wait (see ``Journal._try_now``: no lock wait, no fsync),
and every other one in a worker thread, so that neither a lock held by
another process nor an fsync ever stalls the loop; a cancelled call still
finishes the journal write in progress (nothing is half-written) and then
releases its lease.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import httpx

from idempotently._events import Unfinished, adeliver, deliver
from idempotently._exceptions import IdempotentlyError, JournalError
from idempotently._flow import Flow, Held
from idempotently._group_commit import Failed
from idempotently._heartbeat import heartbeat_for
from idempotently._store import (
    Command,
    Emit,
    Insert,
    Queue,
    Reconcile,
    Record,
    Release,
    Report,
    Send,
    Sleep,
    Store,
)
from idempotently._vocabulary import Status

T = TypeVar("T")

# What a send may raise that still means "this attempt ended" and is journaled as
# such: any error (transport errors, an answer httpx could not read, a response
# hook that raised). KeyboardInterrupt and cancellation end the call instead.
SEND_ERRORS = (Exception,)


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
    unfinished = Unfinished()
    try:
        while True:
            try:
                command: Command = flow.send(reply)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            if isinstance(command, Send):
                try:
                    with heartbeat_for(store).holding(command.lease):
                        reply = send(command.request)
                except SEND_ERRORS as error:
                    reply = error
            elif isinstance(command, Sleep):
                reply = sleep(command.seconds)
            elif isinstance(command, Reconcile):
                reply = reconcile(command.operation) if reconcile is not None else None
            elif isinstance(command, Report):
                reply = report(command.result) if report is not None else None
            elif isinstance(command, Emit):
                unfinished.saw(command.event, command.hooks)
                deliver(command.event, command.hooks)
                reply = None
            else:
                reply = _with_ids(command, command.run, store)
                if isinstance(command, Record):
                    held.recorded(command)
    finally:
        flow.close()
        cleanup, held.lease, held.interrupted = held.cleanup(), None, None
        try:
            if cleanup is not None:
                # If the journal cannot take this write either, the lease simply
                # expires; the error that ended the call is the one to report.
                with suppress(JournalError):
                    cleanup.run(store)
        finally:
            held.end()
            for event, hooks in unfinished.endings(_status_after(cleanup)):
                deliver(event, hooks)


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
    unfinished = Unfinished()
    try:
        while True:
            try:
                command: Command = flow.send(reply)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            if isinstance(command, Send):
                try:
                    with heartbeat_for(store).holding(command.lease):
                        reply = await send(command.request)
                except SEND_ERRORS as error:
                    reply = error
            elif isinstance(command, Sleep):
                waited = sleep(command.seconds)
                if not inspect.isawaitable(waited):
                    raise TypeError(
                        "an async session's sleep must be an async function (e.g. anyio.sleep), "
                        f"not {sleep!r}"
                    )
                reply = await waited
            elif isinstance(command, Reconcile):
                reply = await reconcile(command.operation) if reconcile is not None else None
            elif isinstance(command, Report):
                reply = report(command.result) if report is not None else None
            elif isinstance(command, Emit):
                unfinished.saw(command.event, command.hooks)
                await adeliver(command.event, command.hooks)
                reply = None
            else:
                # Not abandoned on cancellation: the write completes, then the
                # cancellation is delivered here, before anything is sent.
                reply = await _journal(store, command)
                if isinstance(command, Record):
                    held.recorded(command)
                await anyio.lowlevel.checkpoint_if_cancelled()
    finally:
        flow.close()
        cleanup, held.lease, held.interrupted = held.cleanup(), None, None
        try:
            if cleanup is not None:
                with anyio.CancelScope(shield=True), suppress(JournalError):
                    await anyio.to_thread.run_sync(cleanup.run, store)
        finally:
            held.end()
            endings = unfinished.endings(_status_after(cleanup))
            if endings:
                with anyio.CancelScope(shield=True):
                    for event, hooks in endings:
                        await adeliver(event, hooks)


class _Pending:
    """One task's journal command, waiting for a worker thread to run it."""

    __slots__ = ("command", "done", "error", "ran", "reply", "wake")

    def __init__(self, command: Any) -> None:
        self.command = command
        self.done = False
        self.ran = False
        self.reply: Any = None
        self.error: BaseException | None = None
        self.wake: anyio.Event | None = None


class _Batcher:
    """The journal commands an event loop's tasks are waiting for, run a batch per thread hop."""

    __slots__ = ("busy", "waiting")

    def __init__(self) -> None:
        self.busy = False
        self.waiting: list[_Pending] = []


# Per store and event loop; an entry lives only while its loop has commands in flight.
_BATCHERS: dict[tuple[int, object], _Batcher] = {}


async def _journal(store: Store, command: Any) -> Any:
    """Run one journal command: on the loop if nothing there can wait, else in a worker
    thread with whatever other tasks are waiting for.

    One task at a time takes every command waiting on this event loop to one
    worker thread (the new keys among them in one commit), instead of a thread
    hop per command: with many tasks in flight, the hand-offs (waking a thread,
    passing the GIL back and forth) cost more than the writes. Each command is
    still its own transaction and each caller returns once its own write is
    done; nothing is abandoned on cancellation: the write completes first.
    """
    await anyio.lowlevel.checkpoint_if_cancelled()
    try_now = getattr(store, "_try_now", None)
    if (
        try_now is not None
        and not isinstance(command, Queue)
        and not (isinstance(command, Insert) and getattr(store, "durability", None) == "fsync")
    ):
        # On the loop, if nothing would make it wait (see Journal._try_now): a
        # thread hop costs more than a commit without fsync. Not Queue: a resume's
        # list of every pending operation may be long; not a key to fsync: the
        # group commit shares its fsync with other tasks' keys, off the loop.
        ran, reply = try_now(functools.partial(_with_ids, command, command.run, store))
        if ran:
            return reply
    slot = (id(store), anyio.lowlevel.current_token())
    batcher = _BATCHERS.get(slot)
    if batcher is None:
        batcher = _BATCHERS[slot] = _Batcher()
    pending = _Pending(command)
    batcher.waiting.append(pending)
    while not pending.done:
        if batcher.busy:
            pending.wake = anyio.Event()
            with anyio.CancelScope(shield=True):  # the batch it joins runs regardless
                await pending.wake.wait()
            continue
        batcher.busy = True
        batch, batcher.waiting = batcher.waiting, []
        try:
            if len(batch) == 1:
                # Like any to_thread call: not started if already cancelled, and
                # once started, not abandoned.
                await anyio.to_thread.run_sync(_run_batch, batch, store)
            else:
                # Other tasks' commands too: run them even if this task was cancelled.
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(_run_batch, batch, store)
        except BaseException as error:
            # The hop itself failed: what the thread did not run fails with it.
            for each in batch:
                if not each.ran:
                    each.error = error
            raise
        finally:
            batcher.busy = False
            for each in batch:
                each.done = True
                if each.wake is not None:
                    each.wake.set()
            if batcher.waiting:
                # The first task still waiting takes the next batch.
                first = batcher.waiting[0]
                if first.wake is not None:
                    first.wake.set()
            elif _BATCHERS.get(slot) is batcher:
                del _BATCHERS[slot]
    if pending.error is not None:
        raise pending.error
    return pending.reply


def _run_batch(batch: Sequence[_Pending], store: Store) -> None:
    """In a worker thread: each command's reply or error; new keys share one commit."""
    inserts = [each for each in batch if isinstance(each.command, Insert)]
    insert_many = getattr(store, "_insert_operations", None)
    if len(inserts) > 1 and insert_many is not None:
        commands: list[Insert] = [each.command for each in inserts]
        try:
            outcomes = insert_many([(i.new, i.owner, i.lease_until) for i in commands])
        except Exception as error:  # before any commit (the file moved): none was written
            outcomes = [Failed(copy.copy(error)) for _ in inserts]
        for each, outcome in zip(inserts, outcomes, strict=True):
            _settle_pending(each, store, functools.partial(_unwrap, outcome))
        rest = [each for each in batch if not isinstance(each.command, Insert)]
    else:
        rest = list(batch)
    records = [each for each in rest if isinstance(each.command, Record)]
    record_many = getattr(store, "_record_attempts", None)
    if len(records) > 1 and record_many is not None:
        # The completions too: one transaction (each failing alone if one fails).
        done: list[Record] = [each.command for each in records]
        try:
            recorded = record_many([(r.operation_id, r.record, r.now, r.owner) for r in done])
        except Exception as error:  # before any write (read-only journal): none was written
            recorded = [Failed(copy.copy(error)) for _ in records]
        for each, outcome in zip(records, recorded, strict=True):
            _settle_pending(each, store, functools.partial(_unwrap, outcome))
        rest = [each for each in rest if not isinstance(each.command, Record)]
    for each in rest:
        _settle_pending(each, store, each.command.run)


def _settle_pending(pending: _Pending, store: Store, run: Callable[[Store], Any]) -> None:
    try:
        pending.reply = _with_ids(pending.command, run, store)
    except Exception as error:
        pending.error = error
    finally:
        pending.ran = True


def _unwrap(outcome: Any, _store: Store) -> Any:
    if isinstance(outcome, Failed):
        raise outcome.error
    return outcome


def _status_after(cleanup: Record | Release | None) -> Status:
    """What the journal says of an operation its call left early: pending, unless the
    cleanup's record of the interrupted attempt says otherwise."""
    return cleanup.record.status if isinstance(cleanup, Record) else "pending"


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


FlowFactory = Callable[[Held], Flow[T]]
"""Makes one flow, given the lease holder its driver will clean up after."""


def run_each(
    factories: Sequence[FlowFactory[T]],
    store: Store,
    *,
    concurrency: int,
    send: Callable[[httpx.Request], httpx.Response],
    sleep: Callable[[float], object],
    reconcile: Callable[[Any], Any] | None = None,
    report: Callable[[Any], object] | None = None,
) -> list[T]:
    """Run one flow per factory, ``concurrency`` at a time in threads; results in order.

    The first error stops the workers from starting new flows and is raised once
    the running ones have ended (each releasing its own lease).
    """
    results: list[T] = []
    if concurrency <= 1 or len(factories) <= 1:
        for factory in factories:
            held = Held()
            results.append(
                run(
                    factory(held),
                    held,
                    store,
                    send=send,
                    sleep=sleep,
                    reconcile=reconcile,
                    report=report,
                )
            )
        return results
    found: dict[int, T] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()
    indexes = iter(range(len(factories)))

    def locked_report(result: Any) -> object:
        with lock:  # on_result (a progress bar, say) need not be thread-safe
            return report(result) if report is not None else None

    def worker() -> None:
        while not errors:
            with lock:
                index = next(indexes, None)
            if index is None:
                return
            held = Held()
            try:
                found[index] = run(
                    factories[index](held),
                    held,
                    store,
                    send=send,
                    sleep=sleep,
                    reconcile=reconcile,
                    report=locked_report,
                )
            except BaseException as error:
                errors.append(error)
                return

    workers = [
        threading.Thread(target=worker, name=f"idempotently-resume-{n}", daemon=True)
        for n in range(min(concurrency, len(factories)))
    ]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    if errors:
        raise errors[0]
    return [found[index] for index in range(len(factories))]


async def arun_each(
    factories: Sequence[FlowFactory[T]],
    store: Store,
    *,
    concurrency: int,
    send: Callable[[httpx.Request], Awaitable[httpx.Response]],
    sleep: Callable[[float], Awaitable[object]],
    reconcile: Callable[[Any], Awaitable[Any]] | None = None,
    report: Callable[[Any], object] | None = None,
) -> list[T]:
    """Run one flow per factory, ``concurrency`` tasks at a time; results in order.

    The first error cancels the other tasks (each releases its own lease).
    """
    found: dict[int, T] = {}
    indexes = iter(range(len(factories)))

    async def worker() -> None:
        for index in indexes:  # shared: each index is taken by exactly one worker
            held = Held()
            found[index] = await arun(
                factories[index](held),
                held,
                store,
                send=send,
                sleep=sleep,
                reconcile=reconcile,
                report=report,
            )

    async with anyio.create_task_group() as tasks:
        for _ in range(max(1, min(concurrency, len(factories)))):
            tasks.start_soon(worker)
    return [found[index] for index in range(len(factories))]
