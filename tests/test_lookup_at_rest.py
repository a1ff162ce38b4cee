"""The operator's journal keeps the codec's promise: what a lookup stores (the object it
found, a fork of the request) and what an operator's fork makes are stored encoded like
the rest of the row, read back clear, and sent clear."""

from __future__ import annotations

import json
import time
from typing import Any

from cryptography.fernet import Fernet

import idempotently
from idempotently import Journal, Lookup
from idempotently._rows import AttemptRecord
from idempotently.testing import MockServer
from tests.at_rest import stored_bytes
from tests.journal_commands import record_attempt, set_status
from tests.test_lookup import AUTH, CARRYING, charged_but_unsettled
from tests.test_operator_actions import make

CODEC = idempotently.FernetCodec(Fernet.generate_key())
CUSTOMER = "cus_private_77"


def lost_encoded(journal: Journal, server: MockServer, name: str) -> None:
    """An encoded operation whose only attempt was lost an hour ago, now needs_reconcile."""
    document: dict[str, Any] = {
        "amount": 1000,
        "currency": "usd",
        "customer": CUSTOMER,
        "metadata": {"operation_id": name},
    }
    make(
        journal,
        name,
        "pending",
        url=f"{server.url}/v1/charges",
        body=CODEC.encode(json.dumps(document).encode()),
        codec=CODEC.name,
    )
    started = time.time() - 3600
    record_attempt(
        journal, name, AttemptRecord(started, 0.1, "maybe_delivered", error="reset"), now=started
    )
    assert set_status(journal, name, "needs_reconcile", reason="key expired", now=time.time())


def test_a_lookups_found_object_is_stored_encoded_and_read_clear(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    server = idempotently_mock_server
    journal = Journal(journal_target, codec=CODEC)
    with idempotently.Session(
        journal, base_url=server.url, headers=AUTH, profile=CARRYING, sleep=lambda _: None
    ) as session:
        charged_but_unsettled(session, server, "order-1")
        (result,) = session.reconcile(Lookup("/v1/charges"))
        operation = session.journal.operation("order-1")
    journal.close()
    (made,) = server.charges()
    assert operation is not None and operation.unreadable is None
    assert ("reconciled", "succeeded") == (result.action, operation.status)
    assert made.id == json.loads(operation.response_body or b"")["id"]
    assert made.id.encode() not in stored_bytes(journal_target)


def test_a_lookups_resend_forks_an_encoded_request_that_is_sent_clear_once(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    server = idempotently_mock_server
    journal = Journal(journal_target, codec=CODEC)
    lost_encoded(journal, server, "order-1")
    with idempotently.Session(journal, base_url=server.url, headers=AUTH) as session:
        (result,) = session.reconcile(Lookup("/v1/charges", absent="resend"))
        resumed = session.resume()
        fork = session.journal.operation("order-1~fork1")
    journal.close()
    assert "forked as order-1~fork1" in result.detail
    assert fork is not None and fork.unreadable is None
    assert [("order-1~fork1", "succeeded")] == [(r.operation_id, r.action) for r in resumed]
    (made,) = server.charges()
    assert (fork.key, CUSTOMER) == (made.key, made.customer)
    assert CUSTOMER.encode() not in stored_bytes(journal_target)


def test_an_operators_fork_of_an_encoded_operation_is_returned_clear_and_sent_once(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    server = idempotently_mock_server
    journal = Journal(journal_target, codec=CODEC)
    lost_encoded(journal, server, "order-1")
    fork = journal.fork("order-1", note="checked the dashboard: no charge", actor="ada@ops")
    assert CUSTOMER == json.loads(fork.request_body)["customer"]
    with idempotently.Session(journal, base_url=server.url, headers=AUTH) as session:
        resumed = session.resume()
    journal.close()
    assert [("order-1~fork1", "succeeded")] == [(r.operation_id, r.action) for r in resumed]
    (made,) = server.charges()
    assert CUSTOMER == made.customer
