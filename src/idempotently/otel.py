"""OpenTelemetry spans and metrics for idempotently, built on its hooks.

Needs the ``otel`` extra (``pip install 'idempotently[otel]'``, which brings
``opentelemetry-api`` only; the SDK and exporters are the application's)::

    from idempotently.otel import OpenTelemetryHook

    session = idempotently.Session("idempotently.db", hooks=[OpenTelemetryHook()])

Each time a call or a resume sends an operation: one span ``idempotently.operation``
(a child of the caller's current span) with one child ``idempotently.attempt``
per attempt. Metrics: the
counters ``idempotently.attempts``, ``idempotently.retries``,
``idempotently.replays``, ``idempotently.operations`` (by final status) and
``idempotently.breaker.changes`` (circuit breakers opened, reopened and closed, by
origin), and
the histogram ``idempotently.operation.duration`` (seconds). Metric attributes
are low-cardinality (outcome, status, HTTP status code): operation ids and keys
go on spans only.
"""

from __future__ import annotations

import threading
import time
from typing import Any

try:
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
except ImportError as error:  # pragma: no cover - exercised with the module hidden
    raise ImportError(
        "idempotently.otel needs OpenTelemetry's API: pip install 'idempotently[otel]'"
    ) from error

from idempotently import __version__
from idempotently._events import (
    AttemptFinished,
    BreakerChanged,
    Event,
    OperationFinished,
    OperationStarted,
    RetryRefused,
    RetryScheduled,
)

__all__ = ["OpenTelemetryHook"]

SCOPE = "idempotently"
OPERATION_SPAN = "idempotently.operation"
ATTEMPT_SPAN = "idempotently.attempt"

# Span and metric attribute names: OpenTelemetry's own where one exists.
OPERATION_ID = "idempotently.operation_id"
KEY = "idempotently.key"
ATTEMPT = "idempotently.attempt"
OUTCOME = "idempotently.outcome"
ACTION = "idempotently.action"
STATUS = "idempotently.status"
REPLAYED = "idempotently.replayed"
RESUMING = "idempotently.resuming"
DELIVERY = "idempotently.delivery"
METHOD = "http.request.method"
STATUS_CODE = "http.response.status_code"
ORIGIN = "idempotently.origin"
BREAKER_CHANGE = "idempotently.breaker.change"


def _nanoseconds(seconds: float) -> int:
    return int(seconds * 1e9)


class OpenTelemetryHook:
    """A hook that turns idempotently's events into OpenTelemetry spans and metrics.

    Give it to a Session, AsyncSession, Transport or AsyncTransport as
    ``hooks=[OpenTelemetryHook()]``; one instance may serve several of them and
    many threads. ``tracer_provider`` and ``meter_provider`` default to the
    global ones (``opentelemetry.trace.set_tracer_provider`` and so on).
    """

    def __init__(
        self,
        *,
        tracer_provider: _trace.TracerProvider | None = None,
        meter_provider: _metrics.MeterProvider | None = None,
    ) -> None:
        self._tracer = _trace.get_tracer(SCOPE, __version__, tracer_provider)
        meter = _metrics.get_meter(SCOPE, __version__, meter_provider)
        self._attempts = meter.create_counter(
            "idempotently.attempts", unit="{attempt}", description="Attempts sent, by outcome"
        )
        self._retries = meter.create_counter(
            "idempotently.retries", unit="{retry}", description="Retries decided"
        )
        self._refusals = meter.create_counter(
            "idempotently.retry_budget.refusals",
            unit="{retry}",
            description="Retries the process's retry budget refused, by origin",
        )
        self._breakers = meter.create_counter(
            "idempotently.breaker.changes",
            unit="{change}",
            description="Circuit breakers opened, reopened (a failed probe) and closed, by origin",
        )
        self._replays = meter.create_counter(
            "idempotently.replays",
            unit="{response}",
            description="Answers the server marked as its stored one for the key",
        )
        self._operations = meter.create_counter(
            "idempotently.operations",
            unit="{operation}",
            description="Operations a call or resume stopped sending, by the status they reached",
        )
        self._duration = meter.create_histogram(
            "idempotently.operation.duration",
            unit="s",
            description="From the first attempt of a call or resume to its last decision",
        )
        # The open operation spans, by operation id: a lease lets one caller at a time
        # send an operation, so the id names one span.
        self._spans: dict[str, _trace.Span] = {}
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        if isinstance(event, OperationStarted):
            self._started(event)
        elif isinstance(event, AttemptFinished):
            self._attempt(event)
        elif isinstance(event, RetryScheduled):
            self._retries.add(1)
        elif isinstance(event, OperationFinished):
            self._finished(event)
        elif isinstance(event, RetryRefused):
            self._refusals.add(1, {ORIGIN: event.origin})
        elif isinstance(event, BreakerChanged):
            self._breakers.add(1, {ORIGIN: event.origin, BREAKER_CHANGE: event.change})

    def _started(self, event: OperationStarted) -> None:
        span = self._tracer.start_span(
            OPERATION_SPAN,
            attributes={
                OPERATION_ID: event.operation_id,
                KEY: event.key,
                METHOD: event.method,
                DELIVERY: event.delivery,
                RESUMING: event.resuming,
            },
        )
        with self._lock:
            stale = self._spans.pop(event.operation_id, None)
            self._spans[event.operation_id] = span
        if stale is not None:  # the call before was cancelled or crashed mid-flight
            stale.set_status(_trace.StatusCode.ERROR, "ended without a decision")
            stale.end()

    def _attempt(self, event: AttemptFinished) -> None:
        attributes: dict[str, Any] = {OUTCOME: event.outcome, REPLAYED: event.replayed}
        if event.status_code is not None:
            attributes[STATUS_CODE] = event.status_code
        self._attempts.add(1, attributes)
        if event.replayed:
            self._replays.add(1)
        with self._lock:
            parent = self._spans.get(event.operation_id)
        end = time.time_ns()
        span = self._tracer.start_span(
            ATTEMPT_SPAN,
            context=None if parent is None else _trace.set_span_in_context(parent),
            start_time=end - _nanoseconds(event.elapsed),
            attributes={
                OPERATION_ID: event.operation_id,
                KEY: event.key,
                ATTEMPT: event.attempt,
                ACTION: event.action,
                **attributes,
            },
        )
        if event.error is not None or (event.status_code or 0) >= 500:
            span.set_status(
                _trace.StatusCode.ERROR, event.error or f"{event.status_code} from the server"
            )
        span.end(end_time=end)

    def _finished(self, event: OperationFinished) -> None:
        self._operations.add(1, {STATUS: event.status})
        self._duration.record(event.elapsed, {STATUS: event.status})
        with self._lock:
            span = self._spans.pop(event.operation_id, None)
        if span is None:
            return
        attributes: dict[str, Any] = {
            STATUS: event.status,
            ACTION: event.action,
            ATTEMPT: event.attempts,
            REPLAYED: event.replayed,
        }
        if event.status_code is not None:
            attributes[STATUS_CODE] = event.status_code
        span.set_attributes(attributes)
        if event.status != "succeeded":
            span.set_status(_trace.StatusCode.ERROR, f"{event.status}: {event.reason}")
        span.end()
