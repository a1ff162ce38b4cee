"""Lookups and origin pauses: a lookup is a request to its origin like any other.

While the lookup's origin is paused (a 429 or 503 with Retry-After, answered to a call
or to a lookup), a reconcile run sends it nothing: the operation stays needs_reconcile,
looked up once the pause is over, and its result says so. A lookup answered 429 or 503
with Retry-After pauses the origin for every caller of the journal. A lookup is a read,
not a retry: the retry budget neither holds it back nor counts it. Against a real
loopback server, on SQLite and PostgreSQL, sync and async (asyncio and trio).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

import idempotently
from idempotently import Journal, Lookup
from idempotently._budget import origin_of
from tests.scripted_server import Answer, ScriptedApp
from tests.test_operator_actions import make

AUTH = {"Authorization": "Bearer tenant-a"}
POLICY = idempotently.RetryPolicy(max_attempts=1, budget=None)


def limited(seconds: int, status: int = 429) -> Answer:
    return Answer(status=status, headers=(("Retry-After", str(seconds)),), body=b"{}")


def session(journal: str, url: str, **options: Any) -> idempotently.Session:
    options.setdefault("policy", POLICY)
    return idempotently.Session(
        journal, base_url=url, headers=AUTH, sleep=lambda seconds: None, **options
    )


def asession(journal: str, url: str, **options: Any) -> idempotently.AsyncSession:
    return idempotently.AsyncSession(
        journal, base_url=url, headers=AUTH, policy=POLICY, sleep=_no_sleep, **options
    )


async def _no_sleep(seconds: float) -> None:
    return None


def pause_by_a_call(journal: str, app: ScriptedApp, url: str) -> float:
    """A charge answered 429 with Retry-After 120 s: the origin is paused; its end."""
    app.answer(limited(120))
    with session(journal, url) as s:
        with pytest.raises(idempotently.RetryLaterError):
            s.post("/v1/charges", json={"amount": 1}, operation_id="limited")
        (pause,) = s.journal.origin_pauses()
    app.arrivals.clear()
    return pause.until


def needs_reconcile(journal: str, url: str, *names: str) -> None:
    with Journal(journal) as opened:
        for name in names:
            make(opened, name, "needs_reconcile", url=f"{url}/v1/charges")


def assert_deferred(journal: str, name: str, until: float, result: Any) -> None:
    """Nothing changed but the next lookup's time (the pause's end) and its audit note."""
    with Journal(journal) as opened:
        operation = opened.operation(name)
        entries = opened.audit(name)
    assert operation is not None
    assert ("needs_reconcile", "waiting") == (result.status, result.action)
    assert "not looked up: origin paused until" in result.detail
    assert ("needs_reconcile", until) == (operation.status, operation.lookup_after)
    assert [("lookup", "lookup_deferred")] == [(entry.actor, entry.action) for entry in entries]
    assert until == json.loads(entries[0].detail or "{}")["paused_until"]


def test_a_reconcile_run_sends_no_lookup_to_a_paused_origin(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """A call's 429 with Retry-After paused the origin: Session.reconcile sends no GET to
    it, leaves the operation needs_reconcile, looked up after the pause, and says so."""
    app, url = scripted
    until = pause_by_a_call(journal_target, app, url)
    needs_reconcile(journal_target, url, "order-1")
    with session(journal_target, url) as s:
        (result,) = s.reconcile(Lookup("/v1/charges"))
    assert [] == app.arrivals
    assert_deferred(journal_target, "order-1", until, result)


def test_a_resume_with_a_lookup_defers_it_too(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """resume(reconciler=Lookup(...)) honours the same pause for the lookups it makes (the
    operation the 429 answered waits for its own not_before)."""
    app, url = scripted
    until = pause_by_a_call(journal_target, app, url)
    needs_reconcile(journal_target, url, "order-1")
    with session(journal_target, url) as s:
        results = {r.operation_id: r for r in s.resume(reconciler=Lookup("/v1/charges"))}
    assert [] == app.arrivals
    assert "waiting" == results["limited"].action
    assert_deferred(journal_target, "order-1", until, results["order-1"])


def test_one_tenants_pause_does_not_defer_another_tenants_lookup(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The pause is scoped to the credentials it was answered to: a lookup made with
    other credentials is sent."""
    app, url = scripted
    pause_by_a_call(journal_target, app, url)
    needs_reconcile(journal_target, url, "order-1")
    app.answer(Answer(status=200, body=b'{"data": []}'))
    with idempotently.Session(
        journal_target, base_url=url, headers={"Authorization": "Bearer tenant-b"}
    ) as s:
        (result,) = s.reconcile(Lookup("/v1/charges"))
    assert ["Bearer tenant-b"] == [arrival.authorization for arrival in app.arrivals]
    assert "absent from the lookup; absent='keep' leaves it to you" == result.detail


def test_a_deferred_operation_is_looked_up_once_the_pause_is_over(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """Once the pause is over (the engine's clock past its end, no sleep), the deferred
    operation is looked up at once: the deferral is no backoff of its own."""
    app, url = scripted
    until = pause_by_a_call(journal_target, app, url)
    needs_reconcile(journal_target, url, "order-1")
    with session(journal_target, url) as s:
        s.reconcile(Lookup("/v1/charges"))
    app.answer(Answer(status=200, body=b'{"data": []}'))
    with session(journal_target, url, clock=lambda: until + 1) as s:
        (result,) = s.reconcile(Lookup("/v1/charges"))
    assert 1 == len(app.arrivals)
    assert "absent from the lookup; absent='keep' leaves it to you" == result.detail


def test_a_deferral_is_journaled_once_per_pause(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """A second run during the same pause sends nothing and writes nothing new: one audit
    entry per pause, however often a cron job runs."""
    app, url = scripted
    until = pause_by_a_call(journal_target, app, url)
    needs_reconcile(journal_target, url, "order-1")
    with session(journal_target, url) as s:
        s.reconcile(Lookup("/v1/charges"))
        (again,) = s.reconcile(Lookup("/v1/charges"))
    assert [] == app.arrivals
    assert_deferred(journal_target, "order-1", until, again)


def test_a_pause_lifted_early_lets_the_deferred_lookup_go_at_once(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """`unpause` lifts the pause: the next reconcile run looks the deferred operation up
    at once, instead of waiting for the pause's planned end."""
    app, url = scripted
    pause_by_a_call(journal_target, app, url)
    needs_reconcile(journal_target, url, "order-1")
    with session(journal_target, url) as s:
        s.reconcile(Lookup("/v1/charges"))
        assert 1 == len(s.journal.unpause(origin_of(httpx.URL(url)), actor="alice@ops"))
        app.answer(Answer(status=200, body=b'{"data": []}'))
        (result,) = s.reconcile(Lookup("/v1/charges"))
    assert 1 == len(app.arrivals)
    assert "absent from the lookup; absent='keep' leaves it to you" == result.detail


def test_a_lookup_answered_429_with_retry_after_pauses_the_origin(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The first lookup is answered 429 with Retry-After 90 s: the origin is paused (in the
    journal), the next operation of the run is not looked up, and a charge made next is
    held back as after any 429."""
    app, url = scripted
    needs_reconcile(journal_target, url, "order-1", "order-2")
    app.answer(limited(90))
    with session(journal_target, url) as s:
        before = time.time()
        first, second = s.reconcile(Lookup("/v1/charges"))
        (pause,) = s.journal.origin_pauses()
        with pytest.raises(idempotently.RetryLaterError, match="is paused until"):
            s.post("/v1/charges", json={"amount": 1}, operation_id="next")
        looked = s.journal.operation("order-1")
    assert 1 == len(app.arrivals)
    assert looked is not None and looked.lookup_after is not None
    assert before + 90 <= pause.until <= time.time() + 90
    assert "429 with Retry-After 90s" == pause.reason
    assert ("needs_reconcile", "the lookup answered 429 with Retry-After 90s; nothing changed") == (
        first.action,
        first.detail,
    )
    assert looked.lookup_after >= pause.until
    assert_deferred(journal_target, "order-2", pause.until, second)


def test_a_lookup_answered_503_with_retry_after_pauses_the_origin_too(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """A 503 with Retry-After is a pause as much as a 429 is; a 500 with one is not."""
    app, url = scripted
    needs_reconcile(journal_target, url, "order-1")
    app.answer(limited(45, status=500))
    with session(journal_target, url) as s:
        s.reconcile(Lookup("/v1/charges", backoff=0))
        assert [] == s.journal.origin_pauses()
    app.answer(limited(45, status=503))
    with session(journal_target, url, clock=lambda: time.time() + 3600) as s:
        s.reconcile(Lookup("/v1/charges"))
        (pause,) = s.journal.origin_pauses(now=time.time() + 3600)
    assert "503 with Retry-After 45s" == pause.reason


@pytest.mark.anyio
async def test_an_async_session_defers_lookups_to_a_paused_origin(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncSession.reconcile (asyncio and trio) honours the journal's pause: no GET."""
    app, url = scripted
    until = pause_by_a_call(journal_target, app, url)
    needs_reconcile(journal_target, url, "order-1")
    async with asession(journal_target, url) as s:
        (result,) = await s.reconcile(Lookup("/v1/charges"))
    assert [] == app.arrivals
    assert_deferred(journal_target, "order-1", until, result)


@pytest.mark.anyio
async def test_an_async_lookup_answered_429_pauses_the_origin(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncSession.resume(reconciler=...) (asyncio and trio): a lookup's 429 with
    Retry-After pauses the origin, and the next lookup of the run is deferred."""
    app, url = scripted
    needs_reconcile(journal_target, url, "order-1", "order-2")
    app.answer(limited(90))
    async with asession(journal_target, url) as s:
        first, second = await s.resume(reconciler=Lookup("/v1/charges"))
        (pause,) = s.journal.origin_pauses()
    assert 1 == len(app.arrivals)
    assert "429 with Retry-After 90s" == pause.reason
    assert "needs_reconcile" == first.action
    assert_deferred(journal_target, "order-2", pause.until, second)


def test_a_spent_retry_budget_neither_holds_a_lookup_back_nor_counts_it(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The origin's retry budget is spent (a budget that allows no retry, as resume reads
    it): the lookup is sent all the same, and counts as no first attempt either."""
    from idempotently._budget import BUDGETS

    app, url = scripted
    needs_reconcile(journal_target, url, "order-1")
    origin = origin_of(httpx.URL(url))
    BUDGETS.first_attempt(origin, time.time())
    spent = idempotently.RetryPolicy(budget=idempotently.RetryBudget(ratio=0, min_per_second=0))
    app.answer(Answer(status=200, body=b'{"data": []}'))
    with session(journal_target, url, policy=spent) as s:
        (result,) = s.reconcile(Lookup("/v1/charges"))
    assert 1 == len(app.arrivals)
    assert "absent from the lookup; absent='keep' leaves it to you" == result.detail
    assert (1, 0) == BUDGETS._ledger(origin)._window(time.time())
