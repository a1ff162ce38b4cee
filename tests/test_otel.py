"""OpenTelemetry through the ``otel`` extra: one span per operation with a child per
attempt, and counters and a histogram, read back with the SDK's in-memory exporters
from calls to a real server on 127.0.0.1."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import idempotently
from idempotently.otel import OpenTelemetryHook
from tests.scripted_server import RESET, Answer, ScriptedApp
from tests.support import FakeTime

Scripted = tuple[ScriptedApp, str]
CHARGE = {"amount": 1000, "currency": "usd"}
REPLAYED = Answer(201, headers=(("Idempotent-Replayed", "true"),))
FLAKY = (Answer(503), RESET, REPLAYED)
"""A 503, a connection reset, then the server's stored 201 for the key."""
POLICY = idempotently.RetryPolicy(initial_backoff=0.5, max_backoff=1.0)


@attrs.define
class Telemetry:
    hook: OpenTelemetryHook
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader
    tracer_provider: TracerProvider

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def points(self) -> dict[str, list[tuple[dict[str, Any], Any]]]:
        """Each metric's data points: (attributes, value), a histogram's value being
        (count, sum)."""
        found: dict[str, list[tuple[dict[str, Any], Any]]] = {}
        data = self.metrics.get_metrics_data()
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        value = (
                            point.value if hasattr(point, "value") else (point.count, point.sum)  # type: ignore[union-attr]
                        )
                        found.setdefault(metric.name, []).append(
                            (dict(point.attributes or {}), value)
                        )
        return found


@pytest.fixture
def telemetry() -> Telemetry:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    hook = OpenTelemetryHook(
        tracer_provider=tracer_provider, meter_provider=MeterProvider(metric_readers=[reader])
    )
    return Telemetry(hook, spans, reader, tracer_provider)


def check_trace(telemetry: Telemetry, caller: ReadableSpan | None) -> None:
    """One operation span, child of ``caller``, with one child per attempt, in order."""
    spans = telemetry.finished()
    [operation] = [span for span in spans if span.name == "idempotently.operation"]
    attempts = [span for span in spans if span.name == "idempotently.attempt"]
    assert operation.context is not None
    if caller is not None:
        assert caller.context is not None and operation.parent is not None
        assert caller.context.span_id == operation.parent.span_id
    assert [operation.context.span_id] * 3 == [
        span.parent.span_id if span.parent else None for span in attempts
    ]
    assert {operation.context.trace_id} == {
        span.context.trace_id for span in attempts if span.context
    }
    key = operation.attributes["idempotently.key"]  # type: ignore[index]
    assert {
        "idempotently.operation_id": "order-1",
        "idempotently.key": key,
        "http.request.method": "POST",
        "idempotently.delivery": "exactly_once",
        "idempotently.resuming": False,
        "idempotently.status": "succeeded",
        "idempotently.action": "succeed",
        "idempotently.attempt": 3,
        "idempotently.replayed": True,
        "http.response.status_code": 201,
    } == dict(operation.attributes or {})
    assert StatusCode.UNSET == operation.status.status_code
    assert [
        (1, "answered", 503, False, StatusCode.ERROR),
        (2, "maybe_delivered", None, False, StatusCode.ERROR),
        (3, "answered", 201, True, StatusCode.UNSET),
    ] == [
        (
            span.attributes["idempotently.attempt"],  # type: ignore[index]
            span.attributes["idempotently.outcome"],  # type: ignore[index]
            span.attributes.get("http.response.status_code"),  # type: ignore[union-attr]
            span.attributes["idempotently.replayed"],  # type: ignore[index]
            span.status.status_code,
        )
        for span in attempts
    ]
    assert {("order-1", key)} == {
        (span.attributes["idempotently.operation_id"], span.attributes["idempotently.key"])  # type: ignore[index]
        for span in attempts
    }


def check_metrics(telemetry: Telemetry, fake_time: FakeTime) -> None:
    points = telemetry.points()
    assert sorted(
        [
            ({"idempotently.outcome": "answered", "idempotently.replayed": False,
              "http.response.status_code": 503}, 1),
            ({"idempotently.outcome": "maybe_delivered", "idempotently.replayed": False}, 1),
            ({"idempotently.outcome": "answered", "idempotently.replayed": True,
              "http.response.status_code": 201}, 1),
        ],
        key=repr,
    ) == sorted(points["idempotently.attempts"], key=repr)  # fmt: skip
    assert [({}, 2)] == points["idempotently.retries"]
    assert [({}, 1)] == points["idempotently.replays"]
    assert [({"idempotently.status": "succeeded"}, 1)] == points["idempotently.operations"]
    [(attributes, (count, total))] = points["idempotently.operation.duration"]
    assert ({"idempotently.status": "succeeded"}, 1) == (attributes, count)
    assert pytest.approx(sum(fake_time.sleeps), abs=1e-6) == total  # epoch-time rounding


def test_a_session_call_makes_an_operation_span_with_a_child_per_attempt(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime, telemetry: Telemetry
) -> None:
    """Session: the operation span is a child of the caller's span, each attempt a child
    of it with its number, outcome, status and replay flag; counters and the duration
    histogram count what happened."""
    app, url = scripted
    app.answer(*FLAKY)
    tracer = telemetry.tracer_provider.get_tracer("checkout")
    with (
        idempotently.Session(
            tmp_path / "journal.db",
            base_url=url,
            policy=POLICY,
            clock=fake_time.clock,
            sleep=fake_time.sleep,
            hooks=[telemetry.hook],
        ) as session,
        tracer.start_as_current_span("checkout"),
    ):
        response = session.post("/v1/charges", json=CHARGE, operation_id="order-1")
    assert 201 == response.status_code
    [caller] = [span for span in telemetry.finished() if span.name == "checkout"]
    check_trace(telemetry, caller)
    check_metrics(telemetry, fake_time)


@pytest.mark.anyio
async def test_an_async_session_call_makes_the_same_spans_and_metrics(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime, telemetry: Telemetry
) -> None:
    """AsyncSession on asyncio and trio: the same spans (under the task's current span)
    and the same metrics."""
    app, url = scripted
    app.answer(*FLAKY)
    tracer = telemetry.tracer_provider.get_tracer("checkout")
    async with idempotently.AsyncSession(
        tmp_path / "journal.db",
        base_url=url,
        policy=POLICY,
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
        hooks=[telemetry.hook],
    ) as session:
        with tracer.start_as_current_span("checkout"):
            response = await session.post("/v1/charges", json=CHARGE, operation_id="order-1")
    assert 201 == response.status_code
    [caller] = [span for span in telemetry.finished() if span.name == "checkout"]
    check_trace(telemetry, caller)
    check_metrics(telemetry, fake_time)


def test_an_operation_left_pending_is_an_error_span_counted_as_pending(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime, telemetry: Telemetry
) -> None:
    """Budget spent on 503s: the operation span says pending (status ERROR) and the
    operations counter counts it as pending; the resume that settles it makes a new
    operation span marked resuming."""
    app, url = scripted
    app.answer(Answer(503), Answer(503), Answer(201))
    with idempotently.Session(
        tmp_path / "journal.db",
        base_url=url,
        policy=idempotently.RetryPolicy(max_attempts=2, initial_backoff=0.5),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        hooks=[telemetry.hook],
    ) as session:
        with pytest.raises(idempotently.OperationPendingError):
            session.post("/v1/charges", json=CHARGE, operation_id="order-2")
        [result] = session.resume()
    assert "succeeded" == result.status
    operations = [span for span in telemetry.finished() if span.name == "idempotently.operation"]
    assert [(False, "pending", StatusCode.ERROR), (True, "succeeded", StatusCode.UNSET)] == [
        (
            span.attributes["idempotently.resuming"],  # type: ignore[index]
            span.attributes["idempotently.status"],  # type: ignore[index]
            span.status.status_code,
        )
        for span in operations
    ]
    assert sorted(
        [({"idempotently.status": "pending"}, 1), ({"idempotently.status": "succeeded"}, 1)],
        key=repr,
    ) == sorted(telemetry.points()["idempotently.operations"], key=repr)


def test_without_the_extra_the_import_names_the_pip_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No opentelemetry-api installed: importing idempotently.otel is an ImportError that
    says ``pip install 'idempotently[otel]'``."""
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    monkeypatch.delitem(sys.modules, "idempotently.otel")
    monkeypatch.delattr(idempotently, "otel", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'idempotently\[otel\]'"):
        importlib.import_module("idempotently.otel")
