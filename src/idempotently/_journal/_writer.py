"""The journal's one writer: every write of a journal passes through it.

A write is a value (``_commands.py``: a key to insert, an attempt to record, a
lease to take, extend or renew...). Every write joins the writer's one queue.

A sync caller hands its writes to `Writer.write_many`. If no batch is being
committed, the caller leads: it takes every write waiting (its own included)
and commits them in one transaction on its own thread, durable (fsync'd) if any
of them must be. If a batch is being committed, it waits; when that batch is
done, the next waiter leads with everything that arrived meanwhile. So a lone
sync caller commits on its own thread with no hand-off (a dedicated writer
thread measured 26 % slower for one caller), and concurrent callers share
transactions and fsyncs.

An async caller (`Writer.awrite`) never commits on its event loop: it queues its
write, and the writer's thread (one per journal, started on demand, ended after
``IDLE`` seconds with nothing to do) leads the next batch, unless a sync leader
takes the write into its own batch first. Whoever committed the batch wakes each
event loop that waits for one of its writes, once per loop (asyncio's
``call_soon_threadsafe``, trio's ``TrioToken.run_sync_soon``), so the tasks of
a loop share a commit, and an fsync, with each other and with every thread.
The same thread runs the lease heartbeat (`_heartbeat.Heartbeat`), whose
extensions are writes like any other.

Nobody returns before its own write is committed (or has failed), so no
durability promise is weakened: a key is still durable before its first byte
is sent, it only shares the fsync with its neighbours'. One failing write
fails alone: the store runs each write of a batch in a savepoint.

Observers (`Writer.observe`) see each batch before it is committed (raising
there fails the whole batch, as a failed BEGIN would) and after.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import anyio
import sniffio

from idempotently._exceptions import JournalError, JournalWriteError
from idempotently._heartbeat import Heartbeat
from idempotently._rows import Failed

logger = logging.getLogger("idempotently")

_REENTERED = (
    "a journal commit observer cannot {what} the journal it watches from inside its "
    "callback: the batch that runs the callback holds the journal's writer until the "
    "callback returns, so this would wait for itself forever. Nothing of it was written. "
    "Hand the work to another thread, or do it after the batch (once the call returns)"
)

_INTERRUPTED = (
    "the journal transaction that held this write was interrupted (KeyboardInterrupt in "
    "the thread committing it), so it may or may not have been journaled; nothing was sent "
    "after it. Call again with the same operation_id, or resume: the same key makes it safe"
)

IDLE = 5.0
"""Seconds the writer's thread waits with nothing to do (no async write, no lease to
keep alive) before it ends: starting a thread costs about a millisecond, as much as
the rest of a call's journal work, so back-to-back calls reuse one thread."""

Commit = Callable[[Sequence[Any], bool], Sequence[Any]]
"""``commit(writes, durable)``: one transaction; each write's result or a Failed."""

Before = Callable[[Sequence[Any], bool], object]
"""``before(writes, durable)``: a batch about to be committed (fsync'd if ``durable``);
raising fails the whole batch."""

After = Callable[[Sequence[Any], Sequence[Any]], object]
"""``after(writes, outcomes)``: a batch committed; each outcome is the write's result or
the exception it failed with."""

Wake = Callable[..., object]
"""An event loop's thread-safe call: ``wake(function, *args)`` runs it on that loop."""


class _Job:
    __slots__ = ("done", "durable", "error", "event", "result", "wake", "write")

    def __init__(self, write: Any, durable: bool) -> None:
        self.write = write
        self.durable = durable
        self.done = False
        self.result: Any = None
        self.error: Exception | None = None
        # An async caller's: its loop's thread-safe call, and the event it awaits.
        self.wake: Wake | None = None
        self.event: anyio.Event | None = None


class Writer:
    """The queue of one journal's writes, who is committing it now, and the journal's
    one thread (for async callers and the heartbeat) while it has work."""

    def __init__(
        self,
        commit: Commit,
        durable: Callable[[Any], bool],
        refusal: Callable[[Any], Exception | None] = lambda write: None,
    ) -> None:
        self._commit = commit
        self._durable = durable
        self._refusal = refusal
        self._observers: tuple[tuple[Before | None, After | None], ...] = ()
        # The thread committing a batch (its observers run on it), else None: a write
        # or close from there would wait for its own batch.
        self._leader: int | None = None
        self.heartbeat = Heartbeat(self)
        """The leases this journal keeps alive: extended by this writer's thread."""
        self._fresh()

    def _fresh(self) -> None:
        lock = threading.Lock()
        self._lock = lock
        # Two conditions on one lock: a sync commit wakes the callers waiting for it,
        # never the thread (a thread switch per call), unless an async write waits.
        self._changed = threading.Condition(lock)
        self._work = threading.Condition(lock)
        self._waiting: list[_Job] = []
        self._async_waiting = 0
        # How many async writes the batch being committed holds (their loops are woken
        # after it), and how many callers wait on ``_changed``: a lone caller's commit
        # then wakes nobody, at no cost.
        self._batch_async = 0
        self._sleepers = 0
        self._committing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.wake_at = math.inf
        """time.monotonic() when the thread next wakes by itself (inf: no thread)."""

    # -- sync callers: leader/follower ----------------------------------------------------

    def write(self, write: Any) -> Any:
        """Commit ``write`` (with whatever else is waiting); its result, or its error raised.

        `write_many` for one write (a call's every write), without its lists."""
        self.refuse_reentry("write to")
        job = _Job(write, self._durable(write))
        lead: list[_Job] | None = None
        with self._lock:
            self._waiting.append(job)
            if self._committing:
                self._wait_for(job)
            if not job.done:
                lead = self._take()
        if lead is not None:
            self._lead(lead, (job,))
        if job.error is not None:
            # The caller's own copy: callers annotate the error they raise (operation
            # id, key), and one object must not carry another's.
            raise copy.copy(job.error)
        return job.result

    def _wait_for(self, job: _Job) -> None:
        """Wait (under the lock) until ``job`` is committed or nobody commits."""
        self._sleepers += 1
        try:
            while self._committing and not job.done:
                self._changed.wait()
        finally:
            self._sleepers -= 1

    def write_many(self, writes: Sequence[Any]) -> list[Any]:
        """Commit ``writes`` together (with whatever else is waiting); each one's outcome.

        All of them are in one transaction. An outcome is the write's result, or a
        `Failed` holding this caller's own copy of its error.
        """
        self.refuse_reentry("write to")
        jobs = [_Job(write, self._durable(write)) for write in writes]
        lead: list[_Job] | None = None
        with self._lock:
            # Appended together, so one leader always takes all of them at once.
            self._waiting.extend(jobs)
            if self._committing:
                self._wait_for(jobs[0])
            if not jobs[0].done:
                lead = self._take()
        if lead is not None:
            self._lead(lead, jobs)
        # Each caller gets its own copy of an error: callers annotate the error
        # they raise (operation id, key), and one object must not carry another's.
        return [
            Failed(copy.copy(job.error)) if job.error is not None else job.result for job in jobs
        ]

    # -- async callers: the writer's thread commits, the caller's loop is woken -----------

    async def awrite(self, write: Any) -> Any:
        """Commit ``write`` off the event loop; its result, or its error raised.

        Not abandoned on cancellation: once queued, the write is committed (or fails)
        before this returns, and a cancellation is delivered after, by the caller's
        next checkpoint."""
        # anyio's submodules load with the first async call, not with the package: anyio 4.16
        # loads its parts when first used, and these two cost 8 M instructions at import.
        import anyio.lowlevel

        await anyio.lowlevel.checkpoint_if_cancelled()
        wake = _loop_wake()
        if wake is None:
            # Another async library: its own worker thread joins the writer as a sync caller.
            import anyio.to_thread

            return await anyio.to_thread.run_sync(self.write, write)
        job = _Job(write, self._durable(write))
        job.wake, job.event = wake, anyio.Event()
        with self._lock:
            if self._closed:
                raise self._refusal(write) or JournalError("the journal was closed")
            self._waiting.append(job)
            self._async_waiting += 1
            if self._thread is None:
                self._start()
            elif not self._committing:
                self._work.notify()
        with anyio.CancelScope(shield=True):  # the batch it joined commits regardless
            await job.event.wait()
        if job.error is not None:
            raise copy.copy(job.error)
        return job.result

    # -- the batch ------------------------------------------------------------------------

    def _take(self) -> list[_Job]:
        """Become the leader of everything waiting (under the lock)."""
        self._committing = True
        batch, self._waiting = self._waiting, []
        self._batch_async, self._async_waiting = self._async_waiting, 0
        return batch

    def refuse_reentry(self, what: str) -> None:
        """Raise if this thread is committing a batch (an observer's callback runs)."""
        if self._leader is not None and self._leader == threading.get_ident():
            raise JournalError(_REENTERED.format(what=what))

    def _lead(self, batch: list[_Job], own: Sequence[_Job]) -> None:
        finished = False
        self._leader = threading.get_ident()
        try:
            writes = [job.write for job in batch]
            observers = self._observers
            durable = any(job.durable for job in batch)
            for before, _after in observers:
                if before is not None:
                    before(writes, durable)
            results = self._commit(writes, durable)
            for job, result in zip(batch, results, strict=True):
                if isinstance(result, Failed):
                    job.error = result.error
                else:
                    job.result = result
            if observers:
                # Before anyone waiting for the batch goes on (a crash point dies here,
                # before the key it committed is sent).
                _observed(observers, writes, batch)
            finished = True
        except Exception as error:
            # The transaction itself failed (BEGIN or COMMIT, or an observer before it):
            # nobody's write stands.
            for job in batch:
                job.error = error
            finished = True
        finally:
            self._leader = None
            with self._lock:
                if not finished:
                    # Interrupted (KeyboardInterrupt) in the leader's commit: it may or may
                    # not have committed, and running the writes again could journal an
                    # attempt twice or find a key "taken" by its own row. Each other caller
                    # is told so; the interrupt itself goes on in the leader.
                    for job in batch:
                        if job not in own:
                            job.error = JournalWriteError(_INTERRUPTED)
                for job in batch:
                    job.done = True
                self._committing = False
                if self._sleepers:
                    self._changed.notify_all()
                if self._async_waiting:
                    self._work.notify()
                woken = self._batch_async
            if woken:
                _wake_loops(batch)

    def observe(self, before: Before | None, after: After | None) -> Callable[[], None]:
        """Call ``before``/``after`` around each batch; returns what stops it."""
        for name, function in (("before", before), ("after", after)):
            if function is not None and not callable(function):
                raise TypeError(
                    f"observe_commits({name}=...) takes a function called with each batch, "
                    f"not {type(function).__name__}; pass a callable or None"
                )
        entry = (before, after)
        with self._lock:
            self._observers = (*self._observers, entry)

        def stop() -> None:
            with self._lock:
                self._observers = tuple(each for each in self._observers if each is not entry)

        return stop

    # -- the thread: async callers' batches and the heartbeat -----------------------------

    def _start(self) -> None:
        """Start the thread (under the lock)."""
        self._thread = threading.Thread(target=self._run, name="idempotently-journal", daemon=True)
        self._thread.start()

    def wake_for(self, due: float) -> None:
        """A lease is due at ``due`` (time.monotonic()): make the thread run by then
        (under the lock)."""
        if self._closed:
            return
        if self._thread is None:
            self._start()
        elif due < self.wake_at:
            # Only a lease due before the thread's next wake-up needs to wake it:
            # waking it on every call would cost a thread switch per call.
            self._work.notify()

    def _run(self) -> None:
        idle_since: float | None = None
        heartbeat = self.heartbeat
        while True:
            batch: list[_Job] | None = None
            with self._lock:
                now = time.monotonic()
                if self._async_waiting and not self._committing:
                    batch = self._take()
                    idle_since = None
                elif self._async_waiting:
                    # A sync leader commits; it wakes this thread when done.
                    self.wake_at = -math.inf
                    self._work.wait()
                    continue
                elif self._closed:
                    # The queue is drained; the leases are left to expire.
                    self._thread, self.wake_at = None, math.inf
                    self._changed.notify_all()
                    return
                else:
                    due = heartbeat.next_due()
                    if due > now:
                        if due < math.inf:
                            idle_since, self.wake_at = None, due
                        else:
                            idle_since = now if idle_since is None else idle_since
                            if now - idle_since >= IDLE:
                                self._thread, self.wake_at = None, math.inf
                                return
                            self.wake_at = idle_since + IDLE
                        self._work.wait(self.wake_at - now)
                        continue
                    self.wake_at = -math.inf  # beating: it looks at every entry right after
            if batch is not None:
                self._lead(batch, ())
            else:
                heartbeat.beat(all_leases=False)

    # -- the end --------------------------------------------------------------------------

    def close(self) -> None:
        """Take no more async writes: wait for those queued and the batch in flight to be
        committed, and for the thread to end (the leases it kept are left to expire)."""
        self.refuse_reentry("close")
        with self._lock:
            self._closed = True
            thread = self._thread
            self._work.notify_all()
            self._sleepers += 1
            try:
                while self._committing or self._waiting:
                    self._changed.wait()
            finally:
                self._sleepers -= 1
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def after_fork(self) -> None:
        """In a child process: a fresh lock and queue (the parent's may have been held at
        fork), and no thread (the child has none of its parent's threads)."""
        self._fresh()
        self.heartbeat.after_fork()


def _observed(
    observers: Sequence[tuple[Before | None, After | None]], writes: list[Any], batch: list[_Job]
) -> None:
    """Tell the observers a batch was committed, with what each write came to. Its writes
    stand whatever an observer raises: its error is logged, never a write's."""
    outcomes = [job.error if job.error is not None else job.result for job in batch]
    for _before, after in observers:
        if after is None:
            continue
        try:
            after(writes, outcomes)
        except Exception as error:
            logger.warning(
                "a journal commit observer raised %s: %s (the batch is committed)",
                type(error).__name__,
                error,
            )


def _loop_wake() -> Wake | None:
    """The running event loop's thread-safe call, or None on another async library."""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return None
    if library == "asyncio":
        import asyncio

        return asyncio.get_running_loop().call_soon_threadsafe
    if library == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    return None


def _wake_loops(batch: Sequence[_Job]) -> None:
    """Wake each event loop waiting for a write of ``batch``: one call per loop."""
    loops: dict[Any, tuple[Wake, list[anyio.Event]]] = {}
    for job in batch:
        if job.wake is not None and job.event is not None:
            # Bound methods of one loop (or token) are equal, never identical.
            loops.setdefault(job.wake, (job.wake, []))[1].append(job.event)
    for wake, events in loops.values():
        with suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            wake(_set_all, events)


def _set_all(events: list[anyio.Event]) -> None:
    for event in events:
        event.set()
