"""The lookup backoff: exponential with full jitter, capped, counted from the journal.

An operation a lookup leaves needs_reconcile is looked up again after a random wait up
to ``backoff * 2**(n-1)`` (its n-th unsettled lookup in a row), never more than
``max_backoff``; n is counted from the lookup entries of its audit trail, so it
survives restarts and is the same for every process sharing the journal. The time is
the engine's clock (no sleeps); the jitter its ``rand``. Against a real loopback
server, on SQLite and PostgreSQL, sync and async (asyncio and trio).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import idempotently
from idempotently import Journal, Lookup
from idempotently._lookup import unsettled_lookups
from idempotently._rows import AuditEntry
from tests.scripted_server import Answer, ScriptedApp
from tests.support import FakeTime
from tests.test_operator_actions import make

AUTH = {"Authorization": "Bearer tenant-a"}
POLICY = idempotently.RetryPolicy(max_attempts=1, budget=None)
FAILING = Answer(status=500, body=b"{}")


def session(
    journal: str, url: str, fake_time: FakeTime, rand: Callable[[], float]
) -> idempotently.Session:
    opened = idempotently.Session(
        journal, base_url=url, headers=AUTH, policy=POLICY, clock=fake_time.clock
    )
    opened._engine.rand = rand
    return opened


def needs_reconcile(journal: str, url: str, fake_time: FakeTime) -> None:
    with Journal(journal) as opened:
        make(
            opened, "order-1", "needs_reconcile", url=f"{url}/v1/charges", created_at=fake_time.now
        )


def waits(
    journal: str, app: ScriptedApp, url: str, fake_time: FakeTime, rand: float, lookups: int
) -> list[float]:
    """Look the operation up ``lookups`` times, each once its backoff has passed; the
    backoffs journaled."""
    lookup = Lookup("/v1/charges", backoff=60, max_backoff=300)
    seen = []
    for _ in range(lookups):
        app.answer(FAILING)
        with session(journal, url, fake_time, lambda: rand) as s:
            (result,) = s.reconcile(lookup)
            assert "the lookup answered 500; nothing changed" == result.detail
            operation = s.journal.operation("order-1")
        assert operation is not None and operation.lookup_after is not None
        seen.append(operation.lookup_after - fake_time.now)
        fake_time.now = operation.lookup_after
    return seen


def test_each_unsettled_lookup_in_a_row_doubles_the_backoff_up_to_its_cap(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """With the jitter at its ceiling: 60 s, 120 s, 240 s, then the 300 s cap; each
    session a new one (the count is the journal's, not the process's)."""
    app, url = scripted
    needs_reconcile(journal_target, url, fake_time)
    assert [60, 120, 240, 300, 300] == waits(journal_target, app, url, fake_time, 1.0, 5)
    assert 5 == len(app.arrivals)


def test_the_wait_is_a_random_part_of_the_ceiling(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """Full jitter: the wait is the engine's rand() times the ceiling (so operations that
    failed together are not all looked up together again)."""
    app, url = scripted
    needs_reconcile(journal_target, url, fake_time)
    assert [15, 30, 60, 75] == waits(journal_target, app, url, fake_time, 0.25, 4)


def test_a_deferral_by_a_paused_origin_neither_counts_nor_breaks_the_run(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """Two unsettled lookups, then one deferred by a pause (nothing sent), then one more
    unsettled lookup: its ceiling is the third's, 240 s."""
    app, url = scripted
    needs_reconcile(journal_target, url, fake_time)
    assert [60, 120] == waits(journal_target, app, url, fake_time, 1.0, 2)
    app.answer(Answer(status=429, headers=(("Retry-After", "1000"),), body=b"{}"))
    with session(journal_target, url, fake_time, lambda: 1.0) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post("/v1/charges", json={"amount": 1}, operation_id="limited")
        (deferred,) = s.reconcile(Lookup("/v1/charges", backoff=60, max_backoff=300))
    assert "waiting" == deferred.action
    fake_time.now += 1000
    assert [240] == waits(journal_target, app, url, fake_time, 1.0, 1)
    assert 4 == len(app.arrivals)


@pytest.mark.anyio
async def test_an_async_session_doubles_the_backoff_too(
    journal_target: str, scripted: tuple[ScriptedApp, str], fake_time: FakeTime
) -> None:
    """AsyncSession.reconcile (asyncio and trio) reads the audit trail off its loop and
    backs off as a Session does."""
    app, url = scripted
    needs_reconcile(journal_target, url, fake_time)
    lookup = Lookup("/v1/charges", backoff=60, max_backoff=300)
    seen = []
    for _ in range(3):
        app.answer(FAILING)
        async with idempotently.AsyncSession(
            journal_target, base_url=url, headers=AUTH, policy=POLICY, clock=fake_time.clock
        ) as s:
            s._engine.rand = lambda: 1.0
            await s.reconcile(lookup)
            operation = s.journal.operation("order-1")
        assert operation is not None and operation.lookup_after is not None
        seen.append(operation.lookup_after - fake_time.now)
        fake_time.now = operation.lookup_after
    assert [60, 120, 240] == seen


def entry(seq: int, actor: str, action: str) -> AuditEntry:
    return AuditEntry(seq, "order-1", float(seq), actor, action, None, None)


@pytest.mark.parametrize(
    ("trail", "expected"),
    [
        ([], 0),
        ([("lookup", "lookup")] * 3, 3),
        ([("lookup", "lookup"), ("lookup", "lookup_deferred"), ("lookup", "lookup")], 2),
        ([("lookup", "lookup"), ("alice@ops", "retry"), ("lookup", "lookup")], 1),
        ([("lookup", "lookup"), ("lookup", "settle")], 0),
    ],
)
def test_the_run_of_unsettled_lookups_is_read_from_the_end_of_the_trail(
    trail: list[tuple[str, str]], expected: int
) -> None:
    """Only the lookup entries at the end of the trail count; a deferral is skipped; any
    other entry (an operator's, a settlement) ends the run."""
    entries = [entry(seq, actor, action) for seq, (actor, action) in enumerate(trail)]
    assert expected == unsettled_lookups(entries)


@pytest.mark.parametrize(
    ("options", "cap"),
    [({}, 3600.0), ({"backoff": 7200}, 7200.0), ({"backoff": 10, "max_backoff": 20}, 20.0)],
)
def test_the_cap_is_an_hour_unless_backoff_is_longer_or_max_backoff_says(
    options: dict[str, Any], cap: float
) -> None:
    assert cap == Lookup("/v1/charges", **options).backoff_cap


def test_a_cap_below_the_base_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_backoff \(10 s\) must be at least backoff"):
        Lookup("/v1/charges", backoff=60, max_backoff=10)
    with pytest.raises(TypeError, match="max_backoff must be a number of seconds"):
        Lookup("/v1/charges", max_backoff="1h")  # type: ignore[arg-type]
