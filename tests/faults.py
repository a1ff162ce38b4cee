"""The one fault-injection seam of the journal: its store's commit of a batch of writes.

Every write, whoever makes it (a call, a resume, the heartbeat, a watch worker,
sync or async), reaches the store through the journal's one writer as a batch
(``Store.commit``). Tests make a write fail, or something happen around it,
there, instead of patching the many private methods that make writes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

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
    store = journal._store
    commit = store.commit

    def wrapped(writes: Sequence[Any], durable: bool) -> list[Any]:
        for write in writes:
            if before is not None and isinstance(write, kind):
                before(write)
        results = commit(writes, durable)
        for write in writes:
            if after is not None and isinstance(write, kind):
                after(write)
        return results

    store.commit = wrapped  # type: ignore[method-assign]
    try:
        yield
    finally:
        del store.commit  # type: ignore[method-assign]
