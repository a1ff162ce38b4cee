"""The outbox in an ORM's transaction survives SIGKILL as a driver connection's does: a
shop that commits its order in a SQLAlchemy Session (sync, or async on aiosqlite and
asyncpg) or in Django's atomic block, killed right after its commit, loses nothing; a
relay killed mid-batch sends nothing twice. Real processes (tests/outbox_child.py), a
real journal (SQLite file and PostgreSQL) and the mock server on 127.0.0.1: the
server's ledger holds exactly one charge per committed order.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest

import idempotently
from idempotently.testing import Fault, MockServerConfig, serve
from tests.test_outbox_crash import (
    Child,
    _drop_the_shops_tables,  # noqa: F401 (autouse: the shops' PostgreSQL tables)
    charges_per_order,
    relay,
    run_child,
    wait_for_a_send_in_flight,
)

pytestmark = pytest.mark.slow

SHOPS = [("sqlalchemy", "sync"), ("sqlalchemy", "asyncio"), ("django", "sync")]


@pytest.mark.parametrize(("orm", "backend"), SHOPS)
def test_an_orm_shop_killed_right_after_its_commit_loses_nothing(
    journal_target: str, tmp_path: Path, orm: str, backend: str
) -> None:
    """SIGKILL the moment the second order's commit returns: both committed orders'
    charges are journaled, unsent, and resume sends each exactly once."""
    user = f"shop_{uuid.uuid4().hex[:8]}"
    with serve() as api:
        common = ["--journal", journal_target, "--base-url", api.url, "--user", user]
        code, events, child = run_child(
            tmp_path,
            "shop",
            *common,
            "--orm",
            orm,
            "--backend",
            backend,
            "--orders",
            "3",
            "--kill-after-commit",
            "1",
        )
        assert -9 == code, child.diagnosis()
        assert [0] == [event["order"] for event in events if event["event"] == "committed"]
        assert [] == api.charges(user)
        with idempotently.Journal(journal_target) as journal:
            queued = sorted(operation.operation_id for operation in journal.operations())
        assert ["order-0:charge", "order-1:charge"] == queued
        results = relay(journal_target, api, user)
        assert {"succeeded"} == {result.action for result in results}
        assert [] == relay(journal_target, api, user)
        assert Counter({"order-0": 1, "order-1": 1}) == charges_per_order(api, user)


@pytest.mark.parametrize(("orm", "backend"), SHOPS)
def test_a_relay_killed_mid_batch_of_orm_enqueued_charges_sends_each_once(
    journal_target: str, tmp_path: Path, orm: str, backend: str
) -> None:
    """Six charges enqueued in the ORM's transactions; the relay is SIGKILLed while the
    fourth is in flight at a slow server; a second relay finishes the batch: every order
    charged exactly once, every operation succeeded."""
    user = f"shop_{uuid.uuid4().hex[:8]}"
    with serve(MockServerConfig(provider_latency=0.3)) as api:
        common = ["--journal", journal_target, "--base-url", api.url, "--user", user]
        code, _, child = run_child(
            tmp_path, "shop", *common, "--orm", orm, "--backend", backend, "--orders", "6"
        )
        assert 0 == code, child.diagnosis()
        api.faults.for_order("order-3", Fault.delay(2.0))  # still unanswered at the kill
        doomed = Child(tmp_path, "relay", *common, "--backend", backend)
        try:
            results = 0
            while results < 3:
                event = doomed.next_event()
                assert event is not None, doomed.diagnosis()
                results += event["event"] == "result"
            in_flight = wait_for_a_send_in_flight(journal_target)
            assert "order-3:charge" == in_flight
            doomed.proc.kill()
            assert -9 == doomed.proc.wait(timeout=60)
        finally:
            doomed.close()
        relay(journal_target, api, user)
        with idempotently.Journal(journal_target) as journal:
            statuses = {
                operation.operation_id: operation.status for operation in journal.operations()
            }
        assert {f"order-{n}:charge": "succeeded" for n in range(6)} == statuses
        assert Counter({f"order-{n}": 1 for n in range(6)}) == charges_per_order(api, user)
