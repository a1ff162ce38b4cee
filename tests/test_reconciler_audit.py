"""A reconciler of your own leaves an audit entry for every settlement, as a lookup does.

Its Settlement is journaled as an operator's settle is: one compare-and-swap on the row
as read and its audit entry (the actor names the reconciler, ``reconciler:module.qualname``)
in one transaction; if the operation changed while the reconciler looked at it, neither
is written. Against a real loopback mock server, on SQLite and PostgreSQL, sync and
async (asyncio and trio).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

import idempotently
from idempotently.testing import MockServer
from tests.test_lookup import AUTH, CARRYING, charged_but_unsettled


def found_on_the_server(
    operation: idempotently.Operation, client: httpx.Client
) -> idempotently.Settlement:
    """Looks the charge up by the id its metadata carries."""
    listed = client.get("/v1/charges", params={"metadata[operation_id]": operation.operation_id})
    (charge,) = listed.json()["data"]
    found = httpx.Response(200, json=charge)
    return idempotently.Settlement("succeeded", f"found {charge['id']}", found)


class AsyncDashboard:
    """A callable object: its actor is its class."""

    async def __call__(
        self, operation: idempotently.Operation, client: httpx.AsyncClient
    ) -> idempotently.Settlement:
        listed = await client.get(
            "/v1/charges", params={"metadata[operation_id]": operation.operation_id}
        )
        assert 1 == len(listed.json()["data"])
        return idempotently.Settlement("failed", "refunded and voided on the dashboard")


@pytest.fixture
def session(
    journal_target: str, idempotently_mock_server: MockServer
) -> Iterator[idempotently.Session]:
    with idempotently.Session(
        journal_target,
        base_url=idempotently_mock_server.url,
        headers=AUTH,
        profile=CARRYING,
        sleep=lambda seconds: None,
    ) as opened:
        yield opened


@pytest.mark.parametrize("entry", ["reconcile", "resume"])
def test_a_settlement_of_your_own_reconciler_is_audited_with_its_name(
    session: idempotently.Session, idempotently_mock_server: MockServer, entry: str
) -> None:
    """Session.reconcile and resume(reconciler=...): the operation is settled with the
    object as its answer, and its audit trail says which reconciler settled it, why, and
    from what to what."""
    charged_but_unsettled(session, idempotently_mock_server, "order-1")
    if entry == "reconcile":
        (result,) = session.reconcile(found_on_the_server)
    else:
        (result,) = session.resume(reconciler=found_on_the_server)
    operation = session.journal.operation("order-1")
    (made,) = idempotently_mock_server.charges()
    assert operation is not None
    assert ("reconciled", "succeeded") == (result.action, operation.status)
    assert f"reconciled: found {made.id}" == operation.reason
    assert made.id == json.loads(operation.response_body or b"")["id"]
    (audited,) = session.journal.audit("order-1")
    assert (
        "reconciler:tests.test_reconciler_audit.found_on_the_server",
        "settle",
        f"found {made.id}",
        {"from": "needs_reconcile", "to": "succeeded"},
    ) == (audited.actor, audited.action, audited.note, json.loads(audited.detail or ""))


def test_a_settlement_on_an_operation_that_changed_meanwhile_writes_nothing(
    session: idempotently.Session, idempotently_mock_server: MockServer
) -> None:
    """An operator settles the operation while the reconciler is looking: the
    reconciler's settlement and its audit entry are not written (one write, refused as a
    whole); the operator's word and entry stand."""
    charged_but_unsettled(session, idempotently_mock_server, "order-1")

    def slow_reconciler(
        operation: idempotently.Operation, client: httpx.Client
    ) -> idempotently.Settlement:
        session.journal.settle("order-1", "failed", note="voided by hand", actor="alice@ops")
        return found_on_the_server(operation, client)

    (result,) = session.reconcile(slow_reconciler)
    operation = session.journal.operation("order-1")
    assert operation is not None
    assert ("skipped", "failed") == (result.action, operation.status)
    assert "it changed while the reconciler looked at it" in result.detail
    assert [("alice@ops", "settle")] == [
        (entry.actor, entry.action) for entry in session.journal.audit("order-1")
    ]


@pytest.mark.anyio
async def test_an_async_reconcilers_settlement_is_audited(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    """AsyncSession.reconcile (asyncio and trio): the settlement and its audit entry, the
    actor the callable's class."""
    server = idempotently_mock_server
    with idempotently.Session(
        journal_target, base_url=server.url, headers=AUTH, profile=CARRYING, sleep=lambda s: None
    ) as s:
        charged_but_unsettled(s, server, "order-1")
    async with idempotently.AsyncSession(journal_target, base_url=server.url, headers=AUTH) as s:
        (result,) = await s.reconcile(AsyncDashboard())
        operation = s.journal.operation("order-1")
        entries = s.journal.audit("order-1")
    assert operation is not None
    assert ("reconciled", "failed") == (result.action, operation.status)
    assert [
        (
            "reconciler:tests.test_reconciler_audit.AsyncDashboard",
            "settle",
            "refunded and voided on the dashboard",
        )
    ] == [(entry.actor, entry.action, entry.note) for entry in entries]
