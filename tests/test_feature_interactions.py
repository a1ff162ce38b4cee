"""Where the outbox, operator actions, data at rest and retry control meet: each test is
one promise that held for each feature alone and broke in combination (found by an
adversarial review of the four together)."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import attrs
import pytest

import idempotently
from idempotently import Lookup, profiles
from tests.scripted_server import Answer, ScriptedApp

TOKEN_A = "Bearer sk_live_account_a"
TOKEN_B = "Bearer sk_live_account_b"
BOUND = attrs.evolve(
    profiles.GENERIC,
    name="bound-carrying",
    key_bound_to_credentials=True,
    operation_id_field="metadata.operation_id",
)
REPLAYED_500 = Answer(status=500, headers=(("Idempotent-Replayed", "true"),), body=b"{}")
LATER = lambda: time.time() + 7200  # noqa: E731 (a session's clock, past absent_after)


def test_lookup_absence_under_other_credentials_never_settles_a_credential_bound_key(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A key bound to its credentials is never resent under others, because that server
    scopes what it stores per API token. A lookup is answered per token too: absence
    seen through account B proves nothing about a charge made with account A. Yet the
    lookup settles it failed and forks it, and the next resume with A charges again."""
    app, url = scripted
    journal = str(tmp_path / "j.db")
    app.answer(REPLAYED_500)
    with (
        idempotently.Session(
            journal, base_url=url, headers={"Authorization": TOKEN_A}, profile=BOUND
        ) as session,
        pytest.raises(idempotently.NeedsReconcileError),
    ):
        session.post("/v1/charges", json={"amount": 1000}, operation_id="order-1")
    # The operator's reconcile run, with the wrong account's token: its search is empty.
    app.answer(Answer(status=200, body=b'{"data": []}'))
    with idempotently.Session(
        journal, base_url=url, headers={"Authorization": TOKEN_B}, profile=BOUND, clock=LATER
    ) as session:
        session.reconcile(Lookup("/v1/charges", absent="resend"))
        parent = session.journal.operation("order-1")
    assert parent is not None
    assert app.arrivals[-1].authorization == TOKEN_B  # the lookup ran as account B
    # Promised: absence proves nothing here, it stays needs_reconcile.
    assert parent.status == "needs_reconcile", (parent.status, parent.reason)


def test_operator_retry_refuses_an_enqueued_never_sent_operation_as_expired(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """An enqueued operation not yet sent has a key no server has seen: resume never
    takes it for expired ("a relay down for a day still sends it"), and decisions.md
    says `retry` applies "the same rule resume applies". retry_now refuses it anyway,
    saying the server may have forgotten a key it never saw."""
    _, url = scripted
    journal = str(tmp_path / "j.db")
    with idempotently.Session(journal, base_url=url) as session:
        session.enqueue("POST", "/v1/charges", json={"amount": 1}, operation_id="order-7")
    # The relay was down for two days (its rows as they would be, moved back in time).
    conn = sqlite3.connect(journal)
    with conn:
        conn.execute(
            "UPDATE operations SET created_at = created_at - 172800, "
            "enqueued_at = enqueued_at - 172800, key_expires_at = key_expires_at - 172800, "
            "updated_at = updated_at - 172800, not_before = ?",
            (time.time() + 3600,),
        )
    conn.close()
    with idempotently.Journal(journal) as opened:
        done = opened.retry_now("order-7", note="relay back up")
    assert done.not_before is None


def test_cli_resume_max_attempts_bounds_an_operation_with_a_journaled_policy(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """`resume --max-attempts N` "bounds each operation in a run ... so a dead host costs
    seconds". An operation made with a per-call `policy=` is resumed under that journaled
    policy instead: the operator's bound is silently ignored (here 6 attempts for
    --max-attempts 1; with a journaled timeout=300 a dead host costs minutes per op)."""
    from click.testing import CliRunner

    from idempotently.cli import cli

    app, url = scripted
    journal = str(tmp_path / "j.db")
    patient = idempotently.RetryPolicy(max_attempts=6, initial_backoff=0.001, max_backoff=0.001)
    app.answer(*[Answer(status=503, body=b"{}")] * 6)
    with (
        idempotently.Session(journal, base_url=url, sleep=lambda seconds: None) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post("/v1/charges", json={"a": 1}, operation_id="op", policy=patient)
    before = len(app.arrivals)
    app.answer(*[Answer(status=503, body=b"{}")] * 6)
    result = CliRunner().invoke(
        cli, ["--journal", journal, "resume", "--base-url", url, "--max-attempts", "1"]
    )
    assert result.exit_code == 1, result.output
    assert len(app.arrivals) - before == 1, f"{len(app.arrivals) - before} attempts were sent"


def test_a_hostile_lookup_answer_nested_too_deep_leaves_the_operation_and_the_run_intact(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A lookup whose answer is not usable "changes nothing" (the lookup failed, backs
    off). An answer nested deeper than Python's recursion limit (200 KB, well under the
    10 MiB cap) escapes `Lookup.judge` as a raw RecursionError instead, and aborts the
    whole reconcile run (a watch worker's round too) for every other operation."""
    app, url = scripted
    journal = str(tmp_path / "j.db")
    app.answer(REPLAYED_500)
    with idempotently.Session(
        journal, base_url=url, profile=BOUND, headers={"Authorization": TOKEN_A}
    ) as session:
        with pytest.raises(idempotently.NeedsReconcileError):
            session.post("/v1/charges", json={"amount": 1}, operation_id="deep")
        app.answer(Answer(status=200, body=b"[" * 100_000 + b"]" * 100_000))
        (result,) = session.reconcile(Lookup("/v1/charges", absent="failed"))
        assert result.status == "needs_reconcile"


def test_a_per_call_credential_bound_profile_on_a_session_with_httpx_auth_binds_its_credentials(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A profile that binds keys to credentials, given per call on a client with httpx
    `auth=`: the key is bound to the Authorization the auth flow added as the request
    left (not to none), and a resume under other credentials sends nothing."""
    app, url = scripted
    journal = str(tmp_path / "j.db")
    app.answer(Answer(status=503))
    with (
        idempotently.Session(
            journal,
            base_url=url,
            auth=("sk_live_account_a", ""),
            policy=idempotently.RetryPolicy(max_attempts=1),
        ) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post("/v1/charges", json={"amount": 1}, operation_id="op", profile=BOUND)
    with idempotently.Session(journal, base_url=url, auth=("sk_live_account_b", "")) as other:
        (refused,) = other.resume()
    assert ("not_sent", 1) == (refused.action, len(app.arrivals))
    with idempotently.Journal(journal) as opened:
        operation = opened.operation("op")
    assert operation is not None and operation.credentials_digest is not None
    assert ["header:authorization"] == json.loads(operation.credentials_digest)["names"]


@pytest.mark.anyio
async def test_async_a_per_call_credential_bound_profile_with_httpx_auth_binds_its_credentials(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """The same on an AsyncSession, on asyncio and trio."""
    app, url = scripted
    journal = str(tmp_path / "j.db")
    async with idempotently.AsyncSession(
        journal, base_url=url, auth=("sk_live_account_a", "")
    ) as session:
        await session.post("/v1/charges", json={"amount": 1}, operation_id="op", profile=BOUND)
    assert 1 == len(app.arrivals)
    with idempotently.Journal(journal) as opened:
        operation = opened.operation("op")
    assert operation is not None and operation.credentials_digest is not None
    assert ["header:authorization"] == json.loads(operation.credentials_digest)["names"]


def test_a_fork_of_an_at_most_once_operation_is_sent_by_the_next_resume(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """`fork` "sends a failed, abandoned or needs_reconcile operation once more"; the
    fork is journaled enqueued, never sent, and "the next resume sends it". A fork of an
    at-most-once operation (the typical abandoned one) keeps delivery=at_most_once, and
    resume abandons every at-most-once operation, sent or not: the operator's fork ends
    `abandoned` ("whose send may have gone out") with nothing sent."""
    from tests.scripted_server import RESET

    app, url = scripted
    journal = str(tmp_path / "j.db")
    app.answer(RESET)
    with idempotently.Session(journal, base_url=url) as session:
        with pytest.raises(idempotently.IdempotentlyError):
            session.post("/v1/charges", json={"a": 1}, operation_id="op", delivery="at_most_once")
        session.resume()  # at most once: it is abandoned, never resent
        assert session.journal.operation("op").status == "abandoned"  # type: ignore[union-attr]
        session.journal.fork("op", note="checked the dashboard: no charge")
        before = len(app.arrivals)
        (result,) = session.resume()
    assert (result.operation_id, len(app.arrivals) - before) == ("op~fork1", 1), (
        result.status,
        result.detail,
    )


def test_settling_succeeded_an_enqueued_operation_never_sent_is_refused(tmp_path: Path) -> None:
    """An enqueued operation whose first send never began is provably undelivered (the
    journal knows: `show` says "enqueued and not sent yet"). `settle` refuses "a change
    that makes no sense", yet records it `succeeded` ("it took effect"): the outbox
    entry is then never sent, and a call again gets NoStoredAnswerError. The operation
    is lost on a careless operator's word that the journal can disprove."""
    journal = str(tmp_path / "j.db")
    with idempotently.Session(journal, base_url="http://127.0.0.1:9") as session:
        session.enqueue("POST", "/v1/charges", json={"a": 1}, operation_id="order-9")
        with pytest.raises(idempotently.OperatorActionError):
            session.journal.settle("order-9", "succeeded", note="saw it in the dashboard")
