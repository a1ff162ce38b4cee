"""The one fault-injection seam of the journal: its public commit observer.

Every write, whoever makes it (a call, a resume, the heartbeat, a watch worker,
sync or async), reaches the store through the journal's one writer as a batch,
and `Journal.observe_commits` sees each batch before and after it commits. Tests
make a write fail, or something happen around it, there, instead of patching the
many private methods that make writes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs

from idempotently import Journal


@contextmanager
def around_commit(
    journal: Journal,
    kind: type | tuple[type, ...],
    *,
    before: Callable[[Any], object] | None = None,
    after: Callable[[Any], object] | None = None,
) -> Iterator[None]:
    """Call ``before(write)`` / ``after(write)`` for each write of ``kind`` in a batch,
    before the batch commits (``before`` may raise: the batch then fails) or after."""

    def each_before(writes: Sequence[Any], durable: bool) -> None:
        for write in writes:
            if before is not None and isinstance(write, kind):
                before(write)

    def each_after(writes: Sequence[Any], outcomes: Sequence[Any]) -> None:
        for write in writes:
            if after is not None and isinstance(write, kind):
                after(write)

    stop = journal.observe_commits(before=each_before, after=each_after)
    try:
        yield
    finally:
        stop()


@attrs.frozen
class Batch:
    """One batch of writes a journal committed."""

    thread: int
    """threading.get_ident() of the thread that committed it."""
    writes: list[Any]
    durable: bool

    def count(self, kind: type | tuple[type, ...]) -> int:
        return sum(isinstance(write, kind) for write in self.writes)


def commits(journal: Journal) -> list[Batch]:
    """Every batch ``journal`` commits from now on, in order."""
    seen: list[Batch] = []
    journal.observe_commits(
        before=lambda writes, durable: seen.append(
            Batch(threading.get_ident(), list(writes), durable)
        )
    )
    return seen
