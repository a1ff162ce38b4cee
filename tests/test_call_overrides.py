"""Per-call overrides: post(..., policy=, profile=, timeout=), journaled for resume.

One call may need more patience (a slow report) or another server profile than
its session; the journal keeps them with the operation, so a resume, by this
process or another, sends it as its caller asked.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import tenacity

import idempotently
from idempotently import profiles
from tests.support import FakeTime

URL = "https://api.example.test/v1/charges"
SESSION_POLICY = idempotently.RetryPolicy(max_attempts=5, initial_backoff=0.0, budget=None)
X_KEY = attrs.evolve(profiles.GENERIC, name="x-key", key_header="X-Key")


def recording(*statuses: int) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """A server answering ``statuses`` in turn (then 503 forever), and what it got."""
    sent: list[httpx.Request] = []
    queue = list(statuses)

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(queue.pop(0) if queue else 503)

    return httpx.MockTransport(handler), sent


def session(
    journal: Path | str, fake_time: FakeTime, transport: httpx.MockTransport, **options: Any
) -> idempotently.Session:
    options.setdefault("policy", SESSION_POLICY)
    return idempotently.Session(
        journal, transport=transport, clock=fake_time.clock, sleep=fake_time.sleep, **options
    )


def test_a_call_policy_replaces_the_sessions(tmp_path: Path, fake_time: FakeTime) -> None:
    """policy=RetryPolicy(max_attempts=1) on one call: one attempt, not the session's five."""
    transport, sent = recording()
    with session(tmp_path / "j.db", fake_time, transport) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(
                URL, json={}, operation_id="once", policy=idempotently.RetryPolicy(max_attempts=1)
            )
        assert 1 == len(sent)
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={}, operation_id="default")
    assert 1 + 5 == len(sent)


def test_resume_uses_the_journaled_policy_and_timeout(tmp_path: Path, fake_time: FakeTime) -> None:
    """An operation made with max_attempts=2 and timeout=3.5 is resumed with both, by a
    session whose own policy allows five attempts and whose timeout is 20 s."""
    transport, sent = recording()
    with (
        session(tmp_path / "j.db", fake_time, transport) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(
            URL,
            json={},
            operation_id="op",
            policy=idempotently.RetryPolicy(max_attempts=2, initial_backoff=0.0, budget=None),
            timeout=3.5,
        )
    assert 2 == len(sent)
    sent.clear()
    with session(tmp_path / "j.db", fake_time, transport, timeout=20.0) as s:
        [result] = s.resume()
    assert "still_pending" == result.action
    assert 2 == len(sent)
    assert {3.5} == set(sent[0].extensions["timeout"].values())


def test_overrides_are_journaled_as_json(tmp_path: Path, fake_time: FakeTime) -> None:
    """The operation's overrides column holds the call's policy and timeouts; a call
    without any leaves it NULL."""
    transport, _ = recording(201, 201)
    policy = idempotently.RetryPolicy(max_attempts=2, budget=idempotently.RetryBudget(0.2, 1.0))
    with session(tmp_path / "j.db", fake_time, transport) as s:
        s.post(
            URL, json={}, operation_id="with", policy=policy, timeout=httpx.Timeout(2.0, read=9.0)
        )
        s.post(URL, json={}, operation_id="without")
    with sqlite3.connect(tmp_path / "j.db") as conn:
        rows = dict(conn.execute("SELECT operation_id, overrides FROM operations"))
    assert rows["without"] is None
    stored = json.loads(rows["with"])
    assert {"connect": 2.0, "read": 9.0, "write": 2.0, "pool": 2.0} == stored["timeout"]
    assert (2, {"ratio": 0.2, "min_per_second": 1.0}) == (
        stored["policy"]["max_attempts"],
        stored["policy"]["budget"],
    )


def test_a_call_profile_is_used_and_journaled(tmp_path: Path, fake_time: FakeTime) -> None:
    """profile= on one call sends the key in its header; a resume by a session with the
    generic profile uses the profile the operation was journaled under."""
    transport, sent = recording(503)
    with session(tmp_path / "j.db", fake_time, transport) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(
                URL,
                json={},
                operation_id="op",
                profile=X_KEY,
                policy=idempotently.RetryPolicy(max_attempts=1),
            )
        key = s.journal.operation("op").key
    assert (key, None) == (sent[0].headers.get("X-Key"), sent[0].headers.get("Idempotency-Key"))
    transport, sent = recording(201)
    with session(tmp_path / "j.db", fake_time, transport) as s:
        [result] = s.resume()
    assert "succeeded" == result.action
    assert key == sent[0].headers.get("X-Key")


def test_a_policy_that_cannot_be_journaled_is_refused_before_anything(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A per-call policy with a custom stop= is a ValueError; nothing journaled or sent."""
    transport, sent = recording()
    with session(tmp_path / "j.db", fake_time, transport) as s:
        with pytest.raises(ValueError, match="stop="):
            s.post(
                URL, json={}, policy=idempotently.RetryPolicy(stop=tenacity.stop_after_attempt(1))
            )
        with pytest.raises(TypeError, match="policy must be"):
            s.post(URL, json={}, policy={"max_attempts": 1})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="profile must be"):
            s.post(URL, json={}, profile="stripe")  # type: ignore[arg-type]
        assert 0 == len(s.journal.operations())
    assert [] == sent


def test_damaged_overrides_keep_the_operation_pending(tmp_path: Path, fake_time: FakeTime) -> None:
    """Overrides that cannot be read back: resume sends nothing and says why."""
    transport, sent = recording()
    with (
        session(tmp_path / "j.db", fake_time, transport) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post(URL, json={}, operation_id="op", policy=idempotently.RetryPolicy(max_attempts=1))
    with sqlite3.connect(tmp_path / "j.db") as conn:
        conn.execute("""UPDATE operations SET overrides = '{"policy": {"max_attempts": "lots"}}'""")
    conn.close()
    sent.clear()
    with session(tmp_path / "j.db", fake_time, transport) as s:
        [result] = s.resume()
        assert "pending" == s.journal.operation("op").status
    assert ("not_sent", []) == (result.action, sent)
    assert "journaled policy is not valid" in result.detail


@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_overrides_survive_on_both_stores(
    journal_target: str, fake_time: FakeTime, store: str
) -> None:
    """SQLite and PostgreSQL journal the overrides alike: a resume reads them back."""
    transport, sent = recording()
    policy = idempotently.RetryPolicy(max_attempts=3, initial_backoff=0.0, budget=None)
    with session(journal_target, fake_time, transport) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={}, operation_id="op", policy=policy)
        assert (
            json.loads(s.journal.operation("op").overrides or "{}")["policy"]["max_attempts"] == 3
        )
    sent.clear()
    with session(journal_target, fake_time, transport) as s:
        s.resume()
    assert 3 == len(sent)


@pytest.mark.anyio
async def test_an_async_call_takes_overrides_too(tmp_path: Path, fake_time: FakeTime) -> None:
    """AsyncSession.post(policy=...) on asyncio and trio: the call's policy is used and
    journaled."""
    transport, sent = recording()
    async with idempotently.AsyncSession(
        tmp_path / "j.db",
        transport=transport,
        policy=SESSION_POLICY,
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
    ) as s:
        with pytest.raises(idempotently.OperationPendingError):
            await s.post(
                URL, json={}, operation_id="op", policy=idempotently.RetryPolicy(max_attempts=2)
            )
    assert 2 == len(sent)
    with sqlite3.connect(tmp_path / "j.db") as conn:
        (text,) = conn.execute("SELECT overrides FROM operations").fetchone()
    assert 2 == json.loads(text)["policy"]["max_attempts"]
