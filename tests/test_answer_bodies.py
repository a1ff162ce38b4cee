"""A server's answer body never hangs a journaled write, nor fills memory.

On a real uvicorn server on 127.0.0.1: an endless 503 is read no further than an
excerpt and retried (Session, AsyncSession, Transport, AsyncTransport); a final answer
larger than ``max_response_bytes`` is journaled with its status and headers, and the
caller gets `AnswerNotReadError` (at once, on a call again, and after a resume); a
trickled body ends with the call's deadline, a trickled 503 within one read timeout.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

import idempotently
from idempotently._answers import DECODE_STEP, DEFAULT_MAX_RESPONSE_BYTES, RETRIED_ANSWER_BYTES
from idempotently._commands import ReadAnswer, Send
from idempotently._flow._engine import Engine
from idempotently._flow._operation import Call, Held
from tests.drivers import answer
from tests.memory_store import MemoryStore
from tests.scripted_server import ENDLESS_BYTES, RESET, Answer, ScriptedApp
from tests.support import URL, FakeTime
from tests.test_flow import Run, build

try:
    import httpx2
except ImportError:  # the [httpx2] extra
    httpx2 = None

LIBRARIES = [
    pytest.param(httpx, id="httpx"),
    pytest.param(
        httpx2, id="httpx2", marks=pytest.mark.skipif(httpx2 is None, reason="needs httpx2")
    ),
]

FAST = idempotently.RetryPolicy(initial_backoff=0.0, max_backoff=0.0)
CHARGE = {"amount": 1000, "currency": "usd"}
CHUNK = 65536
"""The most one read of the server's stream adds past a limit."""
LIMIT = 1024 * 1024
"""A small max_response_bytes, so an endless 201 is "too large" in a few milliseconds."""
OK_BODY = Answer().body


def operation(target: str | Path, operation_id: str) -> idempotently.Operation:
    with idempotently.Journal(target) as journal:
        found = journal.operation(operation_id)
    assert found is not None
    return found


def assert_cut_off(app: ScriptedApp, answers: int = 1) -> None:
    """Every endless answer was hung up on long before its end: the client stopped.
    (The server notes what it streamed once it sees the hang-up, a moment later.)"""
    deadline = time.monotonic() + 10
    while len(app.streamed) < answers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert answers == len(app.streamed)
    assert all(sent < ENDLESS_BYTES // 4 for sent in app.streamed)


# -- an endless answer that is retried ---------------------------------------------------


def test_a_sessions_endless_503_is_retried_without_reading_it(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """Session: a POST answered 503 with an endless body is retried with its key, and
    the retry's 201 is the call's answer."""
    app, url = scripted
    app.answer(Answer(status=503, endless=True), Answer(status=201))
    with idempotently.Session(tmp_path / "journal.db", policy=FAST, timeout=30) as session:
        response = session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-1")
    assert (201, OK_BODY) == (response.status_code, response.content)
    first, second = app.arrivals
    assert first.key == second.key is not None
    assert_cut_off(app)
    journaled = operation(tmp_path / "journal.db", "op-1")
    assert ("succeeded", [503, 201]) == (
        journaled.status,
        [attempt.status_code for attempt in journaled.attempts],
    )


@pytest.mark.anyio
async def test_an_async_sessions_endless_503_is_retried_without_reading_it(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncSession on asyncio and trio: the endless 503 is cut off, the retry's 201 comes
    back."""
    app, url = scripted
    app.answer(Answer(status=503, endless=True), Answer(status=201))
    async with idempotently.AsyncSession(
        tmp_path / "journal.db", policy=FAST, timeout=30
    ) as session:
        response = await session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-1")
    assert (201, OK_BODY) == (response.status_code, response.content)
    assert 2 == len({arrival.at for arrival in app.arrivals})
    assert 1 == len({arrival.key for arrival in app.arrivals})
    assert_cut_off(app)


@pytest.mark.parametrize("lib", LIBRARIES)
def test_an_httpx2_sessions_endless_503_is_retried_without_reading_it(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], lib: ModuleType
) -> None:
    """Session(client=...) of either library: the endless 503 is cut off, the 201 kept."""
    app, url = scripted
    app.answer(Answer(status=503, endless=True), Answer(status=201))
    with (
        lib.Client(timeout=30) as client,
        idempotently.Session(tmp_path / "journal.db", client=client, policy=FAST) as session,
    ):
        response = session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-1")
    assert (201, OK_BODY) == (response.status_code, response.content)
    assert 1 == len({arrival.key for arrival in app.arrivals})
    assert_cut_off(app)


@pytest.mark.parametrize("lib", LIBRARIES)
def test_a_transports_endless_503_is_retried_without_reading_it(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], lib: ModuleType
) -> None:
    """Transport under an httpx or an httpx2 client: the journaled POST's endless 503 is
    cut off and retried under the same key."""
    app, url = scripted
    app.answer(Answer(status=503, endless=True), Answer(status=201))
    transport = idempotently.Transport(tmp_path / "journal.db", policy=FAST)
    with lib.Client(transport=transport, timeout=30) as client:
        response = client.post(f"{url}/v1/charges", json=CHARGE)
    assert (lib.Response, 201, OK_BODY) == (
        type(response),
        response.status_code,
        response.content,
    )
    first, second = app.arrivals
    assert first.key == second.key is not None
    assert_cut_off(app)


@pytest.mark.anyio
async def test_an_async_transports_endless_503_is_retried_without_reading_it(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncTransport on asyncio and trio: the same."""
    app, url = scripted
    app.answer(Answer(status=503, endless=True), Answer(status=201))
    transport = idempotently.AsyncTransport(tmp_path / "journal.db", policy=FAST)
    async with httpx.AsyncClient(transport=transport, timeout=30) as client:
        response = await client.post(f"{url}/v1/charges", json=CHARGE)
    assert (201, OK_BODY) == (response.status_code, response.content)
    assert 1 == len({arrival.key for arrival in app.arrivals})
    assert 2 == len(app.arrivals)
    assert_cut_off(app)


def test_the_last_endless_503_leaves_the_operation_pending_with_an_excerpt(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """When every attempt gets an endless 503, the operation stays pending, and the
    error's response holds what was read of the last one: an excerpt of at most 64 KiB
    (and one read's chunk), never the endless body."""
    app, url = scripted
    app.answer(Answer(status=503, endless=True), Answer(status=503, endless=True))
    policy = idempotently.RetryPolicy(max_attempts=2, initial_backoff=0.0, max_backoff=0.0)
    with (
        idempotently.Session(tmp_path / "journal.db", policy=policy, timeout=30) as session,
        pytest.raises(idempotently.OperationPendingError) as caught,
    ):
        session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-1")
    response = caught.value.response
    assert response is not None
    assert 503 == response.status_code
    assert RETRIED_ANSWER_BYTES < len(response.content) <= RETRIED_ANSWER_BYTES + CHUNK
    assert "pending" == operation(tmp_path / "journal.db", "op-1").status
    assert_cut_off(app, answers=2)


SEEN: list[int] = []
"""The body lengths `measuring` was given."""


def measuring(status: int, headers: httpx.Headers, body: bytes) -> None:
    """A classifier that keeps the built-in table, noting how much body it was shown."""
    SEEN.append(len(body))


def test_a_classifier_sees_an_excerpt_of_an_endless_503(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A profile's classify= is given a bounded body for an answer that may be retried:
    the first 64 KiB (and at most one chunk more) of an endless 503, all of a 201."""
    app, url = scripted
    app.answer(Answer(status=503, endless=True), Answer(status=201))
    profile = idempotently.ServerProfile(name="measured", classify=measuring)
    SEEN.clear()
    with idempotently.Session(
        tmp_path / "journal.db", policy=FAST, profile=profile, timeout=30
    ) as session:
        assert 201 == session.post(f"{url}/v1/charges", json=CHARGE).status_code
    excerpt, whole = SEEN
    assert RETRIED_ANSWER_BYTES < excerpt <= RETRIED_ANSWER_BYTES + CHUNK
    assert len(OK_BODY) == whole


def test_an_answer_read_as_an_excerpt_but_kept_is_journaled_whole(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A replayed 503 is final (needs_reconcile), not retried: its body, longer than the
    excerpt, is read on and journaled whole for whoever reconciles it."""
    app, url = scripted
    body = b"e" * (3 * RETRIED_ANSWER_BYTES)
    app.answer(Answer(status=503, headers=(("Idempotent-Replayed", "true"),), body=body))
    with (
        idempotently.Session(tmp_path / "journal.db", policy=FAST, timeout=30) as session,
        pytest.raises(idempotently.NeedsReconcileError),
    ):
        session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-1")
    journaled = operation(tmp_path / "journal.db", "op-1")
    assert ("needs_reconcile", 503, body) == (
        journaled.status,
        journaled.response_status,
        journaled.response_body,
    )


# -- a final answer too large to keep ------------------------------------------------------


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_an_oversized_201_is_journaled_with_its_status_and_the_caller_is_told(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """A 201 whose body is over max_response_bytes: the server acted, so the operation is
    journaled succeeded with the 201 and its headers (no body), and the caller gets
    AnswerNotReadError naming the operation and key; a call again gets it too and sends
    nothing. SQLite and PostgreSQL."""
    app, url = scripted
    app.answer(Answer(status=201, endless=True))
    with idempotently.Session(
        journal_target, policy=FAST, max_response_bytes=LIMIT, timeout=30
    ) as session:
        with pytest.raises(idempotently.AnswerNotReadError) as caught:
            session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-big")
        error = caught.value
        [arrival] = app.arrivals
        assert ("op-big", arrival.key) == (error.operation_id, error.key)
        assert "max_response_bytes" in str(error) and "never sent again" in str(error)
        assert error.response is not None and 201 == error.response.status_code
        assert LIMIT < len(error.response.content) <= LIMIT + CHUNK  # all that was read
        with pytest.raises(idempotently.AnswerNotReadError, match="201"):
            session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-big")
    assert 1 == len(app.arrivals)
    assert_cut_off(app)
    journaled = operation(journal_target, "op-big")
    assert ("succeeded", 201, None) == (
        journaled.status,
        journaled.response_status,
        journaled.response_body,
    )
    assert ("content-type", "application/json") in (journaled.response_headers or ())
    assert "max_response_bytes" in (journaled.reason or "")


@pytest.mark.anyio
async def test_an_async_sessions_oversized_201_is_journaled_with_its_status(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncSession on asyncio and trio: the same end for an oversized 201."""
    app, url = scripted
    app.answer(Answer(status=201, endless=True))
    async with idempotently.AsyncSession(
        tmp_path / "journal.db", policy=FAST, max_response_bytes=LIMIT, timeout=30
    ) as session:
        with pytest.raises(idempotently.AnswerNotReadError) as caught:
            await session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-big")
    assert "op-big" == caught.value.operation_id
    assert_cut_off(app)
    journaled = operation(tmp_path / "journal.db", "op-big")
    assert ("succeeded", 201, None) == (
        journaled.status,
        journaled.response_status,
        journaled.response_body,
    )


def test_a_transports_oversized_201_is_journaled_with_its_status(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """Transport(max_response_bytes=...): the same, raised through the httpx client."""
    app, url = scripted
    app.answer(Answer(status=201, endless=True))
    transport = idempotently.Transport(
        tmp_path / "journal.db", policy=FAST, max_response_bytes=LIMIT
    )
    with (
        httpx.Client(transport=transport, timeout=30) as client,
        pytest.raises(idempotently.AnswerNotReadError) as caught,
    ):
        client.post(f"{url}/v1/charges", json=CHARGE)
    assert caught.value.operation_id is not None
    assert_cut_off(app)
    journaled = operation(tmp_path / "journal.db", caught.value.operation_id)
    assert ("succeeded", 201, None) == (
        journaled.status,
        journaled.response_status,
        journaled.response_body,
    )


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_resume_journals_an_oversized_answer_with_its_status(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """A pending operation (its answer lost) is resumed; the resend's answer is an
    oversized 201: the resume settles it succeeded with its status, says why there is no
    body, and a call again gets AnswerNotReadError. SQLite and PostgreSQL."""
    app, url = scripted
    app.answer(RESET, Answer(status=201, endless=True))
    once = idempotently.RetryPolicy(max_attempts=1)
    with idempotently.Session(
        journal_target, policy=once, max_response_bytes=LIMIT, timeout=30
    ) as session:
        with pytest.raises(idempotently.OperationPendingError):
            session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-r")
        [result] = session.resume()
        assert ("succeeded", 201) == (result.status, result.status_code)
        assert "max_response_bytes" in result.detail
        with pytest.raises(idempotently.AnswerNotReadError):
            session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-r")
    assert 2 == len(app.arrivals)
    assert_cut_off(app)
    journaled = operation(journal_target, "op-r")
    assert ("succeeded", 201, None) == (
        journaled.status,
        journaled.response_status,
        journaled.response_body,
    )


def test_an_answer_within_the_limit_is_kept_whole(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A large answer under max_response_bytes is returned and journaled as it came."""
    app, url = scripted
    body = b"y" * (LIMIT - 1)
    app.answer(Answer(status=201, body=body))
    with idempotently.Session(
        tmp_path / "journal.db", max_response_bytes=LIMIT, timeout=30
    ) as session:
        assert body == session.post(f"{url}/v1/charges", operation_id="op-1").content
    assert body == operation(tmp_path / "journal.db", "op-1").response_body


# -- a trickled answer -------------------------------------------------------------------


def test_a_trickled_final_answer_ends_with_the_calls_deadline(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A 201 whose body comes one byte every 10 ms (each well within the read timeout)
    is read until the policy's deadline and no longer: the operation is journaled with
    its 201, and the caller is told it was still arriving."""
    app, url = scripted
    app.answer(Answer(status=201, endless=True, trickle=0.01))
    policy = idempotently.RetryPolicy(deadline=1.0)
    started = time.monotonic()
    with (
        idempotently.Session(tmp_path / "journal.db", policy=policy, timeout=5) as session,
        pytest.raises(idempotently.AnswerNotReadError, match="deadline"),
    ):
        session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-t")
    # The endless body would be read forever: this bound only catches a hang, with
    # room for a loaded machine.
    assert time.monotonic() - started < 20.0
    journaled = operation(tmp_path / "journal.db", "op-t")
    assert ("succeeded", 201, None) == (
        journaled.status,
        journaled.response_status,
        journaled.response_body,
    )


# A gzip header announcing a comment (FLG.FCOMMENT): every byte after it is comment until
# a NUL, so an endless run of "x" decodes to nothing, ever.
GZIP_ENDLESS_COMMENT = b"\x1f\x8b\x08\x10\x00\x00\x00\x00\x00\xff"


@pytest.mark.parametrize("status", [201, 503])
def test_a_trickled_compressed_answer_that_decodes_to_nothing_still_ends_at_the_deadline(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], status: int
) -> None:
    """A gzip answer whose trickled bytes decode to nothing (an endless header comment)
    is still bounded in time: the call ends with its deadline instead of reading forever,
    and the operation keeps its key."""
    app, url = scripted
    app.answer(
        Answer(
            status=status,
            headers=(("content-encoding", "gzip"),),
            endless=True,
            trickle=0.01,
            prefix=GZIP_ENDLESS_COMMENT,
        )
    )
    policy = idempotently.RetryPolicy(deadline=1.0, max_attempts=1)
    with (
        idempotently.Session(tmp_path / "journal.db", policy=policy, timeout=5) as session,
        pytest.raises(idempotently.IdempotentlyError) as raised,
    ):
        session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-z")
    assert "op-z" == raised.value.operation_id
    assert operation(tmp_path / "journal.db", "op-z").status in {"succeeded", "pending"}


def test_a_trickled_503_is_given_up_within_one_read_timeout(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A 503 trickling its body is read no longer than one read timeout (0.5 s) before
    it is retried, not until the call's 60 s deadline: the retry's 201 comes in time."""
    app, url = scripted
    app.answer(Answer(status=503, endless=True, trickle=0.01), Answer(status=201))
    started = time.monotonic()
    with idempotently.Session(
        tmp_path / "journal.db", policy=FAST, timeout=httpx.Timeout(5.0, read=0.5)
    ) as session:
        response = session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-t")
    assert 201 == response.status_code
    assert time.monotonic() - started < 30.0  # half the 60 s deadline: load cannot reach it


# -- the flow's limits (no I/O) ------------------------------------------------------------


def test_the_flow_reads_an_answer_that_may_be_retried_to_an_excerpt_and_a_final_one_to_the_cap(
    fake_time: FakeTime,
) -> None:
    """The sans-I/O flow asks for 64 KiB of a 503, within its read timeout, and for up
    to max_response_bytes of the 201, within the call's deadline."""
    engine = Engine(
        policy=idempotently.RetryPolicy(initial_backoff=0.0, max_backoff=0.0, deadline=60.0),
        clock=fake_time.clock,
        max_response_bytes=DEFAULT_MAX_RESPONSE_BYTES,
    )
    request = httpx.Request(
        "POST", URL, json=CHARGE, extensions={"timeout": httpx.Timeout(5.0, read=2.0).as_dict()}
    )
    run = Run(MemoryStore(), fake_time, [answer(503), answer(201)])
    started = fake_time.now
    response = run(engine.call(Call(request, operation_id="op-1"), build, Held()), Held())
    assert 201 == response.status_code
    reading = run.of(Send)[0].read
    _, limit, until, _ = reading(httpx.Response(503))
    assert (RETRIED_ANSWER_BYTES, started + 2.0) == (limit, until)
    _, limit, until, _ = reading(httpx.Response(201))
    assert (DEFAULT_MAX_RESPONSE_BYTES, started + 60.0) == (limit, until)
    assert [] == run.of(ReadAnswer)  # both read whole as they came: nothing more to read


# -- the option ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error"), [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_max_response_bytes_must_be_a_positive_int(
    tmp_path: Path, value: object, error: type[Exception]
) -> None:
    """A wrong max_response_bytes is refused by name before the journal is created."""
    with pytest.raises(error, match="max_response_bytes"):
        idempotently.Session(tmp_path / "journal.db", max_response_bytes=value)  # type: ignore[arg-type]
    with pytest.raises(error, match="max_response_bytes"):
        idempotently.Transport(tmp_path / "journal.db", max_response_bytes=value)  # type: ignore[arg-type]
    assert not (tmp_path / "journal.db").exists()


# -- an answer that inflates: decoded bytes are bounded as they are produced ------------------

BOMB_BYTES = 256 * 1024 * 1024
"""What the bomb inflates to: far past any bound, and past the memory bound below."""
MEMORY_BOUND = 100 * 1024 * 1024
"""The most the process's traced memory may grow while a bomb is answered."""


@functools.cache
def bomb() -> bytes:
    """gzip of gzip of 256 MiB of zeros: about a kilobyte on the wire."""
    inner = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    zeros = bytes(1024 * 1024)
    once = b"".join(inner.compress(zeros) for _ in range(BOMB_BYTES // len(zeros)))
    once += inner.flush()
    return gzip.compress(once, 9)


def bomb_answer(status: int = 201) -> Answer:
    return Answer(status=status, headers=(("content-encoding", "gzip, gzip"),), body=bomb())


@contextlib.contextmanager
def memory_growth() -> Iterator[list[int]]:
    """The peak of traced memory above where it started, in the one item of the list."""
    bomb()  # made before the measure
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        grew = [0]
        yield grew
        grew[0] = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


def assert_journaled_not_read(target: str | Path, operation_id: str) -> None:
    journaled = operation(target, operation_id)
    assert ("succeeded", 201, None) == (
        journaled.status,
        journaled.response_status,
        journaled.response_body,
    )
    assert "max_response_bytes" in (journaled.reason or "")


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_sessions_gzip_of_gzip_bomb_is_journaled_not_read(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """A 201 of a kilobyte that inflates (gzip, gzip) to 256 MiB: the process grows by
    far less than 100 MiB, the operation is journaled succeeded with the 201 and no body,
    and the caller gets AnswerNotReadError. SQLite and PostgreSQL."""
    app, url = scripted
    app.answer(bomb_answer())
    with (
        idempotently.Session(
            journal_target, policy=FAST, max_response_bytes=LIMIT, timeout=30
        ) as session,
        memory_growth() as grew,
        pytest.raises(idempotently.AnswerNotReadError) as caught,
    ):
        session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-bomb")
    assert grew[0] < MEMORY_BOUND
    assert ("op-bomb", app.arrivals[0].key) == (caught.value.operation_id, caught.value.key)
    assert caught.value.response is not None
    assert LIMIT < len(caught.value.response.content) <= LIMIT + DECODE_STEP
    assert_journaled_not_read(journal_target, "op-bomb")


@pytest.mark.parametrize("lib", LIBRARIES)
def test_a_bomb_through_a_client_of_either_library_is_journaled_not_read(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], lib: ModuleType
) -> None:
    """Session(client=...) of httpx or httpx2: the bomb is bounded the same way (the
    httpx2 answer's raw bytes are decoded here too)."""
    app, url = scripted
    app.answer(bomb_answer())
    with (
        lib.Client(timeout=30) as client,
        idempotently.Session(
            tmp_path / "journal.db", client=client, policy=FAST, max_response_bytes=LIMIT
        ) as session,
        memory_growth() as grew,
        pytest.raises(idempotently.AnswerNotReadError),
    ):
        session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-bomb")
    assert grew[0] < MEMORY_BOUND
    assert_journaled_not_read(tmp_path / "journal.db", "op-bomb")


@pytest.mark.anyio
async def test_an_async_sessions_gzip_of_gzip_bomb_is_journaled_not_read(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncSession on asyncio and trio: the same bound, the same journal."""
    app, url = scripted
    app.answer(bomb_answer())
    async with idempotently.AsyncSession(
        tmp_path / "journal.db", policy=FAST, max_response_bytes=LIMIT, timeout=30
    ) as session:
        with memory_growth() as grew, pytest.raises(idempotently.AnswerNotReadError):
            await session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-bomb")
    assert grew[0] < MEMORY_BOUND
    assert_journaled_not_read(tmp_path / "journal.db", "op-bomb")


def test_a_transports_gzip_of_gzip_bomb_is_journaled_not_read(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """Transport under an httpx client: the same bound, the same journal."""
    app, url = scripted
    app.answer(bomb_answer())
    transport = idempotently.Transport(
        tmp_path / "journal.db", policy=FAST, max_response_bytes=LIMIT
    )
    with (
        httpx.Client(transport=transport, timeout=30) as client,
        memory_growth() as grew,
        pytest.raises(idempotently.AnswerNotReadError) as caught,
    ):
        client.post(f"{url}/v1/charges", json=CHARGE)
    assert grew[0] < MEMORY_BOUND
    assert caught.value.operation_id is not None
    assert_journaled_not_read(tmp_path / "journal.db", caught.value.operation_id)


@pytest.mark.anyio
async def test_an_async_transports_gzip_of_gzip_bomb_is_journaled_not_read(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncTransport on asyncio and trio: the same bound, the same journal."""
    app, url = scripted
    app.answer(bomb_answer())
    transport = idempotently.AsyncTransport(
        tmp_path / "journal.db", policy=FAST, max_response_bytes=LIMIT
    )
    async with httpx.AsyncClient(transport=transport, timeout=30) as client:
        with memory_growth() as grew, pytest.raises(idempotently.AnswerNotReadError) as caught:
            await client.post(f"{url}/v1/charges", json=CHARGE)
    assert grew[0] < MEMORY_BOUND
    assert caught.value.operation_id is not None
    assert_journaled_not_read(tmp_path / "journal.db", caught.value.operation_id)


def test_a_retried_503_bomb_is_read_to_an_excerpt(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A 503 that inflates to 256 MiB is read to its 64 KiB excerpt and retried; the
    retry's 201 is the answer."""
    app, url = scripted
    app.answer(bomb_answer(503), Answer(status=201))
    with (
        idempotently.Session(tmp_path / "journal.db", policy=FAST, timeout=30) as session,
        memory_growth() as grew,
    ):
        response = session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-1")
    assert grew[0] < MEMORY_BOUND
    assert (201, OK_BODY) == (response.status_code, response.content)


@pytest.mark.parametrize(
    ("encoding", "encode"),
    [
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", lambda data: zlib.compress(data)[2:-4]),  # raw deflate, as some send it
        ("gzip, gzip", lambda data: gzip.compress(gzip.compress(data))),
        ("identity", lambda data: data),
    ],
    ids=["gzip", "x-gzip", "deflate", "raw-deflate", "gzip-gzip", "identity"],
)
def test_an_encoded_answer_is_decoded_and_journaled_decoded(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], encoding: str, encode: Any
) -> None:
    """A 201 sent gzip, deflate (zlib-wrapped or raw) or gzip twice comes back and is
    journaled decoded, as before: the bound changes nothing for an answer within it."""
    app, url = scripted
    body = b'{"id": "ch_1", "pad": "' + b"x" * 300_000 + b'"}'
    app.answer(Answer(status=201, headers=(("content-encoding", encoding),), body=encode(body)))
    with idempotently.Session(tmp_path / "journal.db", policy=FAST, timeout=30) as session:
        response = session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-1")
        assert (201, body) == (response.status_code, response.content)
        replayed = session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-1")
    assert body == replayed.content
    assert 1 == len(app.arrivals)
    assert body == operation(tmp_path / "journal.db", "op-1").response_body


@pytest.mark.parametrize(
    ("encoding", "why"),
    [
        ("gzip, gzip, gzip", "encoded 3 times"),
        ("br", "'br'"),
        ("gzip, compress", "'compress'"),
    ],
)
def test_too_many_layers_or_an_unknown_encoding_is_journaled_not_read(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], encoding: str, why: str
) -> None:
    """More than two encoding layers, or an encoding not decoded within a bound: the 201
    is journaled with its status and headers and the caller gets AnswerNotReadError."""
    app, url = scripted
    app.answer(Answer(status=201, headers=(("content-encoding", encoding),), body=b"\x00" * 64))
    with (
        idempotently.Session(tmp_path / "journal.db", policy=FAST, timeout=30) as session,
        pytest.raises(idempotently.AnswerNotReadError, match=why),
    ):
        session.post(f"{url}/v1/charges", json=CHARGE, operation_id="op-1")
    journaled = operation(tmp_path / "journal.db", "op-1")
    assert ("succeeded", 201, None) == (
        journaled.status,
        journaled.response_status,
        journaled.response_body,
    )
    assert why in (journaled.reason or "")
