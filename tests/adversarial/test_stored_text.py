"""Text from the wire or a hook reaches both journal stores, identically, without an error.

An exception message may hold lone surrogates (undecodable server bytes) that
no UTF-8 encoder takes, and NUL, which PostgreSQL refuses in text: stored as
U+FFFD and U+2400, so the call ends as it would have (pending, with its key),
never in a raw UnicodeEncodeError or JournalWriteError, and the row reads back.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

import idempotently
from idempotently._text import NUL_SYMBOL, REPLACEMENT, storable_text

HOSTILE = "charge refused: \udcff\udcfe bytes, a NUL \x00 here, \ud83d half an emoji"
STORED = (
    f"charge refused: {REPLACEMENT}{REPLACEMENT} bytes, a NUL {NUL_SYMBOL} here, "
    f"{REPLACEMENT} half an emoji"
)
ONE_TRY = idempotently.RetryPolicy(max_attempts=1)


def lost(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadError(HOSTILE, request=request)


def answered(request: httpx.Request) -> httpx.Response:
    return httpx.Response(201, json={"id": "ch_1"})


def hook_that_raises(response: httpx.Response) -> None:
    raise RuntimeError(HOSTILE)


async def async_hook_that_raises(response: httpx.Response) -> None:
    raise RuntimeError(HOSTILE)


CASES = {
    "transport error": ({"transport": httpx.MockTransport(lost)}, f"ReadError: {STORED}"),
    "response hook": (
        {
            "transport": httpx.MockTransport(answered),
            "event_hooks": {"response": [hook_that_raises]},
        },
        f"RuntimeError: {STORED}",
    ),
}


def stored_errors(journal: str, operation_id: str) -> tuple[str, list[str | None], str | None]:
    with idempotently.Journal(journal, create=False) as opened:
        operation = opened.operation(operation_id)
    assert operation is not None
    return operation.status, [attempt.error for attempt in operation.attempts], operation.reason


@pytest.mark.parametrize("case", CASES)
def test_hostile_error_text_is_stored_readably_sync(journal_target: str, case: str) -> None:
    """Sync Session: pending with the text stored as U+FFFD/U+2400, on SQLite and PostgreSQL."""
    options, expected = CASES[case]
    with (
        idempotently.Session(journal_target, policy=ONE_TRY, **options) as session,
        pytest.raises(idempotently.OperationPendingError) as caught,
    ):
        session.post("http://api.example.test/v1/charges", json={"a": 1}, operation_id="op")
    status, errors, reason = stored_errors(journal_target, "op")
    assert ("pending", [expected], True, True) == (
        status,
        errors,
        reason is not None and STORED in reason,
        STORED in str(caught.value),
    )


@pytest.mark.anyio
@pytest.mark.parametrize("case", CASES)
async def test_hostile_error_text_is_stored_readably_async(journal_target: str, case: str) -> None:
    """AsyncSession on asyncio and trio: the same stored text as the sync Session."""
    _, expected = CASES[case]
    transport = {"transport error": lost, "response hook": answered}[case]
    async_options: dict[str, Any] = {"transport": httpx.MockTransport(transport)}
    if case == "response hook":
        async_options["event_hooks"] = {"response": [async_hook_that_raises]}
    async with idempotently.AsyncSession(
        journal_target, policy=ONE_TRY, **async_options
    ) as session:
        with pytest.raises(idempotently.OperationPendingError):
            await session.post("http://api.example.test/v1/charges", json={}, operation_id="op")
    status, errors, _ = stored_errors(journal_target, "op")
    assert ("pending", [expected]) == (status, errors)


def test_show_prints_the_stored_text(tmp_path: Any) -> None:
    """`idempotently show` reads the row back: the stand-ins, no traceback."""
    from click.testing import CliRunner

    from idempotently.cli import cli

    journal = str(tmp_path / "journal.db")
    options, _ = CASES["transport error"]
    with (
        idempotently.Session(journal, policy=ONE_TRY, **options) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post("http://api.example.test/v1/charges", json={}, operation_id="op")
    result = CliRunner().invoke(cli, ["--journal", journal, "show", "op"])
    assert (0, True) == (result.exit_code, STORED in result.output), result.output


@given(text=st.text())
def test_storable_text_is_always_encodable_and_nul_free(text: str) -> None:
    """Whatever the text, the stored form encodes as UTF-8 and holds no NUL."""
    stored = storable_text(text)
    assert (False, len(text)) == ("\x00" in stored, len(stored))
    stored.encode("utf-8")


@given(text=st.text(alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00")))
def test_storable_text_leaves_ordinary_text_alone(text: str) -> None:
    """Text with neither surrogates nor NUL is stored exactly as it is."""
    assert text == storable_text(text)
