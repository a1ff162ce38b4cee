"""The client-side outbox: journal an operation that nothing has sent yet."""

from __future__ import annotations

import attrs

from idempotently._commands import (
    Enqueue,
    Find,
)
from idempotently._exceptions import OperationInProgressError
from idempotently._flow._engine import Engine
from idempotently._flow._operation import Call, Flow, _iso
from idempotently._rows import Operation


def enqueue(engine: Engine, call: Call, connection: object | None) -> Flow[Operation]:
    """Journal ``call`` as a pending operation that nothing has sent yet; send nothing.

    Rendered and journaled exactly as `call` journals a new operation (the
    same key, headers, body bytes, fingerprint and profile), but unleased and marked
    enqueued, with no first send: until a send begins it is provably undelivered,
    and its key's lifetime starts at that first send. On ``connection`` it is written
    inside the application's transaction. An operation id already journaled (the
    application's transaction run again) returns that operation, unchanged, after
    the same check a call makes (`KeyReuseError` for another request).
    """
    request = call.request
    headers, print_ = engine.read_request(request)
    now = engine.clock()
    if call.deadline_at is not None and call.deadline_at <= now:
        raise ValueError(
            f"deadline_at ({_iso(call.deadline_at)}) has already passed for operation "
            f"{call.operation_id!r}: nothing was journaled; give a deadline in the future, "
            "or none"
        )
    new, _ = engine.new_operation(call, print_, headers, now)
    # Bound to credentials (if its profile says so) by its first send, as a call's is.
    new = attrs.evolve(new, enqueued_at=now, in_order=False)
    if (yield Enqueue(new, connection)):
        # What a read of the row would return: its body in clear.
        return attrs.evolve(new.as_row(), request_body=request.content)
    found: Operation | None = yield Find(call.operation_id, new.key, connection)
    if found is None:
        # Taken when the insert ran, gone when we looked (pruned meanwhile): the
        # caller's transaction is the one to run again.
        raise OperationInProgressError(
            f"operation {new.operation_id!r} was journaled by another transaction and "
            "removed before this one could read it; nothing was journaled here: run "
            "your transaction again",
            operation_id=new.operation_id,
            key=new.key,
        )
    engine.check_same(found, call, print_)
    return found
