"""Switches that imitate other servers a client must also survive."""

from __future__ import annotations

from collections import Counter

import anyio
import httpx
import pytest

from idempotently.testing import REPLAY_HEADER, Fault, MockServerConfig
from idempotently.testing.pytest_plugin import MockServerFactory

from .conftest import charge, post, post_async


async def _first_and_twin(url: str, key: str, delay: float = 0.05) -> list[httpx.Response]:
    """A first request, and a twin sent while the first is inside the provider call."""
    responses: list[httpx.Response] = []
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:

        async def twin() -> None:
            await anyio.sleep(delay)
            responses.append(await post_async(client, key))

        async with anyio.create_task_group() as group:
            group.start_soon(twin)
            responses.append(await post_async(client, key))
    return sorted(responses, key=lambda r: REPLAY_HEADER in r.headers or r.status_code != 201)


@pytest.mark.anyio
async def test_in_progress_as_423_with_retry_after(
    idempotently_mock_server_factory: MockServerFactory,
) -> None:
    """in_progress="423" answers a concurrent twin 423 Locked with Retry-After."""
    server = idempotently_mock_server_factory(
        MockServerConfig(provider_latency=0.3, in_progress="423", in_progress_retry_after=3)
    )

    first, twin = await _first_and_twin(server.url, "k-1")

    assert (201, 423) == (first.status_code, twin.status_code)
    assert "3" == twin.headers["retry-after"]
    assert 1 == server.stats().conflicts


@pytest.mark.anyio
async def test_in_progress_wait_then_replay(
    idempotently_mock_server_factory: MockServerFactory,
) -> None:
    """in_progress="wait" holds the twin until the first finishes, then replays its response."""
    server = idempotently_mock_server_factory(
        MockServerConfig(provider_latency=0.3, in_progress="wait")
    )

    first, twin = await _first_and_twin(server.url, "k-1")

    assert (201, 201) == (first.status_code, twin.status_code)
    assert first.content == twin.content
    assert "true" == twin.headers[REPLAY_HEADER]
    assert 1 == len(server.charges())


def test_in_progress_wait_is_bounded(idempotently_mock_server_factory: MockServerFactory) -> None:
    """A waiting request gives up with 409 after in_progress_wait: a client never hangs forever."""
    server = idempotently_mock_server_factory(
        MockServerConfig(in_progress="wait", in_progress_wait=0.1)
    )
    server.faults.push(Fault.crash())
    with httpx.Client(base_url=server.url) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            post(client, "k-1")
        response = post(client, "k-1")

    assert 409 == response.status_code


def test_mismatch_as_stripe_400(idempotently_mock_server_factory: MockServerFactory) -> None:
    """mismatch="stripe" answers a different payload with 400 and an idempotency_error body."""
    server = idempotently_mock_server_factory(MockServerConfig(mismatch="stripe"))
    with httpx.Client(base_url=server.url) as client:
        post(client, "k-1", charge(amount=100))
        response = post(client, "k-1", charge(amount=100000))

    assert 400 == response.status_code
    assert "idempotency_error" == response.json()["error"]["type"]
    assert "different payload" in response.json()["error"]["message"]
    assert 1 == len(server.charges())


def test_quoted_keys_are_rfc_8941_strings(
    idempotently_mock_server_factory: MockServerFactory,
) -> None:
    """key_format="quoted" decodes sf-strings and refuses bare tokens with 400."""
    server = idempotently_mock_server_factory(MockServerConfig(key_format="quoted"))
    with httpx.Client(base_url=server.url) as client:
        quoted = post(client, '"abc"')
        escaped = post(client, r'"a\"b"')
        bare = post(client, "abc")
        replayed = post(client, '"abc"')

    assert (201, 201, 400) == (quoted.status_code, escaped.status_code, bare.status_code)
    assert "RFC 8941" in bare.json()["detail"]
    assert "true" == replayed.headers[REPLAY_HEADER]
    assert {("user_1", "abc"): 1, ("user_1", 'a"b'): 1} == server.charge_count_by_key()


def test_bare_keys_are_taken_verbatim(idempotently_mock_server_factory: MockServerFactory) -> None:
    """key_format="bare" (the default) keeps quotes as part of the key."""
    server = idempotently_mock_server_factory()
    with httpx.Client(base_url=server.url) as client:
        statuses = Counter([post(client, '"abc"').status_code, post(client, "abc").status_code])

    assert {201: 2} == statuses
    assert {'"abc"', "abc"} == {record.key for record in server.idempotency_keys()}
