"""Secrets never reach the disk or the screen.

URL userinfo is never stored or printed, and is re-applied from the live
configuration (never from the journal); an error that quotes a secret header's
value is scrubbed before it is journaled, raised or printed; the CLI never
prints a credential it read from the environment.
"""

from __future__ import annotations

import base64
import traceback
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import idempotently
from idempotently.cli import cli
from tests.adversarial.invariants import assert_sound, journal_bytes
from tests.adversarial.wire import RESET, Wire, reply

ONE_TRY = idempotently.RetryPolicy(max_attempts=1)
CHARGE = {"amount": 1000}
TOKEN = "sk_live_51HiddenToken"


def with_userinfo(url: str, userinfo: str) -> str:
    return url.replace("http://", f"http://{userinfo}@")


# -- URL userinfo ------------------------------------------------------------------------------

USERINFO = {
    "user-and-password": ("merchant:hunter2-password", "hunter2-password"),
    "percent-encoded": ("merchant:p%40ss%3Aword-42", "p%40ss%3Aword-42"),
    "token-as-username": (f"{TOKEN}", TOKEN),
    "token-and-empty-password": (f"{TOKEN}:", TOKEN),
}


@pytest.mark.parametrize("where", ["base_url", "url"])
@pytest.mark.parametrize("form", USERINFO)
def test_url_userinfo_is_sent_but_never_stored_or_printed(
    journal: Path, wire: Wire, form: str, where: str
) -> None:
    """A credential in the URL authenticates the request and appears nowhere else:
    not in the journal file, its WAL, `list` or `show`."""
    userinfo, secret = USERINFO[form]
    url = with_userinfo(wire.url, userinfo)
    options: dict[str, Any] = {"base_url": url} if where == "base_url" else {}
    target = "/v1/charges" if where == "base_url" else f"{url}/v1/charges"
    with idempotently.Session(journal, **options) as session:
        response = session.post(target, json=CHARGE, operation_id="op")
    assert 201 == response.status_code
    assert (wire.arrivals[0].header("Authorization") or b"").startswith(b"Basic ")
    operations = assert_sound(journal, operations=["op"], secrets=[secret])
    assert "@" not in operations[0].url


@pytest.fixture
def pending_with_userinfo(journal: Path, wire: Wire) -> Path:
    """A journal holding one pending operation first sent with URL credentials."""
    wire.answer(RESET)
    base = with_userinfo(wire.url, "merchant:hunter2-password")
    with (
        idempotently.Session(journal, base_url=base, policy=ONE_TRY) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post("/v1/charges", json=CHARGE, operation_id="op")
    wire.reset()
    return journal


def test_resume_takes_url_credentials_from_the_live_session(
    pending_with_userinfo: Path, wire: Wire
) -> None:
    """A session configured with the credentials resends with them."""
    base = with_userinfo(wire.url, "merchant:hunter2-password")
    with idempotently.Session(pending_with_userinfo, base_url=base) as session:
        assert ["succeeded"] == [result.action for result in session.resume()]
    sent = httpx.BasicAuth("merchant", "hunter2-password")._auth_header
    assert [sent.encode()] == [arrival.header("Authorization") for arrival in wire.arrivals]
    assert_sound(pending_with_userinfo, secrets=["hunter2-password"])


def test_resume_never_takes_url_credentials_from_the_journal(
    pending_with_userinfo: Path, wire: Wire
) -> None:
    """A session (or the CLI) without the credentials resends without them."""
    with idempotently.Session(pending_with_userinfo) as session:
        session.resume()
    result = CliRunner().invoke(cli, ["--journal", str(pending_with_userinfo), "resume"])
    assert [None] == [arrival.header("Authorization") for arrival in wire.arrivals]
    assert "hunter2-password" not in result.output
    assert_sound(pending_with_userinfo, secrets=["hunter2-password"])


# -- secret header values httpx refuses to send ------------------------------------------------

SECRET_HEADERS = ["Authorization", "X-Api-Key", "Cookie", "Proxy-Authorization", "X-Partner-Token"]
BAD_EDGES = {
    "trailing-newline": (f"Bearer {TOKEN}", "\n"),
    "trailing-space": (f"Bearer {TOKEN}", " "),
    "trailing-cr": (f"Bearer {TOKEN}", "\r"),
    "trailing-tab": (f"Bearer {TOKEN}", "\t"),
    "header-injection": (f"Bearer {TOKEN}", "\r\nX-Injected: 1"),
    "nul": (f"{TOKEN}", "\x00"),
    "leading-space": (f" {TOKEN}", ""),
}


def traceback_text(error: BaseException) -> str:
    """What a traceback of ``error`` prints: its chain of causes and contexts."""
    return "".join(traceback.format_exception(error))


def refused(
    journal: Path, wire: Wire, header: str, value: str | bytes
) -> idempotently.RequestNotSentError:
    """Send with a secret header httpx will refuse; return the error the caller got."""
    with (
        idempotently.Session(journal, redact_headers=["X-Partner-Token"]) as session,
        pytest.raises(idempotently.RequestNotSentError) as caught,
    ):
        headers: Any = {header: value}  # str or bytes values, as httpx accepts
        session.post(f"{wire.url}/v1/charges", json=CHARGE, headers=headers, operation_id="op")
    assert [] == wire.arrivals
    return caught.value


@pytest.mark.parametrize("edge", BAD_EDGES)
@pytest.mark.parametrize("header", SECRET_HEADERS)
def test_an_unsendable_secret_header_is_scrubbed_everywhere(
    journal: Path, wire: Wire, header: str, edge: str
) -> None:
    """httpx quotes an illegal header value in its error; the caller, the journal and the
    CLI see that error without the secret, and nothing is sent."""
    token, suffix = BAD_EDGES[edge]
    error = refused(journal, wire, header, token + suffix)
    assert_sound(journal, operations=["op"], secrets=[TOKEN], screens=[traceback_text(error)])


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(TOKEN.encode() + b"\xe9\n", id="latin-1-newline"),
        pytest.param(TOKEN.encode() + b"\xff ", id="latin-1-space"),
        pytest.param(TOKEN.encode() + b"\n", id="ascii-newline"),
    ],
)
@pytest.mark.parametrize("header", ["Authorization", "X-Api-Key"])
def test_an_unsendable_secret_header_given_as_bytes_is_scrubbed(
    journal: Path, wire: Wire, header: str, value: bytes
) -> None:
    """A secret header given as bytes is scrubbed from the error like a str one."""
    error = refused(journal, wire, header, value)
    assert_sound(journal, operations=["op"], secrets=[TOKEN], screens=[traceback_text(error)])


@pytest.mark.anyio
@pytest.mark.parametrize("edge", ["trailing-newline", "header-injection"])
async def test_async_session_scrubs_an_unsendable_secret_header(
    journal: Path, wire: Wire, edge: str, anyio_backend: str
) -> None:
    """AsyncSession scrubs the same way, on asyncio and trio."""
    token, suffix = BAD_EDGES[edge]
    async with idempotently.AsyncSession(journal, headers={"Authorization": token + suffix}) as s:
        with pytest.raises(idempotently.RequestNotSentError) as caught:
            await s.post(f"{wire.url}/v1/charges", json=CHARGE, operation_id="op")
    assert TOKEN not in traceback_text(caught.value)
    assert [] == wire.arrivals
    assert_sound(journal, operations=["op"], secrets=[TOKEN])


def test_transport_scrubs_an_unsendable_secret_header(journal: Path, wire: Wire) -> None:
    """Behind a Transport, an SDK's illegal credential header is scrubbed too."""
    transport = idempotently.Transport(journal)
    with (
        httpx.Client(transport=transport, headers={"X-Api-Key": TOKEN + "\n"}) as client,
        pytest.raises(idempotently.RequestNotSentError) as caught,
    ):
        client.post(f"{wire.url}/v1/charges", json=CHARGE)
    assert TOKEN not in traceback_text(caught.value)
    assert [] == wire.arrivals
    assert_sound(journal, secrets=[TOKEN])


VISIBLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="\\'\"")


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    # A prefix no journal column, table or message spells: a hit can only be the secret.
    token=st.text(VISIBLE, min_size=8, max_size=40).map(lambda text: f"sk_test_{text}"),
    prefix=st.sampled_from(["", "Bearer ", "Basic ", "Token "]),
    suffix=st.sampled_from(["\n", "\r", " ", "\t", "\r\n", "\x00", "\n\n"]),
    header=st.sampled_from(SECRET_HEADERS),
)
def test_any_unsendable_secret_never_reaches_disk_or_screen(
    scratch: Path, wire: Wire, token: str, prefix: str, suffix: str, header: str
) -> None:
    """Whatever the token and the illegal ending, it is in neither the error, the journal
    file nor the CLI output."""
    wire.reset()
    journal = scratch / f"{uuid.uuid4().hex}.db"
    error = refused(journal, wire, header, prefix + token + suffix)
    assert token not in traceback_text(error)
    assert token.encode() not in journal_bytes(journal)
    assert_sound(journal, secrets=[token])


# -- credentials the CLI reads from the environment --------------------------------------------


@pytest.fixture
def pending(journal: Path, wire: Wire) -> Path:
    """A journal holding one pending operation on the loopback server."""
    wire.answer(RESET)
    with (
        idempotently.Session(journal, policy=ONE_TRY) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post(f"{wire.url}/v1/charges", json=CHARGE, operation_id="op")
    wire.reset()
    return journal


@pytest.mark.parametrize(
    "header",
    [
        "Authorization",
        "X-Api-Key",
        pytest.param(
            "X-Partner-Token",
        ),
    ],
)
@pytest.mark.parametrize("suffix", ["\n", " "])
def test_resume_never_prints_a_credential_from_the_environment(
    pending: Path, wire: Wire, header: str, suffix: str
) -> None:
    """`resume --header-env NAME=VAR`: whatever NAME is, VAR's value is never printed or
    journaled, even when httpx refuses to send it."""
    result = CliRunner().invoke(
        cli,
        ["--journal", str(pending), "resume", "--header-env", f"{header}=PARTNER_TOKEN"],
        env={"PARTNER_TOKEN": TOKEN + suffix},
    )
    assert TOKEN not in result.output
    assert [] == wire.arrivals
    assert_sound(pending, operations=["op"], secrets=[TOKEN])


def test_resume_with_a_refused_credential_never_prints_it(pending: Path, wire: Wire) -> None:
    """A server refusing the credential (401) keeps the operation; the token stays unprinted."""
    wire.default = reply(401, body=b'{"error": "invalid api key"}')
    result = CliRunner().invoke(
        cli,
        ["--journal", str(pending), "resume", "--header-env", "X-Api-Key=API_KEY", "--json"],
        env={"API_KEY": TOKEN},
    )
    assert (1, TOKEN.encode()) == (result.exit_code, wire.arrivals[0].header("X-Api-Key"))
    assert TOKEN not in result.output
    operations = assert_sound(pending, operations=["op"], secrets=[TOKEN])
    assert "pending" == operations[0].status


def test_cookies_and_basic_auth_never_reach_the_journal(journal: Path, wire: Wire) -> None:
    """Credentials httpx adds itself (cookies=, auth=) are sent but never stored."""
    with idempotently.Session(
        journal, cookies={"session": "cookie-secret-value"}, auth=("merchant", "auth-password")
    ) as session:
        session.post(f"{wire.url}/v1/charges", json=CHARGE, operation_id="op")
    arrival = wire.arrivals[0]
    assert b"session=cookie-secret-value" == arrival.header("Cookie")
    assert (arrival.header("Authorization") or b"").startswith(b"Basic ")
    basic = base64.b64encode(b"merchant:auth-password").decode()
    assert_sound(journal, secrets=["cookie-secret-value", "auth-password", basic])
