"""The two drivers of the operation flow: they only send, sleep and persist.

Every decision is the flow's (``_flow/``). The sync driver hands each journal
command to the journal (a write goes to its one writer, and commits on the
caller's own thread when the writer is free). The async driver never runs
SQLite or a database round trip on its event loop: the journal commands its
tasks are waiting for go to a worker thread together, one hand-off per batch,
and join the journal's writer there; a cancelled call still finishes the
journal write in progress (nothing is half-written) and then releases its
lease.
"""

from __future__ import annotations

import inspect
import os
import queue
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import httpx
import sniffio

from idempotently._answers import aread_answer, read_answer
from idempotently._commands import (
    BindCredentials,
    Command,
    DigestCredentials,
    Discard,
    Emit,
    Enqueue,
    Find,
    GateCommand,
    JournalCommand,
    Journaled,
    PlanReconcile,
    ReadAnswer,
    Reconcile,
    Record,
    Release,
    Report,
    Send,
    Sleep,
    assert_never,
)
from idempotently._credentials import compute_digest
from idempotently._events import Unfinished, adeliver, deliver
from idempotently._exceptions import JournalError, after_send_began
from idempotently._flow._operation import Flow, Held
from idempotently._gate import GATE_EXTENSION, LEAVING, Passage
from idempotently._heartbeat import heartbeat_for
from idempotently._journal import Journal
from idempotently._rows import Failed
from idempotently._vocabulary import Status

if TYPE_CHECKING:
    from idempotently._lookup import BoundReconciler

T = TypeVar("T")

# What a send may raise that still means "this attempt ended" and is journaled as
# such: any error (transport errors, an answer httpx could not read, a response
# hook that raised). KeyboardInterrupt and cancellation end the call instead.
SEND_ERRORS = (Exception,)


def run(
    flow: Flow[T],
    held: Held,
    store: Journal,
    *,
    send: Callable[[httpx.Request], httpx.Response],
    sleep: Callable[[float], object],
    reconcile: BoundReconciler | None = None,
    report: Callable[[Any], object] | None = None,
) -> T:
    """Run ``flow`` to its end with blocking I/O."""
    reply: Any = None
    unfinished = Unfinished()

    def perform(command: GateCommand) -> Any:
        """What a request's gate asks for as it leaves (inside ``send``)."""
        match command:
            case DigestCredentials():
                return compute_digest(command.key)
            case BindCredentials():
                return store._execute(command)
            case _:
                assert_never(command)

    try:
        while True:
            try:
                command: Command = flow.send(reply)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            # The journal's commands first: a call yields several for each send.
            match command:
                case Record():
                    reply = store._execute(command)
                    held.recorded(command)
                case Journaled():
                    reply = store._execute(command)
                case Send():
                    try:
                        with heartbeat_for(store).holding(command.lease), _Gated(command, perform):
                            reply = send(command.request)
                            # An answer already read (an in-process transport's) is whole.
                            if command.read is not None and not reply.is_stream_consumed:
                                read_answer(*command.read(reply))
                    except SEND_ERRORS as error:
                        reply = error
                case ReadAnswer():
                    try:
                        with heartbeat_for(store).holding(command.lease):
                            read_answer(command.body, command.limit, command.until, command.clock)
                        reply = None
                    except SEND_ERRORS as error:
                        reply = error
                case Sleep():
                    reply = sleep(command.seconds)
                case Discard():
                    # An answer thrown away: failing to close it ends its connection, not
                    # the call.
                    if command.body is not None:
                        command.body.close()
                    with suppress(Exception):
                        command.response.close()
                    reply = None
                case PlanReconcile():
                    reply = reconcile.plan(command.operation) if reconcile is not None else None
                case Reconcile():
                    reply = (
                        reconcile(command.operation, command.request)
                        if reconcile is not None
                        else None
                    )
                case Report():
                    reply = report(command.result) if report is not None else None
                case Emit():
                    unfinished.saw(command.event, command.hooks)
                    deliver(command.event, command.hooks)
                    reply = None
                case DigestCredentials():
                    reply = compute_digest(command.key)
                case _:
                    assert_never(command)
    except Exception as error:
        told = _told(error, held)
        if told is error:
            raise
        raise told  # noqa: B904 (its __cause__ is the error)
    finally:
        flow.close()
        cleanup, held.lease, held.interrupted = held.cleanup(), None, None
        try:
            if cleanup is not None:
                # If the journal cannot take this write either, the lease simply
                # expires; the error that ended the call is the one to report.
                with suppress(JournalError):
                    store._execute(cleanup)
        finally:
            held.end()
            for event, hooks in unfinished.endings(_status_after(cleanup)):
                deliver(event, hooks)


async def arun(
    flow: Flow[T],
    held: Held,
    store: Journal,
    *,
    send: Callable[[httpx.Request], Awaitable[httpx.Response]],
    sleep: Callable[[float], Awaitable[object]],
    reconcile: BoundReconciler | None = None,
    report: Callable[[Any], object] | None = None,
) -> T:
    """Run ``flow`` to its end on asyncio or trio; journal commands off the event loop."""
    reply: Any = None
    unfinished = Unfinished()

    async def aperform(command: GateCommand) -> Any:
        """What a request's gate asks for as it leaves, off the event loop as ever."""
        match command:
            case DigestCredentials():
                return await anyio.to_thread.run_sync(compute_digest, command.key)
            case BindCredentials():
                return await _journal(store, command)
            case _:
                assert_never(command)

    try:
        while True:
            try:
                command: Command = flow.send(reply)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            # The journal's commands first: a call yields several for each send. None is
            # abandoned on cancellation: the write completes, then the cancellation is
            # delivered at the checkpoint after it, before anything is sent.
            match command:
                case Record():
                    reply = await _journal(store, command)
                    held.recorded(command)
                    await anyio.lowlevel.checkpoint_if_cancelled()
                case Find(connection=connection) | Enqueue(connection=connection) if (
                    connection is not None
                ):
                    # The application's own connection (the outbox): on its loop.
                    reply = await store._aexecute(command)
                    await anyio.lowlevel.checkpoint_if_cancelled()
                case Journaled():
                    reply = await _journal(store, command)
                    await anyio.lowlevel.checkpoint_if_cancelled()
                case Send():
                    try:
                        with (
                            heartbeat_for(store).holding(command.lease),
                            _Gated(command, aperform),
                        ):
                            reply = await send(command.request)
                            if command.read is not None and not reply.is_stream_consumed:
                                await aread_answer(*command.read(reply))
                    except SEND_ERRORS as error:
                        reply = error
                case ReadAnswer():
                    try:
                        with heartbeat_for(store).holding(command.lease):
                            await aread_answer(
                                command.body, command.limit, command.until, command.clock
                            )
                        reply = None
                    except SEND_ERRORS as error:
                        reply = error
                case Sleep():
                    waited = sleep(command.seconds)
                    if not inspect.isawaitable(waited):
                        raise TypeError(
                            "an async session's sleep must be an async function (e.g. "
                            f"anyio.sleep), not {sleep!r}"
                        )
                    reply = await waited
                case Discard():
                    if command.body is not None:
                        await command.body.aclose()
                    with suppress(Exception):
                        await command.response.aclose()
                    reply = None
                case PlanReconcile():
                    reply = reconcile.plan(command.operation) if reconcile is not None else None
                case Reconcile():
                    reply = (
                        await reconcile(command.operation, command.request)
                        if reconcile is not None
                        else None
                    )
                case Report():
                    reply = report(command.result) if report is not None else None
                case Emit():
                    unfinished.saw(command.event, command.hooks)
                    await adeliver(command.event, command.hooks)
                    reply = None
                case DigestCredentials():
                    # scrypt takes tens of milliseconds: never on the event loop.
                    reply = await anyio.to_thread.run_sync(compute_digest, command.key)
                case _:
                    assert_never(command)
    except Exception as error:
        told = _told(error, held)
        if told is error:
            raise
        raise told  # noqa: B904 (its __cause__ is the error)
    finally:
        flow.close()
        cleanup, held.lease, held.interrupted = held.cleanup(), None, None
        try:
            if cleanup is not None:
                with anyio.CancelScope(shield=True), suppress(JournalError):
                    await _journal(store, cleanup)
        finally:
            held.end()
            endings = unfinished.endings(_status_after(cleanup))
            if endings:
                with anyio.CancelScope(shield=True):
                    for event, hooks in endings:
                        await adeliver(event, hooks)


def _told(error: Exception, held: Held) -> BaseException:
    """``error`` as the call raises it: the one place that knows whether a send of the
    operation may have begun with its answer not journaled (``held.interrupted``), and
    then makes the error say so (`after_send_began`), whatever raised it."""
    sending = held.interrupted
    if sending is None:
        return error
    operation_id, key, _owner, _started, delivery = sending
    return after_send_began(error, operation_id, key, delivery)


class _Pending:
    """One task's journal command, waiting for a worker thread to run it."""

    __slots__ = ("command", "done", "error", "reply", "wake")

    def __init__(self, command: JournalCommand) -> None:
        self.command = command
        self.done = False
        self.reply: Any = None
        self.error: BaseException | None = None
        self.wake: anyio.Event | None = None


class _Batch:
    """The journal commands an event loop's tasks are waiting for."""

    __slots__ = ("busy", "waiting")

    def __init__(self) -> None:
        self.busy = False
        self.waiting: list[_Pending] = []


# Per journal and event loop; an entry lives only while its loop has commands in flight.
_BATCHES: dict[tuple[int, object], _Batch] = {}


async def _journal(journal: Journal, command: JournalCommand) -> Any:
    """Run one journal command in a worker thread, with whatever other tasks of this
    event loop are waiting for.

    One task at a time takes every command waiting on this loop to one worker
    thread (`Journal._execute_many`: the writes among them join the
    journal's writer as one batch, so their keys share a commit and an fsync),
    instead of a thread hop per command. Each caller returns once its own command
    is done; nothing is abandoned on cancellation: the write completes first.
    """
    await anyio.lowlevel.checkpoint_if_cancelled()
    slot = (id(journal), anyio.lowlevel.current_token())
    batch = _BATCHES.get(slot)
    if batch is None:
        batch = _BATCHES[slot] = _Batch()
    pending = _Pending(command)
    batch.waiting.append(pending)
    while not pending.done:
        if batch.busy:
            pending.wake = anyio.Event()
            with anyio.CancelScope(shield=True):  # the batch it joins runs regardless
                await pending.wake.wait()
            continue
        batch.busy = True
        taken, batch.waiting = batch.waiting, []
        try:
            # Other tasks' commands too: run them even if this task was cancelled.
            with anyio.CancelScope(shield=True):
                outcomes = await _hand_over(journal, [each.command for each in taken])
            for each, outcome in zip(taken, outcomes, strict=True):
                if isinstance(outcome, Failed):
                    each.error = outcome.error
                else:
                    each.reply = outcome
        except BaseException as error:
            # The hop itself failed: every command of the batch fails with it.
            for each in taken:
                each.error = error
            raise
        finally:
            batch.busy = False
            for each in taken:
                each.done = True
                if each.wake is not None:
                    each.wake.set()
            if batch.waiting:
                # The first task still waiting takes the next batch.
                first = batch.waiting[0]
                if first.wake is not None:
                    first.wake.set()
            elif _BATCHES.get(slot) is batch:
                del _BATCHES[slot]
    if pending.error is not None:
        raise pending.error
    return pending.reply


async def _hand_over(journal: Journal, commands: list[JournalCommand]) -> list[Any]:
    """``journal._execute_many(commands)`` in the journal's worker thread, awaited here.

    A plain queue to one long-lived thread per journal, which wakes this loop when the
    batch is done (``call_soon_threadsafe`` on asyncio, the trio token on trio): about
    half the cost of an ``anyio.to_thread`` hop, and one hand-off per batch. On another
    async library, the anyio hop.
    """
    done = anyio.Event()
    wake = _waker(done)
    if wake is None:
        return await anyio.to_thread.run_sync(journal._execute_many, commands)
    box: list[Any] = []
    _worker_of(journal).put(journal, commands, box, wake)
    await done.wait()
    (outcome,) = box
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome  # type: ignore[no-any-return]


def _waker(event: anyio.Event) -> Callable[[], None] | None:
    """A function any thread may call to set ``event`` on the running loop, or None."""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return None
    if library == "asyncio":
        import asyncio

        loop = asyncio.get_running_loop()

        def wake_asyncio() -> None:
            with suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                loop.call_soon_threadsafe(event.set)

        return wake_asyncio
    if library == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def wake_trio() -> None:
            with suppress(trio.RunFinishedError):
                token.run_sync_soon(event.set)

        return wake_trio
    return None


class _Worker:
    """One journal's thread for its async callers' batches: a queue, and a thread that
    lives while there is work (it ends after IDLE seconds without any)."""

    IDLE = 5.0

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Journal, list[Any], list[Any], Callable[[], None]]]
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def put(
        self, journal: Journal, commands: list[Any], box: list[Any], wake: Callable[[], None]
    ) -> None:
        with self._lock:
            self._jobs.put((journal, commands, box, wake))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="idempotently-journal", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                journal, commands, box, wake = self._jobs.get(timeout=self.IDLE)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._thread = None
                        return
                continue
            try:
                box.append(journal._execute_many(commands))
            except BaseException as error:  # handed to the waiting task, raised there
                box.append(error)
            del journal, commands
            wake()


_WORKERS: weakref.WeakKeyDictionary[Journal, _Worker] = weakref.WeakKeyDictionary()
_WORKERS_LOCK = threading.Lock()


def _worker_of(journal: Journal) -> _Worker:
    with _WORKERS_LOCK:
        worker = _WORKERS.get(journal)
        if worker is None:
            worker = _WORKERS[journal] = _Worker()
        return worker


def _forget_workers() -> None:
    """A forked child has none of its parent's threads."""
    global _WORKERS_LOCK
    _WORKERS_LOCK = threading.Lock()
    _WORKERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


class _Gated:
    """While ``command`` is sent, its request carries its gate with the driver's I/O
    (`_gate.Passage`), for the client's last request hook or the Transport to check it
    as it leaves; afterwards it carries nothing of ours. A class, not a generator: it
    runs around every send."""

    __slots__ = ("request", "token")

    def __init__(self, command: Send, perform: Callable[[GateCommand], Any]) -> None:
        gate = command.gate
        self.request = None if gate is None else command.request
        self.token: Any = None
        if gate is not None:
            passage = Passage(gate, perform)
            command.request.extensions = {**command.request.extensions, GATE_EXTENSION: passage}
            self.token = LEAVING.set(passage)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        request = self.request
        if request is not None:
            LEAVING.reset(self.token)
            request.extensions = {
                name: value for name, value in request.extensions.items() if name != GATE_EXTENSION
            }


def _status_after(cleanup: Record | Release | None) -> Status:
    """What the journal says of an operation its call left early: pending, unless the
    cleanup's record of the interrupted attempt says otherwise."""
    match cleanup:
        case Record():
            return cleanup.record.status
        case Release() | None:
            return "pending"
        case _:
            assert_never(cleanup)


FlowFactory = Callable[[Held], Flow[T]]
"""Makes one flow, given the lease holder its driver will clean up after."""


def run_each(
    factories: Sequence[FlowFactory[T]],
    store: Journal,
    *,
    concurrency: int,
    send: Callable[[httpx.Request], httpx.Response],
    sleep: Callable[[float], object],
    reconcile: BoundReconciler | None = None,
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
    store: Journal,
    *,
    concurrency: int,
    send: Callable[[httpx.Request], Awaitable[httpx.Response]],
    sleep: Callable[[float], Awaitable[object]],
    reconcile: BoundReconciler | None = None,
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
