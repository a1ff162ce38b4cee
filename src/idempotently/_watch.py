"""A resume worker: keeps resuming pending operations as they fall due.

``Session.watch`` runs `watch` (and ``idempotently resume --watch`` runs
``Session.watch``). Each round claims a batch of
due operations (pending, lease expired, ``not_before`` passed) in one journal
transaction (``ClaimDue``: ``FOR UPDATE SKIP LOCKED`` on PostgreSQL, one
``BEGIN IMMEDIATE`` on SQLite), so workers on several hosts never resume one
operation at once; the heartbeat keeps the claimed leases alive while the batch
runs; each operation goes through the same resume flow as ``Session.resume``.
When nothing is due it sleeps ``interval`` seconds.

An operation a round leaves pending with nothing to wait for (the retry budget
ran out, an answer that settles nothing, a request that cannot be sent) is
*parked*: this worker keeps its lease for ``interval`` seconds, doubling each
time it comes back pending (at most `MAX_PARK`), so a dead server or a
refused credential is not hammered in a loop. Nothing is written to the
operation but its lease.

With a reconciler (``--reconcile-lookup``), lookups run on a lane of their own, so
a lookup that trickles never holds back a claimed send.

Stopping (``stop`` set, e.g. by SIGTERM): no new claims and no new operations;
operations in flight finish their current attempt (a retry wait ends the flow,
its attempt already journaled); a lookup in flight reads no more; then every lease
the worker holds is released.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import httpx

from idempotently._commands import ClaimDue, Find, Release, TakeLease
from idempotently._drivers import run
from idempotently._flow._engine import Engine
from idempotently._flow._leases import mark_in_flight, unmark_in_flight
from idempotently._flow._operation import BuildRequest, Held, ResumeResult
from idempotently._flow._reconcile import reconcile_one
from idempotently._flow._resume import resume_operation
from idempotently._journal import Journal
from idempotently._lookup import BoundReconciler
from idempotently._rows import Operation

logger = logging.getLogger("idempotently.watch")

MAX_WATCH_INTERVAL = 100 * 366 * 86400.0
"""The longest wait a worker is given: a century, as the command line's durations."""
BATCH_PER_WORKER = 4
"""A round claims up to ``concurrency * BATCH_PER_WORKER`` operations."""
MAX_PARK = 300.0
"""The longest an operation left pending waits before this worker tries it again."""


def check_watch_arguments(*, stop: object, interval: object) -> None:
    """A worker's ``stop`` and ``interval``, checked before it claims anything."""
    if not isinstance(stop, threading.Event):
        raise TypeError(
            f"stop must be a threading.Event (set it to stop the worker), not {type(stop).__name__}"
        )
    if isinstance(interval, bool) or not isinstance(interval, (int, float)):
        raise TypeError(f"interval must be a number of seconds, not {type(interval).__name__}")
    if not 0 < interval <= MAX_WATCH_INTERVAL:  # NaN, -0.0 and 10**400 fail too
        raise ValueError(
            f"interval must be a number of seconds above 0, at most {MAX_WATCH_INTERVAL:g} "
            f"(a century), not {str(interval)[:40]}"
        )


class _Stopping(Exception):
    """Raised by the worker's sleep once it is told to stop: ends a flow that waits to retry."""


@attrs.frozen
class WatchBatch:
    """One round of a resume worker (`Session.watch`'s ``on_batch``)."""

    number: int
    """The round's number, from 1."""
    claimed: int
    """How many due operations it claimed."""
    results: tuple[ResumeResult, ...]
    """What became of each operation it resumed, in completion order."""
    elapsed: float
    """Seconds the round took."""

    def actions(self) -> dict[str, int]:
        return dict(sorted(Counter(result.action for result in self.results).items()))


@attrs.define
class WatchSummary:
    """What a resume worker did until it stopped (`Session.watch`)."""

    owner: str
    """The worker's lease owner (``host_id:pid:token``)."""
    batches: int = 0
    """Rounds that claimed something."""
    operations: int = 0
    """Results reported (`ResumeResult`), lookups included."""
    actions: Counter[str] = attrs.Factory(Counter)
    """Those results counted by action."""
    released: int = 0
    """Claimed operations it never started, whose leases it gave back."""


def watch(
    engine: Engine,
    store: Journal,
    build: BuildRequest,
    *,
    send: Callable[[httpx.Request], httpx.Response],
    stop: threading.Event,
    interval: float,
    concurrency: int,
    base_url: str | None = None,
    on_result: Callable[[ResumeResult], object] | None = None,
    on_batch: Callable[[WatchBatch], object] | None = None,
    pending_left: Callable[[], int] | None = None,
    reconcile: BoundReconciler | None = None,
) -> WatchSummary:
    """Resume due operations until ``stop`` is set; then release every lease and return.

    ``on_result`` is called for each operation as soon as it is known (from worker
    threads, one at a time); ``on_batch`` after each round that claimed something.
    A journal error ends the worker (after releasing what it can) and is raised.
    ``pending_left`` (how many operations are pending now) is logged with each batch.
    With ``reconcile`` (a reconciler bound to the worker's client), a lane of its own (a
    thread) hands it the needs_reconcile operations whose lookup backoff has passed, each
    ``interval`` and at once when a round ends one needs_reconcile: a lookup, however
    slow within its bounds, never holds back the sends the worker claimed, and a
    stopping worker does not wait for one (a lookup is a read).
    """
    owner = engine.new_owner()
    summary = WatchSummary(owner)
    heartbeat = store._heartbeat
    parked: dict[str, int] = {}  # operation id -> rounds it came back pending in a row
    parked_now: set[str] = set()  # operations this worker holds a parking lease on
    # Rows it cannot decode (`Operation.damaged`), reported once: claimed again each time
    # their lease runs out, they are held again without a word.
    damaged: set[str] = set()
    report_lock = threading.Lock()

    def report(result: ResumeResult) -> None:
        with report_lock:
            summary.operations += 1
            summary.actions[result.action] += 1
            if on_result is not None:
                on_result(result)

    def sleep(seconds: float) -> None:
        if stop.wait(seconds):
            raise _Stopping

    mark_in_flight(owner)  # this process's callers see the worker's leases as live
    lane = (
        None
        if reconcile is None
        else _LookupLane(
            engine,
            store,
            build,
            # A stopping worker's lookup reads no more: a lookup is a read, nothing to finish.
            attrs.evolve(reconcile, bounds=attrs.evolve(reconcile.bounds, stopped=stop.is_set)),
            send,
            sleep,
            report,
            stop,
            interval,
        )
    )
    logger.info(
        "resume worker %s started",
        owner,
        extra=_event("watch_started", owner=owner, concurrency=concurrency, interval=interval),
    )
    try:
        if lane is not None:
            lane.start()
        while not stop.is_set():
            if lane is not None:
                lane.check()
            now = engine.clock()
            claimed: list[Operation] = store._execute(
                ClaimDue(owner, now, now + engine.lease_duration, concurrency * BATCH_PER_WORKER)
            )
            parked_now.difference_update(operation.operation_id for operation in claimed)
            for operation in claimed:
                if operation.damaged is not None:
                    parked_now.add(
                        operation.operation_id
                    )  # its claim's lease, given back at the end
            claimed = [
                operation
                for operation in claimed
                if operation.damaged is None or operation.operation_id not in damaged
            ]
            damaged.update(o.operation_id for o in claimed if o.damaged is not None)
            if not claimed:
                stop.wait(interval)
                continue
            started = time.monotonic()
            summary.batches += 1
            logger.info(
                "batch %d: claimed %d operation(s)",
                summary.batches,
                len(claimed),
                extra=_event(
                    "claimed",
                    batch=summary.batches,
                    claimed=len(claimed),
                    operation_ids=[operation.operation_id for operation in claimed],
                ),
            )
            results = _run_batch(
                engine,
                store,
                build,
                claimed,
                owner=owner,
                send=send,
                sleep=sleep,
                stop=stop,
                concurrency=concurrency,
                base_url=base_url,
                report=report,
                heartbeat_add=heartbeat.add,
                heartbeat_remove=heartbeat.remove,
                released=summary,
            )
            if lane is not None and any(result.status == "needs_reconcile" for result in results):
                lane.wake.set()  # looked up at once, by the lane, not by a sender
            for result in results:
                if result.operation_id in damaged:
                    continue  # held by its claim's lease; reading it again would raise
                if result.status == "pending" and result.action not in ("leased", "waiting"):
                    rounds = parked.get(result.operation_id, 0)
                    if _park(engine, store, result, owner, min(MAX_PARK, interval * 2**rounds)):
                        parked[result.operation_id] = rounds + 1
                        parked_now.add(result.operation_id)
                else:
                    parked.pop(result.operation_id, None)
            batch = WatchBatch(
                summary.batches, len(claimed), tuple(results), time.monotonic() - started
            )
            logger.info(
                "batch %d: %d claimed, %d resumed",
                batch.number,
                batch.claimed,
                len(batch.results),
                extra=_event(
                    "batch",
                    batch=batch.number,
                    claimed=batch.claimed,
                    resumed=len(batch.results),
                    actions=batch.actions(),
                    elapsed=round(batch.elapsed, 3),
                    **({} if pending_left is None else {"pending_left": pending_left()}),
                ),
            )
            if on_batch is not None:
                on_batch(batch)
    finally:
        try:
            if lane is not None:
                lane.stop()
            for operation_id in sorted(parked_now):
                store._execute(Release(operation_id, owner))
        finally:
            unmark_in_flight(owner)
        logger.info(
            "resume worker %s stopped",
            owner,
            extra=_event(
                "watch_stopped",
                owner=owner,
                batches=summary.batches,
                operations=summary.operations,
                released=summary.released,
            ),
        )
    return summary


def _run_batch(
    engine: Engine,
    store: Journal,
    build: BuildRequest,
    claimed: list[Operation],
    *,
    owner: str,
    send: Callable[[httpx.Request], httpx.Response],
    sleep: Callable[[float], None],
    stop: threading.Event,
    concurrency: int,
    base_url: str | None,
    report: Callable[[ResumeResult], None],
    heartbeat_add: Callable[[Any], None],
    heartbeat_remove: Callable[[Any], None],
    released: WatchSummary,
) -> list[ResumeResult]:
    """Resume the claimed operations, ``concurrency`` at a time; stop starting new ones
    once ``stop`` is set and give their leases back. Results in completion order."""
    leases = [engine.lease(operation.operation_id, owner) for operation in claimed]
    for lease in leases:
        heartbeat_add(lease)  # queued operations keep their claim until their turn
    queue = iter(claimed)
    lock = threading.Lock()
    results: list[ResumeResult] = []
    errors: list[BaseException] = []
    unstarted: list[Operation] = []

    def worker() -> None:
        while True:
            with lock:
                operation = next(queue, None)
                if operation is None:
                    return
                if stop.is_set() or errors:
                    unstarted.append(operation)
                    continue
            held = Held()
            try:
                result = run(
                    resume_operation(
                        engine,
                        operation,
                        build,
                        held,
                        dry_run=False,
                        base_url=base_url,
                        reconciling=False,  # the lookup lane's job: a send never waits on one
                        claimed_by=owner,
                    ),
                    held,
                    store,
                    send=send,
                    sleep=sleep,
                    report=report,
                )
            except _Stopping:
                result = ResumeResult.of(
                    operation,
                    "pending",
                    "still_pending",
                    "the worker stopped while this operation waited to retry (its attempts "
                    "are journaled); the next worker resumes it",
                )
                report(result)
            except BaseException as error:
                with lock:
                    errors.append(error)
                return
            with lock:
                results.append(result)

    try:
        threads = [
            threading.Thread(target=worker, name=f"idempotently-watch-{n}", daemon=True)
            for n in range(min(concurrency, len(claimed)))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for lease in leases:
            heartbeat_remove(lease)
        for operation in unstarted:
            store._execute(Release(operation.operation_id, owner))
        released.released += len(unstarted)
    if errors:
        raise errors[0]
    return results


LANE_STOP_WAIT = 0.5
"""How long a stopping worker waits for its lookup lane to end: a lookup is a read, so
one still reading (an answer stalled within its read timeout) is left behind."""


class _LookupLane:
    """The worker's lookups, on a thread of their own: a lookup that trickles within its
    time limit never holds back the sends the worker claimed, nor its stop. It hands the
    due needs_reconcile operations to the reconciler each ``interval`` (at once when a
    round ends one needs_reconcile); a stopping worker's lookup reads no more (the
    reconciler is bound with the stop), and one stalled in a read is left behind."""

    def __init__(
        self,
        engine: Engine,
        store: Journal,
        build: BuildRequest,
        reconcile: BoundReconciler,
        send: Callable[[httpx.Request], httpx.Response],
        sleep: Callable[[float], None],
        report: Callable[[ResumeResult], None],
        stopping: threading.Event,
        interval: float,
    ) -> None:
        self.wake = threading.Event()
        self._stopping = stopping
        self._errors: list[BaseException] = []
        self._ended = threading.Event()

        damaged: set[str] = set()  # rows it cannot decode, reported once

        def lane() -> None:
            try:
                while not stopping.is_set():
                    self.wake.clear()
                    if not _reconcile_due(
                        engine, store, build, reconcile, send, sleep, report, stopping, damaged
                    ):
                        self._idle(interval)
            except _Stopping:
                pass
            except BaseException as error:  # raised by the worker's loop, as its own
                self._errors.append(error)
            finally:
                self._ended.set()

        self._thread = threading.Thread(target=lane, name="idempotently-watch-lookups", daemon=True)

    def _idle(self, interval: float) -> None:
        ends = time.monotonic() + interval
        while not self._stopping.is_set() and not self.wake.is_set():
            left = ends - time.monotonic()
            if left <= 0:
                return
            self.wake.wait(min(left, 0.1))  # a stop, set elsewhere, is seen within 0.1 s

    def start(self) -> None:
        self._thread.start()

    def check(self) -> None:
        """Raise what ended the lane (a journal error ends the worker)."""
        if self._errors:
            raise self._errors[0]

    def stop(self) -> None:
        self.wake.set()
        self._ended.wait(LANE_STOP_WAIT)


RECONCILE_BATCH = 1000
"""A round looks at most this many needs_reconcile operations, oldest first."""


def _reconcile_due(
    engine: Engine,
    store: Journal,
    build: BuildRequest,
    reconcile: BoundReconciler,
    send: Callable[[httpx.Request], httpx.Response],
    sleep: Callable[[float], None],
    report: Callable[[ResumeResult], None],
    stop: threading.Event,
    damaged: set[str],
) -> int:
    """Hand the needs_reconcile operations whose lookup backoff has passed to the
    reconciler, one after the other; how many it settled. No lease is needed:
    each verdict is a compare-and-swap on the row it read, so two workers looking one
    operation up at once settle it once."""
    now = engine.clock()
    due = [
        operation
        for operation in store.operations(
            status="needs_reconcile", newest_first=False, limit=RECONCILE_BATCH
        )
        if (operation.lookup_after is None or operation.lookup_after <= now)
        and operation.operation_id not in damaged
    ]
    damaged.update(operation.operation_id for operation in due if operation.damaged is not None)
    settled = 0
    for operation in due:
        if stop.is_set():
            break
        result = run(
            reconcile_one(
                engine,
                operation,
                ResumeResult.of(operation, operation.status, "needs_reconcile", operation.reason),
            ),
            Held(),
            store,
            send=send,
            sleep=sleep,
            reconcile=reconcile,
        )
        report(result)
        settled += result.action == "reconciled"
    return settled


def _park(engine: Engine, store: Journal, result: ResumeResult, owner: str, seconds: float) -> bool:
    """Hold a lease on an operation left pending, so it is tried again in ``seconds``."""
    operation: Operation | None = store._execute(Find(result.operation_id, None))
    if operation is None or operation.status != "pending" or operation.lease_owner is not None:
        return False
    now = engine.clock()
    return bool(store._execute(TakeLease(operation, owner, now + seconds, now)))


def _event(event: str, **fields: Any) -> dict[str, Any]:
    return {"idempotently": {"event": event, **fields}}
