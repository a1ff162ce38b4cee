"""The lookup reconciler against a real loopback mock server: one GET per needs_reconcile
operation, one match settles it, several or none do not unless absence is proven; a
failed lookup changes nothing and backs off; on SQLite and PostgreSQL, sync and async."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest
from click.testing import CliRunner

import idempotently
from idempotently import Journal, Lookup, profiles
from idempotently._rows import AttemptRecord
from idempotently.cli import cli
from idempotently.testing import Fault, MockServer
from tests.journal_commands import record_attempt, set_status
from tests.test_operator_actions import make

CARRYING = attrs.evolve(profiles.GENERIC, operation_id_field="metadata.operation_id")
AUTH = {"Authorization": "Bearer user_1"}


def charge(operation_id: str) -> dict[str, Any]:
    return {"amount": 1000, "currency": "usd", "customer": "cus_1"}


def charged_but_unsettled(session: idempotently.Session, server: MockServer, name: str) -> None:
    """A charge the server made whose answer the journal cannot use: a stored 500,
    replayed, leaves the operation needs_reconcile."""
    server.faults.push(Fault.server_error())
    with pytest.raises(idempotently.NeedsReconcileError):
        session.post("/v1/charges", json=charge(name), operation_id=name)


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
        opened._engine.rand = lambda: 1.0  # full jitter at its ceiling: backoffs are exact
        yield opened


def lost(journal: Journal, server: MockServer, name: str, *, ago: float, carries: bool) -> None:
    """An operation whose only attempt may have been delivered ``ago`` seconds ago and that
    the server never saw (the request was lost), now needs_reconcile (its key expired)."""
    document: dict[str, Any] = charge(name)
    if carries:
        document["metadata"] = {"operation_id": name}
    make(
        journal,
        name,
        "pending",
        url=f"{server.url}/v1/charges",
        body=json.dumps(document).encode(),
    )
    started = time.time() - ago
    record_attempt(
        journal, name, AttemptRecord(started, 0.1, "maybe_delivered", error="reset"), now=started
    )
    assert set_status(journal, name, "needs_reconcile", reason="key expired", now=time.time())


def test_one_match_settles_it_succeeded_with_the_object_as_its_answer(
    session: idempotently.Session, idempotently_mock_server: MockServer
) -> None:
    """The profile carries the id into the charge's metadata; the lookup by it finds one
    charge: the operation is succeeded, the charge stored as its answer, audited."""
    server = idempotently_mock_server
    charged_but_unsettled(session, server, "order-1")
    lookup = Lookup("/v1/charges", params={"metadata[operation_id]": "{operation_id}"})
    (result,) = session.reconcile(lookup)
    operation = session.journal.operation("order-1")
    assert operation is not None
    (made,) = server.charges()
    assert ("reconciled", "succeeded") == (result.action, operation.status)
    assert made.id == json.loads(operation.response_body or b"")["id"]
    assert [("lookup", "settle")] == [
        (entry.actor, entry.action) for entry in session.journal.audit("order-1")
    ]


def test_an_answer_a_lookup_found_says_so_in_the_receipt_and_in_show(
    session: idempotently.Session, idempotently_mock_server: MockServer
) -> None:
    """An operation settled by a lookup replays the object found with the list GET's
    status: the receipt says answered_by="lookup", the stored Content-Location names the
    page, and `show` (table and --json) says it is not the server's answer to the
    request; a call the server answered says answered_by="server"."""
    server = idempotently_mock_server
    charged_but_unsettled(session, server, "order-1")
    lookup = Lookup("/v1/charges", params={"metadata[operation_id]": "{operation_id}"})
    session.reconcile(lookup)
    again = session.post("/v1/charges", json=charge("order-1"), operation_id="order-1")
    fresh = session.post("/v1/charges", json=charge("order-2"), operation_id="order-2")
    receipt = again.extensions["idempotently"]
    page = f"{server.url}/v1/charges?metadata%5Boperation_id%5D=order-1"
    assert (200, "lookup", True) == (
        again.status_code,
        receipt.answered_by,
        receipt.replayed_locally,
    )
    assert page == again.headers["content-location"]
    assert "server" == fresh.extensions["idempotently"].answered_by
    table = CliRunner().invoke(cli, ["--journal", session.journal.path, "show", "order-1"])
    shown = CliRunner().invoke(
        cli, ["--journal", session.journal.path, "show", "order-1", "--json"]
    )
    assert "not the server's answer to this request: the object a lookup found" in " ".join(
        table.output.split()
    )
    assert f"GET {page}" in table.output
    assert ("lookup", 200) == (
        json.loads(shown.output)["answered_by"],
        json.loads(shown.output)["response_status"],
    )


def test_an_endpoint_that_ignores_its_filter_settles_each_only_by_its_own_id(
    session: idempotently.Session, idempotently_mock_server: MockServer
) -> None:
    """A list endpoint that returns every charge (no filter) still settles each operation
    only with the charge carrying its id; a match path nothing carries settles nothing."""
    server = idempotently_mock_server
    for name in ("order-1", "order-2"):
        charged_but_unsettled(session, server, name)
    nothing = session.reconcile(Lookup("/v1/charges", match="metadata.order", backoff=0))
    assert ["needs_reconcile", "needs_reconcile"] == [result.status for result in nothing]
    results = session.reconcile(Lookup("/v1/charges", backoff=0))
    assert ["reconciled", "reconciled"] == [result.action for result in results]
    by_charge = {charge.id: charge.metadata["operation_id"] for charge in server.charges()}
    for name in ("order-1", "order-2"):
        operation = session.journal.operation(name)
        assert operation is not None
        assert name == by_charge[json.loads(operation.response_body or b"")["id"]]


def test_two_matches_are_ambiguous_and_never_guessed(
    session: idempotently.Session, idempotently_mock_server: MockServer
) -> None:
    """Two charges carrying the operation's id: it stays needs_reconcile, noted ambiguous
    in its audit trail, and is not looked up again before the backoff."""
    server = idempotently_mock_server
    charged_but_unsettled(session, server, "order-1")
    with server.client() as client:
        client.post(
            "/v1/charges",
            json={**charge("x"), "metadata": {"operation_id": "order-1"}},
            headers={"Idempotency-Key": "another-key"},
        )
    search = Lookup(
        "/v1/charges/search", params={"query": "metadata['operation_id']:'{operation_id}'"}
    )
    (result,) = session.reconcile(search)
    operation = session.journal.operation("order-1")
    assert operation is not None
    assert "needs_reconcile" == operation.status
    assert "ambiguous: 2 objects" in result.detail
    (entry,) = session.journal.audit("order-1")
    assert entry.note is not None and "ambiguous" in entry.note
    assert operation.lookup_after is not None and operation.lookup_after > time.time() + 50


def test_absence_fails_it_only_when_it_carries_its_id_and_the_window_has_passed(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    """absent='failed': an operation whose request carries its id and whose last maybe-
    delivered attempt is older than absent_after is settled failed; a recent one, or one
    whose request does not carry its id, stays, noted why."""
    server = idempotently_mock_server
    with Journal(journal_target) as journal:
        lost(journal, server, "old", ago=3600, carries=True)
        lost(journal, server, "recent", ago=10, carries=True)
        lost(journal, server, "bare", ago=3600, carries=False)
    with idempotently.Session(journal_target, base_url=server.url, headers=AUTH) as session:
        lookup = Lookup("/v1/charges", absent="failed", absent_after=300)
        results = {result.operation_id: result for result in session.reconcile(lookup)}
        statuses = {name: session.journal.operation(name).status for name in results}  # type: ignore[union-attr]
    assert {"old": "failed", "recent": "needs_reconcile", "bare": "needs_reconcile"} == statuses
    assert "within absent_after=300 s" in results["recent"].detail
    assert "does not carry its id at metadata.operation_id" in results["bare"].detail
    assert [] == server.charges()


def test_the_sessions_clock_governs_the_absent_after_window_and_the_backoff(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    """Session(clock=...) two hours ahead: an attempt lost a second ago (real time) is past
    absent_after by the session's clock, so its absence settles it failed; one left
    needs_reconcile is looked up again after a backoff counted on that same clock."""
    server = idempotently_mock_server
    ahead = time.time() + 7200
    with Journal(journal_target) as journal:
        lost(journal, server, "lost", ago=1, carries=True)
        lost(journal, server, "kept", ago=1, carries=False)
    with idempotently.Session(
        journal_target, base_url=server.url, headers=AUTH, clock=lambda: ahead
    ) as session:
        session._engine.rand = lambda: 1.0  # full jitter at its ceiling: backoffs are exact
        lookup = Lookup("/v1/charges", absent="failed", absent_after=300, backoff=60)
        results = {result.operation_id: result for result in session.reconcile(lookup)}
        kept = session.journal.operation("kept")
    assert ("reconciled", "failed") == (results["lost"].action, results["lost"].status)
    assert kept is not None
    assert ahead + 60 == kept.lookup_after


def test_absence_with_resend_forks_it_and_the_fork_is_charged_once(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    """absent='resend': the lost operation is settled failed and forked in one write; the
    next resume sends the fork once, under its own key, with the same bytes."""
    server = idempotently_mock_server
    with Journal(journal_target) as journal:
        lost(journal, server, "order-1", ago=3600, carries=True)
    with idempotently.Session(journal_target, base_url=server.url, headers=AUTH) as session:
        (result,) = session.reconcile(Lookup("/v1/charges", absent="resend"))
        resumed = session.resume()
        again = session.resume()
        fork = session.journal.operation("order-1~fork1")
        parent = session.journal.operation("order-1")
    assert fork is not None and parent is not None
    assert ("reconciled", "failed", "failed") == (result.action, result.status, parent.status)
    assert "forked as order-1~fork1" in result.detail
    assert [("order-1~fork1", "succeeded")] == [(r.operation_id, r.action) for r in resumed]
    assert [] == again
    (made,) = server.charges()
    assert (fork.key, "order-1") == (made.key, made.metadata["operation_id"])


def test_absence_with_resend_passes_over_an_unrelated_operation_holding_the_fork_id(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    """absent='resend' when an unrelated operation is already called order-1~fork1: the
    lookup forks as order-1~fork2 (never "skipped" at every lookup), leaves
    order-1~fork1 as it was, and the next resume sends the fork once."""
    server = idempotently_mock_server
    with Journal(journal_target) as journal:
        lost(journal, server, "order-1", ago=3600, carries=True)
        unrelated = make(journal, "order-1~fork1", "succeeded")
    with idempotently.Session(journal_target, base_url=server.url, headers=AUTH) as session:
        (result,) = session.reconcile(Lookup("/v1/charges", absent="resend"))
        resumed = session.resume()
        fork = session.journal.operation("order-1~fork2")
        parent = session.journal.operation("order-1")
        assert unrelated == session.journal.operation("order-1~fork1")
    assert fork is not None and parent is not None
    assert ("reconciled", "failed", "failed") == (result.action, result.status, parent.status)
    assert ("order-1", "forked as order-1~fork2") == (
        fork.forked_from,
        result.detail.split("; ")[-1].split(",")[0],
    )
    assert [("order-1~fork2", "succeeded")] == [(r.operation_id, r.action) for r in resumed]
    (made,) = server.charges()
    assert fork.key == made.key


def test_a_failed_lookup_changes_nothing_and_backs_off(
    session: idempotently.Session, idempotently_mock_server: MockServer
) -> None:
    """A lookup that cannot reach its server leaves the operation as it was (but for its
    backoff and audit note); the next pass within the backoff sends no GET."""
    charged_but_unsettled(session, idempotently_mock_server, "order-1")
    seen: list[httpx.Request] = []
    session.client.event_hooks["request"].append(seen.append)
    lookup = Lookup("http://127.0.0.1:9/v1/charges", backoff=120)
    (first,) = session.reconcile(lookup)
    (second,) = session.reconcile(lookup)
    operation = session.journal.operation("order-1")
    assert operation is not None
    assert 1 == len(seen)
    assert ("needs_reconcile", "the lookup failed (ConnectError); nothing changed") == (
        operation.status,
        first.detail,
    )
    assert "looked up already" in second.detail
    assert b"" == (operation.response_body or b"")[:0]
    (entry,) = session.journal.audit("order-1")
    assert {"lookup_failed": True} == json.loads(entry.detail or "")


@pytest.mark.anyio
@pytest.mark.parametrize("entry", ["resume", "reconcile"])
async def test_an_async_session_reconciles_with_a_lookup(
    journal_target: str, idempotently_mock_server: MockServer, entry: str
) -> None:
    """AsyncSession.resume(reconciler=Lookup(...)) and AsyncSession.reconcile look the
    operation up through the async client and settle it, on asyncio and trio."""
    server = idempotently_mock_server
    path = journal_target
    with idempotently.Session(
        path, base_url=server.url, headers=AUTH, profile=CARRYING, sleep=lambda s: None
    ) as session:
        charged_but_unsettled(session, server, "order-1")
    async with idempotently.AsyncSession(
        path, base_url=server.url, headers=AUTH, sleep=_no_sleep
    ) as asession:
        lookup = Lookup("/v1/charges", params={"metadata[operation_id]": "{operation_id}"})
        if entry == "resume":
            results = await asession.resume(reconciler=lookup)
        else:
            results = await asession.reconcile(lookup)
        operation = asession.journal.operation("order-1")
    assert [("order-1", "reconciled")] == [(r.operation_id, r.action) for r in results]
    assert operation is not None and "succeeded" == operation.status


async def _no_sleep(seconds: float) -> None:
    return None


def test_the_profile_carries_the_operation_id_into_json_and_form_bodies(
    tmp_path: Any,
) -> None:
    """operation_id_field adds the id to a JSON body (nested objects made) and a form body
    (metadata[operation_id]) of a named call, never overwriting the caller's value, never
    touching the caller's own dict, and nothing for an anonymous call."""
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(201, json={})

    caller = {"amount": 1, "metadata": {"order": "42"}}
    with idempotently.Session(
        tmp_path / "journal.db",
        transport=httpx.MockTransport(answer),
        base_url="https://api.test",
        profile=CARRYING,
    ) as session:
        session.post("/v1/charges", json=caller, operation_id="op-json")
        session.post("/v1/charges", data={"amount": "1"}, operation_id="op-form")
        session.post(
            "/v1/charges", json={"metadata": {"operation_id": "mine"}}, operation_id="op-own"
        )
        session.post("/v1/charges", json={"amount": 2})
    bodies = [request.content for request in sent]
    assert {"amount": 1, "metadata": {"order": "42", "operation_id": "op-json"}} == json.loads(
        bodies[0]
    )
    assert b"amount=1&metadata%5Boperation_id%5D=op-form" == bodies[1]
    assert {"metadata": {"operation_id": "mine"}} == json.loads(bodies[2])
    assert {"amount": 2} == json.loads(bodies[3])
    assert {"amount": 1, "metadata": {"order": "42"}} == caller
    with pytest.raises(ValueError, match="field names"):
        attrs.evolve(profiles.GENERIC, operation_id_field="metadata..id")


def test_templates_are_url_encoded_into_the_url_and_params(tmp_path: Any) -> None:
    """{operation_id} and {key} are substituted URL-encoded into the path and, as values,
    into the parameters; a path is relative to the client's base URL, or without one to
    the operation's own origin."""
    with Journal(tmp_path / "journal.db") as journal:
        operation = make(journal, "order 42/charge?", "needs_reconcile")
    lookup = Lookup("/v1/orders/{operation_id}", params={"key": "{key}", "q": "id:{operation_id}"})
    with httpx.Client(base_url="https://api.example.test/base") as based:
        request = lookup.request(operation, based)
    with httpx.Client() as bare:
        relative = lookup.request(operation, bare)
    assert "/base/v1/orders/order%2042%2Fcharge%3F" == request.url.raw_path.decode().split("?")[0]
    assert {"key": operation.key, "q": "id:order 42/charge?"} == dict(request.url.params)
    assert ("api.example.test", "/v1/orders/order%2042%2Fcharge%3F") == (
        relative.url.host,
        relative.url.raw_path.decode().split("?")[0],
    )


def test_a_found_function_of_your_own_picks_the_object(
    session: idempotently.Session, idempotently_mock_server: MockServer
) -> None:
    """found(response) returning the object settles it; returning None is absence."""
    charged_but_unsettled(session, idempotently_mock_server, "order-1")

    def nothing(response: httpx.Response) -> None:
        return None

    def first(response: httpx.Response) -> Any:
        return response.json()["data"][0]

    (absent,) = session.reconcile(Lookup("/v1/charges", found=nothing, backoff=0))
    (found,) = session.reconcile(Lookup("/v1/charges", found=first))
    assert ("needs_reconcile", "absent from the lookup; absent='keep' leaves it to you") == (
        absent.status,
        absent.detail,
    )
    assert ("reconciled", "succeeded") == (found.action, found.status)


def test_an_enqueued_operation_carries_its_id_as_a_call_would(tmp_path: Any) -> None:
    """enqueue renders the request as post would: the profile's operation_id_field is in
    the journaled body."""
    with idempotently.Session(
        tmp_path / "journal.db", base_url="https://api.example.test", profile=CARRYING
    ) as session:
        operation = session.enqueue(
            "POST", "/v1/charges", json={"amount": 1}, operation_id="order-q"
        )
    assert {"amount": 1, "metadata": {"operation_id": "order-q"}} == json.loads(
        operation.request_body
    )
