"""The journal's one writer: every write of a journal passes through it.

A write is a value (``_commands.py``: a key to insert, an attempt to record, a
lease to take, extend or renew...). A caller hands its writes to
`Writer.write_many`. If no batch is being committed, the caller leads: it
takes every write waiting (its own included) and commits them in one
transaction on its own thread, durable (fsync'd) if any of them must be. If a
batch is being committed, it waits; when that batch is done, the next waiter
leads with everything that arrived meanwhile. So a lone sync caller commits on
its own thread with no hand-off (a dedicated writer thread measured 26 %
slower for one caller), and concurrent callers (threads, an async session's
batch from its worker thread, the heartbeat) share transactions and fsyncs.

Nobody returns before its own write is committed (or has failed), so no
durability promise is weakened: a key is still durable before its first byte
is sent, it only shares the fsync with its neighbours'. One failing write
fails alone: the store runs each write of a batch in a savepoint.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any

from idempotently._exceptions import JournalWriteError
from idempotently._rows import Failed

_INTERRUPTED = (
    "the journal transaction that held this write was interrupted (KeyboardInterrupt in "
    "the thread committing it), so it may or may not have been journaled; nothing was sent "
    "after it. Call again with the same operation_id, or resume: the same key makes it safe"
)

Commit = Callable[[Sequence[Any], bool], Sequence[Any]]
"""``commit(writes, durable)``: one transaction; each write's result or a Failed."""


class _Job:
    __slots__ = ("done", "durable", "error", "result", "write")

    def __init__(self, write: Any, durable: bool) -> None:
        self.write = write
        self.durable = durable
        self.done = False
        self.result: Any = None
        self.error: Exception | None = None


class Writer:
    """The queue of one journal's writes, and who is committing it now."""

    def __init__(self, commit: Commit, durable: Callable[[Any], bool]) -> None:
        self._commit = commit
        self._durable = durable
        self._changed = threading.Condition()
        self._waiting: list[_Job] = []
        self._committing = False

    def write(self, write: Any) -> Any:
        """Commit ``write`` (with whatever else is waiting); its result, or its error raised."""
        (outcome,) = self.write_many([write])
        if isinstance(outcome, Failed):
            raise outcome.error
        return outcome

    def write_many(self, writes: Sequence[Any]) -> list[Any]:
        """Commit ``writes`` together (with whatever else is waiting); each one's outcome.

        All of them are in one transaction. An outcome is the write's result, or a
        `Failed` holding this caller's own copy of its error.
        """
        jobs = [_Job(write, self._durable(write)) for write in writes]
        lead: list[_Job] | None = None
        with self._changed:
            # Appended together, so one leader always takes all of them at once.
            self._waiting.extend(jobs)
            while self._committing and not jobs[0].done:
                self._changed.wait()
            if not jobs[0].done:
                self._committing = True
                lead, self._waiting = self._waiting, []
        if lead is not None:
            self._lead(lead, jobs)
        # Each caller gets its own copy of an error: callers annotate the error
        # they raise (operation id, key), and one object must not carry another's.
        return [
            Failed(copy.copy(job.error)) if job.error is not None else job.result for job in jobs
        ]

    def _lead(self, batch: list[_Job], own: Sequence[_Job]) -> None:
        finished = False
        try:
            durable = any(job.durable for job in batch)
            results = self._commit([job.write for job in batch], durable)
            for job, result in zip(batch, results, strict=True):
                if isinstance(result, Failed):
                    job.error = result.error
                else:
                    job.result = result
            finished = True
        except Exception as error:
            # The transaction itself failed (BEGIN or COMMIT): nobody's write stands.
            for job in batch:
                job.error = error
            finished = True
        finally:
            with self._changed:
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
                self._changed.notify_all()

    def after_fork(self) -> None:
        """In a child process: a fresh condition (the parent's may have been held at fork)."""
        self._changed = threading.Condition()
        self._waiting = []
        self._committing = False
