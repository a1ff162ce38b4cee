"""Hooks and log records: one typed event per operation start, attempt, retry decision
and finish, on every entry point, against a real server on 127.0.0.1 (DESIGN §4)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

import idempotently
from idempotently import AttemptFinished, OperationFinished, OperationStarted, RetryScheduled
from idempotently._transport import OPERATION_ID_HEADER
from tests.scripted_server import RESET, Answer, ScriptedApp
from tests.support import FakeTime

Scripted = tuple[ScriptedApp, str]
TOKEN = "sk_live_never_in_an_event_4242"
CHARGE = {"amount": 1000, "currency": "usd"}
FLAKY = (Answer(503), RESET, Answer(201))
"""A 503, a connection reset after the request was read, then the charge."""
EXPECTED_NAMES = [
    "operation_started",
    "attempt_finished",
    "retry_scheduled",
    "attempt_finished",
    "retry_scheduled",
    "attempt_finished",
    "operation_finished",
]


class Records(logging.Handler):
    """A real handler on the ``idempotently`` logger that keeps every record."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    logger = logging.getLogger("idempotently")
    handler = Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(level)


def options(fake_time: FakeTime, hooks: list[Any], *, asynchronous: bool) -> dict[str, Any]:
    return {
        "policy": idempotently.RetryPolicy(initial_backoff=0.5, max_backoff=1.0),
        "clock": fake_time.clock,
        "sleep": fake_time.async_sleep if asynchronous else fake_time.sleep,
        "hooks": hooks,
    }


def check_flaky_events(events: list[Any], fake_time: FakeTime, operation_id: str) -> None:
    """The events of one operation sent through FLAKY, in order, with their fields."""
    assert EXPECTED_NAMES == [event.name for event in events]
    started, first, retry, second, _, third, finished = events
    key = started.key
    assert {operation_id} == {event.operation_id for event in events}
    assert {key} == {event.key for event in events}
    assert ("POST", "exactly_once", False, 0) == (
        started.method,
        started.delivery,
        started.resuming,
        started.attempts,
    )
    assert [(1, "answered", 503, "retry", "pending", None)] == [
        (first.attempt, first.outcome, first.status_code, first.action, first.status, first.error)
    ]
    assert (2, "maybe_delivered", None, "retry") == (
        second.attempt,
        second.outcome,
        second.status_code,
        second.action,
    )
    assert second.error is not None
    assert (3, "answered", 201, "succeed", "succeeded", False) == (
        third.attempt,
        third.outcome,
        third.status_code,
        third.action,
        third.status,
        third.replayed,
    )
    assert 1 == retry.attempt
    assert "503" in retry.reason
    assert fake_time.sleeps == [event.wait for event in events if isinstance(event, RetryScheduled)]
    assert ("succeeded", "succeed", 3, 201, False) == (
        finished.status,
        finished.action,
        finished.attempts,
        finished.status_code,
        finished.replayed,
    )
    # The fake clock moves only when the call sleeps.
    # Absolute tolerance: elapsed is a difference of two epoch times (about 1e9 s), so
    # float rounding leaves it off by up to about 1e-7 s.
    assert pytest.approx(sum(fake_time.sleeps), abs=1e-6) == finished.elapsed


def test_a_session_hook_gets_every_event_of_a_flaky_call_in_order(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime
) -> None:
    """Session: started, one event per attempt and per retry decision, finished."""
    app, url = scripted
    app.answer(*FLAKY)
    events: list[Any] = []
    with idempotently.Session(
        tmp_path / "journal.db",
        base_url=url,
        **options(fake_time, [events.append], asynchronous=False),
    ) as session:
        response = session.post("/v1/charges", json=CHARGE, operation_id="order-1")
    assert 201 == response.status_code
    check_flaky_events(events, fake_time, "order-1")
    assert [arrival.key for arrival in app.arrivals] == [events[0].key] * 3


def test_a_transport_hook_gets_the_same_events(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime
) -> None:
    """Transport: the same events as the Session, for the same flaky call."""
    app, url = scripted
    app.answer(*FLAKY)
    events: list[Any] = []
    transport = idempotently.Transport(
        tmp_path / "journal.db", **options(fake_time, [events.append], asynchronous=False)
    )
    with httpx.Client(transport=transport, base_url=url) as client:
        response = client.post("/v1/charges", json=CHARGE, headers={OPERATION_ID_HEADER: "order-1"})
    assert 201 == response.status_code
    check_flaky_events(events, fake_time, "order-1")


@pytest.mark.anyio
async def test_an_async_session_takes_sync_and_async_hooks(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime
) -> None:
    """AsyncSession: a plain hook and an async hook each get every event, in order."""
    app, url = scripted
    app.answer(*FLAKY)
    plain: list[Any] = []
    awaited: list[Any] = []

    async def async_hook(event: idempotently.Event) -> None:
        awaited.append(event)

    async with idempotently.AsyncSession(
        tmp_path / "journal.db",
        base_url=url,
        **options(fake_time, [plain.append, async_hook], asynchronous=True),
    ) as session:
        response = await session.post("/v1/charges", json=CHARGE, operation_id="order-1")
    assert 201 == response.status_code
    check_flaky_events(plain, fake_time, "order-1")
    assert plain == awaited


@pytest.mark.anyio
async def test_an_async_transport_hook_gets_the_same_events(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime
) -> None:
    """AsyncTransport: the same events as the Session, through an async hook."""
    app, url = scripted
    app.answer(*FLAKY)
    events: list[Any] = []

    async def hook(event: idempotently.Event) -> None:
        events.append(event)

    transport = idempotently.AsyncTransport(
        tmp_path / "journal.db", **options(fake_time, [hook], asynchronous=True)
    )
    async with httpx.AsyncClient(transport=transport, base_url=url) as client:
        response = await client.post(
            "/v1/charges", json=CHARGE, headers={OPERATION_ID_HEADER: "order-1"}
        )
    assert 201 == response.status_code
    check_flaky_events(events, fake_time, "order-1")


def test_resume_emits_the_events_of_the_operations_it_sends(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime
) -> None:
    """A resumed operation: started (resuming, with the attempts before), its attempt,
    and finished; an operation answered from the journal emits nothing."""
    app, url = scripted
    app.answer(Answer(503), Answer(503), Answer(201), Answer(201))
    events: list[Any] = []
    one_attempt = idempotently.RetryPolicy(max_attempts=2, initial_backoff=0.5)
    with idempotently.Session(
        tmp_path / "journal.db",
        base_url=url,
        policy=one_attempt,
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        hooks=[events.append],
    ) as session:
        with pytest.raises(idempotently.OperationPendingError):
            session.post("/v1/charges", json=CHARGE, operation_id="order-1")
        assert ("pending", "pending", 2) == (
            events[-1].status,
            events[-1].action,
            events[-1].attempts,
        )
        events.clear()
        [result] = session.resume()
        assert "succeeded" == result.status
        resumed = list(events)
        events.clear()
        session.post("/v1/charges", json=CHARGE, operation_id="order-1")  # from the journal
    assert ["operation_started", "attempt_finished", "operation_finished"] == [
        event.name for event in resumed
    ]
    started, attempt, finished = resumed
    assert (True, 2) == (started.resuming, started.attempts)
    assert (3, 201) == (attempt.attempt, attempt.status_code)
    assert ("succeeded", 3) == (finished.status, finished.attempts)
    assert [] == events


def test_a_hook_that_raises_is_logged_and_the_call_goes_on(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime, records: list[logging.LogRecord]
) -> None:
    """A raising hook: an ERROR record with the event's fields and the traceback; the
    call returns its answer and the next hook still gets every event."""
    app, url = scripted
    app.answer(*FLAKY)
    after: list[Any] = []

    def broken(event: idempotently.Event) -> None:
        raise RuntimeError("metrics backend down")

    with idempotently.Session(
        tmp_path / "journal.db",
        base_url=url,
        **options(fake_time, [broken, after.append], asynchronous=False),
    ) as session:
        response = session.post("/v1/charges", json=CHARGE, operation_id="order-1")
    assert 201 == response.status_code
    assert EXPECTED_NAMES == [event.name for event in after]
    failures = [record for record in records if record.levelno == logging.ERROR]
    assert EXPECTED_NAMES == [record.idempotently["event"] for record in failures]  # type: ignore[attr-defined]
    first = failures[0]
    assert first.exc_info is not None and isinstance(first.exc_info[1], RuntimeError)
    assert "order-1" == first.idempotently["operation_id"]  # type: ignore[attr-defined]
    assert after[0].key == first.idempotently["key"]  # type: ignore[attr-defined]
    assert "order-1" in first.getMessage() and "broken" in first.getMessage()


@pytest.mark.anyio
async def test_an_async_hook_that_raises_is_logged_and_the_call_goes_on(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime, records: list[logging.LogRecord]
) -> None:
    """An async hook that raises: logged with the event's fields; the call succeeds."""
    app, url = scripted
    app.answer(Answer(201))

    async def broken(event: idempotently.Event) -> None:
        raise RuntimeError("metrics backend down")

    async with idempotently.AsyncSession(
        tmp_path / "journal.db", base_url=url, **options(fake_time, [broken], asynchronous=True)
    ) as session:
        response = await session.post("/v1/charges", json=CHARGE, operation_id="order-1")
    assert 201 == response.status_code
    failures = [record for record in records if record.levelno == logging.ERROR]
    assert ["operation_started", "attempt_finished", "operation_finished"] == [
        record.idempotently["event"]  # type: ignore[attr-defined]
        for record in failures
    ]


def test_log_records_carry_the_events_fields(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime, records: list[logging.LogRecord]
) -> None:
    """Without hooks, every record about the operation has ``record.idempotently``: the
    event's name and fields, JSON-serialisable; the retry decision is at INFO."""
    app, url = scripted
    app.answer(*FLAKY)
    with idempotently.Session(
        tmp_path / "journal.db", base_url=url, **options(fake_time, [], asynchronous=False)
    ) as session:
        session.post("/v1/charges", json=CHARGE, operation_id="order-1")
    fields = [record.idempotently for record in records]  # type: ignore[attr-defined]
    assert EXPECTED_NAMES == [field["event"] for field in fields]
    assert {"order-1"} == {field["operation_id"] for field in fields}
    retries = [record for record in records if record.idempotently["event"] == "retry_scheduled"]  # type: ignore[attr-defined]
    assert [logging.INFO, logging.INFO] == [record.levelno for record in retries]
    assert fake_time.sleeps == [record.idempotently["wait"] for record in retries]  # type: ignore[attr-defined]
    assert {"attempt": 1, "outcome": "answered", "status_code": 503} == {
        name: fields[1][name] for name in ("attempt", "outcome", "status_code")
    }
    json.dumps(fields)  # a JSON formatter can write them as they are


def test_no_event_or_log_record_holds_a_secret(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime, records: list[logging.LogRecord]
) -> None:
    """The Authorization header and URL credentials appear in no event and no record."""
    app, url = scripted
    app.answer(*FLAKY)
    events: list[Any] = []
    with idempotently.Session(
        tmp_path / "journal.db",
        base_url=url.replace("http://", f"http://user:{TOKEN}-pw@"),
        headers={"Authorization": f"Bearer {TOKEN}"},
        **options(fake_time, [events.append], asynchronous=False),
    ) as session:
        session.post("/v1/charges", json=CHARGE, operation_id="order-1")
    assert 7 == len(events)
    seen = [repr(attrs.asdict(event)) for event in events] + [
        record.getMessage() + repr(record.__dict__) for record in records
    ]
    assert [] == [text for text in seen if TOKEN in text]


def test_a_sync_session_refuses_an_async_hook_and_ignores_an_awaitable(
    tmp_path: Path, scripted: Scripted, fake_time: FakeTime, records: list[logging.LogRecord]
) -> None:
    """An async function as a sync hook is a TypeError; a callable that returns an
    awaitable anyway is logged and the awaitable closed (never awaited); the call goes on."""
    app, url = scripted
    app.answer(Answer(201))

    async def async_hook(event: idempotently.Event) -> None:
        pass

    with pytest.raises(TypeError, match="hooks"):
        idempotently.Session(tmp_path / "journal.db", hooks=[async_hook])

    returned: list[Any] = []

    def sneaky(event: idempotently.Event) -> Any:
        returned.append(async_hook(event))
        return returned[-1]

    with idempotently.Session(
        tmp_path / "journal.db", base_url=url, **options(fake_time, [sneaky], asynchronous=False)
    ) as session:
        assert 201 == session.post("/v1/charges", json=CHARGE).status_code
    assert 3 == len([record for record in records if "awaitable" in record.getMessage()])
    assert [None, None, None] == [coroutine.cr_frame for coroutine in returned]  # closed


def test_event_classes_are_frozen_and_exported() -> None:
    """Events are immutable values importable from the package root."""
    event = OperationStarted(
        operation_id="o",
        key="k",
        method="POST",
        delivery="exactly_once",
        resuming=False,
        attempts=0,
        at=1.0,
    )
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        event.key = "other"  # type: ignore[misc]
    assert {AttemptFinished, OperationFinished, RetryScheduled, OperationStarted} <= {
        getattr(idempotently, name) for name in idempotently.__all__
    }


@pytest.mark.parametrize("entry_point", [idempotently.Session, idempotently.Transport])
def test_an_async_hook_for_a_sync_entry_point_is_a_type_error(
    tmp_path: Path, entry_point: type
) -> None:
    """An async function in hooks= of a sync Session or Transport is refused, no file."""

    async def hook(event: idempotently.Event) -> None:
        pass

    with pytest.raises(TypeError, match="hooks"):
        entry_point(tmp_path / "journal.db", hooks=[hook])
    assert [] == list(tmp_path.iterdir())


def test_an_interrupted_call_still_ends_with_operation_finished(tmp_path: Path) -> None:
    """A call stopped mid-send (Ctrl-C) still gives its hooks an OperationFinished, with
    the status the journal keeps (pending), so spans and metrics are never left open."""
    events: list[idempotently.Event] = []

    def interrupt(request: httpx.Request) -> httpx.Response:
        raise KeyboardInterrupt

    with (
        idempotently.Session(
            str(tmp_path / "j.db"),
            base_url="http://127.0.0.1:9",
            transport=httpx.MockTransport(interrupt),
            hooks=[events.append],
        ) as session,
        pytest.raises(KeyboardInterrupt),
    ):
        session.post("/v1/charges", json={"amount": 1}, operation_id="order-1")
    assert ["operation_started", "operation_finished"] == [event.name for event in events]
    finished = events[-1]
    assert isinstance(finished, idempotently.OperationFinished)
    assert ("pending", "order-1") == (finished.status, finished.operation_id)


def test_a_call_builds_no_log_fields_when_its_records_are_not_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the idempotently logger above DEBUG, a settled call's events make no record,
    so their fields are never built (work every call would otherwise pay)."""
    from idempotently import _events

    def refuse(event: object) -> dict[str, Any]:
        raise AssertionError(f"fields built for {event!r}")

    monkeypatch.setattr(_events, "fields", refuse)
    with (
        caplog.at_level(logging.WARNING, logger="idempotently"),
        idempotently.Session(
            tmp_path / "journal.db", transport=httpx.MockTransport(lambda r: httpx.Response(201))
        ) as session,
    ):
        assert 201 == session.post("https://api.example/v1/charges", json={}).status_code
    assert [] == caplog.records


def test_a_call_builds_no_event_when_nobody_would_see_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without hooks and with the logger above DEBUG, a settled call makes no event at
    all (work every call would otherwise pay); an unsettled one still logs its end."""
    from idempotently import _events

    def refuse(**fields: object) -> None:
        raise AssertionError(f"event built: {fields!r}")

    for name in ("OperationStarted", "AttemptFinished", "OperationFinished"):
        monkeypatch.setattr(_events, name, refuse)
    with (
        caplog.at_level(logging.INFO, logger="idempotently"),
        idempotently.Session(
            tmp_path / "journal.db", transport=httpx.MockTransport(lambda r: httpx.Response(201))
        ) as session,
    ):
        assert 201 == session.post("https://api.example/v1/charges", json={}).status_code
    assert [] == caplog.records
    monkeypatch.undo()
    with (
        caplog.at_level(logging.INFO, logger="idempotently"),
        idempotently.Session(
            tmp_path / "journal.db",
            transport=httpx.MockTransport(lambda r: httpx.Response(503)),
            policy=idempotently.RetryPolicy(max_attempts=1),
        ) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post("https://api.example/v1/charges", json={})
    assert [(logging.INFO, "operation_finished")] == [
        (record.levelno, record.idempotently["event"])  # type: ignore[attr-defined]
        for record in caplog.records
    ]
