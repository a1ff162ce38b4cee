"""A redirect's body never hangs a call nor fills memory, and redirects are followed as
the client would follow them.

With ``follow_redirects=True``, httpx reads every redirect answer whole before it
follows it, decoded by httpx. On a real uvicorn server on 127.0.0.1: a 302 whose body
is a kilobyte of gzip-of-gzip (256 MiB decoded) or that trickles for ever is read no
further than an excerpt and within one read timeout, and then followed: through a
Session's write, an AsyncSession's (asyncio and trio), a Transport's and an
AsyncTransport's read, and a lookup's GET. The redirects themselves go on as httpx's:
a 303 becomes a GET, a 307 resends the same bytes with the same key, Authorization is
dropped on the way to another origin, ``max_redirects`` ends a loop.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import ModuleType

import attrs
import httpx
import pytest

import idempotently
from idempotently import Journal, Lookup, profiles
from idempotently._answers import DECODE_STEP
from idempotently._redirects import REDIRECT_BODY_BYTES
from idempotently._rows import AttemptRecord
from tests.journal_commands import record_attempt, set_status
from tests.scripted_server import ENDLESS_BYTES, Answer, ScriptedApp
from tests.test_answer_bodies import LIBRARIES, MEMORY_BOUND, bomb, memory_growth, operation
from tests.test_operator_actions import make

FAST = idempotently.RetryPolicy(initial_backoff=0.0, max_backoff=0.0)
CHARGE = {"amount": 1000, "currency": "usd"}
TIMEOUT = httpx.Timeout(30.0, read=1.0)
"""A read timeout of a second: how long a trickling redirect's body is read."""
NEXT = "/v1/next"


def bomb_redirect(status: int = 302) -> Answer:
    """A redirect whose body is gzip of gzip of 256 MiB of zeros: a kilobyte on the wire."""
    return Answer(
        status=status,
        headers=(("location", NEXT), ("content-encoding", "gzip, gzip")),
        body=bomb(),
    )


def trickling_redirect(status: int = 302) -> Answer:
    """A redirect whose body comes one byte every 10 ms, without end."""
    return Answer(status=status, headers=(("location", NEXT),), endless=True, trickle=0.01)


REDIRECTS = {"bomb": bomb_redirect, "trickle": trickling_redirect}


def assert_cut_off(app: ScriptedApp) -> None:
    """The trickling body was hung up on long before its end (the server notes what it
    streamed once it sees the hang-up, a moment later)."""
    deadline = time.monotonic() + 10
    while not app.streamed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 1 == len(app.streamed)
    assert app.streamed[0] < ENDLESS_BYTES // 4


def assert_followed(app: ScriptedApp, first: str, kind: str) -> None:
    """The redirect was followed to NEXT with a GET (302), after ``first``."""
    assert [(first, "/v1/charges"), ("GET", NEXT)] == [
        (arrival.method, arrival.path) for arrival in app.arrivals
    ]
    if kind == "trickle":
        assert_cut_off(app)


# -- a Session's write ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", REDIRECTS)
def test_a_sessions_redirect_body_is_read_to_an_excerpt_and_followed(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], kind: str
) -> None:
    """A POST answered by a 302 whose body is a bomb or trickles for ever: the process
    grows by far less than 100 MiB, the 302 is followed within one read timeout, and the
    operation is journaled with the final answer."""
    app, url = scripted
    app.answer(REDIRECTS[kind](), Answer(status=201))
    with (
        idempotently.Session(
            tmp_path / "journal.db", policy=FAST, follow_redirects=True, timeout=TIMEOUT
        ) as session,
        memory_growth() as grew,
    ):
        response = session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op")
    assert grew[0] < MEMORY_BOUND
    assert (201, [302]) == (response.status_code, [r.status_code for r in response.history])
    assert len(response.history[0].content) <= REDIRECT_BODY_BYTES + DECODE_STEP
    assert_followed(app, "POST", kind)
    journaled = operation(tmp_path / "journal.db", "op")
    assert ("succeeded", 201) == (journaled.status, journaled.response_status)


@pytest.mark.parametrize("lib", LIBRARIES)
@pytest.mark.parametrize("kind", REDIRECTS)
def test_a_redirect_through_a_client_of_either_library_is_bounded_too(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], kind: str, lib: ModuleType
) -> None:
    """Session(client=...) of httpx or httpx2 that follows redirects: the same bounds,
    the redirect followed, the final answer journaled."""
    app, url = scripted
    app.answer(REDIRECTS[kind](), Answer(status=201))
    with (
        lib.Client(follow_redirects=True, timeout=lib.Timeout(30.0, read=1.0)) as client,
        idempotently.Session(tmp_path / "journal.db", client=client, policy=FAST) as session,
        memory_growth() as grew,
    ):
        response = session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op")
    assert grew[0] < MEMORY_BOUND
    assert 201 == response.status_code
    assert_followed(app, "POST", kind)
    assert "succeeded" == operation(tmp_path / "journal.db", "op").status


@pytest.mark.anyio
@pytest.mark.parametrize("kind", REDIRECTS)
async def test_an_async_sessions_redirect_body_is_read_to_an_excerpt_and_followed(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], kind: str, anyio_backend: str
) -> None:
    """AsyncSession, on asyncio and trio: the same bound, the redirect followed."""
    app, url = scripted
    app.answer(REDIRECTS[kind](), Answer(status=201))
    async with idempotently.AsyncSession(
        tmp_path / "journal.db", policy=FAST, follow_redirects=True, timeout=TIMEOUT
    ) as session:
        with memory_growth() as grew:
            response = await session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op")
    assert grew[0] < MEMORY_BOUND
    assert (201, [302]) == (response.status_code, [r.status_code for r in response.history])
    assert_followed(app, "POST", kind)
    assert "succeeded" == operation(tmp_path / "journal.db", "op").status


# -- a Transport's read -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", REDIRECTS)
def test_a_transports_redirect_answer_to_a_read_is_read_to_an_excerpt(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], kind: str
) -> None:
    """A GET through a Transport under a client that follows redirects: the client's
    own read of the 302 finds it read by the transport, within the bounds; the client
    follows it."""
    app, url = scripted
    app.answer(REDIRECTS[kind](), Answer(status=200))
    transport = idempotently.Transport(tmp_path / "journal.db", policy=FAST)
    with (
        httpx.Client(transport=transport, follow_redirects=True, timeout=TIMEOUT) as client,
        memory_growth() as grew,
    ):
        response = client.get(f"{url}/v1/charges")
    assert grew[0] < MEMORY_BOUND
    assert (200, [302]) == (response.status_code, [r.status_code for r in response.history])
    assert_followed(app, "GET", kind)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", REDIRECTS)
async def test_an_async_transports_redirect_answer_to_a_read_is_read_to_an_excerpt(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], kind: str, anyio_backend: str
) -> None:
    """AsyncTransport, on asyncio and trio: the same."""
    app, url = scripted
    app.answer(REDIRECTS[kind](), Answer(status=200))
    transport = idempotently.AsyncTransport(tmp_path / "journal.db", policy=FAST)
    async with httpx.AsyncClient(
        transport=transport, follow_redirects=True, timeout=TIMEOUT
    ) as client:
        with memory_growth() as grew:
            response = await client.get(f"{url}/v1/charges")
    assert grew[0] < MEMORY_BOUND
    assert 200 == response.status_code
    assert_followed(app, "GET", kind)


# -- a lookup's GET ---------------------------------------------------------------------------


def needs_reconcile(target: Path, url: str) -> None:
    """An operation whose only attempt may have been delivered, now needs_reconcile."""
    with Journal(target) as journal:
        make(journal, "op", "pending", url=f"{url}/v1/charges", body=json.dumps(CHARGE).encode())
        started = time.time() - 60
        record_attempt(
            journal,
            "op",
            AttemptRecord(started, 0.1, "maybe_delivered", error="reset"),
            now=started,
        )
        assert set_status(journal, "op", "needs_reconcile", reason="key expired", now=time.time())


@pytest.mark.parametrize("kind", REDIRECTS)
def test_a_lookups_redirect_body_is_read_to_an_excerpt_and_followed(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], kind: str
) -> None:
    """Session.reconcile with a Lookup whose list URL redirects: the 302's body is read
    within the bounds and the page it points to is read; nothing is settled from the
    redirect."""
    app, url = scripted
    needs_reconcile(tmp_path / "journal.db", url)
    app.answer(REDIRECTS[kind](), Answer(status=200, body=b'{"data": [], "has_more": false}'))
    with (
        idempotently.Session(
            tmp_path / "journal.db", base_url=url, follow_redirects=True, timeout=TIMEOUT
        ) as session,
        memory_growth() as grew,
    ):
        (result,) = session.reconcile(Lookup("/v1/charges", backoff=0))
    assert grew[0] < MEMORY_BOUND
    assert ("op", "needs_reconcile") == (result.operation_id, result.status)
    assert_followed(app, "GET", kind)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", REDIRECTS)
async def test_an_async_lookups_redirect_body_is_read_to_an_excerpt_and_followed(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], kind: str, anyio_backend: str
) -> None:
    """AsyncSession.reconcile, on asyncio and trio: the same."""
    app, url = scripted
    needs_reconcile(tmp_path / "journal.db", url)
    app.answer(REDIRECTS[kind](), Answer(status=200, body=b'{"data": [], "has_more": false}'))
    async with idempotently.AsyncSession(
        tmp_path / "journal.db", base_url=url, follow_redirects=True, timeout=TIMEOUT
    ) as session:
        with memory_growth() as grew:
            (result,) = await session.reconcile(Lookup("/v1/charges", backoff=0))
    assert grew[0] < MEMORY_BOUND
    assert ("op", "needs_reconcile") == (result.operation_id, result.status)
    assert_followed(app, "GET", kind)


# -- redirects are followed as httpx follows them ---------------------------------------------


def test_a_307_resends_the_same_bytes_with_the_same_key_and_a_303_becomes_a_get(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """The POST answered 307 arrives again at the new location with its body and key;
    the 303 after it is followed with a GET. The redirect's short body is kept whole in
    the answer's history."""
    app, url = scripted
    app.answer(
        Answer(status=307, headers=(("location", "/v1/charges/moved"),), body=b"moved"),
        Answer(status=303, headers=(("location", NEXT),), body=b"see there"),
        Answer(status=200),
    )
    with idempotently.Session(
        tmp_path / "journal.db", policy=FAST, follow_redirects=True, timeout=TIMEOUT
    ) as session:
        response = session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op")
    key = app.arrivals[0].key
    assert [
        ("POST", "/v1/charges", key, True),
        ("POST", "/v1/charges/moved", key, True),
        ("GET", NEXT, key, False),
    ] == [(a.method, a.path, a.key, bool(a.body)) for a in app.arrivals]
    assert [b"moved", b"see there"] == [hop.content for hop in response.history]
    assert 200 == response.status_code


CREDENTIALS = {
    "header": ({"headers": {"Authorization": "Bearer sk_live_1"}}, "Bearer sk_live_1"),
    "auth": ({"auth": httpx.BasicAuth("user", "pass")}, "Basic dXNlcjpwYXNz"),
}


@pytest.mark.parametrize("given", CREDENTIALS)
def test_authorization_is_dropped_on_a_redirect_to_another_origin(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], given: str
) -> None:
    """Authorization (a header of the client's, or its auth=) goes with a redirect to
    the same origin, and not to another one (localhost instead of 127.0.0.1), as httpx's
    own loop decides: the client's auth is not applied again to a later hop."""
    app, url = scripted
    options, sent = CREDENTIALS[given]
    elsewhere = url.replace("127.0.0.1", "localhost")
    app.answer(
        Answer(status=307, headers=(("location", "/v1/charges/moved"),), body=b""),
        Answer(status=307, headers=(("location", f"{elsewhere}{NEXT}"),), body=b""),
        Answer(status=201),
    )
    with idempotently.Session(
        tmp_path / "journal.db",
        policy=FAST,
        follow_redirects=True,
        timeout=TIMEOUT,
        **options,
    ) as session:
        session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op")
    assert [sent, sent, None] == [arrival.authorization for arrival in app.arrivals]


def test_a_redirect_never_carries_a_bound_key_on_without_its_credentials_nor_says_nothing_was_sent(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """Under a profile that binds keys to credentials, a 307 to another origin (where httpx
    drops Authorization) is not followed with the key: the first request was answered, so
    the attempt is journaled maybe delivered, and neither the error nor the journal says
    that nothing was sent; the error says resume finishes it and names the operation."""
    app, url = scripted
    elsewhere = url.replace("127.0.0.1", "localhost")
    app.answer(
        Answer(status=307, headers=(("location", f"{elsewhere}{NEXT}"),), body=b""),
        Answer(status=201),
    )
    bound = attrs.evolve(profiles.GENERIC, name="bound", key_bound_to_credentials=True)
    with (
        idempotently.Session(
            tmp_path / "journal.db",
            policy=idempotently.RetryPolicy(max_attempts=1),
            profile=bound,
            follow_redirects=True,
            timeout=TIMEOUT,
            headers={"Authorization": "Bearer sk_live_1"},
        ) as session,
        pytest.raises(idempotently.CredentialsMismatchError) as caught,
    ):
        session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op")
    (arrival,) = app.arrivals
    message = str(caught.value)
    assert ("op", arrival.key) == (caught.value.operation_id, caught.value.key)
    assert "may have been delivered" in message and "resume" in message
    assert "nothing was sent" not in message.lower()
    journaled = operation(tmp_path / "journal.db", "op")
    (attempt,) = journaled.attempts
    assert ("pending", "maybe_delivered") == (journaled.status, attempt.outcome)
    assert "nothing was sent" not in (attempt.error or "").lower()


@pytest.mark.parametrize("location", ["http://127.0.0.1:1/v1/orders/1", "ftp://127.0.0.1/x"])
def test_a_redirect_that_cannot_be_followed_never_resends_an_at_most_once_write(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], location: str
) -> None:
    """A POST answered 303 (it acted: post/redirect/get) whose Location cannot be reached
    (nothing listens there, or a scheme httpx cannot send): the POST reached the server,
    so the attempt is journaled maybe delivered and an at-most-once write is never sent
    again, however many attempts the policy allows."""
    app, url = scripted
    app.answer(Answer(status=303, headers=(("location", location),), body=b""))
    with (
        idempotently.Session(
            tmp_path / "journal.db",
            policy=idempotently.RetryPolicy(max_attempts=3, initial_backoff=0.0, max_backoff=0.0),
            follow_redirects=True,
            timeout=TIMEOUT,
        ) as session,
        pytest.raises(idempotently.IdempotentlyError) as caught,
    ):
        session.post(f"{url}/v1/orders", json=CHARGE, operation_id="op", delivery="at_most_once")
    assert [("POST", "/v1/orders")] == [(a.method, a.path) for a in app.arrivals]
    journaled = operation(tmp_path / "journal.db", "op")
    assert ["maybe_delivered"] == [attempt.outcome for attempt in journaled.attempts]
    assert "may have been delivered" in str(caught.value)


@pytest.mark.anyio
async def test_async_a_redirect_that_cannot_be_followed_never_resends_an_at_most_once_write(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], anyio_backend: str
) -> None:
    """AsyncSession, on asyncio and trio: the same."""
    app, url = scripted
    location = "http://127.0.0.1:1/v1/orders/1"
    app.answer(Answer(status=303, headers=(("location", location),), body=b""))
    async with idempotently.AsyncSession(
        tmp_path / "journal.db",
        policy=idempotently.RetryPolicy(max_attempts=3, initial_backoff=0.0, max_backoff=0.0),
        follow_redirects=True,
        timeout=TIMEOUT,
    ) as session:
        with pytest.raises(idempotently.IdempotentlyError):
            await session.post(
                f"{url}/v1/orders", json=CHARGE, operation_id="op", delivery="at_most_once"
            )
    assert [("POST", "/v1/orders")] == [(a.method, a.path) for a in app.arrivals]
    journaled = operation(tmp_path / "journal.db", "op")
    assert ["maybe_delivered"] == [attempt.outcome for attempt in journaled.attempts]


def test_a_write_redirected_to_a_get_that_fails_is_never_journaled_failed(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A POST answered 303 (it acted: post/redirect/get) whose GET is answered 404: that
    404 is not the server's first word on the write, so the operation is not journaled
    failed (which says nothing happened and a new operation is safe); it stays pending
    with its key."""
    app, url = scripted
    app.answer(
        Answer(status=303, headers=(("location", NEXT),), body=b""),
        Answer(status=404, body=b'{"error": "not yet visible"}'),
    )
    with (
        idempotently.Session(
            tmp_path / "journal.db", policy=FAST, follow_redirects=True, timeout=TIMEOUT
        ) as session,
        pytest.raises(idempotently.IdempotentlyError) as caught,
    ):
        session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op")
    assert [("POST", "/v1/charges"), ("GET", NEXT)] == [(a.method, a.path) for a in app.arrivals]
    assert "pending" == operation(tmp_path / "journal.db", "op").status
    assert ("op", app.arrivals[0].key) == (caught.value.operation_id, caught.value.key)


def test_max_redirects_ends_the_chain_as_a_journaled_attempt(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A client's max_redirects=1: the second redirect is not followed; the attempt is
    journaled as maybe delivered and the error says so, TooManyRedirects its cause."""
    app, url = scripted
    hop = Answer(status=307, headers=(("location", "/v1/charges"),), body=b"")
    app.answer(hop, hop, hop)
    with (
        idempotently.Session(
            tmp_path / "journal.db",
            policy=idempotently.RetryPolicy(max_attempts=1),
            follow_redirects=True,
            max_redirects=1,
            timeout=TIMEOUT,
        ) as session,
        pytest.raises(idempotently.IdempotentlyError) as caught,
    ):
        session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op")
    assert isinstance(caught.value.__cause__, httpx.TooManyRedirects)
    assert 2 == len(app.arrivals)
    journaled = operation(tmp_path / "journal.db", "op")
    assert ("pending", ["maybe_delivered"]) == (
        journaled.status,
        [attempt.outcome for attempt in journaled.attempts],
    )


def test_without_follow_redirects_the_redirect_is_the_answer(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A client that does not follow redirects gets the 302 as the final answer, its
    body read and journaled as any final answer's."""
    app, url = scripted
    app.answer(Answer(status=302, headers=(("location", NEXT),), body=b"moved"))
    with idempotently.Session(tmp_path / "journal.db", policy=FAST, timeout=TIMEOUT) as session:
        response = session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op")
    assert (302, b"moved", 1) == (response.status_code, response.content, len(app.arrivals))
    assert b"moved" == operation(tmp_path / "journal.db", "op").response_body
