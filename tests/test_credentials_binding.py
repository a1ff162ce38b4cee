"""ServerProfile(key_bound_to_credentials=True): a key is resent only with its credentials.

Some servers store a key per API token, so a resend under a rotated token is a
new request there: a second charge. Such an operation journals a salted scrypt
digest of the credentials it was made with (never their values); a resume or a
call whose credentials digest differently sends nothing, says why, and leaves
it pending, to be sent once the original credentials are given.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sqlite3
import threading
import time
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import pytest
from click.testing import CliRunner

import idempotently
from idempotently import _credentials, profiles
from idempotently._commands import BindCredentials
from idempotently._gate import CREDENTIALS_DIFFER
from idempotently.cli import cli
from idempotently.testing import serve
from tests.at_rest import stored_bytes, stored_column
from tests.crash_child import USER
from tests.scripted_server import RESET, Answer, ScriptedApp
from tests.test_crash_safety import charge_args, run_worker

BOUND = attrs.evolve(profiles.GENERIC, name="bound", key_bound_to_credentials=True)
TOKEN = "Bearer sk_live_original_4242"
ROTATED = "Bearer sk_live_rotated_9999"
ONE_TRY = idempotently.RetryPolicy(max_attempts=1)
CHARGE = {"amount": 1000}


def lost_answer(target: str, url: str, app: ScriptedApp, **options: Any) -> None:
    """Journal operation ``op`` under TOKEN: sent once, its answer lost (pending)."""
    app.answer(RESET)
    options = {"headers": {"Authorization": TOKEN}, "profile": BOUND, **options}
    with (
        idempotently.Session(target, base_url=url, policy=ONE_TRY, **options) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post("/v1/charges", json=CHARGE, operation_id="op")


def status(target: str) -> str:
    with idempotently.Journal(target, create=False) as journal:
        found = journal.operation("op")
    assert found is not None
    return found.status


def test_a_bound_key_journals_a_digest_of_the_credentials_never_their_value(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The row names what was digested and holds the scrypt digest; the token is nowhere
    in the store. A profile that does not bind keys journals no digest."""
    _app, url = scripted
    with idempotently.Session(
        journal_target, base_url=url, headers={"Authorization": TOKEN}, profile=BOUND
    ) as session:
        session.post("/v1/charges", json=CHARGE, operation_id="op")
    with idempotently.Session(
        journal_target, base_url=url, headers={"Authorization": TOKEN}
    ) as session:
        session.post("/v1/charges", json=CHARGE, operation_id="unbound")
    record = json.loads(stored_column(journal_target, "op", "credentials_digest"))
    assert ["header:authorization"] == record["names"]
    assert 64 == len(record["digest"])
    assert None is stored_column(journal_target, "unbound", "credentials_digest")
    assert TOKEN.split()[1].encode() not in stored_bytes(journal_target)
    shown = CliRunner().invoke(cli, ["--journal", journal_target, "show", "op"])
    assert "key bound to\tthe authorization header (a salted digest" in shown.output
    assert TOKEN.split()[1] not in shown.output


def test_resume_with_other_credentials_sends_nothing_and_says_why(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """A rotated token: not_sent, "credentials differ from those it was made with", still
    pending. The original token again: sent once, with the same key."""
    app, url = scripted
    lost_answer(journal_target, url, app)
    with idempotently.Session(
        journal_target, base_url=url, headers={"Authorization": ROTATED}
    ) as session:
        (refused,) = session.resume()
    assert ("not_sent", "pending") == (refused.action, refused.status)
    assert "credentials differ from those it was made with" in refused.detail
    assert 1 == len(app.arrivals)
    assert "pending" == status(journal_target)
    with idempotently.Session(
        journal_target, base_url=url, headers={"Authorization": TOKEN}
    ) as session:
        (result,) = session.resume()
    assert "succeeded" == result.action
    first, second = app.arrivals
    assert (first.key, TOKEN) == (second.key, second.authorization)


def test_a_call_again_with_other_credentials_raises_and_sends_nothing(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The same operation_id under a rotated token: CredentialsMismatchError (an
    OperationPendingError) naming the operation and its key; nothing sent."""
    app, url = scripted
    lost_answer(journal_target, url, app)
    with (
        idempotently.Session(
            journal_target, base_url=url, headers={"Authorization": ROTATED}, profile=BOUND
        ) as session,
        pytest.raises(idempotently.CredentialsMismatchError) as caught,
    ):
        session.post("/v1/charges", json=CHARGE, operation_id="op")
    assert isinstance(caught.value, idempotently.OperationPendingError)
    assert "op" == caught.value.operation_id and caught.value.key == app.arrivals[0].key
    assert "credentials differ from those it was made with" in str(caught.value)
    assert ROTATED not in str(caught.value) and TOKEN not in str(caught.value)
    assert 1 == len(app.arrivals)


def test_missing_credentials_differ_too(tmp_path: Path, scripted: tuple[ScriptedApp, str]) -> None:
    """A resume with no Authorization at all is refused like one with another token."""
    app, url = scripted
    target = str(tmp_path / "j.db")
    lost_answer(target, url, app)
    with idempotently.Session(target, base_url=url) as session:
        (refused,) = session.resume()
    assert ("not_sent", 1) == (refused.action, len(app.arrivals))


def test_a_bound_operation_past_its_key_lifetime_goes_to_reconciliation(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """Its key's lifetime runs out as any pending operation's: needs_reconcile, unsent,
    whatever credentials the resume has."""
    app, url = scripted
    target = str(tmp_path / "j.db")
    lost_answer(target, url, app)
    later = time.time() + BOUND.key_lifetime
    with idempotently.Session(
        target, base_url=url, headers={"Authorization": ROTATED}, clock=lambda: later
    ) as session:
        (result,) = session.resume()
    assert ("needs_reconcile", "needs_reconcile") == (result.action, result.status)
    assert 1 == len(app.arrivals)


def test_secret_query_parameters_and_redacted_headers_are_credentials_too(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A header in redact_headers and a redacted ?api_key= are digested with Authorization:
    another api_key is refused, the original one sent."""
    app, url = scripted
    target = str(tmp_path / "j.db")
    lost_answer(
        target,
        url,
        app,
        params={"api_key": "query-secret-1"},
        headers={"Authorization": TOKEN, "X-Partner-Token": "partner-1"},
        redact_headers=["X-Partner-Token"],
    )
    record = json.loads(stored_column(target, "op", "credentials_digest"))
    assert ["header:authorization", "header:x-partner-token", "query:api_key"] == record["names"]
    live = {"headers": {"Authorization": TOKEN, "X-Partner-Token": "partner-1"}}
    with idempotently.Session(
        target, base_url=url, params={"api_key": "query-secret-2"}, **live
    ) as session:
        (refused,) = session.resume()
    with idempotently.Session(
        target, base_url=url, params={"api_key": "query-secret-1"}, **live
    ) as session:
        (result,) = session.resume()
    assert ("not_sent", "succeeded") == (refused.action, result.action)
    assert 2 == len(app.arrivals)


def test_the_digest_is_computed_once_per_credential_value(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """scrypt is slow by design: many calls and a resume under one token compute it once
    (kept in memory); another token is one more."""
    _app, url = scripted
    calls: list[bytes] = []
    real = hashlib.scrypt

    def counting(password: bytes, **options: Any) -> bytes:
        calls.append(password)
        return real(password, **options)

    monkeypatch.setattr(_credentials.hashlib, "scrypt", counting)
    monkeypatch.setattr(_credentials, "_CACHE", type(_credentials._CACHE)())
    with idempotently.Session(
        tmp_path / "j.db", base_url=url, headers={"Authorization": TOKEN}, profile=BOUND
    ) as session:
        for number in range(5):
            session.post("/v1/charges", json=CHARGE, operation_id=f"op-{number}")
        session.resume()
        session.post(
            "/v1/charges", json=CHARGE, operation_id="rotated", headers={"Authorization": ROTATED}
        )
    assert 2 == len(calls)


@pytest.mark.anyio
async def test_async_the_digest_runs_off_the_event_loop_and_binds_the_key(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """AsyncSession on asyncio and trio: scrypt runs in a worker thread, never on the loop;
    a resume with a rotated token sends nothing, the original token sends once."""
    app, url = scripted
    threads: list[threading.Thread] = []
    real = hashlib.scrypt

    def recording(password: bytes, **options: Any) -> bytes:
        threads.append(threading.current_thread())
        return real(password, **options)

    monkeypatch.setattr(_credentials.hashlib, "scrypt", recording)
    monkeypatch.setattr(_credentials, "_CACHE", type(_credentials._CACHE)())
    target = str(tmp_path / "j.db")
    app.answer(RESET)
    loop_thread = threading.current_thread()
    async with idempotently.AsyncSession(
        target, base_url=url, policy=ONE_TRY, headers={"Authorization": TOKEN}, profile=BOUND
    ) as session:
        with pytest.raises(idempotently.OperationPendingError):
            await session.post("/v1/charges", json=CHARGE, operation_id="op")
    async with idempotently.AsyncSession(
        target, base_url=url, headers={"Authorization": ROTATED}
    ) as rotated:
        (refused,) = await rotated.resume()
    async with idempotently.AsyncSession(
        target, base_url=url, headers={"Authorization": TOKEN}
    ) as original:
        (result,) = await original.resume()
    assert ("not_sent", "succeeded") == (refused.action, result.action)
    assert 2 == len(app.arrivals)
    assert threads and loop_thread not in threads
    assert "succeeded" == await anyio.to_thread.run_sync(status, target)


def test_cli_resume_sends_only_with_the_original_credentials(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """`resume --header-env Authorization=...` with a rotated token: not_sent, exit 1;
    with the original: sent, exit 0."""
    app, url = scripted
    lost_answer(journal_target, url, app)
    runner = CliRunner()
    args = ["--journal", journal_target, "resume", "--header-env", "Authorization=API_TOKEN"]
    refused = runner.invoke(cli, [*args, "--json"], env={"API_TOKEN": ROTATED})
    assert (1, 1) == (refused.exit_code, len(app.arrivals)), refused.output
    (result,) = json.loads(refused.stdout)
    assert "not_sent" == result["action"] and "credentials differ" in result["detail"]
    assert ROTATED not in refused.output
    sent = runner.invoke(cli, args, env={"API_TOKEN": TOKEN})
    assert (0, 2) == (sent.exit_code, len(app.arrivals)), sent.output
    assert app.arrivals[0].key == app.arrivals[1].key


def test_cli_resume_with_a_forced_profile_that_binds_nothing_still_checks_the_credentials(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """`resume --profile generic --force-profile` (a profile that binds no key) with a
    rotated token: the key was journaled bound, so it stays bound: not_sent, exit 1,
    nothing reaches the server (before: the forced profile's "not bound" skipped the
    check and the key went out under the other credentials)."""
    app, url = scripted
    lost_answer(journal_target, url, app)
    refused = CliRunner().invoke(
        cli,
        [
            *("--journal", journal_target, "resume", "--json"),
            *("--profile", "generic", "--force-profile"),
            *("--header-env", "Authorization=API_TOKEN"),
        ],
        env={"API_TOKEN": ROTATED},
    )
    assert (1, 1, "pending") == (refused.exit_code, len(app.arrivals), status(journal_target)), (
        refused.output
    )
    (result,) = json.loads(refused.stdout)
    assert ("not_sent", True) == (result["action"], "credentials differ" in result["detail"])


class Token:
    """The live token of a client that refreshes it as each request leaves."""

    def __init__(self, value: str = TOKEN) -> None:
        self.value = value

    def set(self, request: httpx.Request) -> None:
        request.headers["Authorization"] = self.value

    async def aset(self, request: httpx.Request) -> None:
        request.headers["Authorization"] = self.value


class TokenAuth(httpx.Auth):
    """An httpx auth flow that adds the live token (the token-refresh pattern as an Auth)."""

    def __init__(self, token: Token) -> None:
        self.token = token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = self.token.value
        yield request


def with_hook(token: Token) -> dict[str, Any]:
    return {"event_hooks": {"request": [token.set]}}


def with_auth(token: Token) -> dict[str, Any]:
    return {"auth": TokenAuth(token)}


WAYS = pytest.mark.parametrize("way", [with_hook, with_auth], ids=["request hook", "httpx.Auth"])


def digest_names(target: str) -> list[str]:
    return list(json.loads(stored_column(target, "op", "credentials_digest"))["names"])


@WAYS
def test_credentials_a_hook_or_auth_flow_sets_bind_the_key_and_a_rotated_token_sends_nothing(
    journal_target: str, scripted: tuple[ScriptedApp, str], way: Any
) -> None:
    """The key is bound to the Authorization the request left with (set by the client's
    request hook or auth flow, after the journal saw it). Once the token rotates, a call
    again raises CredentialsMismatchError and a resume is not_sent, the server receiving
    nothing; the original token again: resent once, same key."""
    app, url = scripted
    app.answer(RESET)
    token = Token()
    with (
        idempotently.Session(
            journal_target, base_url=url, policy=ONE_TRY, profile=BOUND, **way(token)
        ) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post("/v1/charges", json=CHARGE, operation_id="op")
    assert ["header:authorization"] == digest_names(journal_target)
    assert TOKEN.split()[1].encode() not in stored_bytes(journal_target)
    token.value = ROTATED
    with idempotently.Session(journal_target, base_url=url, **way(token)) as session:
        with pytest.raises(idempotently.CredentialsMismatchError) as caught:
            session.post("/v1/charges", json=CHARGE, operation_id="op", profile=BOUND)
        (refused,) = session.resume()
    assert ("op", app.arrivals[0].key) == (caught.value.operation_id, caught.value.key)
    assert "credentials differ from those it was made with" in str(caught.value)
    assert ROTATED not in str(caught.value) and TOKEN not in str(caught.value)
    assert ("not_sent", "pending") == (refused.action, refused.status)
    assert "credentials differ from those it was made with" in refused.detail
    assert 1 == len(app.arrivals)
    token.value = TOKEN
    with idempotently.Session(journal_target, base_url=url, **way(token)) as session:
        (result,) = session.resume()
    assert "succeeded" == result.action
    first, second = app.arrivals
    assert (first.key, TOKEN, TOKEN) == (second.key, first.authorization, second.authorization)


@pytest.mark.anyio
async def test_async_credentials_an_async_hook_sets_bind_the_key(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncSession with an async request hook (asyncio and trio, SQLite and PostgreSQL):
    bound to the hook's token; rotated, a call again raises CredentialsMismatchError and a
    resume sends nothing; the original token resends the same key."""
    app, url = scripted
    app.answer(RESET)
    token = Token()
    target = journal_target
    hooks = {"event_hooks": {"request": [token.aset]}}
    async with idempotently.AsyncSession(
        target, base_url=url, policy=ONE_TRY, profile=BOUND, **hooks
    ) as session:
        with pytest.raises(idempotently.OperationPendingError):
            await session.post("/v1/charges", json=CHARGE, operation_id="op")
        token.value = ROTATED
        with pytest.raises(idempotently.CredentialsMismatchError):
            await session.post("/v1/charges", json=CHARGE, operation_id="op")
        (refused,) = await session.resume()
        assert ("not_sent", 1) == (refused.action, len(app.arrivals))
        token.value = TOKEN
        (result,) = await session.resume()
    assert "succeeded" == result.action
    assert ["header:authorization"] == await anyio.to_thread.run_sync(digest_names, target)
    first, second = app.arrivals
    assert (first.key, TOKEN) == (second.key, second.authorization)


@pytest.mark.anyio
async def test_async_credentials_an_auth_flow_sets_bind_the_key(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncSession with an httpx.Auth flow: the same binding and refusal."""
    app, url = scripted
    app.answer(RESET)
    token = Token()
    target = str(tmp_path / "j.db")
    async with idempotently.AsyncSession(
        target, base_url=url, policy=ONE_TRY, profile=BOUND, auth=TokenAuth(token)
    ) as session:
        with pytest.raises(idempotently.OperationPendingError):
            await session.post("/v1/charges", json=CHARGE, operation_id="op")
        token.value = ROTATED
        (refused,) = await session.resume()
        token.value = TOKEN
        (result,) = await session.resume()
    assert ("not_sent", "succeeded") == (refused.action, result.action)
    first, second = app.arrivals
    assert (first.key, TOKEN) == (second.key, second.authorization)


def test_a_token_rotated_between_attempts_of_one_call_stops_it_unsent(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """A hook that refreshes the token before the second attempt of the same call: that
    attempt is journaled not_sent, the call raises CredentialsMismatchError, the server
    saw only the first."""
    app, url = scripted
    app.answer(Answer(503))
    token = Token()

    def rotate_after_first(request: httpx.Request) -> None:
        token.set(request)
        token.value = ROTATED

    with (
        idempotently.Session(
            journal_target,
            base_url=url,
            profile=BOUND,
            policy=idempotently.RetryPolicy(initial_backoff=0.001, max_backoff=0.001),
            event_hooks={"request": [rotate_after_first]},
        ) as session,
        pytest.raises(idempotently.CredentialsMismatchError),
    ):
        session.post("/v1/charges", json=CHARGE, operation_id="op")
    assert [TOKEN] == [arrival.authorization for arrival in app.arrivals]
    with idempotently.Journal(journal_target, create=False) as journal:
        operation = journal.operation("op")
    assert operation is not None
    assert ("pending", ["answered", "not_sent"]) == (
        operation.status,
        [attempt.outcome for attempt in operation.attempts],
    )


def test_a_hook_that_keeps_the_credentials_keeps_working(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """A hook that sets the same token and a fresh trace id on every attempt: retried
    within the call, resumed, called again: all sent, one key."""
    app, url = scripted
    app.answer(Answer(503), RESET)
    token = Token()
    traces = iter(range(100))

    def trace(request: httpx.Request) -> None:
        token.set(request)
        request.headers["X-Trace-Id"] = f"trace-{next(traces)}"

    with idempotently.Session(
        journal_target,
        base_url=url,
        profile=BOUND,
        policy=idempotently.RetryPolicy(max_attempts=2, initial_backoff=0.001, max_backoff=0.001),
        event_hooks={"request": [trace]},
    ) as session:
        with pytest.raises(idempotently.OperationPendingError):
            session.post("/v1/charges", json=CHARGE, operation_id="op")
        (resumed,) = session.resume()
        again = session.post("/v1/charges", json=CHARGE, operation_id="op")
    assert ("succeeded", 201) == (resumed.action, again.status_code)
    assert 3 == len(app.arrivals)
    assert {app.arrivals[0].key} == {arrival.key for arrival in app.arrivals}


def test_a_bound_request_that_leaves_with_no_credentials_is_never_sent(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """Bound to no credentials is a bug, never a default: a bound operation whose request
    leaves without any is not sent (CredentialsMismatchError, pending, unbound), and is
    sent once credentials are given."""
    app, url = scripted
    with (
        idempotently.Session(journal_target, base_url=url, profile=BOUND) as session,
        pytest.raises(idempotently.CredentialsMismatchError, match="leaves with none") as caught,
    ):
        session.post("/v1/charges", json=CHARGE, operation_id="op")
    assert "op" == caught.value.operation_id and caught.value.key
    assert [] == app.arrivals
    assert None is stored_column(journal_target, "op", "credentials_digest")
    with idempotently.Session(
        journal_target, base_url=url, headers={"Authorization": TOKEN}
    ) as session:
        (result,) = session.resume()
    assert ("succeeded", [caught.value.key]) == (
        result.action,
        [arrival.key for arrival in app.arrivals],
    )


def body_changed(request: httpx.Request) -> None:
    request.stream = httpx.ByteStream(b'{"amount": 99999}')
    request.headers["Content-Length"] = "17"


def key_changed(request: httpx.Request) -> None:
    request.headers["Idempotency-Key"] = "a-key-of-the-hooks-own"


@pytest.mark.parametrize(
    ("hook", "what"), [(body_changed, "its body"), (key_changed, "its Idempotency-Key header")]
)
def test_a_hook_that_changes_the_journaled_body_or_key_is_refused_unsent(
    journal_target: str, scripted: tuple[ScriptedApp, str], hook: Any, what: str
) -> None:
    """The journal cannot vouch for a request a hook rewrote under its key: nothing is
    sent, RequestNotSentError names the operation, its key and what changed; it stays
    pending, and so does a resume through the same hook."""
    app, url = scripted
    with idempotently.Session(
        journal_target, base_url=url, event_hooks={"request": [hook]}
    ) as session:
        with pytest.raises(idempotently.RequestNotSentError) as caught:
            session.post("/v1/charges", json=CHARGE, operation_id="op")
        (resumed,) = session.resume()
    assert "op" == caught.value.operation_id and caught.value.key
    assert f"changed {what}" in str(caught.value) and caught.value.key in str(caught.value)
    assert ("not_sent", "pending", []) == (resumed.action, resumed.status, app.arrivals)


def test_a_transport_under_a_client_with_a_hook_binds_what_the_hook_set(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """An SDK's client with a token hook over idempotently.Transport: bound to the hook's
    token, and a rotated token is refused before the transport sends."""
    app, url = scripted
    app.answer(RESET)
    token = Token()
    transport = idempotently.Transport(journal_target, profile=BOUND, policy=ONE_TRY)
    with httpx.Client(
        base_url=url, transport=transport, event_hooks=with_hook(token)["event_hooks"]
    ) as client:
        with pytest.raises(idempotently.OperationPendingError) as pending:
            client.post("/v1/charges", json=CHARGE, headers={"Idempotency-Key": "sdk-key-1"})
        token.value = ROTATED
        with pytest.raises(idempotently.CredentialsMismatchError):
            client.post("/v1/charges", json=CHARGE, headers={"Idempotency-Key": "sdk-key-1"})
    assert "sdk-key-1" == pending.value.key
    assert [TOKEN] == [arrival.authorization for arrival in app.arrivals]


@pytest.mark.parametrize("phase", ["before_send", "after_charge"])
def test_a_first_attempt_killed_in_flight_resumes_only_under_the_token_its_hook_set(
    journal_target: str, tmp_path: Path, phase: str
) -> None:
    """A worker whose token comes from a request hook is SIGKILLed inside its first
    attempt (bound, about to send; or sent and charged, answer unread). A resume under a
    rotated token sends nothing; under the same token it sends the same key: exactly one
    charge at the server, and none for the rotated token's account."""
    with serve() as server:
        code, killed = run_worker(
            tmp_path,
            *charge_args(
                journal_target,  # type: ignore[arg-type]
                server.url,
                "--kill-at",
                phase,
                "--token-by-hook",
                orders=1,
            ),
        )
        assert -signal.SIGKILL == code, killed.diagnosis()
        charged = 1 if phase == "after_charge" else 0
        assert charged == len(server.charges())
        rotated, original = Token("Bearer shop_rotated"), Token(f"Bearer {USER}")
        with idempotently.Session(journal_target, base_url=server.url, **with_hook(rotated)) as s:
            (refused,) = s.resume()
        assert ("not_sent", charged) == (refused.action, len(server.charges()))
        with idempotently.Session(journal_target, base_url=server.url, **with_hook(original)) as s:
            (resumed,) = s.resume()
        assert "succeeded" == resumed.action
        assert {(USER, "order-0"): 1} == server.charge_count_by_order()
        assert 1 == len(server.charges())


class HooklessClient(httpx.Client):
    """A client whose send skips its request hooks and auth (straight to its transport)."""

    def send(self, request: httpx.Request, **options: Any) -> httpx.Response:
        return self._transport.handle_request(request)


def test_a_client_that_skips_its_hooks_is_checked_after_the_fact_and_said_so(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """Such a client cannot be checked before it sends: its lost first attempt is bound
    after the fact (never left bound to nothing), and a resend under a rotated token is
    journaled maybe delivered, pending, and says the client skipped its hooks."""
    app, url = scripted
    app.answer(RESET)
    target = str(tmp_path / "j.db")
    first = HooklessClient(base_url=url, headers={"Authorization": TOKEN})
    with (
        idempotently.Session(target, client=first, profile=BOUND, policy=ONE_TRY) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post("/v1/charges", json=CHARGE, operation_id="op")
    assert ["header:authorization"] == digest_names(target)
    rotated = HooklessClient(base_url=url, headers={"Authorization": ROTATED})
    with idempotently.Session(target, client=rotated) as session:
        (result,) = session.resume()
    assert ("still_pending", "pending") == (result.action, result.status)
    assert "without running its request hooks" in result.detail
    assert CREDENTIALS_DIFFER in result.detail
    first.close()
    rotated.close()


def test_a_first_attempt_killed_before_its_request_left_is_bound_by_the_resume_that_sends_it(
    journal_target: str, tmp_path: Path
) -> None:
    """Killed inside the client's request hook: the key is journaled, nothing is bound and
    nothing left. Its key was never sent, so the first resume that sends it binds it to the
    credentials it leaves with (here a rotated token): one charge, then bound to that."""
    with serve() as server:
        code, killed = run_worker(
            tmp_path,
            *charge_args(
                journal_target,  # type: ignore[arg-type]
                server.url,
                "--token-by-hook",
                "--die-in-hook",
                orders=1,
            ),
        )
        assert -signal.SIGKILL == code, killed.diagnosis()
        assert stored_column(journal_target, "order-0:charge", "key")
        assert None is stored_column(journal_target, "order-0:charge", "credentials_digest")
        assert [] == server.charges()
        rotated = Token("Bearer shop_rotated")
        with idempotently.Session(journal_target, base_url=server.url, **with_hook(rotated)) as s:
            (resumed,) = s.resume()
        assert "succeeded" == resumed.action
        assert {("shop_rotated", "order-0"): 1} == server.charge_count_by_order()
    record = json.loads(stored_column(journal_target, "order-0:charge", "credentials_digest"))
    assert ["header:authorization"] == record["names"]


def test_the_binding_is_made_durable_before_the_first_byte_leaves(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """With durability "fsync", the write that binds the key to the hook's token commits
    durably while the server has seen nothing of the request; later sends write no
    binding again."""
    app, url = scripted
    token = Token()
    journal = idempotently.Journal(tmp_path / "j.db")
    binds: list[tuple[bool, int]] = []

    def recorded(writes: Sequence[Any], durable: bool) -> None:
        if any(isinstance(write, BindCredentials) for write in writes):
            binds.append((durable, len(app.arrivals)))

    journal.observe_commits(before=recorded)
    with idempotently.Session(journal, base_url=url, profile=BOUND, **with_hook(token)) as session:
        session.post("/v1/charges", json=CHARGE, operation_id="op")
        session.post("/v1/charges", json=CHARGE, operation_id="op")
    journal.close()
    assert [(True, 0)] == binds
    assert 1 == len(app.arrivals)


def test_a_key_an_earlier_version_bound_to_no_credentials_is_never_resent(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A row bound to no credentials (an earlier version digested the request before its
    hook added them): no resend can be shown to carry its credentials, so none is sent,
    whatever the live ones; it stays pending and says to look it up."""
    app, url = scripted
    target = str(tmp_path / "j.db")
    lost_answer(target, url, app)
    with idempotently.Journal(target, create=False) as journal:
        salt = journal._namespace.bytes
    # What the earlier version journaled: the real digest of no credentials at all, which
    # every request matches.
    empty = _credentials.credentials_record([], _credentials.compute_digest((salt, (), ())))
    with sqlite3.connect(target) as conn:
        conn.execute("UPDATE operations SET credentials_digest = ?", (empty,))
    conn.close()
    with idempotently.Session(target, base_url=url, headers={"Authorization": TOKEN}) as s:
        (refused,) = s.resume()
    assert ("not_sent", "pending", 1) == (refused.action, refused.status, len(app.arrivals))
    assert "bound to no credentials" in refused.detail
