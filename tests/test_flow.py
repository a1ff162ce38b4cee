"""The operation flow on its own: no SQLite, no network, no driver.

``Engine.call`` and ``Engine.resume`` are generators (sans-I/O, like httpx's
``auth_flow``): these tests run them by hand against a journal kept in a dict
and a scripted server, and read the commands they yield. What holds here holds
for every driver, since the drivers only carry the commands out.
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import httpx
import pytest

import idempotently
from idempotently import profiles
from idempotently._answers import read_answer
from idempotently._commands import Insert, Pauses, ReadAnswer, Record, Release, Send, Sleep
from idempotently._commands_rare import Command, Report
from idempotently._flow._engine import _FIRST_POLL, _MAX_POLL, Engine
from idempotently._flow._operation import Call, Flow, Held, ResumeResult
from idempotently._flow._resume import resume
from idempotently._journal import Operation
from idempotently._vocabulary import Status
from tests.drivers import Step, answer, fail
from tests.memory_store import MemoryStore
from tests.support import URL, FakeTime

CHARGE = {"amount": 1000, "currency": "usd"}
LEASE = 60.0
# rand() = 0.5 and an initial backoff of 1 s: the first retry waits 0.5 s, the second 1 s.
POLICY = idempotently.RetryPolicy(initial_backoff=1.0, max_backoff=8.0)
ELSEWHERE = "another-host.example:4242:0123456789ab"


@attrs.define
class Run:
    """Carries a flow's commands out by hand, and keeps what it yielded.

    ``leases`` holds, for each command, the lease the flow held when it yielded it.
    """

    store: MemoryStore
    time: FakeTime
    steps: list[Step] = attrs.field(factory=list)
    commands: list[Command] = attrs.field(factory=list)
    leases: list[tuple[str, str] | None] = attrs.field(factory=list)

    def __call__(self, flow: Flow[Any], held: Held, *, until: type | None = None) -> Any:
        """Run ``flow`` to its end (or until it yields an ``until`` command)."""
        reply: Any = None
        while True:
            try:
                command = flow.send(reply)
            except StopIteration as stop:
                return stop.value
            if isinstance(command, Pauses):
                # The journal's origin pauses, read at most once a second per engine
                # (test_origin_pauses): not part of the sequences these tests read.
                reply = self.store._execute(command)
                continue
            self.commands.append(command)
            self.leases.append(held.lease)
            if until is not None and isinstance(command, until):
                return command
            if isinstance(command, Send):
                try:
                    reply = self.steps.pop(0)(command.request)
                    if command.read is not None:
                        read_answer(*command.read(reply))
                except httpx.HTTPError as error:
                    reply = error
            elif isinstance(command, ReadAnswer):
                read_answer(command.body, command.limit, command.until, command.clock)
                reply = None
            elif isinstance(command, Sleep):
                self.time.sleep(command.seconds)
                reply = None
            elif isinstance(command, Report):
                reply = None
            else:
                reply = self.store._execute(command)  # type: ignore[arg-type]

    def of(self, kind: type) -> list[Any]:
        return [command for command in self.commands if isinstance(command, kind)]

    def kinds(self) -> list[str]:
        return [type(command).__name__ for command in self.commands]


def build(
    method: str, url: httpx.URL, headers: list[tuple[bytes, bytes]], body: bytes
) -> httpx.Request:
    return httpx.Request(method, url, headers=headers, content=body)


def charge(operation_id: str | None = "op-1", **options: Any) -> Call:
    request = httpx.Request("POST", URL, json=CHARGE, headers={"Authorization": "Bearer sk_t"})
    return Call(request, operation_id=operation_id, **options)


def engine(time: FakeTime, **options: Any) -> Engine:
    options.setdefault("policy", POLICY)
    return Engine(
        profile=profiles.GENERIC,
        clock=time.clock,
        rand=lambda: 0.5,
        lease_duration=LEASE,
        **options,
    )


@pytest.fixture
def store() -> MemoryStore:
    """An empty journal in a dict."""
    return MemoryStore()


def test_the_key_is_journaled_before_the_first_byte(
    store: MemoryStore, fake_time: FakeTime
) -> None:
    """The first journal write of a new operation is the Insert of its key, before any Send."""
    journaled: list[Operation | None] = []

    def server(request: httpx.Request) -> httpx.Response:
        journaled.append(store.find(None, request.headers["Idempotency-Key"]))
        return httpx.Response(201)

    run = Run(store, fake_time, [server])
    response = run(engine(fake_time).call(charge(), build, Held()), Held())
    insert = run.of(Insert)[0]
    assert ["Insert", "Send", "Record"] == run.kinds()  # insert first: no lookup
    assert insert.new.key == run.of(Send)[0].request.headers["Idempotency-Key"]
    assert ["op-1"] == [operation.operation_id for operation in journaled if operation]
    assert 201 == response.status_code


def test_an_anonymous_call_inserts_before_sending_without_a_lookup(
    store: MemoryStore, fake_time: FakeTime
) -> None:
    """With no operation id or key there is nothing to find: Insert, then Send."""
    run = Run(store, fake_time, [answer(201)])
    run(engine(fake_time).call(charge(operation_id=None), build, Held()), Held())
    assert ["Insert", "Send", "Record"] == run.kinds()


def test_every_send_carries_the_journaled_key_and_bytes(
    store: MemoryStore, fake_time: FakeTime
) -> None:
    """Every attempt of one operation sends the same key header and the same body bytes."""
    run = Run(
        store,
        fake_time,
        [fail(httpx.ConnectError), fail(httpx.ReadTimeout), answer(503), answer(201)],
    )
    run(engine(fake_time).call(charge(), build, Held()), Held())
    new = run.of(Insert)[0].new
    sends = run.of(Send)
    assert 4 == len(sends)
    assert {(new.key, new.request_body)} == {
        (send.request.headers["Idempotency-Key"], send.request.content) for send in sends
    }
    assert 1 == len({tuple(send.request.headers.raw) for send in sends})


def test_a_retry_records_then_sleeps_then_sends(store: MemoryStore, fake_time: FakeTime) -> None:
    """After a retryable answer the flow journals the attempt, sleeps the decided wait, resends."""
    run = Run(store, fake_time, [answer(503), answer(503), answer(201)])
    run(engine(fake_time).call(charge(), build, Held()), Held())
    records = run.of(Record)
    assert ["Insert"] + ["Send", "Record", "Sleep"] * 2 + ["Send", "Record"] == run.kinds()
    assert [0.5, 1.0] == [sleep.seconds for sleep in run.of(Sleep)]
    assert [0.5, 1.0, None] == [record.record.wait for record in records]
    assert ["pending", "pending", "succeeded"] == [record.record.status for record in records]


@pytest.mark.parametrize(
    ("steps", "options", "status"),
    [
        ([answer(201)], {}, "succeeded"),
        ([answer(422)], {}, "failed"),
        ([answer(500, headers={"Idempotent-Replayed": "true"})], {}, "needs_reconcile"),
        ([fail(httpx.ReadTimeout), answer(404)], {}, "pending"),
        ([answer(503, headers={"Retry-After": "3600"})], {}, "pending"),
        ([fail(httpx.ReadTimeout)], {"delivery": "at_most_once"}, "abandoned"),
    ],
    ids=["201", "422", "replayed-500", "timeout-then-404", "retry-after-3600", "at-most-once"],
)
def test_the_final_record_carries_the_operations_status(
    store: MemoryStore,
    fake_time: FakeTime,
    steps: list[Step],
    options: dict[str, Any],
    status: Status,
) -> None:
    """The last Record of a call writes the status the answer means, in the same transaction."""
    run = Run(store, fake_time, list(steps))
    with contextlib.suppress(idempotently.IdempotentlyError):
        run(engine(fake_time).call(charge(**options), build, Held()), Held())
    assert status == run.of(Record)[-1].record.status
    assert status == store.rows["op-1"].status


def test_the_lease_is_held_while_retrying_and_cleared_by_the_terminal_record(
    store: MemoryStore, fake_time: FakeTime
) -> None:
    """The lease is held from the key's write (so a call stopped during it releases it),
    across the sleep; the last Record releases it."""
    held = Held()
    started = fake_time.now
    run = Run(store, fake_time, [answer(503), answer(201)])
    run(engine(fake_time).call(charge(), build, held), held)
    insert = run.of(Insert)[0]
    lease = ("op-1", insert.owner)
    sleep_at = run.commands.index(run.of(Sleep)[0])
    first_record = run.of(Record)[0].record
    assert [lease, lease, lease, lease, lease, lease] == run.leases
    assert lease == run.leases[sleep_at]
    assert started + 0.5 + LEASE == first_record.lease_until
    assert None is held.lease
    assert (None, 0.0) == (store.rows["op-1"].lease_owner, store.rows["op-1"].lease_until)


def test_closing_the_flow_early_leaves_the_lease_for_the_driver(
    store: MemoryStore, fake_time: FakeTime
) -> None:
    """A flow closed mid-flight (cancelled) does not release its lease: the driver does."""
    held = Held()
    flow = engine(fake_time).call(charge(), build, held)
    run = Run(store, fake_time)
    run(flow, held, until=Send)
    flow.close()
    owner = run.of(Insert)[0].owner
    assert ("op-1", owner) == held.lease
    assert owner == store.rows["op-1"].lease_owner
    store._execute(Release(*held.lease))
    assert None is store.rows["op-1"].lease_owner


def test_a_pending_operation_is_leased_before_it_is_sent_again(
    store: MemoryStore, fake_time: FakeTime
) -> None:
    """Calling a pending operation again takes its lease, then sends its journaled key."""
    first = Run(store, fake_time, [fail(httpx.ReadTimeout)])
    with pytest.raises(idempotently.OperationPendingError):
        first(
            engine(fake_time, policy=attrs.evolve(POLICY, max_attempts=1)).call(
                charge(), build, Held()
            ),
            Held(),
        )
    again = Run(store, fake_time, [answer(201)])
    again(engine(fake_time).call(charge(), build, Held()), Held())
    assert ["Insert", "Find", "TakeLease", "Send", "Record"] == again.kinds()
    assert store.rows["op-1"].key == again.of(Send)[0].request.headers["Idempotency-Key"]
    assert "succeeded" == store.rows["op-1"].status


def test_a_call_waits_for_another_hosts_lease_then_raises_in_progress(
    store: MemoryStore, fake_time: FakeTime
) -> None:
    """An operation leased elsewhere is polled (Sleep), never sent, until the deadline."""
    held = Held()
    run = Run(store, fake_time)
    run(engine(fake_time).call(charge(), build, held), held, until=Send)
    store.rows["op-1"] = attrs.evolve(
        store.rows["op-1"], lease_owner=ELSEWHERE, lease_until=fake_time.now + 1000
    )
    deadline = 2.0
    waiting = Run(store, fake_time)
    started = fake_time.now
    with pytest.raises(idempotently.OperationInProgressError) as caught:
        waiting(
            engine(fake_time, policy=attrs.evolve(POLICY, deadline=deadline)).call(
                charge(), build, Held()
            ),
            Held(),
        )
    polls = [sleep.seconds for sleep in waiting.of(Sleep)]
    assert set(waiting.kinds()) == {"Insert", "Find", "Sleep"}
    assert [_FIRST_POLL, 2 * _FIRST_POLL] == polls[:2]
    assert _MAX_POLL == max(polls)
    assert deadline - _MAX_POLL < fake_time.now - started <= deadline
    assert ("op-1", store.rows["op-1"].key) == (caught.value.operation_id, caught.value.key)
    assert ELSEWHERE in str(caught.value)


def test_resume_reports_each_operation_as_soon_as_it_is_known(
    store: MemoryStore, fake_time: FakeTime
) -> None:
    """Resume yields one Report per pending operation, right after its attempts, oldest first."""
    once = attrs.evolve(POLICY, max_attempts=1)
    for operation_id in ("op-1", "op-2"):
        with pytest.raises(idempotently.OperationPendingError):
            Run(store, fake_time, [answer(503)])(
                engine(fake_time, policy=once).call(charge(operation_id), build, Held()), Held()
            )
    run = Run(store, fake_time, [answer(201), answer(409)])
    held = Held()
    results = run(
        resume(
            engine(fake_time, policy=attrs.evolve(POLICY, in_progress_retries=0)),
            build,
            held,
            dry_run=False,
            base_url=None,
            reconciling=False,
        ),
        held,
    )
    reports = run.of(Report)
    # Each operation is sent from the row the queue read: no second read of it.
    assert ["Queue"] + ["TakeLease", "Send", "Record", "Report"] * 2 == run.kinds()
    assert results == [report.result for report in reports]
    assert [("op-1", "succeeded", "succeeded"), ("op-2", "pending", "still_pending")] == [
        (result.operation_id, result.status, result.action) for result in results
    ]
    assert all(isinstance(result, ResumeResult) for result in results)
    assert None is held.lease
