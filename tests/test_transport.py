"""Transport and AsyncTransport: an SDK's own httpx client gains the journal."""

from __future__ import annotations

import re
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

TOKEN = "sk_live_sdk_token_do_not_store_4242"
CHARGE = {"amount": 1000, "currency": "usd"}

Answer = httpx.Response | httpx.TransportError


@attrs.define
class Script:
    """A wrapped transport's handler: answers in order, remembers what it was sent."""

    answers: list[Answer]
    sent: list[httpx.Request] = attrs.field(factory=list)
    on_send: Callable[[httpx.Request], None] | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        if self.on_send is not None:
            self.on_send(request)
        answer = self.answers.pop(0)
        if isinstance(answer, httpx.TransportError):
            raise answer
        return answer

    async def handle_async(self, request: httpx.Request) -> httpx.Response:
        return self(request)

    def keys_and_bodies(self) -> set[tuple[str | None, bytes]]:
        return {(request.headers.get("idempotency-key"), request.content) for request in self.sent}


def sdk_client(tmp_path: Path, fake_time: FakeTime, script: Script, **options: Any) -> httpx.Client:
    """An httpx client as a vendor SDK would build it, with our transport underneath."""
    transport = idempotently.Transport(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(script),
        clock=fake_time.clock,
        sleep=fake_time.sleep,
        **options,
    )
    return httpx.Client(transport=transport, headers={"Authorization": f"Bearer {TOKEN}"})


def journal_rows(path: Path) -> list[tuple[str, str]]:
    """(operation_id, key) rows, read through a connection of our own."""
    with sqlite3.connect(path) as connection:
        return connection.execute("SELECT operation_id, key FROM operations").fetchall()


def stored(path: Path, operation_id: str) -> idempotently.Operation | None:
    """The operation as the journal file holds it."""
    with idempotently.Journal(path) as journal:
        return journal.operation(operation_id)


def post(client: httpx.Client, body: Any = CHARGE, **headers: str) -> httpx.Response:
    return client.post(URL, json=body, headers=headers)


def test_sdk_key_is_adopted_verbatim_and_journaled_before_the_first_send(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """The request's own Idempotency-Key is the journaled key, committed before sending."""
    seen: list[list[tuple[str, str]]] = []
    script = Script(
        [httpx.Response(201, json={"id": "ch_1"})],
        on_send=lambda _: seen.append(journal_rows(tmp_path / "journal.db")),
    )
    with sdk_client(tmp_path, fake_time, script) as client:
        response = post(client, **{"Idempotency-Key": "sdk-key-1"})
    assert 201 == response.status_code
    assert [[("key:sdk-key-1", "sdk-key-1")]] == seen
    assert "sdk-key-1" == script.sent[0].headers["Idempotency-Key"]
    assert "sdk-key-1" == response.extensions["idempotently"].key


def test_a_keyless_request_gets_a_generated_key_and_an_op_id(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """Without a key header the operation id is ``op_<32 hex digits>``, not ``key:<key>``."""
    script = Script([httpx.Response(201, json={"id": "ch_1"})])
    with sdk_client(tmp_path, fake_time, script) as client:
        response = post(client)
    [(operation_id, key)] = journal_rows(tmp_path / "journal.db")
    assert (True, key) == (
        re.fullmatch(r"op_[0-9a-f]{32}", operation_id) is not None,
        script.sent[0].headers["Idempotency-Key"],
    )
    assert key == response.extensions["idempotently"].key


def test_503_is_retried_with_the_same_key_and_bytes(tmp_path: Path, fake_time: FakeTime) -> None:
    """503 then 201: two sends, one key, one body, one fake sleep."""
    script = Script([httpx.Response(503), httpx.Response(201, json={"id": "ch_1"})])
    with sdk_client(tmp_path, fake_time, script) as client:
        response = post(client, **{"Idempotency-Key": "k-503"})
    assert 201 == response.status_code
    assert 2 == len(script.sent)
    assert 1 == len(script.keys_and_bodies())
    assert 1 == len(fake_time.sleeps)


def test_transport_errors_are_retried_with_the_same_key(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A read timeout (maybe delivered) is retried with the same key and bytes."""
    script = Script([httpx.ReadTimeout("slow"), httpx.Response(201)])
    with sdk_client(tmp_path, fake_time, script) as client:
        assert 201 == post(client, **{"Idempotency-Key": "k-timeout"}).status_code
    assert [("k-timeout", script.sent[0].content)] == sorted(script.keys_and_bodies())


def test_422_is_returned_after_one_send(tmp_path: Path, fake_time: FakeTime) -> None:
    """A final 4xx is the SDK's answer: sent once, journaled as failed."""
    script = Script([httpx.Response(422, json={"error": "bad"})])
    with sdk_client(tmp_path, fake_time, script) as client:
        response = post(client, **{"Idempotency-Key": "k-422"})
    operation = stored(tmp_path / "journal.db", "key:k-422")
    assert 422 == response.status_code
    assert 1 == len(script.sent)
    assert operation is not None and "failed" == operation.status
    assert [] == fake_time.sleeps


def test_get_is_retried_unjournaled(tmp_path: Path, fake_time: FakeTime) -> None:
    """A GET is retried after a 503, without a journal row or a key."""
    script = Script([httpx.Response(503), httpx.Response(200)])
    with sdk_client(tmp_path, fake_time, script) as client:
        response = client.get(URL)
    assert 200 == response.status_code
    assert [] == journal_rows(tmp_path / "journal.db")
    assert 2 == len(script.sent)
    assert not any("idempotency-key" in sent.headers for sent in script.sent)


def test_put_passes_through_unjournaled(tmp_path: Path, fake_time: FakeTime) -> None:
    """Methods neither journaled nor retried (PUT, by default) go straight to the
    wrapped transport, untouched and once."""
    script = Script([httpx.Response(503)])
    with sdk_client(tmp_path, fake_time, script) as client:
        response = client.put(URL, json={})
    assert 503 == response.status_code
    assert [] == journal_rows(tmp_path / "journal.db")
    assert 1 == len(script.sent)
    assert "idempotency-key" not in script.sent[0].headers


def test_same_key_after_success_returns_the_stored_response_without_sending(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """An SDK retry (or a second call) with a settled key is answered from the journal."""
    script = Script([httpx.Response(201, json={"id": "ch_1"})])
    with sdk_client(tmp_path, fake_time, script) as client:
        first = post(client, **{"Idempotency-Key": "k-once"})
        again = post(client, **{"Idempotency-Key": "k-once"})
    assert 1 == len(script.sent)
    assert (201, {"id": "ch_1"}) == (again.status_code, again.json())
    assert (False, True) == (
        first.extensions["idempotently"].replayed_locally,
        again.extensions["idempotently"].replayed_locally,
    )


def test_same_key_with_another_body_raises_key_reuse_before_sending(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """The client-side twin of the server's 422: KeyReuseError, nothing sent."""
    script = Script([httpx.Response(201)])
    with sdk_client(tmp_path, fake_time, script) as client:
        post(client, **{"Idempotency-Key": "k-reuse"})
        with pytest.raises(idempotently.KeyReuseError) as caught:
            post(client, {"amount": 99999, "currency": "usd"}, **{"Idempotency-Key": "k-reuse"})
    assert 1 == len(script.sent)
    assert ("key:k-reuse", "k-reuse") == (caught.value.operation_id, caught.value.key)


def test_request_without_a_key_gets_a_generated_one(tmp_path: Path, fake_time: FakeTime) -> None:
    """No Idempotency-Key: one is generated, journaled and sent on every attempt."""
    script = Script([httpx.Response(500), httpx.Response(201)])
    with sdk_client(tmp_path, fake_time, script) as client:
        response = post(client)
    [(_, key)] = journal_rows(tmp_path / "journal.db")
    assert {(key, script.sent[0].content)} == script.keys_and_bodies()
    assert key == response.extensions["idempotently"].key


def test_bearer_token_never_reaches_the_journal_file(tmp_path: Path, fake_time: FakeTime) -> None:
    """Authorization is sent on every attempt and written nowhere in the journal."""
    script = Script([httpx.ReadError("reset"), httpx.Response(201)])
    with sdk_client(tmp_path, fake_time, script, redact_headers=["X-Tenant"]) as client:
        post(client, **{"Idempotency-Key": "k-secret", "X-Tenant": "tenant-secret-7"})
    stored = b"".join(path.read_bytes() for path in tmp_path.glob("journal.db*"))
    assert [f"Bearer {TOKEN}"] * 2 == [r.headers["Authorization"] for r in script.sent]
    assert TOKEN.encode() not in stored
    assert b"tenant-secret-7" not in stored


def test_operation_id_header_keeps_the_first_key_of_its_operation(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """With Idempotency-Operation-Id, an SDK's fresh key after a lost answer resends the first."""
    script = Script([httpx.ReadTimeout("slow"), httpx.Response(201)])
    policy = idempotently.RetryPolicy(max_attempts=1)
    with sdk_client(tmp_path, fake_time, script, policy=policy) as client:
        with pytest.raises(idempotently.OperationPendingError) as caught:
            post(client, **{"Idempotency-Key": "k-1", "Idempotency-Operation-Id": "order-7"})
        response = post(client, **{"Idempotency-Key": "k-2", "Idempotency-Operation-Id": "order-7"})
    assert ("order-7", "k-1") == (caught.value.operation_id, caught.value.key)
    assert 201 == response.status_code
    assert ["k-1", "k-1"] == [request.headers["Idempotency-Key"] for request in script.sent]
    assert [("order-7", "k-1")] == journal_rows(tmp_path / "journal.db")


def test_an_unknown_outcome_raises_what_session_raises(tmp_path: Path, fake_time: FakeTime) -> None:
    """Budget spent on 503s: OperationPendingError reaches the SDK; the operation stays pending."""
    script = Script([httpx.Response(503)] * 2)
    policy = idempotently.RetryPolicy(max_attempts=2)
    client = sdk_client(tmp_path, fake_time, script, policy=policy)
    with client, pytest.raises(idempotently.OperationPendingError) as caught:
        post(client, **{"Idempotency-Key": "k-pending"})
    operation = stored(tmp_path / "journal.db", "key:k-pending")
    assert operation is not None and "pending" == operation.status
    assert "k-pending" == caught.value.key


def test_ietf_quoted_key_is_adopted_without_its_quotes(tmp_path: Path, fake_time: FakeTime) -> None:
    """Under the IETF profile the journaled key is the sf-string's content, sent as it came."""
    script = Script([httpx.Response(201)])
    with sdk_client(tmp_path, fake_time, script, profile=profiles.IETF) as client:
        post(client, **{"Idempotency-Key": '"k-ietf"'})
    assert [("key:k-ietf", "k-ietf")] == journal_rows(tmp_path / "journal.db")
    assert '"k-ietf"' == script.sent[0].headers["Idempotency-Key"]


@pytest.mark.anyio
async def test_async_transport_follows_the_same_contract(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """AsyncTransport passes GET through, adopts, retries, replays locally and refuses reuse."""
    script = Script(
        [
            httpx.Response(200),
            httpx.ConnectError("refused"),
            httpx.Response(201, json={"id": "ch_1"}),
        ]
    )
    transport = idempotently.AsyncTransport(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(script.handle_async),
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
    )
    headers = {"Authorization": f"Bearer {TOKEN}", "Idempotency-Key": "k-async"}
    async with httpx.AsyncClient(transport=transport, headers=headers) as client:
        listed = await client.get(URL)
        response = await client.post(URL, json=CHARGE)
        again = await client.post(URL, json=CHARGE)
        with pytest.raises(idempotently.KeyReuseError):
            await client.post(URL, json={"amount": 1})
    assert (200, 201) == (listed.status_code, response.status_code)
    assert ({"id": "ch_1"}, True) == (
        again.json(),
        again.extensions["idempotently"].replayed_locally,
    )
    assert 3 == len(script.sent)
    assert {("k-async", script.sent[1].content)} == {
        (request.headers["Idempotency-Key"], request.content) for request in script.sent[1:]
    }
    assert [("key:k-async", "k-async")] == journal_rows(tmp_path / "journal.db")
    assert 1 == len(fake_time.sleeps)


def test_lost_response_from_a_real_server_is_retried_into_one_charge(tmp_path: Path) -> None:
    """End to end over loopback: the answer is lost, the retry is replayed, one charge."""
    from idempotently.testing import Fault, serve

    body = {"amount": 1000, "currency": "usd", "customer": "cus_1", "metadata": {}}
    with serve() as server:
        server.faults.push(Fault.lose_response())
        transport = idempotently.Transport(tmp_path / "journal.db", sleep=lambda _: None)
        with httpx.Client(
            transport=transport,
            base_url=server.url,
            headers={"Authorization": "Bearer user_1"},
        ) as client:
            response = client.post(
                "/v1/charges", json=body, headers={"Idempotency-Key": "sdk-charge-1"}
            )
        charges = server.charges()
    operation = stored(tmp_path / "journal.db", "key:sdk-charge-1")
    assert 201 == response.status_code
    assert [response.json()["id"]] == [charge.id for charge in charges]
    assert operation is not None and "succeeded" == operation.status
    assert ["maybe_delivered", "answered"] == [attempt.outcome for attempt in operation.attempts]
