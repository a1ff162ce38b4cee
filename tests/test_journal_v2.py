"""Journal durability modes (DESIGN §3.5): when the row naming a key is fsync'd."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from idempotently import Journal
from tests.test_journal import insert, new_operation


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "ops.db"


@contextlib.contextmanager
def traced(journal: Journal) -> Iterator[list[str]]:
    statements: list[str] = []
    journal._conn.set_trace_callback(lambda sql: statements.append(" ".join(sql.split())))
    try:
        yield statements
    finally:
        journal._conn.set_trace_callback(None)


# -- durability ----------------------------------------------------------------------


def test_durability_is_fsync_by_default(path: Path) -> None:
    """By default the row naming a key is committed under synchronous=FULL: fsync'd."""
    with Journal(path) as journal, traced(journal) as statements:
        insert(journal, new_operation())

    assert "fsync" == journal.durability
    full = statements.index("PRAGMA synchronous = FULL")
    row = next(i for i, sql in enumerate(statements) if sql.startswith("INSERT INTO operations"))
    assert full < row < statements.index("COMMIT", row)


def test_durability_os_commits_the_key_without_an_fsync(path: Path) -> None:
    """durability="os" commits the key's row (synchronous=NORMAL), never under FULL."""
    with Journal(path, durability="os") as journal, traced(journal) as statements:
        insert(journal, new_operation())

    assert "os" == journal.durability
    row = next(i for i, sql in enumerate(statements) if sql.startswith("INSERT INTO operations"))
    assert "COMMIT" in statements[row:]
    assert "PRAGMA synchronous = FULL" not in statements
    with Journal(path, readonly=True) as reader:
        assert 1 == reader.counts()["pending"]


@pytest.mark.parametrize("durability", ["sync", "FSYNC", "", None, True])
def test_an_unknown_durability_is_a_value_error(path: Path, durability: object) -> None:
    """A durability other than "fsync" or "os" is refused, naming the argument and both values."""
    with pytest.raises(ValueError) as caught:
        Journal(path, durability=durability)  # type: ignore[arg-type]

    assert f"durability must be one of 'fsync', 'os', not {durability!r}" == str(caught.value)
    assert not path.exists()
