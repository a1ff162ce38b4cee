"""The two drivers of the operation flow: they only send, sleep and persist.

Every decision is the flow's (``_flow/``). The sync driver hands each journal
command to the journal (a write goes to its one writer, and commits on the
caller's own thread when the writer is free). The async driver never runs
SQLite or a database round trip on its event loop: its writes join the
journal's writer's one queue, committed by the writer's thread with every
other task's and thread's, which wakes the loop when they are; a cancelled call
still finishes the journal write in progress (nothing is half-written) and then
releases its lease.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import httpx

from idempotently import _commands_lazy
from idempotently._answers import aread_answer, read_answer
from idempotently._commands import (
    BindCredentials,
    DigestCredentials,
    Discard,
    Emit,
    GateCommand,
    Journaled,
    ReadAnswer,
    Record,
    Release,
    Send,
    Sleep,
    assert_never,
)
from idempotently._credentials import compute_digest
from idempotently._exceptions import JournalError, after_send_began
from idempotently._flow._operation import Flow, Held
from idempotently._gate import GATE_EXTENSION, LEAVING, Passage
from idempotently._hooks import Unfinished, adeliver, deliver
from idempotently._journal import Journal
from idempotently._vocabulary import Status

if TYPE_CHECKING:
    from idempotently._commands_rare import Command
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
                        with store._heartbeat.holding(command.lease), _Gated(command, perform):
                            reply = send(command.request)
                            # An answer already read (an in-process transport's) is whole.
                            if command.read is not None and not reply.is_stream_consumed:
                                read_answer(*command.read(reply))
                    except SEND_ERRORS as error:
                        reply = error
                case ReadAnswer():
                    try:
                        with store._heartbeat.holding(command.lease):
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
                case Emit():
                    unfinished.saw(command.event, command.hooks)
                    deliver(command.event, command.hooks)
                    reply = None
                case DigestCredentials():
                    reply = compute_digest(command.key)
                # Last, and through the module: a call never yields them (resume and
                # reconcile do), so they load with those rooms.
                case _commands_lazy.PlanReconcile():
                    reply = reconcile.plan(command.operation) if reconcile is not None else None
                case _commands_lazy.Reconcile():
                    reply = (
                        reconcile(command.operation, command.request)
                        if reconcile is not None
                        else None
                    )
                case _commands_lazy.Report():
                    reply = report(command.result) if report is not None else None
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
    # anyio's submodules load with the first async call, not with the package: anyio 4.16
    # loads its parts when first used, and these two cost 8 M instructions at import.
    import anyio.lowlevel
    import anyio.to_thread

    reply: Any = None
    unfinished = Unfinished()

    async def aperform(command: GateCommand) -> Any:
        """What a request's gate asks for as it leaves, off the event loop as ever."""
        match command:
            case DigestCredentials():
                return await anyio.to_thread.run_sync(compute_digest, command.key)
            case BindCredentials():
                return await store._aexecute(command)
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
                    reply = await store._aexecute(command)
                    held.recorded(command)
                    await anyio.lowlevel.checkpoint_if_cancelled()
                case Journaled():
                    reply = await store._aexecute(command)
                    await anyio.lowlevel.checkpoint_if_cancelled()
                case Send():
                    try:
                        with (
                            store._heartbeat.holding(command.lease),
                            _Gated(command, aperform),
                        ):
                            reply = await send(command.request)
                            if command.read is not None and not reply.is_stream_consumed:
                                await aread_answer(*command.read(reply))
                    except SEND_ERRORS as error:
                        reply = error
                case ReadAnswer():
                    try:
                        with store._heartbeat.holding(command.lease):
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
                case Emit():
                    unfinished.saw(command.event, command.hooks)
                    await adeliver(command.event, command.hooks)
                    reply = None
                case DigestCredentials():
                    # scrypt takes tens of milliseconds: never on the event loop.
                    reply = await anyio.to_thread.run_sync(compute_digest, command.key)
                # Last, as in `run`.
                case _commands_lazy.PlanReconcile():
                    reply = reconcile.plan(command.operation) if reconcile is not None else None
                case _commands_lazy.Reconcile():
                    reply = (
                        await reconcile(command.operation, command.request)
                        if reconcile is not None
                        else None
                    )
                case _commands_lazy.Report():
                    reply = report(command.result) if report is not None else None
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
                    await store._aexecute(cleanup)
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
