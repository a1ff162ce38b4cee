"""ServerProfile(attempt_header=...): each send carries its attempt's number, counted
from the journal across processes, outside the request's identity.

The server sees ``Idempotency-Attempt: 1``, ``2``, ... on the sends of one operation
(``; max=M`` only when a cross-process maximum applies); a resume in another process
continues the count; the header is neither journaled nor fingerprinted, so a call
again after a crash is never taken for another request under the key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import pytest

import idempotently
from idempotently import profiles
from idempotently._attempt_header import attempt_maximum, attempt_value
from idempotently._profiles import profile_from_spec, profile_spec
from tests.scripted_server import Answer, ScriptedApp

HEADER = "Idempotency-Attempt"
COUNTED = attrs.evolve(profiles.GENERIC, name="counted", attempt_header=HEADER)
POLICY = idempotently.RetryPolicy(max_attempts=3, initial_backoff=0.0, budget=None)
REPO = Path(__file__).resolve().parents[1]


def attempts_seen(app: ScriptedApp) -> list[str | None]:
    """The attempt header of every request that reached the server, in order."""
    return [dict(arrival.headers).get(HEADER.lower()) for arrival in app.arrivals]


def test_each_send_of_a_call_carries_its_number(
    scripted: tuple[ScriptedApp, str], journal_target: str
) -> None:
    """Answered 503, 503, 201: the server sees attempts 1, 2 and 3, under one key."""
    app, url = scripted
    app.answer(Answer(503), Answer(503), Answer(201))
    with idempotently.Session(journal_target, profile=COUNTED, policy=POLICY) as session:
        response = session.post(f"{url}/charges", json={"amount": 1}, operation_id="order-1")
    assert (201, ["1", "2", "3"]) == (response.status_code, attempts_seen(app))
    assert 1 == len({arrival.key for arrival in app.arrivals})


def test_a_transport_sends_it_too(scripted: tuple[ScriptedApp, str], tmp_path: Path) -> None:
    """Through a Transport (the SDK path), a retry carries attempt 2."""
    app, url = scripted
    app.answer(Answer(503), Answer(201))
    transport = idempotently.Transport(tmp_path / "j.db", profile=COUNTED, policy=POLICY)
    with httpx.Client(transport=transport) as client:
        response = client.post(f"{url}/charges", json={"amount": 1})
    assert (201, ["1", "2"]) == (response.status_code, attempts_seen(app))


@pytest.mark.anyio
async def test_an_async_transport_sends_it_too(
    scripted: tuple[ScriptedApp, str], tmp_path: Path, anyio_backend: str
) -> None:
    """Through an AsyncTransport, on asyncio and trio, a retry carries attempt 2."""
    app, url = scripted
    app.answer(Answer(503), Answer(201))
    transport = idempotently.AsyncTransport(
        tmp_path / "j.db", profile=COUNTED, policy=POLICY, sleep=anyio.sleep
    )
    async with httpx.AsyncClient(transport=transport) as client:
        response = await client.post(f"{url}/charges", json={"amount": 1})
    assert (201, ["1", "2"]) == (response.status_code, attempts_seen(app))


def test_a_resume_in_another_process_continues_the_count(
    scripted: tuple[ScriptedApp, str], journal_target: str
) -> None:
    """Two attempts answered 503 leave the operation pending; `idempotently resume` in
    another process sends attempt 3, from the journal's count and its stored profile."""
    app, url = scripted
    app.answer(Answer(503), Answer(503), Answer(201))
    two = attrs.evolve(POLICY, max_attempts=2)
    with (
        idempotently.Session(journal_target, profile=COUNTED, policy=two) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post(f"{url}/charges", json={"amount": 1}, operation_id="order-1")
    resumed = subprocess.run(
        [sys.executable, "-m", "idempotently", "--journal", journal_target, "resume", "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=120,
        check=False,
    )
    assert 0 == resumed.returncode, resumed.stderr
    assert ["1", "2", "3"] == attempts_seen(app)
    assert "succeeded" == idempotently.Journal(journal_target).operation("order-1").status


def test_a_call_again_after_a_crash_continues_and_is_not_key_reuse(
    scripted: tuple[ScriptedApp, str], tmp_path: Path
) -> None:
    """A call left pending, called again with its operation id (its own header value
    changed, too): attempt 2 is sent under the same key, no KeyReuseError."""
    app, url = scripted
    app.answer(Answer(503), Answer(201))
    once = attrs.evolve(POLICY, max_attempts=1)
    with idempotently.Session(tmp_path / "j.db", profile=COUNTED, policy=once) as session:
        with pytest.raises(idempotently.OperationPendingError):
            session.post(f"{url}/c", json={"a": 1}, operation_id="op", headers={HEADER: "7"})
        response = session.post(f"{url}/c", json={"a": 1}, operation_id="op", headers={HEADER: "8"})
    assert (201, ["1", "2"]) == (response.status_code, attempts_seen(app))
    assert 1 == len({arrival.key for arrival in app.arrivals})


def test_a_resume_that_fingerprints_the_stored_profiles_attempt_header_still_sends(
    scripted: tuple[ScriptedApp, str], tmp_path: Path
) -> None:
    """A resume by a session configured apart (fingerprint_headers naming the header, a
    request hook on its client, so each send is gated) sends attempt 2: the number the
    flow sets is not a change the gate refuses."""
    app, url = scripted
    app.answer(Answer(503), Answer(201))
    once = attrs.evolve(POLICY, max_attempts=1)
    with (
        idempotently.Session(tmp_path / "j.db", profile=COUNTED, policy=once) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post(f"{url}/c", json={"a": 1}, operation_id="op")
    hooked = httpx.Client(event_hooks={"request": [lambda request: None]})
    with idempotently.Session(
        tmp_path / "j.db", client=hooked, policy=once, fingerprint_headers=[HEADER]
    ) as worker:
        [result] = worker.resume()
    assert ("succeeded", ["1", "2"]) == (result.action, attempts_seen(app))


def test_the_header_is_neither_journaled_nor_fingerprinted(
    scripted: tuple[ScriptedApp, str], tmp_path: Path
) -> None:
    """A caller's own value is replaced on the wire and kept out of the journal: the
    operation's stored headers and fingerprint are those of the request without it."""
    app, url = scripted
    app.answer(Answer(201), Answer(201))
    with idempotently.Session(tmp_path / "j.db", profile=COUNTED, policy=POLICY) as session:
        session.post(f"{url}/c", json={"a": 1}, operation_id="with", headers={HEADER: "99"})
    with idempotently.Session(tmp_path / "j.db", policy=POLICY) as session:
        session.post(f"{url}/c", json={"a": 1}, operation_id="without")
    journal = idempotently.Journal(tmp_path / "j.db")
    counted, plain = journal.operation("with"), journal.operation("without")
    assert ["1", None] == attempts_seen(app)
    assert [] == [name for name, _ in counted.request_headers if name.lower() == HEADER.lower()]
    assert plain.fingerprint == counted.fingerprint


def test_off_by_default(scripted: tuple[ScriptedApp, str], tmp_path: Path) -> None:
    """No built-in profile sends an attempt header."""
    app, url = scripted
    assert [] == [p.name for p in profiles.BUILTIN_PROFILES.values() if p.attempt_header]
    with idempotently.Session(tmp_path / "j.db", policy=POLICY) as session:
        session.post(f"{url}/c", json={}, operation_id="op")
    assert [None] == attempts_seen(app)


def test_max_is_given_only_when_a_maximum_applies() -> None:
    """``n`` alone without a cross-process maximum; ``n; max=M`` with one."""
    capped = attrs.evolve(POLICY, max_total_attempts=5)
    assert (None, "3") == (attempt_maximum(POLICY), attempt_value(3, None))
    assert (5, "3; max=5") == (attempt_maximum(capped), attempt_value(3, 5))


class RefusedOnce(httpx.BaseTransport):
    """Refuses the first connection (nothing sent), then sends for real."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.refused = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not self.refused:
            self.refused = True
            raise httpx.ConnectError("connection refused", request=request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_under_a_cap_the_number_counts_what_the_cap_counts(
    scripted: tuple[ScriptedApp, str], journal_target: str
) -> None:
    """With max_total_attempts=3, an attempt never sent takes no number and the server
    sees 1, 2, 3 of 3 (never a number above its max) before the cap ends the operation."""
    app, url = scripted
    app.answer(Answer(503), Answer(503), Answer(503))
    policy = attrs.evolve(POLICY, max_attempts=10, max_total_attempts=3)
    client = httpx.Client(transport=RefusedOnce())
    session = idempotently.Session(journal_target, client=client, profile=COUNTED, policy=policy)
    with session as s, pytest.raises(idempotently.AttemptsCapError):
        s.post(f"{url}/charges", json={"amount": 1}, operation_id="order-cap")
    assert ["1; max=3", "2; max=3", "3; max=3"] == attempts_seen(app)


@pytest.mark.parametrize(
    ("value", "wrong"),
    [
        ("Idempotency-Key", "key_header"),
        ("idempotency-key", "key_header"),
        ("Idempotent-Replayed", "replay_headers"),
        ("Stripe-Should-Retry", "retry_hint_headers"),
        ("", "header name"),
        ("Bad Header", "header name"),
        ("X:1", "header name"),
        (3, "header name"),
        (True, "header name"),
        (b"X-Attempt", "header name"),
    ],
)
def test_a_header_that_is_not_its_own_is_refused(value: Any, wrong: str) -> None:
    """Not a header name, or one the profile already uses: a one-line ValueError."""
    with pytest.raises(ValueError, match=wrong):
        attrs.evolve(profiles.GENERIC, name="x", attempt_header=value)


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("Authorization", "credentials"),
        ("x-api-key", "credentials"),
        ("Cookie", "credentials"),
        ("Content-Length", "framing"),
        ("Content-Type", "body"),
        ("Host", "framing"),
        ("Transfer-Encoding", "framing"),
        ("Idempotency-Operation-Id", "idempotently's own"),
        ("Idempotency-Policy", "idempotently's own"),
    ],
)
def test_a_header_the_request_needs_is_refused(name: str, what: str) -> None:
    """The flow deletes the caller's value of the attempt header and sends the number in
    its place: naming the request's credentials, framing, body type or one of the
    library's own headers would send ``Authorization: 1`` or ``Content-Length: 1``."""
    with pytest.raises(ValueError, match=f"{name!r} is.*{what}") as refused:
        attrs.evolve(profiles.GENERIC, name="x", attempt_header=name)
    assert "\n" not in str(refused.value)


def test_a_fingerprinted_attempt_header_is_refused(tmp_path: Path) -> None:
    """fingerprint_headers naming the attempt header would make every resend another
    request: refused before the journal is opened."""
    with pytest.raises(ValueError, match="leave it out of fingerprint_headers"):
        idempotently.Session(
            tmp_path / "j.db", profile=COUNTED, fingerprint_headers=["idempotency-attempt"]
        )
    assert not (tmp_path / "j.db").exists()


def test_a_redacted_attempt_header_is_refused(tmp_path: Path) -> None:
    """redact_headers makes a header a credential: one that changes on every attempt
    would bind the key to attempt 1 (attempt 2 refused as other credentials) and scope
    each origin pause to one attempt. Refused before the journal is opened."""
    for make in (idempotently.Session, idempotently.Transport):
        with pytest.raises(ValueError, match="leave it out of redact_headers"):
            make(tmp_path / "j.db", profile=COUNTED, redact_headers=["X-Secret", HEADER.upper()])
    assert not (tmp_path / "j.db").exists()


def test_a_per_request_profile_with_a_redacted_attempt_header_is_refused(
    scripted: tuple[ScriptedApp, str], tmp_path: Path
) -> None:
    """A Session call's profile= and a Transport request's extensions profile whose
    attempt header the session redacts: a ValueError, nothing journaled or sent."""
    app, url = scripted
    redacted = {"redact_headers": [HEADER], "policy": POLICY}
    with (
        idempotently.Session(tmp_path / "j.db", **redacted) as session,
        pytest.raises(ValueError, match="leave it out of redact_headers"),
    ):
        session.post(f"{url}/c", json={}, profile=COUNTED)
    with (
        httpx.Client(transport=idempotently.Transport(tmp_path / "j.db", **redacted)) as client,
        pytest.raises(ValueError, match="leave it out of redact_headers"),
    ):
        client.post(f"{url}/c", json={}, extensions={"idempotently": {"profile": COUNTED}})
    assert ([], []) == (app.arrivals, idempotently.Journal(tmp_path / "j.db").operations())


def test_the_profile_round_trips_through_the_journal() -> None:
    """Journaled with its profile (so a resume sends it); a profile without it is
    journaled as before."""
    assert COUNTED == profile_from_spec(profile_spec(COUNTED))
    assert "attempt_header" not in json.loads(profile_spec(profiles.GENERIC))


def test_a_call_profile_with_a_fingerprinted_attempt_header_is_refused(tmp_path: Path) -> None:
    """post(..., profile=) whose attempt header the session fingerprints: a ValueError
    before anything is journaled or sent."""
    sent: list[httpx.Request] = []
    mock = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(201))
    with (
        idempotently.Session(
            tmp_path / "j.db", transport=mock, fingerprint_headers=[HEADER]
        ) as session,
        pytest.raises(ValueError, match="leave it out of fingerprint_headers"),
    ):
        session.post("https://api.example.test/c", json={}, profile=COUNTED)
    assert ([], []) == (sent, idempotently.Journal(tmp_path / "j.db").operations())


def test_a_watch_worker_continues_the_count(
    scripted: tuple[ScriptedApp, str], tmp_path: Path
) -> None:
    """A `watch` worker (a session with the generic profile) resumes an operation two
    attempts in: it sends attempt 3, by the operation's journaled profile."""
    app, url = scripted
    app.answer(Answer(503), Answer(503), Answer(201))
    two = attrs.evolve(POLICY, max_attempts=2)
    with (
        idempotently.Session(tmp_path / "j.db", profile=COUNTED, policy=two) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post(f"{url}/charges", json={"amount": 1}, operation_id="order-1")
    stop = threading.Event()
    results: list[idempotently.ResumeResult] = []

    def finished(result: idempotently.ResumeResult) -> None:
        results.append(result)
        stop.set()

    with idempotently.Session(tmp_path / "j.db", policy=POLICY, host_id="worker-1") as worker:
        worker.watch(stop, interval=0.05, on_result=finished)
    assert (["succeeded"], ["1", "2", "3"]) == (
        [result.action for result in results],
        attempts_seen(app),
    )
