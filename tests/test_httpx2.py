"""Transport and AsyncTransport under httpx and httpx2 alike, on a real loopback server."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

import idempotently
from idempotently.testing import Fault, MockServer, VirtualClock, serve

httpx2 = pytest.importorskip("httpx2")

LIBRARIES = [pytest.param(httpx, id="httpx"), pytest.param(httpx2, id="httpx2")]
CHARGE = {"amount": 1000, "currency": "usd", "customer": "cus_1"}
AUTH = {"Authorization": "Bearer user_1"}


@pytest.fixture(scope="module")
def server() -> Any:
    with serve(clock=VirtualClock()) as running:
        yield running


def no_sleep(seconds: float) -> None:
    """Retries in these tests never wait."""


async def no_async_sleep(seconds: float) -> None:
    """Retries in these tests never wait."""


@pytest.mark.parametrize("lib", LIBRARIES)
def test_transport_retries_a_lost_answer_with_one_key(
    lib: ModuleType, server: MockServer, tmp_path: Path
) -> None:
    """A lost answer is resent with the same key; one charge; the response is the client's kind."""
    server.faults.push(Fault.unavailable(), Fault.lose_response())
    transport = idempotently.Transport(tmp_path / "ops.db", sleep=no_sleep)
    with lib.Client(base_url=server.url, headers=AUTH, transport=transport) as client:
        response = client.post(
            "/v1/charges", json=CHARGE, headers={"Idempotency-Key": f"k-t-{lib.__name__}"}
        )
        listed = client.get("/v1/charges")
    assert lib.Response is type(response)
    assert (201, "true") == (response.status_code, response.headers["Idempotent-Replayed"])
    assert 3 == response.extensions["idempotently"].attempts
    assert 200 == listed.status_code
    assert 1 == server.charge_count_by_key()[("user_1", f"k-t-{lib.__name__}")]


@pytest.mark.parametrize("lib", LIBRARIES)
def test_transport_turns_network_errors_into_the_clients_own(
    lib: ModuleType, tmp_path: Path
) -> None:
    """A refused connection ends as the client library's own ConnectError, never the other's."""
    policy = idempotently.RetryPolicy(max_attempts=2)
    transport = idempotently.Transport(tmp_path / "ops.db", sleep=no_sleep, policy=policy)
    with lib.Client(transport=transport) as client, pytest.raises(Exception) as raised:
        client.post("http://127.0.0.1:9/v1/charges", json=CHARGE)
    errors = [raised.value, raised.value.__cause__, raised.value.__context__]
    assert any(isinstance(error, lib.ConnectError) for error in errors), errors
    other = httpx2 if lib is httpx else httpx
    assert not any(
        isinstance(error, other.HTTPError) and not isinstance(error, lib.HTTPError)
        for error in errors[:1]
    )


@pytest.mark.anyio
@pytest.mark.parametrize("lib", LIBRARIES)
async def test_async_transport_retries_a_lost_answer_with_one_key(
    lib: ModuleType, server: MockServer, tmp_path: Path
) -> None:
    """The async twin: one charge after a lost answer, an answer of the client's kind."""
    server.faults.push(Fault.lose_response())
    transport = idempotently.AsyncTransport(tmp_path / "ops.db", sleep=no_async_sleep)
    async with lib.AsyncClient(base_url=server.url, headers=AUTH, transport=transport) as client:
        response = await client.post(
            "/v1/charges", json=CHARGE, headers={"Idempotency-Key": f"k-a-{lib.__name__}"}
        )
    assert lib.Response is type(response)
    assert 201 == response.status_code
    assert 1 == server.charge_count_by_key()[("user_1", f"k-a-{lib.__name__}")]


def test_httpx2_inner_transport_under_an_httpx_client(server: MockServer, tmp_path: Path) -> None:
    """transport=httpx2.HTTPTransport() under an httpx client: answers are httpx responses."""
    transport = idempotently.Transport(
        tmp_path / "ops.db", transport=httpx2.HTTPTransport(), sleep=no_sleep
    )
    with httpx.Client(base_url=server.url, headers=AUTH, transport=transport) as client:
        created = client.post("/v1/charges", json=CHARGE)
        listed = client.get("/v1/charges")
    assert (httpx.Response, 201) == (type(created), created.status_code)
    assert (httpx.Response, 200) == (type(listed), listed.status_code)


def test_a_transport_of_neither_library_is_refused(tmp_path: Path) -> None:
    """transport= takes an httpx or httpx2 transport and says so otherwise."""
    with pytest.raises(TypeError, match=r"httpx2\.BaseTransport"):
        idempotently.Transport(tmp_path / "ops.db", transport=object())  # type: ignore[arg-type]


@pytest.mark.parametrize("lib", LIBRARIES)
def test_session_sends_through_either_librarys_client(
    lib: ModuleType, server: MockServer, tmp_path: Path
) -> None:
    """Session(client=...) of either library: a lost answer is retried under one key, one charge."""
    server.faults.push(Fault.unavailable(), Fault.lose_response())
    client = lib.Client(base_url=server.url, headers=AUTH)
    with idempotently.Session(tmp_path / "ops.db", client=client, sleep=no_sleep) as session:
        response = session.post("/v1/charges", json=CHARGE, idempotency_key=f"k-s-{lib.__name__}")
    client.close()
    assert (httpx.Response, 201) == (type(response), response.status_code)
    assert "true" == response.headers["Idempotent-Replayed"]
    assert 3 == response.extensions["idempotently"].attempts
    assert 1 == server.charge_count_by_key()[("user_1", f"k-s-{lib.__name__}")]


@pytest.mark.parametrize("lib", LIBRARIES)
def test_session_resumes_through_either_librarys_client(
    lib: ModuleType, server: MockServer, tmp_path: Path
) -> None:
    """A pending operation is resumed through an httpx2 client as through an httpx one."""
    server.faults.push(Fault.lose_response())
    one_try = idempotently.RetryPolicy(max_attempts=1)
    with (
        lib.Client(base_url=server.url, headers=AUTH) as client,
        idempotently.Session(tmp_path / "ops.db", client=client, policy=one_try) as session,
    ):
        with pytest.raises(idempotently.OperationPendingError):
            session.post(
                "/v1/charges",
                json=CHARGE,
                idempotency_key=f"k-r-{lib.__name__}",
                operation_id=f"o-r-{lib.__name__}",
            )
        [result] = session.resume()
    assert (f"o-r-{lib.__name__}", "succeeded", True) == (
        result.operation_id,
        result.action,
        result.replayed,
    )
    assert 1 == server.charge_count_by_key()[("user_1", f"k-r-{lib.__name__}")]


@pytest.mark.anyio
@pytest.mark.parametrize("lib", LIBRARIES)
async def test_async_session_sends_through_either_librarys_client(
    lib: ModuleType, server: MockServer, tmp_path: Path
) -> None:
    """AsyncSession(client=...) of either library, on asyncio and trio: one charge."""
    server.faults.push(Fault.lose_response())
    async with (
        lib.AsyncClient(base_url=server.url, headers=AUTH) as client,
        idempotently.AsyncSession(
            tmp_path / "ops.db", client=client, sleep=no_async_sleep
        ) as session,
    ):
        response = await session.post(
            "/v1/charges", json=CHARGE, idempotency_key=f"k-as-{lib.__name__}"
        )
    assert (httpx.Response, 201) == (type(response), response.status_code)
    assert 1 == server.charge_count_by_key()[("user_1", f"k-as-{lib.__name__}")]


def test_session_refuses_a_client_of_the_wrong_kind(tmp_path: Path) -> None:
    """An async httpx2 client given to Session is a TypeError naming both libraries."""
    with pytest.raises(TypeError, match=r"httpx\.Client or an httpx2\.Client"):
        idempotently.Session(tmp_path / "ops.db", client=httpx2.AsyncClient())
