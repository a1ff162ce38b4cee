"""The entry points check what they are given before anything is created (DESIGN §3.1:
"a wrong type or value is a TypeError or ValueError that names the argument"), and
every error survives a pickle round trip. The static half lives in tests/typing/api.py,
checked by mypy."""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

import idempotently

ENTRY_POINTS = [
    idempotently.Session,
    idempotently.AsyncSession,
    idempotently.Transport,
    idempotently.AsyncTransport,
]


@pytest.mark.parametrize("entry_point", ENTRY_POINTS, ids=lambda cls: cls.__name__)
def test_a_misspelt_option_is_a_type_error_before_the_journal_is_created(
    tmp_path: Path, entry_point: type
) -> None:
    """polcy= (for policy=) is a TypeError naming it, and no journal file appears."""
    path = tmp_path / "journal.db"
    with pytest.raises(TypeError, match="polcy"):
        entry_point(path, polcy=idempotently.RetryPolicy())
    assert [] == list(tmp_path.iterdir())


BAD_OPTIONS: list[tuple[str, Any, type[Exception]]] = [
    ("policy", "fast", TypeError),
    ("policy", idempotently.RetryPolicy, TypeError),  # the class, not an instance
    ("policy", {"max_attempts": 3}, TypeError),
    ("profile", "stripe", TypeError),
    ("profile", None, TypeError),
    ("lease_duration", "60", TypeError),
    ("lease_duration", True, TypeError),
    ("lease_duration", 0, ValueError),
    ("lease_duration", -1.0, ValueError),
    ("lease_duration", math.nan, ValueError),
    ("lease_duration", math.inf, ValueError),
    ("key_expiry_margin", -1, ValueError),
    ("key_expiry_margin", "1h", TypeError),
    ("redact_headers", "X-Api-Key", TypeError),
    ("redact_headers", [42], TypeError),
    ("fingerprint_headers", "X-Account", TypeError),
    ("clock", 1_800_000_000.0, TypeError),
    ("sleep", 0.1, TypeError),
    ("hooks", print, TypeError),  # one hook, not a list of them
    ("hooks", [42], TypeError),
    ("hooks", "log", TypeError),
]


@pytest.mark.parametrize("entry_point", ENTRY_POINTS, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize(
    ("name", "value", "error"),
    BAD_OPTIONS,
    ids=[f"{name}={value!r}" for name, value, _ in BAD_OPTIONS],
)
def test_a_wrong_option_is_refused_by_name_before_the_journal_is_created(
    tmp_path: Path, entry_point: type, name: str, value: Any, error: type[Exception]
) -> None:
    """A wrong type is a TypeError, a wrong value a ValueError; each names the option,
    and no journal file appears."""
    with pytest.raises(error, match=name):
        entry_point(tmp_path / "journal.db", **{name: value})
    assert [] == list(tmp_path.iterdir())


@pytest.mark.parametrize("entry_point", ENTRY_POINTS, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("journal", [42, None, b"journal.db", ["journal.db"]], ids=repr)
def test_a_journal_that_is_neither_a_path_nor_a_journal_is_a_type_error(
    tmp_path: Path, entry_point: type, journal: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """journal= must be a path or an idempotently.Journal; nothing is created anywhere."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match="journal"):
        entry_point(journal)
    assert [] == list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("entry_point", "option", "value"),
    [
        (idempotently.Session, "client", httpx.AsyncClient),
        (idempotently.AsyncSession, "client", httpx.Client),
        (idempotently.Transport, "transport", httpx.AsyncHTTPTransport),
        (idempotently.AsyncTransport, "transport", httpx.HTTPTransport),
        (idempotently.Transport, "methods", lambda: "POST"),
    ],
    ids=lambda value: getattr(value, "__name__", str(value)),
)
def test_the_wrong_client_or_transport_is_a_type_error(
    tmp_path: Path, entry_point: type, option: str, value: Any
) -> None:
    """A sync client for the async session (and the like) is refused by name, no file."""
    with pytest.raises(TypeError, match=option):
        entry_point(tmp_path / "journal.db", **{option: value()})
    assert [] == list(tmp_path.iterdir())


@pytest.mark.parametrize("entry_point", [idempotently.Transport, idempotently.AsyncTransport])
def test_an_unknown_delivery_is_a_value_error(tmp_path: Path, entry_point: type) -> None:
    """delivery= other than exactly_once / at_most_once is a ValueError naming it, no file."""
    with pytest.raises(ValueError, match="delivery"):
        entry_point(tmp_path / "journal.db", delivery="twice")
    assert [] == list(tmp_path.iterdir())


@pytest.mark.parametrize("entry_point", [idempotently.Session, idempotently.Transport])
def test_an_async_sleep_for_a_sync_entry_point_is_a_type_error(
    tmp_path: Path, entry_point: type
) -> None:
    """sleep=anyio.sleep on a sync Session or Transport is refused by name, no file."""
    with pytest.raises(TypeError, match="sleep"):
        entry_point(tmp_path / "journal.db", sleep=anyio.sleep)
    assert [] == list(tmp_path.iterdir())


# -- every error pickles -------------------------------------------------------------------

ERRORS = sorted(
    (
        value
        for value in vars(idempotently).values()
        if isinstance(value, type) and issubclass(value, idempotently.IdempotentlyError)
    ),
    key=lambda cls: cls.__name__,
)


def test_every_public_error_is_exported() -> None:
    """Every IdempotentlyError the package holds is in __all__ (so none escapes the test below)."""
    assert {cls.__name__ for cls in ERRORS} <= set(idempotently.__all__)
    assert 14 <= len(ERRORS)


def make(cls: type[idempotently.IdempotentlyError], **context: Any) -> Any:
    if issubclass(cls, idempotently.RetryLaterError):
        return cls("come back later", not_before=1_800_000_123.5, **context)
    if issubclass(cls, idempotently.RetryBudgetError):
        return cls("budget spent", origin="https://api.example.com:443", **context)
    if issubclass(cls, idempotently.AttemptsCapError):
        return cls("at the cap", status="failed", attempts=3, max_total_attempts=3, **context)
    return cls("it went wrong", **context)


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_survives_a_pickle_round_trip(
    cls: type[idempotently.IdempotentlyError],
) -> None:
    """Sent to a worker process and back, an error keeps its type, message, operation id,
    key, not_before and text."""
    error = make(cls, operation_id="order-42:charge", key="k-42")
    copy = pickle.loads(pickle.dumps(error))
    assert cls is type(copy)
    assert (error.message, error.operation_id, error.key, error.response) == (
        copy.message,
        copy.operation_id,
        copy.key,
        copy.response,
    )
    assert getattr(error, "not_before", None) == getattr(copy, "not_before", None)
    assert getattr(error, "origin", None) == getattr(copy, "origin", None)
    for name in ("status", "attempts", "max_total_attempts"):
        assert getattr(error, name, None) == getattr(copy, name, None)
    assert str(error) == str(copy)
    assert error.args == copy.args


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_an_error_without_an_operation_survives_a_pickle_round_trip(
    cls: type[idempotently.IdempotentlyError],
) -> None:
    """An error about no operation (a journal that cannot be opened) pickles too."""
    error = make(cls)
    copy = pickle.loads(pickle.dumps(error))
    assert (cls, str(error), None, None) == (type(copy), str(copy), copy.operation_id, copy.key)


def test_an_error_carrying_its_response_survives_a_pickle_round_trip() -> None:
    """OperationPendingError keeps the last response (status, body, request) across pickle."""
    response = httpx.Response(
        503, content=b'{"error": "busy"}', request=httpx.Request("POST", "https://api.test/x")
    )
    error = idempotently.OperationPendingError(
        "outcome unknown", operation_id="op", key="k", response=response
    )
    copy = pickle.loads(pickle.dumps(error))
    assert copy.response is not None
    assert (503, b'{"error": "busy"}', "https://api.test/x") == (
        copy.response.status_code,
        copy.response.content,
        str(copy.response.request.url),
    )
