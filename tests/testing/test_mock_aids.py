"""Testing aids: request log, unused faults, in-process server, a session that never sleeps."""

from __future__ import annotations

from pathlib import Path

import pytest

import idempotently
from idempotently.testing import FakeTime, Fault, MockServer

from .conftest import charge

pytest_plugins = ["pytester"]


def test_the_request_log_shows_each_attempt_with_its_key_body_and_replay(
    idempotently_session: idempotently.Session, idempotently_mock_server: MockServer
) -> None:
    """server.requests lists method, path, key, body and replayed for every attempt, in order."""
    idempotently_mock_server.faults.push(Fault.lose_response())
    response = idempotently_session.post("/v1/charges", json=charge(), idempotency_key="k-log")

    first, second = idempotently_mock_server.requests
    assert 201 == response.status_code
    assert ("POST", "/v1/charges", "k-log", "user_1") == (
        first.method,
        first.path,
        first.key,
        first.user,
    )
    assert (False, "lose_response") == (first.replayed, first.fault)
    assert (True, None, 201) == (second.replayed, second.fault, second.status)
    assert charge() == first.json() == second.document


def test_the_session_fixture_never_sleeps_and_moves_both_clocks(
    idempotently_session: idempotently.Session,
    idempotently_mock_server: MockServer,
    idempotently_fake_time: FakeTime,
) -> None:
    """A Retry-After of 2 s costs no real time: it shows in .sleeps and on the server's clock."""
    server = idempotently_mock_server
    started = server.clock.now()
    server.faults.push(Fault.rate_limited(2))
    response = idempotently_session.post("/v1/charges", json=charge())

    assert 201 == response.status_code
    assert 2.0 == sum(idempotently_fake_time.sleeps)  # in slices of at most a second
    assert started + 2 == server.clock.now()


@pytest.mark.anyio
async def test_the_in_process_server_serves_an_async_session(
    idempotently_in_process_mock_server: MockServer, tmp_path: Path
) -> None:
    """No socket: AsyncSession through server.async_client() survives a lost answer, one charge."""
    server = idempotently_in_process_mock_server
    server.faults.push(Fault.lose_response())
    fake = FakeTime()
    async with idempotently.AsyncSession(
        tmp_path / "ops.db", client=server.async_client(), sleep=fake.async_sleep
    ) as session:
        response = await session.post("/v1/charges", json=charge(), idempotency_key="k-ip")

    assert (201, "true") == (response.status_code, response.headers["Idempotent-Replayed"])
    assert {("user_1", "k-ip"): 1} == server.charge_count_by_key()
    assert server.url.startswith("http://mock-server.")


UNUSED_FAULT_TEST = """
import pytest
from idempotently.testing import Fault

{marker}
def test_scenario(idempotently_mock_server):
    idempotently_mock_server.faults.push(Fault.crash())
"""


def test_a_fault_that_never_fired_fails_the_test(pytester: pytest.Pytester) -> None:
    """A scheduled fault no request met is an error at teardown, naming the fault."""
    pytester.makepyfile(UNUSED_FAULT_TEST.format(marker=""))
    result = pytester.runpytest("-p", "no:cacheprovider")

    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*scheduled faults never met a request*crash*"])


def test_unused_faults_may_be_allowed_with_a_marker(pytester: pytest.Pytester) -> None:
    """@pytest.mark.idempotently_allow_unused_faults opts a test out of the check."""
    marker = "@pytest.mark.idempotently_allow_unused_faults"
    pytester.makepyfile(UNUSED_FAULT_TEST.format(marker=marker))
    result = pytester.runpytest("-p", "no:cacheprovider")

    result.assert_outcomes(passed=1)
