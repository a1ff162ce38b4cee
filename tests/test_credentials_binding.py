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
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import pytest
from click.testing import CliRunner

import idempotently
from idempotently import _credentials, profiles
from idempotently.cli import cli
from tests.at_rest import stored_bytes, stored_column
from tests.scripted_server import RESET, ScriptedApp

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


def test_a_session_with_httpx_auth_cannot_bind_keys_to_credentials(tmp_path: Path) -> None:
    """httpx's auth= adds the credentials while sending, after the journal has digested the
    request: such a Session is refused, before the journal file exists."""
    with pytest.raises(ValueError, match="auth="):
        idempotently.Session(tmp_path / "j.db", profile=BOUND, auth=("user", "password"))
    client = httpx.Client(auth=("user", "password"))
    with pytest.raises(ValueError, match="headers"):
        idempotently.Session(tmp_path / "j.db", profile=BOUND, client=client)
    client.close()
    assert not (tmp_path / "j.db").exists()
