"""The retry budget: a process's retries to one origin are bounded, whoever sends them.

Against a dead server every operation would otherwise retry on its own, from every
thread, task and resume at once. The budget's arithmetic is checked on the ledger
alone (an injected clock); its effect through Session, AsyncSession, Transport and
resume with scripted answers (no sleeps: the clock moves when the flow sleeps); and
once end to end against a real server on loopback.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

import idempotently
from idempotently._budget import BUDGETS, WINDOW, RetryBudgets, origin_of
from tests.scripted_server import Answer, ScriptedApp
from tests.support import FakeTime
from tests.test_otel import Telemetry

ORIGIN = "https://api.example.test:443"
URL = "https://api.example.test/v1/charges"
# One retry in reserve per 10 s window, none earned by first attempts.
ONE_RETRY = idempotently.RetryBudget(ratio=0.0, min_per_second=0.1)
POLICY = idempotently.RetryPolicy(max_attempts=5, initial_backoff=0.01, max_backoff=0.01)


def dead_server() -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """A server that answers 503 to everything, and the requests it got."""
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(503)

    return httpx.MockTransport(handler), sent


# -- the arithmetic ------------------------------------------------------------------


def test_the_reserve_allows_min_per_second_times_the_window() -> None:
    """Without first attempts, a window allows min_per_second x 10 retries, no more."""
    budgets = RetryBudgets()
    budget = idempotently.RetryBudget(ratio=0.1, min_per_second=2.0)
    allowed = [budgets.try_retry(budget, ORIGIN, 1000.0) for _ in range(25)]
    assert [True] * 20 + [False] * 5 == allowed
    assert {ORIGIN: 5} == budgets.refusals


def test_first_attempts_earn_ratio_retries_each() -> None:
    """1,000 first attempts with ratio 0.1 and no reserve allow 100 retries."""
    budgets = RetryBudgets()
    budget = idempotently.RetryBudget(ratio=0.1, min_per_second=0.0)
    for _ in range(1000):
        budgets.first_attempt(ORIGIN, 1000.0)
    allowed = sum(budgets.try_retry(budget, ORIGIN, 1000.5) for _ in range(150))
    assert 100 == allowed


def test_the_default_budget_allows_1200_retries_for_1000_operations() -> None:
    """The documented arithmetic: 0.1 x 1000 + 10 x 10 = 200 retries in one window."""
    budgets = RetryBudgets()
    budget = idempotently.RetryBudget()
    for _ in range(1000):
        budgets.first_attempt(ORIGIN, 1000.0)
    assert 200 == sum(budgets.try_retry(budget, ORIGIN, 1000.0) for _ in range(5000))


def test_the_window_slides_after_ten_seconds() -> None:
    """Retries spent more than 10 s ago no longer count."""
    budgets = RetryBudgets()
    assert budgets.try_retry(ONE_RETRY, ORIGIN, 1000.0)
    assert not budgets.try_retry(ONE_RETRY, ORIGIN, 1000.0 + WINDOW - 1)
    assert budgets.try_retry(ONE_RETRY, ORIGIN, 1000.0 + WINDOW)


def test_origins_have_their_own_budgets() -> None:
    """One origin's spent budget does not refuse another's retries."""
    budgets = RetryBudgets()
    assert budgets.try_retry(ONE_RETRY, ORIGIN, 1000.0)
    assert not budgets.try_retry(ONE_RETRY, ORIGIN, 1000.0)
    assert budgets.try_retry(ONE_RETRY, "https://other.example.test:443", 1000.0)


def test_an_origin_is_scheme_host_and_port() -> None:
    """The default port is spelt out: https://h and https://h:443 are one origin."""
    assert origin_of(httpx.URL("https://h.test/a?b=1")) == origin_of(
        httpx.URL("https://h.test:443/c")
    )
    assert "http://127.0.0.1:8080" == origin_of(httpx.URL("http://127.0.0.1:8080/x"))
    assert origin_of(httpx.URL("http://h.test/")) != origin_of(httpx.URL("https://h.test/"))


@pytest.mark.parametrize(
    ("field", "value"), [("ratio", -0.1), ("min_per_second", float("inf")), ("ratio", "x")]
)
def test_a_budget_refuses_bad_numbers(field: str, value: Any) -> None:
    """A negative or infinite number is a ValueError naming the field."""
    with pytest.raises(ValueError, match=field if value != "x" else "could not convert"):
        idempotently.RetryBudget(**{field: value})


def test_the_budget_is_on_by_default() -> None:
    """RetryPolicy() carries RetryBudget(ratio=0.1, min_per_second=10.0)."""
    assert idempotently.RetryBudget(0.1, 10.0) == idempotently.RetryPolicy().budget


def test_only_a_retry_budget_or_none_is_a_budget() -> None:
    """budget= takes a RetryBudget or None."""
    with pytest.raises(TypeError):
        idempotently.RetryPolicy(budget=0.1)  # type: ignore[arg-type]


# -- through a Session -----------------------------------------------------------------


def session(
    tmp_path: Path, fake_time: FakeTime, transport: httpx.BaseTransport, **options: Any
) -> idempotently.Session:
    options.setdefault("policy", POLICY.__class__(**{**_fields(POLICY), "budget": ONE_RETRY}))
    return idempotently.Session(
        tmp_path / "journal.db",
        transport=transport,
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        **options,
    )


def _fields(policy: idempotently.RetryPolicy) -> dict[str, Any]:
    return {
        "max_attempts": policy.max_attempts,
        "initial_backoff": policy.initial_backoff,
        "max_backoff": policy.max_backoff,
    }


def test_a_refused_retry_is_not_sent_and_the_operation_stays_pending(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """With one retry in reserve, a second operation against a dead origin sends only its
    first attempt; RetryBudgetError names the origin; the operation is pending."""
    transport, sent = dead_server()
    with session(tmp_path, fake_time, transport) as s:
        with pytest.raises(idempotently.RetryBudgetError) as first:
            s.post(URL, json={"n": 1}, operation_id="op-1")
        assert 2 == len(sent)  # the first attempt and the one retry in reserve
        with pytest.raises(idempotently.RetryBudgetError) as second:
            s.post(URL, json={"n": 2}, operation_id="op-2")
        assert 3 == len(sent)  # a first attempt only
        operation = s.journal.operation("op-2")
    assert isinstance(second.value, idempotently.OperationPendingError)
    assert (ORIGIN, ORIGIN) == (first.value.origin, second.value.origin)
    assert ("op-2", operation.key) == (second.value.operation_id, second.value.key)
    assert "retry budget of https://api.example.test:443 is spent" in str(second.value)
    assert "pending" == operation.status
    assert 1 == len(operation.attempts)
    assert 503 == second.value.response.status_code  # type: ignore[union-attr]


def test_without_a_budget_every_allowed_retry_is_sent(tmp_path: Path, fake_time: FakeTime) -> None:
    """budget=None: max_attempts decides alone."""
    transport, sent = dead_server()
    policy = idempotently.RetryPolicy(**_fields(POLICY), budget=None)
    with session(tmp_path, fake_time, transport, policy=policy) as s:
        for n in range(3):
            with pytest.raises(idempotently.OperationPendingError) as raised:
                s.post(URL, json={"n": n}, operation_id=f"op-{n}")
            assert not isinstance(raised.value, idempotently.RetryBudgetError)
    assert 3 * POLICY.max_attempts == len(sent)


def test_the_budget_refusal_is_an_event_naming_the_origin(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """Hooks receive RetryRefused with the operation, its key, the attempt and the origin."""
    transport, _ = dead_server()
    events: list[idempotently.Event] = []
    with (
        session(tmp_path, fake_time, transport, hooks=[events.append]) as s,
        pytest.raises(idempotently.RetryBudgetError) as raised,
    ):
        s.post(URL, json={}, operation_id="op-1")
    [refusal] = [event for event in events if isinstance(event, idempotently.RetryRefused)]
    assert ("op-1", raised.value.key, 2, ORIGIN) == (
        refusal.operation_id,
        refusal.key,
        refusal.attempt,
        refusal.origin,
    )
    assert "pending" == events[-1].status  # type: ignore[union-attr]


def test_threads_share_one_budget(tmp_path: Path) -> None:
    """Eight threads on one dead origin send, between them, their first attempts plus the
    budget's reserve, never more (real clock: the whole run is within one window)."""
    transport, sent = dead_server()
    budget = idempotently.RetryBudget(ratio=0.0, min_per_second=0.5)  # 5 retries
    policy = idempotently.RetryPolicy(
        max_attempts=5, initial_backoff=0.0, max_backoff=0.0, budget=budget
    )
    errors: list[BaseException] = []
    with idempotently.Session(tmp_path / "journal.db", transport=transport, policy=policy) as s:

        def work(n: int) -> None:
            try:
                s.post(URL, json={"n": n}, operation_id=f"op-{n}")
            except idempotently.OperationPendingError as error:
                errors.append(error)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert {"pending": 8} == {k: v for k, v in s.journal.counts().items() if v}
    assert 8 + 5 == len(sent)
    assert 8 == len(errors)
    assert 5 <= sum(isinstance(error, idempotently.RetryBudgetError) for error in errors)


@pytest.mark.anyio
async def test_async_tasks_share_the_budget_with_threads(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """An AsyncSession's tasks (asyncio and trio) spend the same process budget a sync
    Session spent: its retry is refused at once."""
    transport, sent = dead_server()
    policy = idempotently.RetryPolicy(**_fields(POLICY), budget=ONE_RETRY)
    with (
        session(tmp_path, fake_time, transport, policy=policy) as s,
        pytest.raises(idempotently.RetryBudgetError),
    ):
        s.post(URL, json={"n": 0}, operation_id="sync")
    assert 2 == len(sent)

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(503)

    errors: list[BaseException] = []
    async with idempotently.AsyncSession(
        tmp_path / "async.db",
        transport=httpx.MockTransport(handler),
        policy=policy,
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
    ) as a:

        async def work(n: int) -> None:
            try:
                await a.post(URL, json={"n": n}, operation_id=f"task-{n}")
            except idempotently.RetryBudgetError as error:
                errors.append(error)

        async with anyio.create_task_group() as group:
            for n in range(4):
                group.start_soon(work, n)
    assert 2 + 4 == len(sent)  # first attempts only
    assert 4 == len(errors)


def test_a_transport_spends_the_same_budget(tmp_path: Path, fake_time: FakeTime) -> None:
    """A Transport (an SDK's client) and a Session of one process share the origin's budget."""
    transport, sent = dead_server()
    policy = idempotently.RetryPolicy(**_fields(POLICY), budget=ONE_RETRY)
    with (
        session(tmp_path, fake_time, transport, policy=policy) as s,
        pytest.raises(idempotently.RetryBudgetError),
    ):
        s.post(URL, json={}, operation_id="session")
    wrapped = idempotently.Transport(
        tmp_path / "sdk.db",
        transport=transport,
        policy=policy,
        clock=fake_time.clock,
        sleep=fake_time.sleep,
    )
    with httpx.Client(transport=wrapped) as client, pytest.raises(idempotently.RetryBudgetError):
        client.post(URL, json={})
    assert 3 == len(sent)


def test_a_loopback_server_sees_no_more_than_the_budget(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """End to end on a real socket: twenty operations against an origin answering 503
    send twenty first attempts and the budget's reserve of retries, not a hundred."""
    app, url = scripted
    app.answer(*[Answer(status=503)] * 200)
    budget = idempotently.RetryBudget(ratio=0.1, min_per_second=0.3)  # 0.1 x 20 + 3 = 5
    policy = idempotently.RetryPolicy(
        max_attempts=5, initial_backoff=0.0, max_backoff=0.0, budget=budget
    )
    with idempotently.Session(tmp_path / "journal.db", policy=policy) as s:
        refused = 0
        for n in range(20):
            try:
                s.post(f"{url}/charges", json={"n": n}, operation_id=f"op-{n}")
            except idempotently.RetryBudgetError:
                refused += 1
            except idempotently.OperationPendingError:
                pass
        assert 20 == s.journal.counts()["pending"]
    assert 20 + 5 == len(app.arrivals)
    assert refused >= 15
    assert BUDGETS.refusals[origin_of(httpx.URL(url))] == refused


@pytest.fixture
def telemetry() -> Telemetry:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from idempotently.otel import OpenTelemetryHook

    spans, reader, tracer_provider = (
        InMemorySpanExporter(),
        InMemoryMetricReader(),
        TracerProvider(),
    )
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    hook = OpenTelemetryHook(
        tracer_provider=tracer_provider, meter_provider=MeterProvider(metric_readers=[reader])
    )
    return Telemetry(hook, spans, reader, tracer_provider)


def test_refusals_are_an_opentelemetry_metric_by_origin(
    tmp_path: Path, fake_time: FakeTime, telemetry: Telemetry
) -> None:
    """idempotently.retry_budget.refusals counts each refused retry with its origin."""
    transport, _ = dead_server()
    with session(tmp_path, fake_time, transport, hooks=[telemetry.hook]) as s:
        for n in range(2):
            with pytest.raises(idempotently.RetryBudgetError):
                s.post(URL, json={"n": n}, operation_id=f"op-{n}")
    assert [({"idempotently.origin": ORIGIN}, 2)] == telemetry.points()[
        "idempotently.retry_budget.refusals"
    ]
