"""The outbox keeps the journal's data-at-rest promises: an enqueued operation's body is
encoded by the journal's codec, its secret query values are never stored, and a key bound
to credentials is bound by its first send, so the relay resends it only with those
credentials."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import attrs
from cryptography.fernet import Fernet

import idempotently
from idempotently import profiles
from tests.at_rest import stored_bytes, stored_column
from tests.scripted_server import RESET, Answer, ScriptedApp

CODEC = idempotently.FernetCodec(Fernet.generate_key())
CARD = "4242424242424242"
TOKEN = "Bearer sk_live_original_4242"
BOUND = attrs.evolve(profiles.GENERIC, name="bound", key_bound_to_credentials=True)


def test_an_enqueued_body_is_stored_encoded_returned_clear_and_sent_clear(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The store holds ciphertext and no secret query value; enqueue returns (and a second
    enqueue of the same operation reads back) the clear body."""
    app, url = scripted
    journal = idempotently.Journal(journal_target, codec=CODEC)
    with idempotently.Session(journal, base_url=url) as session:
        enqueued = session.enqueue(
            "POST", "/v1/charges?api_key=sk_secret_1", json={"card": CARD}, operation_id="op"
        )
        again = session.enqueue(
            "POST", "/v1/charges?api_key=sk_secret_1", json={"card": CARD}, operation_id="op"
        )
        assert [] == app.arrivals
    journal.close()
    raw = stored_bytes(journal_target)
    assert CARD.encode() not in raw and b"sk_secret_1" not in raw
    assert "fernet" == stored_column(journal_target, "op", "codec")
    assert {"card": CARD} == json.loads(enqueued.request_body) == json.loads(again.request_body)


def test_the_relay_sends_an_enqueued_encoded_operation_in_clear_once(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The relay decodes what enqueue encoded: the server gets the clear body, once."""
    app, url = scripted
    app.answer(Answer(201, body=b'{"id": "ch_1"}'))
    journal = idempotently.Journal(journal_target, codec=CODEC)
    with idempotently.Session(journal, base_url=url) as session:
        session.enqueue("POST", "/v1/charges", json={"card": CARD}, operation_id="op")
        (result,) = session.resume()
        assert [] == session.resume()
    journal.close()
    assert "succeeded" == result.action
    assert [{"card": CARD}] == [json.loads(arrival.body) for arrival in app.arrivals]


def test_an_enqueued_key_bound_to_credentials_is_bound_by_its_first_send(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """Nothing is bound at enqueue (nothing left, and a hook or auth flow may add the
    credentials only as the request leaves); the relay's first send binds the key to the
    credentials it leaves with (a digest, never the token), so a relay under a rotated
    token then sends nothing, and one under the original token sends it again."""
    app, url = scripted
    app.answer(RESET)
    path = str(tmp_path / "ops.db")
    with idempotently.Session(
        path, base_url=url, profile=BOUND, headers={"Authorization": TOKEN}
    ) as session:
        session.enqueue("POST", "/v1/charges", json={"amount": 1}, operation_id="op")
    conn = sqlite3.connect(path)
    assert (None,) == conn.execute("SELECT credentials_digest FROM operations").fetchone()
    with idempotently.Session(
        path,
        base_url=url,
        profile=BOUND,
        headers={"Authorization": TOKEN},
        policy=idempotently.RetryPolicy(max_attempts=1),
    ) as relay:
        (lost,) = relay.resume()
    (digest,) = conn.execute("SELECT credentials_digest FROM operations").fetchone()
    conn.close()
    assert digest and TOKEN.split()[1] not in digest
    with idempotently.Session(
        path, base_url=url, profile=BOUND, headers={"Authorization": "Bearer sk_live_rotated"}
    ) as rotated:
        (refused,) = rotated.resume()
    assert ("still_pending", "not_sent", 1) == (lost.action, refused.action, len(app.arrivals))
    with idempotently.Session(
        path, base_url=url, profile=BOUND, headers={"Authorization": TOKEN}
    ) as original:
        (sent,) = original.resume()
    assert ("succeeded", 2) == (sent.action, len(app.arrivals))
