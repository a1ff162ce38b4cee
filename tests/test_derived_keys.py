"""Keys of named operations are derived from the journal's namespace: a lost row sends the
same key again, and the server replays instead of acting twice."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import httpx
import pytest

import idempotently
from tests.support import URL, FakeTime, make_session


class Server:
    """Answers 201 once per key and replays that answer for the same key, as servers do."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        key = request.headers["Idempotency-Key"]
        replay = key in self.keys
        self.keys.append(key)
        return httpx.Response(201, headers={"Idempotent-Replayed": "true"} if replay else {})


def test_a_named_operations_key_is_uuid5_of_the_journal_namespace_and_its_id(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """operation_id="order-42" gets uuid5(journal.namespace, "order-42")."""
    server = Server()
    with make_session(tmp_path, fake_time, transport=httpx.MockTransport(server)) as s:
        response = s.post(URL, json={}, operation_id="order-42")
        expected = str(uuid.uuid5(s.journal.namespace, "order-42"))
    assert expected == response.extensions["idempotently"].key
    assert [expected] == server.keys


def test_a_rerun_after_a_lost_journal_row_sends_the_same_key(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """The journal loses the operation's row (a power cut with durability "os", a restored
    backup): running the operation again sends the same key, so the server replays."""
    server = Server()
    path = tmp_path / "journal.db"
    with idempotently.Session(
        idempotently.Journal(path, durability="os"), transport=httpx.MockTransport(server)
    ) as s:
        first = s.post(URL, json={"amount": 1}, operation_id="order-42")
    with sqlite3.connect(path) as raw:  # the write that never reached the disk
        raw.execute("DELETE FROM attempts")
        raw.execute("DELETE FROM operations")
    with idempotently.Session(path, transport=httpx.MockTransport(server)) as s:
        again = s.post(URL, json={"amount": 1}, operation_id="order-42")
    assert 1 == len(set(server.keys))
    assert (False, True) == (
        first.extensions["idempotently"].replayed,
        again.extensions["idempotently"].replayed,
    )


def test_two_journals_derive_different_keys_for_one_operation_id(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """The namespace is the journal's own, random: another journal's "order-42" is another key."""
    keys = []
    for name in ("a", "b"):
        with idempotently.Session(
            tmp_path / f"{name}.db", transport=httpx.MockTransport(Server())
        ) as s:
            keys.append(
                s.post(URL, json={}, operation_id="order-42").extensions["idempotently"].key
            )
    assert keys[0] != keys[1]


def test_the_namespace_never_changes(tmp_path: Path) -> None:
    """Reopening a journal gives the namespace it was created with."""
    path = tmp_path / "journal.db"
    with idempotently.Journal(path) as journal:
        created = journal.namespace
    with idempotently.Journal(path) as journal:
        assert created == journal.namespace


@pytest.mark.parametrize("options", [{}, {"idempotency_key": "explicit-key-1"}])
def test_anonymous_and_explicit_keys_are_not_derived(
    tmp_path: Path, fake_time: FakeTime, options: dict[str, str]
) -> None:
    """Without an operation id the key is a random UUID4; an explicit key is used verbatim."""
    server = Server()
    with make_session(tmp_path, fake_time, transport=httpx.MockTransport(server)) as s:
        key = s.post(URL, json={}, **options).extensions["idempotently"].key  # type: ignore[arg-type]
    if options:
        assert "explicit-key-1" == key
    else:
        assert 4 == uuid.UUID(key).version
