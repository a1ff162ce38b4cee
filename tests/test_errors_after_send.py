"""One rule for every error raised after a send may have begun (before its answer was
journaled): it says the request may have been delivered and that resume finishes it, and
carries the operation id and key, whatever raised it (a codec on the answer, a response
hook, a journal write, a close). An error raised before any send still says nothing was
sent. Session, Transport and AsyncSession (asyncio and trio), against a loopback server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import idempotently
from idempotently._commands import Record
from idempotently._exceptions import JournalWriteError
from tests.scripted_server import RESET, Answer, ScriptedApp

ANSWER = b'{"id": "ch_1", "secret_answer": true}'
ONE_TRY = idempotently.RetryPolicy(max_attempts=1)


class FailsOnAnswers:
    """Encodes requests; raises on the server's answer (it quotes the data: never shown)."""

    name = "fails-on-answers"

    def encode(self, data: bytes) -> bytes:
        if b"secret_answer" in data:
            raise RuntimeError(f"cannot encode {data!r}")
        return data[::-1]

    def decode(self, data: bytes) -> bytes:
        return data[::-1]


class RecordsFail(idempotently.Journal):
    """A journal whose attempt records fail to commit (a disk error after the send)."""

    def _execute(self, command: Any) -> Any:
        if isinstance(command, Record):
            raise JournalWriteError(f"cannot write the journal {self.path}: disk I/O error")
        return super()._execute(command)

    async def _aexecute(self, command: Any) -> Any:
        if isinstance(command, Record):
            raise JournalWriteError(f"cannot write the journal {self.path}: disk I/O error")
        return await super()._aexecute(command)


def raising_classifier(status: int, headers: httpx.Headers, body: bytes) -> str | None:
    raise ValueError("classifier bug")


def raise_on_response(response: httpx.Response) -> None:
    raise RuntimeError("a response hook failed")


async def araise_on_response(response: httpx.Response) -> None:
    raise RuntimeError("a response hook failed")


def journal_for(point: str, path: Path | str) -> idempotently.Journal:
    if point == "codec-on-the-answer":
        return idempotently.Journal(path, codec=FailsOnAnswers())
    if point == "journal-write-fails":
        return RecordsFail(path)
    return idempotently.Journal(path)


def says_it_may_have_been_delivered(error: BaseException, key: str) -> None:
    """The one rule, as a caller sees it."""
    assert isinstance(error, idempotently.IdempotentlyError), repr(error)
    message = str(error)
    assert ("op", key) == (error.operation_id, error.key)
    # "may have been delivered" (the drivers' rule), or "the server may have acted" (an
    # answer lost to a hook: journaled as an attempt that may have acted).
    assert "may have" in message and "resume" in message
    assert "nothing was" not in message and "not sent" not in message
    assert "secret_answer" not in message


def the_operation(path: Path | str) -> tuple[str, int] | None:
    with idempotently.Journal(path, readonly=True) as journal:
        operation = journal.operation("op")
    return None if operation is None else (operation.status, operation.attempt_count)


SESSION_POINTS = ["codec-on-the-answer", "response-hook", "journal-write-fails", "close"]


@pytest.mark.parametrize("point", SESSION_POINTS)
def test_a_session_error_after_the_send_says_it_may_have_been_delivered(
    journal_target: str, scripted: tuple[ScriptedApp, str], point: str
) -> None:
    """Each hook point that can raise after the request left, on SQLite and PostgreSQL: the
    one sentence, id and key; the server saw the request once and the operation is still
    pending."""
    app, url = scripted
    app.answer(Answer(201, body=ANSWER))
    path = journal_target
    journal = journal_for(point, path)
    hooks: dict[str, list[Callable[..., Any]]] = {}
    if point == "response-hook":
        hooks["response"] = [raise_on_response]
    if point == "close":
        hooks["response"] = [lambda response: journal.close()]
    client = httpx.Client(base_url=url, event_hooks=hooks)
    with (
        idempotently.Session(journal, client=client, policy=ONE_TRY) as session,
        pytest.raises(Exception) as caught,
    ):
        session.post("/v1/charges", json={"amount": 1}, operation_id="op")
    client.close()
    journal.close()
    (arrival,) = app.arrivals
    assert arrival.key is not None
    says_it_may_have_been_delivered(caught.value, arrival.key)
    assert "pending" == (the_operation(path) or ("",))[0]


@pytest.mark.parametrize("point", ["codec-on-the-answer", "journal-write-fails"])
def test_a_transport_error_after_the_send_says_it_may_have_been_delivered(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], point: str
) -> None:
    """The same under an SDK's own client (Transport)."""
    app, url = scripted
    app.answer(Answer(201, body=ANSWER))
    path = tmp_path / "journal.db"
    journal = journal_for(point, path)
    with (
        httpx.Client(transport=idempotently.Transport(journal), base_url=url) as sdk,
        pytest.raises(Exception) as caught,
    ):
        sdk.post("/v1/charges", json={"amount": 1}, headers={"Idempotency-Key": "sdk-1"})
    journal.close()
    (arrival,) = app.arrivals
    assert isinstance(caught.value, idempotently.IdempotentlyError)
    assert ("sdk-1", True) == (
        arrival.key,
        "may have been delivered" in str(caught.value) and "resume" in str(caught.value),
    )
    assert caught.value.key == "sdk-1" and caught.value.operation_id is not None
    assert "nothing was" not in str(caught.value)


@pytest.mark.anyio
@pytest.mark.parametrize("point", ["codec-on-the-answer", "response-hook", "journal-write-fails"])
async def test_an_async_error_after_the_send_says_it_may_have_been_delivered(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], point: str
) -> None:
    """AsyncSession on asyncio and trio: the same rule."""
    app, url = scripted
    app.answer(Answer(201, body=ANSWER))
    path = tmp_path / "journal.db"
    journal = journal_for(point, path)
    hooks = {"response": [araise_on_response]} if point == "response-hook" else {}
    async with (
        httpx.AsyncClient(base_url=url, event_hooks=hooks) as client,
        idempotently.AsyncSession(journal, client=client, policy=ONE_TRY) as session,
    ):
        with pytest.raises(Exception) as caught:
            await session.post("/v1/charges", json={"amount": 1}, operation_id="op")
    journal.close()
    (arrival,) = app.arrivals
    assert arrival.key is not None
    says_it_may_have_been_delivered(caught.value, arrival.key)


def test_an_at_most_once_error_after_the_send_says_it_is_never_resent(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """At-most-once: may have been delivered, so never resent (not "resume finishes it")."""
    app, url = scripted
    app.answer(Answer(201, body=ANSWER))
    path = tmp_path / "journal.db"
    with (
        idempotently.Session(
            idempotently.Journal(path, codec=FailsOnAnswers()), base_url=url
        ) as session,
        pytest.raises(idempotently.CodecError) as caught,
    ):
        session.post("/v1/charges", json={"amount": 1}, operation_id="op", delivery="at_most_once")
    assert "may have been delivered" in str(caught.value)
    assert "never resent" in str(caught.value)
    assert ("abandoned", 1) == the_operation(path)


def test_a_codec_error_before_the_send_still_says_nothing_was_sent(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """The other side of the rule: a request body the codec refuses is never sent, and
    the error says so (with the call's id and key)."""
    app, url = scripted
    path = tmp_path / "journal.db"

    class FailsOnRequests(FailsOnAnswers):
        def encode(self, data: bytes) -> bytes:
            if b"amount" in data:
                raise RuntimeError("no")
            return data[::-1]

    with (
        idempotently.Session(
            idempotently.Journal(path, codec=FailsOnRequests()), base_url=url
        ) as session,
        pytest.raises(idempotently.CodecError) as caught,
    ):
        session.post("/v1/charges", json={"amount": 1}, operation_id="op")
    assert "nothing was journaled or sent" in str(caught.value)
    assert "may have been delivered" not in str(caught.value)
    assert ("op", True) == (caught.value.operation_id, caught.value.key is not None)
    assert ([], None) == (app.arrivals, the_operation(path))


def test_a_classifier_that_raises_leaves_the_operation_pending_with_its_key(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A classifier raising on the answer: the answer is journaled, the error names the
    operation and key and says to resume; it never says nothing was sent."""
    app, url = scripted
    app.answer(Answer(201, body=ANSWER))

    profile = idempotently.ServerProfile(name="raising", classify=raising_classifier)
    path = tmp_path / "journal.db"
    with (
        idempotently.Session(path, base_url=url, profile=profile, policy=ONE_TRY) as session,
        pytest.raises(idempotently.IdempotentlyError) as caught,
    ):
        session.post("/v1/charges", json={"amount": 1}, operation_id="op")
    (arrival,) = app.arrivals
    assert ("op", arrival.key) == (caught.value.operation_id, caught.value.key)
    assert "resume" in str(caught.value) and "nothing was" not in str(caught.value)
    assert ("pending", 1) == the_operation(path)


@pytest.mark.anyio
@pytest.mark.parametrize("point", ["codec-on-the-answer", "journal-write-fails"])
async def test_an_async_transport_error_after_the_send_says_it_may_have_been_delivered(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], point: str
) -> None:
    """AsyncTransport under an SDK's async client, on asyncio and trio: the same rule."""
    app, url = scripted
    app.answer(Answer(201, body=ANSWER))
    journal = journal_for(point, tmp_path / "journal.db")
    async with httpx.AsyncClient(
        transport=idempotently.AsyncTransport(journal), base_url=url
    ) as sdk:
        with pytest.raises(idempotently.IdempotentlyError) as caught:
            await sdk.post("/v1/charges", json={"amount": 1}, headers={"Idempotency-Key": "k-1"})
    journal.close()
    (arrival,) = app.arrivals
    message = str(caught.value)
    assert ("k-1", "k-1") == (arrival.key, caught.value.key)
    assert caught.value.operation_id is not None
    assert "may have been delivered" in message and "resume" in message
    assert "nothing was" not in message and "secret_answer" not in message


def test_the_rule_drops_any_claim_that_nothing_was_sent_and_never_quotes_a_foreign_error() -> None:
    """The one rule on its own: a claim of "nothing was sent" is dropped, the sentence and
    the ids added, its type kept; any other error becomes OperationPendingError, its
    message never quoted (it may hold a body), kept as the cause."""
    from idempotently._exceptions import after_send_began

    claimed = after_send_began(
        idempotently.CodecError("codec 'x' failed; nothing was journaled or sent"),
        "op",
        "k",
        "exactly_once",
    )
    foreign = ValueError("card 4242424242424242")
    wrapped = after_send_began(foreign, "op", "k", "at_most_once")
    assert isinstance(claimed, idempotently.CodecError)
    assert "nothing was" not in str(claimed) and "may have been delivered" in str(claimed)
    assert ("op", "k") == (claimed.operation_id, claimed.key)
    assert isinstance(wrapped, idempotently.OperationPendingError)
    assert (foreign, "4242" in str(wrapped)) == (wrapped.__cause__, False)
    assert "never resent" in str(wrapped)


def test_a_codec_failing_on_one_answer_does_not_stop_the_resume_of_the_others(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """Resume meets an answer the codec cannot encode: that operation is reported as maybe
    delivered (journaled so, still pending with its key), and the operations after it are
    resumed, as for any other row that cannot be resumed (DESIGN §7)."""
    app, url = scripted
    path = tmp_path / "journal.db"
    app.answer(RESET, RESET)
    with idempotently.Session(
        idempotently.Journal(path, codec=FailsOnAnswers()), base_url=url, policy=ONE_TRY
    ) as session:
        for operation_id in ("op", "op-2"):
            with pytest.raises(idempotently.OperationPendingError):
                session.post("/v1/charges", json={"amount": 1}, operation_id=operation_id)
        app.answer(Answer(201, body=ANSWER), Answer(201))
        results = {result.operation_id: result for result in session.resume()}
    assert ["op", "op-2"] == sorted(results)
    assert ("pending", "still_pending") == (results["op"].status, results["op"].action)
    assert "may have been delivered" in results["op"].detail
    assert "secret_answer" not in results["op"].detail
    assert "succeeded" == results["op-2"].status
    with idempotently.Journal(path, readonly=True) as journal:
        first, second = journal.operation("op"), journal.operation("op-2")
    assert first is not None and second is not None
    assert (("pending", 2), ("succeeded", 2)) == (
        (first.status, first.attempt_count),
        (second.status, second.attempt_count),
    )
    assert 4 == len(app.arrivals)
