"""Per-request overrides through Transport and AsyncTransport (the path every SDK takes).

httpx's own ``extensions["timeout"]`` is journaled with the operation, so a resume
applies it; ``extensions["idempotently"] = {"policy": ..., "profile": ...}`` carries
the rest; ``Transport(policies={"slow": ...})`` plus the header ``Idempotency-Policy:
slow`` serves SDKs that can pass only headers, and that header never reaches the
server nor the journal. What cannot be honoured is refused before anything is journaled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import idempotently
from idempotently import profiles
from tests.scripted_server import Answer, ScriptedApp

STRICT = idempotently.RetryPolicy(max_attempts=1, initial_backoff=0.0, budget=None)
PATIENT = idempotently.RetryPolicy(max_attempts=4, initial_backoff=0.0, budget=None)
X_KEY = attrs.evolve(profiles.GENERIC, name="x-key", key_header="X-Key")
SLOW_SERVER = attrs.evolve(profiles.GENERIC, name="slow-server", in_progress_timeout=None)


def header_seen(app: ScriptedApp, name: str) -> list[str | None]:
    return [dict(arrival.headers).get(name.lower()) for arrival in app.arrivals]


def transport(journal: Path | str, **options: Any) -> idempotently.Transport:
    options.setdefault("policy", STRICT)
    return idempotently.Transport(journal, **options)


def test_a_named_policy_is_picked_by_header_and_never_reaches_the_server(
    scripted: tuple[ScriptedApp, str], tmp_path: Path
) -> None:
    """``Idempotency-Policy: patient`` gives the request four attempts instead of one; the
    header is neither sent nor journaled, and the policy is journaled for resume."""
    app, url = scripted
    app.answer(Answer(503), Answer(503), Answer(503), Answer(201))
    with httpx.Client(transport=transport(tmp_path / "j.db", policies={"patient": PATIENT})) as c:
        response = c.post(f"{url}/c", json={}, headers={"Idempotency-Policy": "patient"})
    [operation] = idempotently.Journal(tmp_path / "j.db").operations()
    assert (201, 4) == (response.status_code, len(app.arrivals))
    assert [None] * 4 == header_seen(app, "Idempotency-Policy")
    assert [] == [n for n, _ in operation.request_headers if n.lower() == "idempotency-policy"]
    assert 4 == json.loads(operation.overrides or "{}")["policy"]["max_attempts"]


@pytest.mark.anyio
async def test_an_async_transport_picks_a_named_policy_too(
    scripted: tuple[ScriptedApp, str], tmp_path: Path, anyio_backend: str
) -> None:
    """On asyncio and trio: four attempts, the header never sent."""
    app, url = scripted
    app.answer(Answer(503), Answer(503), Answer(503), Answer(201))
    async_transport = idempotently.AsyncTransport(
        tmp_path / "j.db", policy=STRICT, policies={"patient": PATIENT}, sleep=anyio.sleep
    )
    async with httpx.AsyncClient(transport=async_transport) as client:
        response = await client.post(f"{url}/c", json={}, headers={"Idempotency-Policy": "patient"})
    assert (201, [None] * 4) == (response.status_code, header_seen(app, "Idempotency-Policy"))


def test_an_unknown_policy_name_is_refused_before_anything_is_journaled(
    scripted: tuple[ScriptedApp, str], tmp_path: Path
) -> None:
    """A name the Transport does not know: a ValueError naming the known ones, the
    operation and key; nothing journaled or sent."""
    app, url = scripted
    with (
        httpx.Client(transport=transport(tmp_path / "j.db", policies={"patient": PATIENT})) as c,
        pytest.raises(ValueError, match="'slow' names no policy") as refused,
    ):
        c.post(
            f"{url}/c",
            json={},
            headers={"Idempotency-Policy": "slow", "Idempotency-Key": "k-1"},
        )
    assert "it knows 'patient'" in str(refused.value)
    assert "key 'k-1'" in str(refused.value)
    assert ([], []) == (app.arrivals, idempotently.Journal(tmp_path / "j.db").operations())


def test_a_refusal_names_the_key_in_the_profiles_own_key_header(
    scripted: tuple[ScriptedApp, str], tmp_path: Path
) -> None:
    """Through a Transport whose profile carries the key in ``X-Key``, a refused request
    names that key, as one under ``Idempotency-Key`` does."""
    app, url = scripted
    with (
        httpx.Client(
            transport=transport(tmp_path / "j.db", profile=X_KEY, policies={"patient": PATIENT})
        ) as client,
        pytest.raises(ValueError, match="names no policy") as refused,
    ):
        client.post(f"{url}/c", json={}, headers={"Idempotency-Policy": "slow", "X-Key": "k-9"})
    assert "(key 'k-9')" in str(refused.value)
    assert ([], []) == (app.arrivals, idempotently.Journal(tmp_path / "j.db").operations())


@pytest.mark.anyio
async def test_an_async_refusal_journals_nothing(
    scripted: tuple[ScriptedApp, str], tmp_path: Path, anyio_backend: str
) -> None:
    """On asyncio and trio, an unknown name is refused before anything is journaled."""
    app, url = scripted
    async_transport = idempotently.AsyncTransport(tmp_path / "j.db", sleep=anyio.sleep)
    async with httpx.AsyncClient(transport=async_transport) as client:
        with pytest.raises(ValueError, match="Transport\\(policies="):
            await client.post(f"{url}/c", json={}, headers={"Idempotency-Policy": "slow"})
    assert ([], []) == (app.arrivals, idempotently.Journal(tmp_path / "j.db").operations())


@pytest.mark.parametrize(
    ("policies", "error", "says"),
    [
        ([("slow", PATIENT)], TypeError, "policies must be a mapping"),
        ({"": PATIENT}, ValueError, "policies names"),
        ({"a b": PATIENT}, ValueError, "policies names"),
        ({"x" * 65: PATIENT}, ValueError, "policies names"),
        ({1: PATIENT}, ValueError, "policies names"),
        ({"slow": "RetryPolicy()"}, TypeError, "policies\\['slow'\\]: policy must be"),
        ({"slow": 3}, TypeError, "policies\\['slow'\\]"),
        ({"slow": attrs.evolve(PATIENT, wait=lambda _: 1.0)}, ValueError, "cannot be journaled"),
    ],
)
def test_policies_are_checked_at_construction(
    policies: Any, error: type[Exception], says: str, tmp_path: Path
) -> None:
    """Each name one a header can carry, each policy one that can be journaled: a clear
    one-line error before the journal is opened."""
    with pytest.raises(error, match=says):
        transport(tmp_path / "j.db", policies=policies)
    assert not (tmp_path / "j.db").exists()


def test_the_extension_policy_and_profile_apply(
    scripted: tuple[ScriptedApp, str], tmp_path: Path
) -> None:
    """extensions={"idempotently": {"policy": ..., "profile": ...}}: two attempts, the key
    in the profile's header, the profile journaled with the operation."""
    app, url = scripted
    app.answer(Answer(503), Answer(201))
    asked = {"policy": attrs.evolve(PATIENT, max_attempts=2), "profile": X_KEY}
    with httpx.Client(transport=transport(tmp_path / "j.db")) as c:
        response = c.post(f"{url}/c", json={}, extensions={"idempotently": asked})
    [operation] = idempotently.Journal(tmp_path / "j.db").operations()
    assert (201, 2) == (response.status_code, len(app.arrivals))
    assert [operation.key] * 2 == header_seen(app, "X-Key")
    assert "x-key" == json.loads(operation.profile)["name"]


@pytest.mark.parametrize(
    ("extension", "headers", "error", "says"),
    [
        ("slow", {}, TypeError, "must be a dict"),
        ({"polcy": PATIENT}, {}, ValueError, "'polcy', which this version does not know"),
        ({"policy": "slow"}, {}, TypeError, "policy must be an idempotently.RetryPolicy"),
        ({"policy": attrs.evolve(PATIENT, stop=lambda _: True)}, {}, ValueError, "journaled"),
        ({"profile": "stripe"}, {}, TypeError, "profile must be an idempotently.ServerProfile"),
        (
            {"policy": PATIENT},
            {"Idempotency-Policy": "patient"},
            ValueError,
            "both give this request a policy",
        ),
    ],
)
def test_bad_extensions_are_refused_before_anything_is_journaled(
    extension: Any,
    headers: dict[str, str],
    error: type[Exception],
    says: str,
    scripted: tuple[ScriptedApp, str],
    tmp_path: Path,
) -> None:
    """Unknown keys, wrong types, a policy given twice: refused, naming the operation;
    nothing journaled or sent."""
    app, url = scripted
    with (
        httpx.Client(transport=transport(tmp_path / "j.db", policies={"patient": PATIENT})) as c,
        pytest.raises(error, match=says) as refused,
    ):
        c.post(
            f"{url}/c",
            json={},
            headers={**headers, "Idempotency-Operation-Id": "order-7"},
            extensions={"idempotently": extension},
        )
    assert "operation 'order-7'" in str(refused.value)
    assert ([], []) == (app.arrivals, idempotently.Journal(tmp_path / "j.db").operations())


class Recording(httpx.BaseTransport):
    """Sends through a real HTTPTransport, keeping the timeouts each request carried."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.timeouts: list[dict[str, float | None]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.timeouts.append(dict(request.extensions.get("timeout") or {}))
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_the_request_timeout_is_journaled_and_applied_by_resume(
    scripted: tuple[ScriptedApp, str], journal_target: str
) -> None:
    """A request sent with timeout=7.25 (the client's is 3.5) is journaled with it; a
    resume whose client says 20 s sends it with 7.25."""
    app, url = scripted
    app.answer(Answer(503), Answer(201))
    with (
        httpx.Client(transport=transport(journal_target), timeout=3.5) as client,
        pytest.raises(idempotently.OperationPendingError),
    ):
        client.post(f"{url}/c", json={}, timeout=7.25, headers={"Idempotency-Operation-Id": "op"})
    stored = json.loads(idempotently.Journal(journal_target).operation("op").overrides or "{}")
    assert {"connect": 7.25, "read": 7.25, "write": 7.25, "pool": 7.25} == stored["timeout"]
    recording = Recording()
    with idempotently.Session(journal_target, transport=recording, timeout=20.0) as session:
        [result] = session.resume()
    assert ("succeeded", 2) == (result.status, len(app.arrivals))
    assert [{"connect": 7.25, "read": 7.25, "write": 7.25, "pool": 7.25}] == recording.timeouts


@pytest.mark.parametrize("timeouts", [httpx.Timeout(5.0), [5.0], 5.0])
def test_a_timeout_extension_that_is_no_dict_is_refused_before_anything_is_journaled(
    timeouts: Any, scripted: tuple[ScriptedApp, str], tmp_path: Path
) -> None:
    """extensions={"timeout": httpx.Timeout(5.0)} (httpx wants its ``as_dict()``): a
    TypeError saying what to pass, not an AttributeError; nothing journaled or sent,
    through a Transport and a Session alike."""
    app, url = scripted
    with (
        httpx.Client(transport=transport(tmp_path / "j.db")) as client,
        pytest.raises(TypeError, match='extensions\\["timeout"\\] must be a dict'),
    ):
        client.post(f"{url}/c", json={}, extensions={"timeout": timeouts})
    with (
        idempotently.Session(tmp_path / "j.db") as session,
        pytest.raises(TypeError, match="pass timeout="),
    ):
        session.post(f"{url}/c", json={}, extensions={"timeout": timeouts})
    assert ([], []) == (app.arrivals, idempotently.Journal(tmp_path / "j.db").operations())


def test_a_profile_that_differs_from_the_journaled_one_is_refused_without_sending(
    scripted: tuple[ScriptedApp, str], tmp_path: Path
) -> None:
    """An operation journaled under the generic profile, continued with the same key and
    another profile: StoredProfileError naming the field, nothing sent; continued with
    the same profile, it is sent."""
    app, url = scripted
    app.answer(Answer(503), Answer(201))
    keyed = {"Idempotency-Key": "k-42"}
    with httpx.Client(transport=transport(tmp_path / "j.db")) as c:
        with pytest.raises(idempotently.OperationPendingError):
            c.post(f"{url}/c", json={}, headers=keyed)
        with pytest.raises(idempotently.StoredProfileError, match="in_progress_timeout") as refused:
            c.post(
                f"{url}/c",
                json={},
                headers=keyed,
                extensions={"idempotently": {"profile": SLOW_SERVER}},
            )
        assert 'leave "profile" out of the request' in refused.value.message
        assert 1 == len(app.arrivals)
        same = {"profile": profiles.GENERIC}
        response = c.post(f"{url}/c", json={}, headers=keyed, extensions={"idempotently": same})
    assert (201, 2) == (response.status_code, len(app.arrivals))


@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_reads_and_passed_through_requests_never_send_the_header(
    method: str, scripted: tuple[ScriptedApp, str], tmp_path: Path
) -> None:
    """A GET (retried by the named policy) and a PUT (passed through) leave without it."""
    app, url = scripted
    app.answer(Answer(503), Answer(200))
    with httpx.Client(transport=transport(tmp_path / "j.db", policies={"patient": PATIENT})) as c:
        response = c.request(method, f"{url}/c", headers={"Idempotency-Policy": "patient"})
    expected = (200, 2) if method == "GET" else (503, 1)
    assert expected == (response.status_code, len(app.arrivals))
    assert [None] * expected[1] == header_seen(app, "Idempotency-Policy")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(name=st.text(st.characters(min_codepoint=0x21, max_codepoint=0xFF), min_size=1, max_size=80))
def test_any_name_but_a_known_one_is_refused_and_shown_safely(name: str, tmp_path: Path) -> None:
    """Whatever an SDK puts in Idempotency-Policy, a name not registered is a one-line
    ValueError quoting at most 70 characters of it; nothing is journaled or sent."""
    sent: list[httpx.Request] = []
    mock = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(201))
    journal = tmp_path / f"{len(sent)}-{abs(hash(name))}.db"
    with httpx.Client(transport=transport(journal, transport=mock, policies={"p": PATIENT})) as c:
        if name.strip(" \t") == "p":
            return
        with pytest.raises(ValueError, match="names no policy") as refused:
            c.post(
                "https://api.example.test/c",
                json={},
                headers={"Idempotency-Policy": name.encode("latin-1")},
            )
    message = str(refused.value)
    assert ("\n" not in message, len(message) < 400) == (True, True)
    assert ([], []) == (sent, idempotently.Journal(journal).operations())
