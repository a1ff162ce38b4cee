"""A commit observer (`Journal.observe_commits`) that misbehaves gets a clear error, never
a hang or a raw TypeError: one that writes to or closes the journal it watches from inside
its callback, one that is not callable, one that unsubscribes twice or from inside itself.
Each test states one promise (from an adversarial review)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

import idempotently
from tests.support import URL

STALL = 30.0
"""Seconds a call may take before the test calls it stuck (it returns at once)."""


def session_at(path: Path, sent: list[httpx.Request]) -> idempotently.Session:
    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(201)

    return idempotently.Session(path / "journal.db", transport=httpx.MockTransport(answer))


def without_stalling(call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` on a thread; what it raised (None if it returned). Fails if it hangs
    (the tests then leave their session unclosed: closing would wait for the hung batch)."""
    raised: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as error:  # the test asserts on it
            raised.append(error)
        else:
            raised.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(STALL)
    assert not thread.is_alive(), "the call deadlocked"
    return raised[0]


def test_an_observer_writing_to_its_journal_gets_a_clear_error_not_a_deadlock(
    tmp_path: Path,
) -> None:
    """A call made from inside ``before`` would wait for the batch that runs it: it is
    refused with a JournalError saying why; the outer batch fails with it, nothing is sent."""
    sent: list[httpx.Request] = []
    session = session_at(tmp_path, sent)
    inner: list[BaseException] = []

    def before(writes: Sequence[Any], durable: bool) -> None:
        if not inner:
            try:
                session.post(URL, json={}, operation_id="inner")
            except BaseException as error:
                inner.append(error)
                raise

    session.journal.observe_commits(before=before)
    raised = without_stalling(lambda: session.post(URL, json={}, operation_id="outer"))
    journaled = [operation.operation_id for operation in session.journal.operations()]
    session.close()
    assert isinstance(raised, idempotently.JournalError)
    assert "observer" in str(raised)
    assert ([], []) == (sent, journaled)


def test_an_observer_writing_after_a_commit_is_logged_and_the_call_goes_on(
    tmp_path: Path,
) -> None:
    """From ``after``, the refused write is the observer's error (logged): the batch
    stands and the outer call completes."""
    sent: list[httpx.Request] = []
    session = session_at(tmp_path, sent)
    tried: list[int] = []

    def after(writes: Sequence[Any], outcomes: Sequence[Any]) -> None:
        if not tried:
            tried.append(1)
            session.post(URL, json={}, operation_id="inner")

    session.journal.observe_commits(after=after)
    raised = without_stalling(lambda: session.post(URL, json={}, operation_id="outer"))
    outer = session.journal.operation("outer")
    session.close()
    assert (None, 1, "succeeded") == (raised, len(sent), outer and outer.status)


def test_an_observer_closing_its_journal_gets_a_clear_error_not_a_deadlock(
    tmp_path: Path,
) -> None:
    """close() from inside ``before`` would wait for the batch that runs it: refused, and
    the journal is left open and usable (nothing half-closed)."""
    sent: list[httpx.Request] = []
    session = session_at(tmp_path, sent)
    refused: list[BaseException] = []

    def before(writes: Sequence[Any], durable: bool) -> None:
        if not refused:
            try:
                session.journal.close()
            except idempotently.JournalError as error:
                refused.append(error)

    session.journal.observe_commits(before=before)
    raised = without_stalling(lambda: session.post(URL, json={}, operation_id="outer"))
    outer = session.journal.operation("outer")
    session.close()
    assert (None, 1, "succeeded") == (raised, len(sent), outer and outer.status)
    assert "observer" in str(refused[0])


@pytest.mark.parametrize("argument", ["before", "after"])
def test_a_non_callable_observer_is_refused_when_subscribed(tmp_path: Path, argument: str) -> None:
    """``observe_commits(before=1)`` raises a TypeError naming the argument at once, not a
    raw ``'int' object is not callable`` from every later call."""
    sent: list[httpx.Request] = []
    with session_at(tmp_path, sent) as session:
        with pytest.raises(TypeError, match=argument):
            hostile: dict[str, Any] = {argument: 1}  # what mypy would refuse, at run time
            session.journal.observe_commits(**hostile)
        response = session.post(URL, json={}, operation_id="op-1")
    assert (201, 1) == (response.status_code, len(sent))


def test_stopping_an_observer_twice_and_from_inside_itself_is_harmless(tmp_path: Path) -> None:
    """The stop function is idempotent and may run inside the observer's own callback:
    it sees the batch it stopped in, and nothing after."""
    sent: list[httpx.Request] = []
    seen: list[int] = []
    with session_at(tmp_path, sent) as session:
        stops: list[Callable[[], None]] = []

        def before(writes: Sequence[Any], durable: bool) -> None:
            seen.append(len(writes))
            stops[0]()
            stops[0]()

        stops.append(session.journal.observe_commits(before=before))
        session.post(URL, json={}, operation_id="op-1")
        session.post(URL, json={}, operation_id="op-2")
        stops[0]()
    assert ([1], 2) == (seen, len(sent))


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_observer_writing_during_an_async_commit_gets_a_clear_error_not_a_deadlock(
    tmp_path: Path, backend: str
) -> None:
    """An AsyncSession's writes are committed by the journal's own thread: a write made
    from ``before`` there is refused as from any committing thread; the outer call fails
    with it and nothing is sent, on asyncio and trio."""
    import anyio

    sent: list[httpx.Request] = []
    inner: list[BaseException] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(201)

    async def main() -> None:
        async with idempotently.AsyncSession(
            tmp_path / "journal.db", transport=httpx.MockTransport(answer)
        ) as session:

            def before(writes: Sequence[Any], durable: bool) -> None:
                if not inner:
                    try:
                        session.journal.unpause("https://api.example")
                    except BaseException as error:
                        inner.append(error)
                        raise

            session.journal.observe_commits(before=before)
            await session.post(URL, json={}, operation_id="outer")

    raised = without_stalling(lambda: anyio.run(main, backend=backend))
    assert isinstance(raised, idempotently.JournalError)
    assert [True] == [isinstance(error, idempotently.JournalError) for error in inner]
    assert "observer" in str(inner[0])
    assert [] == sent
