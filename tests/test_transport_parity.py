"""Transport and Session keep the same promises (DESIGN §4): a Transport continues an
operation with the key it generated, or when an SDK resends the same request object;
it takes the Session's options, at-most-once included; and a Session adopts an
``Idempotency-Key`` header the caller sets, as the Transport does."""

from __future__ import annotations

import inspect
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

import idempotently
from idempotently import profiles
from tests.support import URL, FakeTime

CHARGE = {"amount": 1000, "currency": "usd"}

Answer = httpx.Response | Exception


@attrs.define
class Wire:
    """What the wrapped transport was sent, answered from a script (then 201s)."""

    answers: list[Answer] = attrs.field(factory=list)
    sent: list[httpx.Request] = attrs.field(factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        answer = self.answers.pop(0) if self.answers else httpx.Response(201, json={"id": "ch_1"})
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def handle_async(self, request: httpx.Request) -> httpx.Response:
        return self(request)

    @property
    def keys(self) -> list[str | None]:
        return [request.headers.get("Idempotency-Key") for request in self.sent]

    @property
    def bodies(self) -> set[bytes]:
        return {request.content for request in self.sent}


def journal_rows(path: Path) -> list[tuple[str, str, str]]:
    """(operation_id, key, status) of every operation, read with a connection of our own."""
    if not path.exists():
        return []
    with sqlite3.connect(path) as connection:
        return connection.execute("SELECT operation_id, key, status FROM operations").fetchall()


def sync_client(tmp_path: Path, fake_time: FakeTime, wire: Wire, **options: Any) -> httpx.Client:
    transport = idempotently.Transport(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(wire),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        **options,
    )
    return httpx.Client(transport=transport)


def async_client(
    tmp_path: Path, fake_time: FakeTime, wire: Wire, **options: Any
) -> httpx.AsyncClient:
    transport = idempotently.AsyncTransport(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(wire.handle_async),
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
        **options,
    )
    return httpx.AsyncClient(transport=transport)


PENDING = idempotently.RetryPolicy(max_attempts=2)
"""Two 503s leave the operation pending."""


# -- a Transport continues what it started -------------------------------------------------


def test_transport_continues_with_the_key_from_operation_pending_error(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """The key an OperationPendingError names, sent again as the header, continues the
    operation the Transport generated it for: same key, same bytes, one operation."""
    wire = Wire([httpx.Response(503), httpx.Response(503)])
    with sync_client(tmp_path, fake_time, wire, policy=PENDING) as client:
        with pytest.raises(idempotently.OperationPendingError) as caught:
            client.post(URL, json=CHARGE)
        key = caught.value.key
        assert key is not None
        response = client.post(URL, json=CHARGE, headers={"Idempotency-Key": key})
    assert 201 == response.status_code
    assert [key] * 3 == wire.keys
    assert 1 == len(wire.bodies)
    assert [(caught.value.operation_id, key, "succeeded")] == journal_rows(tmp_path / "journal.db")
    assert 3 == response.extensions["idempotently"].attempts


@pytest.mark.anyio
async def test_async_transport_continues_with_the_key_from_operation_pending_error(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """The same through AsyncTransport, on asyncio and trio."""
    wire = Wire([httpx.Response(503), httpx.Response(503)])
    async with async_client(tmp_path, fake_time, wire, policy=PENDING) as client:
        with pytest.raises(idempotently.OperationPendingError) as caught:
            await client.post(URL, json=CHARGE)
        key = caught.value.key
        assert key is not None
        response = await client.post(URL, json=CHARGE, headers={"Idempotency-Key": key})
    assert 201 == response.status_code
    assert [key] * 3 == wire.keys
    assert [(caught.value.operation_id, key, "succeeded")] == journal_rows(tmp_path / "journal.db")


def test_transport_continues_when_the_sdk_resends_the_same_request_object(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """An SDK that retries by sending its request object again continues the operation:
    the key stays the one generated for it, and nothing new is journaled."""
    wire = Wire([httpx.Response(503), httpx.Response(503)])
    with sync_client(tmp_path, fake_time, wire, policy=PENDING) as client:
        request = client.build_request("POST", URL, json=CHARGE)
        with pytest.raises(idempotently.OperationPendingError) as caught:
            client.send(request)
        response = client.send(request)
    assert 201 == response.status_code
    assert [caught.value.key] * 3 == wire.keys
    assert [(caught.value.operation_id, caught.value.key, "succeeded")] == journal_rows(
        tmp_path / "journal.db"
    )


@pytest.mark.anyio
async def test_async_transport_continues_when_the_sdk_resends_the_same_request_object(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """The same through AsyncTransport, on asyncio and trio."""
    wire = Wire([httpx.Response(503), httpx.Response(503)])
    async with async_client(tmp_path, fake_time, wire, policy=PENDING) as client:
        request = client.build_request("POST", URL, json=CHARGE)
        with pytest.raises(idempotently.OperationPendingError) as caught:
            await client.send(request)
        response = await client.send(request)
    assert 201 == response.status_code
    assert [caught.value.key] * 3 == wire.keys
    assert [(caught.value.operation_id, caught.value.key, "succeeded")] == journal_rows(
        tmp_path / "journal.db"
    )


def test_a_settled_request_object_sent_again_returns_the_stored_answer(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """The same request object after success is answered from the journal, not resent."""
    wire = Wire()
    with sync_client(tmp_path, fake_time, wire) as client:
        request = client.build_request("POST", URL, json=CHARGE)
        first = client.send(request)
        again = client.send(request)
    assert 1 == len(wire.sent)
    assert (first.content, True) == (
        again.content,
        again.extensions["idempotently"].replayed_locally,
    )


# -- the Transport takes the Session's options ---------------------------------------------


def options_of(cls: type) -> set[str]:
    return {
        name
        for name, parameter in inspect.signature(cls).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }


@pytest.mark.parametrize(
    ("session", "transport", "own"),
    [
        (idempotently.Session, idempotently.Transport, "client"),
        (idempotently.AsyncSession, idempotently.AsyncTransport, "client"),
    ],
)
def test_every_session_option_is_a_transport_option(
    session: type, transport: type, own: str
) -> None:
    """Whatever a Session can be told (but which client to wrap, and the values of
    redacted query parameters for a resume: a Transport resumes nothing, and a request
    that continues an operation carries its own), a Transport can too."""
    assert set() == options_of(session) - {own, "redacted_params"} - options_of(transport)


@pytest.mark.parametrize("delivery", ["at_most_once", None])
def test_at_most_once_transport_never_resends_what_may_have_been_delivered(
    tmp_path: Path, fake_time: FakeTime, delivery: str | None
) -> None:
    """Transport(delivery="at_most_once"), or the per-request header: a lost answer is
    never resent; the operation is abandoned and the header never reaches the server."""
    wire = Wire([httpx.ReadTimeout("lost")])
    options = {} if delivery is None else {"delivery": delivery}
    headers = {} if delivery is not None else {"Idempotency-Delivery": "at_most_once"}
    with sync_client(tmp_path, fake_time, wire, **options) as client:
        with pytest.raises(idempotently.OperationAbandonedError) as caught:
            client.post(URL, json=CHARGE, headers=headers)
        with pytest.raises(idempotently.OperationAbandonedError):
            client.post(URL, json=CHARGE, headers={"Idempotency-Key": str(caught.value.key)})
    assert 1 == len(wire.sent)
    assert "Idempotency-Delivery" not in wire.sent[0].headers
    assert [(caught.value.operation_id, caught.value.key, "abandoned")] == journal_rows(
        tmp_path / "journal.db"
    )


@pytest.mark.anyio
async def test_at_most_once_async_transport_never_resends_what_may_have_been_delivered(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """AsyncTransport(delivery="at_most_once") on asyncio and trio: one send, abandoned."""
    wire = Wire([httpx.ReadTimeout("lost")])
    async with async_client(tmp_path, fake_time, wire, delivery="at_most_once") as client:
        with pytest.raises(idempotently.OperationAbandonedError):
            await client.post(URL, json=CHARGE)
    assert 1 == len(wire.sent)
    assert ["abandoned"] == [row[2] for row in journal_rows(tmp_path / "journal.db")]


def test_at_most_once_transport_retries_what_was_never_sent(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """At-most-once still retries a connect error: the server never saw it."""
    wire = Wire([httpx.ConnectError("refused")])
    with sync_client(tmp_path, fake_time, wire, delivery="at_most_once") as client:
        response = client.post(URL, json=CHARGE)
    assert 201 == response.status_code
    assert 2 == len(wire.sent)


def test_transport_honours_redact_and_fingerprint_headers(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """redact_headers keeps a header out of the journal file; fingerprint_headers makes a
    changed header another request (KeyReuseError), as on a Session."""
    wire = Wire()
    with sync_client(
        tmp_path,
        fake_time,
        wire,
        redact_headers=["X-Partner-Secret"],
        fingerprint_headers=["X-Account"],
    ) as client:
        headers = {"Idempotency-Key": "k-1", "X-Partner-Secret": "s3cr3t-value", "X-Account": "a"}
        client.post(URL, json=CHARGE, headers=headers)
        with pytest.raises(idempotently.KeyReuseError):
            client.post(URL, json=CHARGE, headers={**headers, "X-Account": "b"})
    assert 1 == len(wire.sent)
    assert "s3cr3t-value" == wire.sent[0].headers["X-Partner-Secret"]
    assert [] == [
        path.name for path in tmp_path.glob("journal.db*") if b"s3cr3t-value" in path.read_bytes()
    ]


# -- a Session adopts the key header, as the Transport does -----------------------------------


def session(
    tmp_path: Path, fake_time: FakeTime, wire: Wire, **options: Any
) -> idempotently.Session:
    return idempotently.Session(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(wire),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        **options,
    )


def test_session_adopts_the_key_header_of_its_client(tmp_path: Path, fake_time: FakeTime) -> None:
    """Session(headers={"Idempotency-Key": "k1"}) sends k1 on every attempt and journals k1."""
    wire = Wire([httpx.Response(503)])
    with session(tmp_path, fake_time, wire, headers={"Idempotency-Key": "k1"}) as s:
        response = s.post(URL, json=CHARGE, operation_id="op")
    assert 201 == response.status_code
    assert ["k1", "k1"] == wire.keys
    assert [("op", "k1", "succeeded")] == journal_rows(tmp_path / "journal.db")
    assert "k1" == response.extensions["idempotently"].key


def test_session_adopts_the_key_header_of_one_call(tmp_path: Path, fake_time: FakeTime) -> None:
    """A key header on one call is that call's key; called again, it replays locally."""
    wire = Wire()
    with session(tmp_path, fake_time, wire) as s:
        first = s.post(URL, json=CHARGE, headers={"Idempotency-Key": "k-call"})
        again = s.post(URL, json=CHARGE, headers={"Idempotency-Key": "k-call"})
    assert ["k-call"] == wire.keys
    assert ["k-call"] == [row[1] for row in journal_rows(tmp_path / "journal.db")]
    assert (first.content, True) == (
        again.content,
        again.extensions["idempotently"].replayed_locally,
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.post(URL, json=CHARGE, idempotency_key="k3"),
        lambda s: s.post(URL, json=CHARGE, idempotency_key="k3", headers={"Idempotency-Key": "k2"}),
    ],
    ids=["client-header", "call-header"],
)
def test_a_key_argument_that_disagrees_with_the_header_is_refused_before_sending(
    tmp_path: Path, fake_time: FakeTime, call: Callable[[idempotently.Session], Any]
) -> None:
    """idempotency_key="k3" against a k1/k2 header: ValueError, nothing sent or journaled."""
    wire = Wire()
    with (
        session(tmp_path, fake_time, wire, headers={"Idempotency-Key": "k1"}) as s,
        pytest.raises(ValueError, match="disagrees") as caught,
    ):
        call(s)
    assert "k3" in str(caught.value)
    assert [] == wire.sent
    assert [] == journal_rows(tmp_path / "journal.db")


def test_a_key_argument_equal_to_the_header_is_accepted(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """Saying the same key twice (argument and header) is not a conflict."""
    wire = Wire()
    with session(tmp_path, fake_time, wire, headers={"Idempotency-Key": "k1"}) as s:
        s.post(URL, json=CHARGE, idempotency_key="k1")
    assert ["k1"] == wire.keys


def test_session_adopts_an_ietf_quoted_key_header_without_its_quotes(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """Under the IETF profile a quoted key header is journaled as its content and sent as
    it came, as the Transport does."""
    wire = Wire([httpx.Response(503)])
    with session(tmp_path, fake_time, wire, profile=profiles.IETF) as s:
        response = s.post(
            URL, json=CHARGE, operation_id="op", headers={"Idempotency-Key": '"k-ietf"'}
        )
    assert ['"k-ietf"', '"k-ietf"'] == wire.keys
    assert [("op", "k-ietf", "succeeded")] == journal_rows(tmp_path / "journal.db")
    assert "k-ietf" == response.extensions["idempotently"].key


def test_session_refuses_an_invalid_key_header_before_sending(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A key header the profile rejects is InvalidKeyError, as idempotency_key= would be."""
    wire = Wire()
    with session(tmp_path, fake_time, wire) as s, pytest.raises(idempotently.InvalidKeyError):
        s.post(URL, json=CHARGE, headers={"Idempotency-Key": "x" * 256})
    assert [] == wire.sent
    assert [] == journal_rows(tmp_path / "journal.db")


@pytest.mark.anyio
async def test_async_session_adopts_the_key_header(tmp_path: Path, fake_time: FakeTime) -> None:
    """AsyncSession adopts the header too, and refuses a disagreeing argument (asyncio, trio)."""
    wire = Wire()
    async with idempotently.AsyncSession(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(wire.handle_async),
        headers={"Idempotency-Key": "k1"},
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
    ) as s:
        with pytest.raises(ValueError, match="idempotency_key"):
            await s.post(URL, json=CHARGE, idempotency_key="k3")
        response = await s.post(URL, json=CHARGE, operation_id="op")
    assert 201 == response.status_code
    assert ["k1"] == wire.keys
    assert [("op", "k1", "succeeded")] == journal_rows(tmp_path / "journal.db")
