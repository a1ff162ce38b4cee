"""Secret query parameters are sent, journaled redacted, and put back before a resend.

``?api_key=sk_live_...`` reaches the server as given, and the journal holds
``api_key=[redacted]`` and the name ``api_key``; a resume puts the value back in
its place (from the live client's ``params``, the caller's own URL, or the
command line's ``--param-env``), or sends nothing and says which is missing.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
from click.testing import CliRunner, Result

import idempotently
from idempotently.cli import cli
from tests.at_rest import stored_bytes
from tests.scripted_server import RESET, Answer, ScriptedApp

SECRET = "sk_live_query_4242"
OTHER_SECRET = "sk_live_query_9999"
ONE_TRY = idempotently.RetryPolicy(max_attempts=1)
CHARGE = {"amount": 1000}


def lost_answer(
    target: str, url: str, app: ScriptedApp, *, client_params: Any = None, **call: Any
) -> None:
    """Journal operation ``op``: sent once, its answer lost (it stays pending)."""
    app.answer(RESET)
    options = {} if client_params is None else {"params": client_params}
    with (
        idempotently.Session(target, base_url=url, policy=ONE_TRY, **options) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post("/v1/charges", json=CHARGE, operation_id="op", **call)


def operation(target: str) -> idempotently.Operation:
    with idempotently.Journal(target, create=False) as journal:
        found = journal.operation("op")
    assert found is not None
    return found


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env)


# -- the call ----------------------------------------------------------------------------------


def test_a_secret_query_parameter_is_sent_but_journaled_redacted(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The server gets the value; the journal's URL has [redacted] in its place, names the
    parameter, and the value is nowhere in the store."""
    app, url = scripted
    with idempotently.Session(journal_target, base_url=url) as session:
        response = session.post(
            "/v1/charges",
            json=CHARGE,
            params={"currency": "usd", "api_key": SECRET},
            operation_id="op",
        )
    stored = operation(journal_target)
    assert 201 == response.status_code
    assert f"currency=usd&api_key={SECRET}".encode() == app.arrivals[0].query
    assert stored.url.endswith("/v1/charges?currency=usd&api_key=[redacted]")
    assert ["api_key"] == json.loads(stored.secret_params or "null")
    assert SECRET.encode() not in stored_bytes(journal_target)


def test_a_secret_the_server_echoes_in_a_location_is_journaled_redacted(
    tmp_path: Any, scripted: tuple[ScriptedApp, str]
) -> None:
    """A 303 whose Location repeats the request's secret query value (and carries
    userinfo): the caller gets the header as sent, the journal keeps the Location with
    the value redacted and without the userinfo, and neither secret is in the store."""
    app, url = scripted
    location = f"http://user:pw_4242@127.0.0.1/v1/charges/ch_1?api_key={SECRET}&expand=customer"
    app.answer(Answer(status=303, headers=(("location", location),)))
    target = str(tmp_path / "j.db")
    with idempotently.Session(target, base_url=url) as session:
        response = session.post(
            "/v1/charges", json=CHARGE, params={"api_key": SECRET}, operation_id="op"
        )
    assert (303, location) == (response.status_code, response.headers["location"])
    assert [
        ("location", "http://127.0.0.1/v1/charges/ch_1?api_key=[redacted]&expand=customer")
    ] == [
        (name.lower(), value)
        for name, value in operation(target).response_headers or []
        if name.lower() == "location"
    ]
    assert SECRET.encode() not in stored_bytes(target)
    assert b"pw_4242" not in stored_bytes(target)


def test_a_url_without_secret_parameters_is_journaled_as_it_is(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """Nothing to redact: the URL is stored whole and secret_params stays NULL."""
    _app, url = scripted
    with idempotently.Session(journal_target, base_url=url) as session:
        session.post("/v1/charges", json=CHARGE, params={"currency": "usd"}, operation_id="op")
    stored = operation(journal_target)
    assert (f"{url}/v1/charges?currency=usd", None) == (stored.url, stored.secret_params)


def test_journal_redact_query_adds_names_and_key_is_not_redacted_by_default(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """Journal(redact_query=[...]) adds the user's names (any case); ``key`` is a resource's
    own key at many APIs, so it stays unless named."""
    _app, url = scripted
    journal = idempotently.Journal(journal_target, redact_query=["Session_Key"])
    with idempotently.Session(journal, base_url=url) as session:
        session.post(
            "/v1/charges",
            json=CHARGE,
            params={"session_key": SECRET, "key": "order-42", "Token": OTHER_SECRET},
            operation_id="op",
        )
    journal.close()
    stored = operation(journal_target)
    assert stored.url.endswith("?session_key=[redacted]&key=order-42&Token=[redacted]")
    assert ["session_key", "Token"] == json.loads(stored.secret_params or "null")
    assert SECRET.encode() not in stored_bytes(journal_target)
    assert OTHER_SECRET.encode() not in stored_bytes(journal_target)


def test_a_bad_redact_query_is_refused_before_the_journal_exists(tmp_path: Any) -> None:
    """A string (not a list) or an empty name is a clear error; no file is created."""
    with pytest.raises(TypeError, match="redact_query must be a list"):
        idempotently.Journal(tmp_path / "j.db", redact_query="api_key")
    with pytest.raises(ValueError, match="redact_query must hold"):
        idempotently.Journal(tmp_path / "j.db", redact_query=[""])
    assert not (tmp_path / "j.db").exists()


def test_another_secret_value_under_the_same_operation_id_is_key_reuse_without_showing_it(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The value is part of the request's identity, as a fingerprinted header is: another
    value is KeyReuseError, naming the parameter and neither value; nothing is sent."""
    app, url = scripted
    lost_answer(journal_target, url, app, params={"api_key": SECRET})
    with (
        idempotently.Session(journal_target, base_url=url) as session,
        pytest.raises(idempotently.KeyReuseError) as caught,
    ):
        session.post(
            "/v1/charges", json=CHARGE, params={"api_key": OTHER_SECRET}, operation_id="op"
        )
    message = str(caught.value)
    assert "api_key" in message
    assert SECRET not in message and OTHER_SECRET not in message
    assert 1 == len(app.arrivals)


def test_a_call_again_takes_the_value_from_its_own_url(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The same call again (same operation_id, same URL) continues the operation with the
    value it carries, in the place it had: the same bytes reach the server."""
    app, url = scripted
    lost_answer(journal_target, url, app, params={"api_key": SECRET, "currency": "usd"})
    with idempotently.Session(journal_target, base_url=url) as session:
        response = session.post(
            "/v1/charges",
            json=CHARGE,
            params={"api_key": SECRET, "currency": "usd"},
            operation_id="op",
        )
    assert 201 == response.status_code
    first, second = app.arrivals
    assert (first.key, first.query) == (second.key, second.query)


# -- resume --------------------------------------------------------------------------------------


def test_resume_puts_the_value_back_from_the_client_params_byte_for_byte(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The client's params give the redacted value back; the journaled query (the call's
    own parameters too) goes out as first sent, not replaced by the client's params."""
    app, url = scripted
    lost_answer(
        journal_target,
        url,
        app,
        client_params={"api_key": "s+cr&t/" + SECRET},
        params={"currency": "usd"},
    )
    with idempotently.Session(
        journal_target, base_url=url, params={"api_key": "s+cr&t/" + SECRET}
    ) as session:
        (result,) = session.resume()
    assert ("succeeded", "succeeded") == (result.action, result.status)
    first, second = app.arrivals
    assert b"currency=usd" in first.query
    assert (first.key, first.query) == (second.key, second.query)


def test_a_resume_without_the_value_sends_nothing_and_names_the_parameter(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """No live value for a redacted parameter: not_sent, naming it and how to give it;
    nothing reaches the server and the operation stays pending."""
    app, url = scripted
    lost_answer(journal_target, url, app, params={"api_key": SECRET})
    with idempotently.Session(journal_target, base_url=url) as session:
        (planned,) = session.resume(dry_run=True)
        (result,) = session.resume()
    assert ("not_sent", "not_sent", "pending") == (planned.action, result.action, result.status)
    assert "'api_key'" in result.detail and "--param-env" in result.detail
    assert 1 == len(app.arrivals)
    assert "pending" == operation(journal_target).status


@pytest.mark.anyio
async def test_async_resume_puts_the_value_back_from_the_client_params(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncSession, on asyncio and trio: the same redaction and the same resend."""
    app, url = scripted
    app.answer(RESET)
    async with idempotently.AsyncSession(
        journal_target, base_url=url, policy=ONE_TRY, params={"api_key": SECRET}
    ) as session:
        with pytest.raises(idempotently.OperationPendingError):
            await session.post("/v1/charges", json=CHARGE, operation_id="op")
    assert SECRET.encode() not in await anyio.to_thread.run_sync(stored_bytes, journal_target)
    async with idempotently.AsyncSession(journal_target, base_url=url) as bare:
        (missing,) = await bare.resume()
    async with idempotently.AsyncSession(
        journal_target, base_url=url, params={"api_key": SECRET}
    ) as session:
        (result,) = await session.resume()
    assert ("not_sent", "succeeded") == (missing.action, result.action)
    first, second = app.arrivals
    assert (f"api_key={SECRET}".encode(), first.key) == (second.query, second.key)


def test_resume_puts_the_value_back_from_redacted_params_where_it_was_redacted(
    tmp_path: Any, scripted: tuple[ScriptedApp, str]
) -> None:
    """Session(redacted_params={"api_key": ...}) (what `resume --param-env` builds on):
    the value goes back in its place in the operation journaled with api_key redacted;
    the operation journaled without it is resent without it."""
    app, url = scripted
    app.answer(RESET, RESET)
    target = str(tmp_path / "j.db")
    with idempotently.Session(target, base_url=url, policy=ONE_TRY) as session:
        for operation_id, params in (("with", {"api_key": SECRET}), ("without", {"n": "1"})):
            with pytest.raises(idempotently.OperationPendingError):
                session.post("/v1/charges", json=CHARGE, params=params, operation_id=operation_id)
    with idempotently.Session(target, base_url=url, redacted_params={"api_key": SECRET}) as session:
        results = session.resume()
    assert ["succeeded", "succeeded"] == [result.action for result in results]
    assert [f"api_key={SECRET}".encode(), b"n=1"] == [arrival.query for arrival in app.arrivals[2:]]
    assert [arrival.key for arrival in app.arrivals[:2]] == [a.key for a in app.arrivals[2:]]


@pytest.mark.anyio
async def test_async_resume_puts_the_value_back_from_redacted_params(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncSession(redacted_params=...), on asyncio and trio: the same resend, the
    value before the client's own params."""
    app, url = scripted
    lost_answer(journal_target, url, app, params={"api_key": SECRET})
    async with idempotently.AsyncSession(
        journal_target,
        base_url=url,
        params={"api_key": OTHER_SECRET},
        redacted_params={"api_key": SECRET},
    ) as session:
        (result,) = await session.resume()
    assert "succeeded" == result.action
    first, second = app.arrivals
    assert (f"api_key={SECRET}".encode(), first.key) == (second.query, second.key)


@pytest.mark.parametrize("session_class", [idempotently.Session, idempotently.AsyncSession])
@pytest.mark.parametrize(
    ("given", "error"),
    [
        ([("api_key", SECRET)], TypeError),
        (SECRET, TypeError),
        ({SECRET + " x": "v"}, ValueError),
        ({"": "v"}, ValueError),
        ({"a=b": "v"}, ValueError),
        ({1: "v"}, TypeError),
        ({"api_key": ""}, ValueError),
        ({"api_key": SECRET + "\n"}, ValueError),
        ({"api_key": " " + SECRET}, ValueError),
        ({"api_key": SECRET + "\x00"}, ValueError),
        ({"api_key": SECRET.encode()}, TypeError),
        ({"api_key": None}, TypeError),
    ],
    ids=repr,
)
def test_bad_redacted_params_are_refused_without_repeating_them(
    tmp_path: Any, session_class: type[Any], given: object, error: type[Exception]
) -> None:
    """Not a mapping, a name that is no query parameter name, a value that is no
    non-empty str or holds surrounding whitespace or a control character: a TypeError or
    ValueError in one line naming redacted_params, never quoting the value (nor a bad
    name: it may be a credential); no journal file is created."""
    with pytest.raises(error, match="redacted_params") as raised:
        session_class(tmp_path / "j.db", redacted_params=given)
    message = str(raised.value)
    assert "\n" not in message
    assert SECRET not in message
    assert not (tmp_path / "j.db").exists()


# -- the command line ----------------------------------------------------------------------------


def test_cli_resume_takes_a_redacted_parameter_from_param_env(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """`resume --param-env api_key=ENVVAR` sends the value in its place; without it the
    operation is not sent (exit 1, naming the parameter); list and show never print it."""
    app, url = scripted
    lost_answer(journal_target, url, app, params={"api_key": SECRET})
    without = run("--journal", journal_target, "resume", "--json")
    assert (1, 1) == (without.exit_code, len(app.arrivals)), without.output
    (result,) = json.loads(without.stdout)
    assert "not_sent" == result["action"] and "'api_key'" in result["detail"]
    env = {"CHARGES_API_KEY": SECRET}
    given = run(
        "--journal", journal_target, "resume", "--param-env", "api_key=CHARGES_API_KEY", env=env
    )
    assert 0 == given.exit_code, given.output
    first, second = app.arrivals
    assert (first.key, first.query) == (second.key, second.query)
    printed = [
        run("--journal", journal_target, *args).output
        for args in (("list",), ("list", "--json"), ("show", "op"), ("show", "op", "--json"))
    ]
    assert [] == [output for output in printed if SECRET in output]
    assert all("[redacted]" in output for output in printed)


def test_cli_prints_an_old_rows_secret_query_value_redacted(tmp_path: Any) -> None:
    """A row journaled before query values were redacted keeps its URL; list and show
    print its secret values as [redacted] all the same."""
    path = str(tmp_path / "j.db")
    with idempotently.Journal(path) as journal:
        journal._conn.execute(
            "INSERT INTO operations (operation_id, key, status, delivery, method, url, "
            "request_headers, request_body, fingerprint, profile, key_header, created_at, "
            "updated_at, key_expires_at, lease_until) VALUES ('old', 'k', 'succeeded', "
            "'exactly_once', 'POST', ?, '[]', x'', 'f', 'generic', 'Idempotency-Key', 1, 1, 2, 0)",
            (f"https://api.example.test/v1?api_key={SECRET}&n=1",),
        )
    outputs = [
        run("--journal", path, *args).output
        for args in (("list",), ("list", "--json"), ("show", "old"), ("show", "old", "--json"))
    ]
    assert [] == [output for output in outputs if SECRET in output]


def test_a_param_env_value_is_never_printed_and_only_fills_redacted_parameters(
    tmp_path: Any, scripted: tuple[ScriptedApp, str]
) -> None:
    """--param-env gives a value only to operations journaled with that parameter
    redacted: an operation without it is resent without it."""
    app, url = scripted
    app.answer(RESET, RESET)
    target = str(tmp_path / "j.db")
    with idempotently.Session(target, base_url=url, policy=ONE_TRY) as session:
        for operation_id, params in (("with", {"api_key": SECRET}), ("without", {"n": "1"})):
            with pytest.raises(idempotently.OperationPendingError):
                session.post("/v1/charges", json=CHARGE, params=params, operation_id=operation_id)
    result = run("--journal", target, "resume", "--param-env", "api_key=KEY", env={"KEY": SECRET})
    assert 0 == result.exit_code, result.output
    assert SECRET not in result.output
    assert [f"api_key={SECRET}".encode(), b"n=1"] == [arrival.query for arrival in app.arrivals[2:]]


def test_an_answer_for_a_redacted_url_is_returned_from_the_journal(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """A settled operation called again answers from the journal, without a send (its
    request, never sent, keeps [redacted])."""
    app, url = scripted
    app.answer(Answer(201))
    with idempotently.Session(journal_target, base_url=url) as session:
        session.post("/v1/charges", json=CHARGE, params={"api_key": SECRET}, operation_id="op")
        again = session.post(
            "/v1/charges", json=CHARGE, params={"api_key": SECRET}, operation_id="op"
        )
    assert again.extensions["idempotently"].replayed_locally
    assert 1 == len(app.arrivals)
    assert isinstance(again.request, httpx.Request)


@pytest.mark.anyio
async def test_an_async_transport_journals_secret_parameters_redacted(
    tmp_path: Any, scripted: tuple[ScriptedApp, str]
) -> None:
    """Under an SDK's own client (AsyncTransport), the same: sent whole, journaled redacted,
    and the SDK's call again (its URL carries the value) continues with the same bytes."""
    app, url = scripted
    app.answer(RESET)
    path = str(tmp_path / "j.db")
    transport = idempotently.AsyncTransport(path, policy=ONE_TRY)
    async with httpx.AsyncClient(transport=transport, base_url=url) as sdk:
        headers = {"Idempotency-Key": "sdk-key-1"}
        with pytest.raises(idempotently.OperationPendingError):
            await sdk.post("/v1/charges", params={"token": SECRET}, json=CHARGE, headers=headers)
        again = await sdk.post(
            "/v1/charges", params={"token": SECRET}, json=CHARGE, headers=headers
        )
    await transport.aclose()
    assert 201 == again.status_code
    first, second = app.arrivals
    assert (f"token={SECRET}".encode(), first.key) == (second.query, second.key)
    assert SECRET.encode() not in await anyio.to_thread.run_sync(stored_bytes, path)
