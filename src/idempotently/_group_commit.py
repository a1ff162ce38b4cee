"""Group commit: callers that need a durable write at the same moment share one fsync.

A caller hands its write to :meth:`GroupCommit.submit`. If no batch is being
committed it leads: it takes every write waiting (its own included), commits
them in one transaction, and wakes the others. If a batch is being committed,
it waits; when that batch is done, one of the waiters leads the next one with
everything that arrived meanwhile. Nobody returns before its own write is
committed, so no durability promise is weakened: a key is still durable before
its first byte is sent, it only shares the fsync with its neighbours'.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class _Job(Generic[T, R]):
    __slots__ = ("done", "error", "item", "result")

    def __init__(self, item: T) -> None:
        self.item = item
        self.done = False
        self.result: R | Failed | None = None
        self.error: Exception | None = None


class Failed:
    """The outcome of an item whose transaction failed: ``error``, to raise."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class GroupCommit(Generic[T, R]):
    """Batches ``commit`` calls made by concurrent threads.

    ``commit`` returns each item's result, or a :class:`Failed` for an item that
    failed alone (the others committed).
    """

    def __init__(self, commit: Callable[[Sequence[T]], Sequence[R | Failed]]) -> None:
        self._commit = commit
        self._changed = threading.Condition()
        self._waiting: list[_Job[T, R]] = []
        self._committing = False

    def submit(self, item: T) -> R:
        """Commit ``item`` (with whatever else is waiting); its result once it is durable."""
        (outcome,) = self.submit_many([item])
        if isinstance(outcome, Failed):
            raise outcome.error
        return outcome

    def submit_many(self, items: Sequence[T]) -> list[R | Failed]:
        """Commit ``items`` together (with whatever else is waiting); each one's outcome.

        All of them are in the same transaction. An outcome is the item's result,
        or a :class:`Failed` holding this caller's own copy of the error that
        rolled the transaction back.
        """
        jobs: list[_Job[T, R]] = [_Job(item) for item in items]
        lead: list[_Job[T, R]] | None = None
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
        # they raise (operation id, key), and one object must not carry the
        # first caller's.
        return [
            Failed(copy.copy(job.error)) if job.error is not None else job.result  # type: ignore[misc]
            for job in jobs
        ]

    def _lead(self, batch: list[_Job[T, R]], own: Sequence[_Job[T, R]]) -> None:
        finished = False
        try:
            results = self._commit([job.item for job in batch])
            for job, result in zip(batch, results, strict=True):
                job.result = result
            finished = True
        except Exception as error:
            # The whole transaction failed: nobody's write was committed.
            for job in batch:
                job.error = error
            finished = True
        finally:
            with self._changed:
                if finished:
                    for job in batch:
                        job.done = True
                else:
                    # Interrupted (KeyboardInterrupt) mid-commit: the others try again
                    # with the next leader; their inserts are idempotent.
                    self._waiting[:0] = [job for job in batch if job not in own]
                self._committing = False
                self._changed.notify_all()
