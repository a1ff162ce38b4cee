"""One definition of a request's credentials, for a key bound to them and a pause's scope.

A profile whose keys are bound to credentials resends a key only under the
credentials it was made with; an origin pause applies to the credentials it was
answered to. Both ask the same question ("are these the same credentials?") and
get the same answer from one function: the credential headers (Authorization,
Proxy-Authorization, X-Api-Key and the headers named in ``redact_headers``, never
Cookie) and the secret query parameters, by name and value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

import idempotently
from idempotently import profiles
from idempotently._credentials import NOT_CREDENTIAL_HEADERS, credential_names
from idempotently._keys import redaction_set
from idempotently._secret_params import secret_param_names
from tests.support import FakeTime

URL = "https://api.example.test/v1/charges"
BOUND = attrs.evolve(profiles.GENERIC, name="bound", key_bound_to_credentials=True)
ONE_TRY = idempotently.RetryPolicy(max_attempts=1, budget=None)
BASE = {
    "Authorization": "Bearer tenant-a",
    "X-Api-Key": "key-1",
    "Cookie": "session=1",
    "X-Tenant-Secret": "s-1",
}


def test_what_counts_as_a_requests_credentials() -> None:
    """The credential headers (built-in and redacted ones, Cookie never) and the secret
    query parameters the request carries, by name, sorted; nothing else."""
    request = httpx.Request(
        "POST",
        f"{URL}?page=2&API_KEY=k&token=t",
        headers={
            "Authorization": "Bearer a",
            "Proxy-Authorization": "Basic b",
            "X-Api-Key": "c",
            "Cookie": "session=d",
            "X-Tenant-Secret": "e",
            "X-Trace": "f",
        },
    )
    names = credential_names(
        request, redaction_set(["X-Tenant-Secret", "Cookie"]), secret_param_names()
    )
    assert (
        "header:authorization",
        "header:proxy-authorization",
        "header:x-api-key",
        "header:x-tenant-secret",
        "query:API_KEY",
        "query:token",
    ) == names
    assert frozenset({"cookie"}) == NOT_CREDENTIAL_HEADERS


def answering(*statuses: int) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    sent: list[httpx.Request] = []
    queue = list(statuses)

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        status = queue.pop(0) if queue else 201
        headers = {"Retry-After": "600"} if status == 429 else {}
        return httpx.Response(status, headers=headers)

    return httpx.MockTransport(handler), sent


def session(path: Path, fake_time: FakeTime, transport: httpx.MockTransport) -> Any:
    return idempotently.Session(
        path,
        transport=transport,
        profile=BOUND,
        policy=ONE_TRY,
        redact_headers=["X-Tenant-Secret"],
        clock=fake_time.clock,
        sleep=fake_time.sleep,
    )


@pytest.mark.parametrize(
    ("changed", "same"),
    [
        ({"Authorization": "Bearer tenant-b"}, False),
        ({"X-Api-Key": "other"}, False),
        ({"X-Tenant-Secret": "s-2"}, False),
        ({"Cookie": "session=2"}, True),
        ({"X-Trace": "t-2"}, True),
    ],
    ids=["authorization", "x-api-key", "redacted-header", "cookie", "other-header"],
)
def test_a_pause_and_a_bound_key_agree_on_what_changed_credentials(
    tmp_path: Path, fake_time: FakeTime, changed: dict[str, str], same: bool
) -> None:
    """Change one header: a bound key is resent under it exactly when a pause answered
    to the old headers still applies to it (Cookie and ordinary headers change
    neither; a credential header changes both)."""
    other = {**BASE, **changed}
    transport, sent = answering(503, 201)
    with session(tmp_path / "bound.db", fake_time, transport) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={}, operation_id="op", headers=BASE)
        try:
            resent = s.post(URL, json={}, operation_id="op", headers=other).status_code == 201
        except idempotently.CredentialsMismatchError:
            resent = False
    assert (same, 1 + same) == (resent, len(sent))

    transport, sent = answering(429, 201)
    with session(tmp_path / "paused.db", fake_time, transport) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(URL, json={}, operation_id="limited", headers=BASE)
        try:
            s.post(URL, json={}, operation_id="next", headers=other)
            paused = False
        except idempotently.RetryLaterError:
            paused = True
    assert (same, 2 - same) == (paused, len(sent))


@pytest.mark.parametrize(
    ("query", "paused"),
    [("?api_key=other", False), ("?api_key=k", True), ("?api_key=k&page=2", True)],
    ids=["other-secret-param", "same-secret-param", "ordinary-param"],
)
def test_a_pause_is_scoped_to_secret_query_parameters_only(
    tmp_path: Path, fake_time: FakeTime, query: str, paused: bool
) -> None:
    """A pause answered to ``?api_key=k`` applies to another request with that key,
    whatever its other query parameters (a list's next page is paused too), and not to
    one with another API key."""
    transport, sent = answering(429, 201)
    with session(tmp_path / "j.db", fake_time, transport) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post(f"{URL}?api_key=k&page=1", json={}, headers=BASE)
        try:
            s.post(f"{URL}{query}", json={}, headers=BASE)
            was_paused = False
        except idempotently.RetryLaterError:
            was_paused = True
    assert (paused, 2 - paused) == (was_paused, len(sent))
