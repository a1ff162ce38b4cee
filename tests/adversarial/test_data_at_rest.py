"""Data at rest under attack: hostile query strings, hostile codecs, tampered rows.

A secret query value never reaches the journal file or the screen, whatever its
spelling (case, percent-encoding, repeats, bytes outside ASCII), and is put back
byte for byte; a codec that fails, lies or was swapped never sends a body and
never prints one encoded; a damaged credentials digest or list of redacted
parameters is a clear refusal, never a traceback.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import idempotently
from idempotently import profiles
from idempotently._secret_params import (
    DEFAULT_SECRET_PARAMS,
    REDACTED,
    reapplied_url,
    redacted_url,
    secret_param_names,
    values_in_url,
)
from tests.adversarial.invariants import assert_sound, cli_run, journal_bytes
from tests.adversarial.wire import RESET, Wire

ONE_TRY = idempotently.RetryPolicy(max_attempts=1)
CHARGE = {"amount": 1000, "card": "4242424242424242"}


def pending(journal: Path, wire: Wire, *, url: str = "/v1/charges", **options: Any) -> None:
    """One operation ``op`` sent once to the raw server, its answer lost."""
    wire.answer(RESET)
    with (
        idempotently.Session(journal, base_url=wire.url, policy=ONE_TRY, **options) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post(url, json=CHARGE, operation_id="op")


# -- hostile query strings -----------------------------------------------------------------------

SPELLINGS = {
    "upper-case": "API_KEY",
    "mixed-case": "Access_Token",
    "percent-encoded-name": "api%5Fkey",
    "plus-in-name": "client_secret",
}
VALUES = {
    "plain": "sk_live_plain_value_1",
    "percent-encoded": "sk%2Flive%2Bencoded%3D%3D",
    "utf-8": "sk_%C3%A9t%C3%A9_value",
    "nul": "sk_nul%00value_2",
    "long": "sk_" + "L" * 5000,
    "ampersand-encoded": "sk_a%26b%3Dc_value",
}


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_hostile_secret_value_is_never_stored_and_is_resent_byte_for_byte(
    journal: Path, wire: Wire, spelling: str, value: str
) -> None:
    """However the parameter is spelt and whatever its value holds, the file and every
    command's output lack it, and the call again sends the very target first sent."""
    raw_value = VALUES[value]
    query = f"n=1&{SPELLINGS[spelling]}={raw_value}&{SPELLINGS[spelling]}={raw_value}x&z="
    pending(journal, wire, url=f"/v1/charges?{query}")
    assert assert_sound(journal, operations=["op"], secrets=[raw_value])[0].secret_params
    with idempotently.Session(journal, base_url=wire.url) as session:
        session.post(f"/v1/charges?{query}", json=CHARGE, operation_id="op")
    first, second = wire.arrivals
    assert (first.target, first.key) == (second.target, second.key)
    assert f"/v1/charges?{query}".encode() == first.target
    assert_sound(journal, operations=["op"], secrets=[raw_value])


NAMES = st.sampled_from([*sorted(DEFAULT_SECRET_PARAMS), "n", "key", "page", "Token", "SIG"])
RAW_VALUES = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters="&#"), min_size=0, max_size=30
).map(lambda text: urllib.parse.quote(text, safe="=+/*[]"))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(NAMES, RAW_VALUES), min_size=1, max_size=8))
def test_any_query_round_trips_and_keeps_no_secret_value(pairs: list[tuple[str, str]]) -> None:
    """Redacted, then put back from the live URL: the very same raw query; and no value of a
    secret parameter is left in the journaled form."""
    query = "&".join(f"{name}={value}" for name, value in pairs)
    url = httpx.URL(f"https://api.example.test/v1/charges?{query}")
    stored, names = redacted_url(url, secret_param_names())
    secret_pairs = [(n, v) for n, v in pairs if n.lower() in DEFAULT_SECRET_PARAMS]
    kept = httpx.URL(stored).query.decode().split("&")
    for name, value in secret_pairs:
        assert f"{name}={REDACTED}" in kept
        assert f"{name}={value}" not in kept or value == REDACTED
    back = reapplied_url(httpx.URL(stored), names, values_in_url(url))
    assert url.raw_path == back.raw_path


# -- hostile codecs ------------------------------------------------------------------------------


@attrs.define
class Scripted:
    """A codec whose decode misbehaves as told once the journal is written."""

    name: str = "scripted"
    decode_as: str = "ok"

    def encode(self, data: bytes) -> bytes:
        return b"ENC:" + data[::-1]

    def decode(self, data: bytes) -> Any:
        if self.decode_as == "raise":
            raise RuntimeError(f"cannot decode {data!r}")  # quotes the data: must not travel
        if self.decode_as == "str":
            return data.decode("latin-1")
        if self.decode_as == "none":
            return None
        if self.decode_as == "other":
            # A lie without an error: what a wrong key gives a codec that does not
            # authenticate (valid JSON, another amount).
            return b'{"amount": 999999, "card": "4000000000000002"}'
        return data[4:][::-1]


@pytest.mark.parametrize("misbehaviour", ["raise", "str", "none", "other"])
def test_a_codec_that_fails_or_lies_on_decode_never_sends_or_prints_a_body(
    journal: Path, wire: Wire, misbehaviour: str
) -> None:
    """decode() raising, returning something else than bytes, or other bytes (the body
    then does not match its journaled digest): the operation reads as unreadable (saying
    so), resume sends nothing, the CLI prints no body bytes."""
    codec = Scripted()
    with idempotently.Journal(journal, codec=codec) as opened:
        wire.answer(RESET)
        with (
            idempotently.Session(opened, base_url=wire.url, policy=ONE_TRY) as session,
            pytest.raises(idempotently.OperationPendingError),
        ):
            session.post("/v1/charges", json=CHARGE, operation_id="op")
        codec.decode_as = misbehaviour
        stored = opened.operation("op")
        with idempotently.Session(opened, base_url=wire.url) as session:
            (result,) = session.resume()
    assert stored is not None and stored.unreadable is not None
    assert ("not_sent", 1) == (result.action, len(wire.arrivals))
    encoded_card = CHARGE["card"][::-1]
    for args in (("show", "op"), ("show", "op", "--json"), ("list", "--json")):
        _, output = cli_run(journal, *args)
        assert encoded_card not in output and CHARGE["card"] not in output
    assert CHARGE["card"].encode() not in journal_bytes(journal)


def test_a_codec_that_encodes_to_something_else_than_bytes_journals_nothing(
    journal: Path, wire: Wire
) -> None:
    """encode() returning str for a body (after passing the check on its probe): CodecError,
    nothing journaled, nothing sent."""

    class Fickle(Scripted):
        def encode(self, data: bytes) -> Any:
            return data.decode("latin-1") if len(data) > 40 else b"ENC:" + data[::-1]

    with idempotently.Journal(journal, codec=Fickle(name="fickle")) as opened:
        with (
            idempotently.Session(opened, base_url=wire.url) as session,
            pytest.raises(idempotently.CodecError, match="not bytes"),
        ):
            session.post("/v1/charges", json={"pad": "x" * 100}, operation_id="op")
        assert opened.operation("op") is None
    assert [] == wire.arrivals


@pytest.mark.parametrize("tampering", ["codec-renamed", "ciphertext-flipped"])
def test_a_tampered_encoded_row_is_never_sent(journal: Path, wire: Wire, tampering: str) -> None:
    """A row whose codec name was changed, or whose Fernet ciphertext was altered (its HMAC
    fails): unreadable, not sent, the audit still runs."""
    from cryptography.fernet import Fernet

    codec = idempotently.FernetCodec(Fernet.generate_key())
    with idempotently.Journal(journal, codec=codec) as opened:
        wire.answer(RESET)
        with (
            idempotently.Session(opened, base_url=wire.url, policy=ONE_TRY) as session,
            pytest.raises(idempotently.OperationPendingError),
        ):
            session.post("/v1/charges", json=CHARGE, operation_id="op")
    conn = sqlite3.connect(journal)
    if tampering == "codec-renamed":
        conn.execute("UPDATE operations SET codec = 'rot13'")
    else:
        body = conn.execute("SELECT request_body FROM operations").fetchone()[0]
        conn.execute("UPDATE operations SET request_body = ?", (body[:-8] + b"AAAAAAAA",))
    conn.commit()
    conn.close()
    with idempotently.Journal(journal, codec=codec) as opened:
        stored = opened.operation("op")
        with idempotently.Session(opened, base_url=wire.url) as session:
            (result,) = session.resume()
    assert stored is not None and stored.unreadable is not None
    assert ("not_sent", 1) == (result.action, len(wire.arrivals))
    assert_sound(journal, operations=["op"], secrets=[CHARGE["card"]], show=False)


@pytest.mark.parametrize("tampering", ["bodies-swapped", "digest-dropped", "digest-copied"])
def test_a_tampered_row_through_a_codec_that_does_not_authenticate_is_never_sent(
    journal: Path, wire: Wire, tampering: str
) -> None:
    """Through a codec that decodes anything: another operation's body swapped in, the
    digest set to NULL (as if written before version 5), or another row's digest copied
    in: the decoded body cannot be proven to be the one first sent, so nothing is sent."""
    codec = Scripted()
    with idempotently.Journal(journal, codec=codec) as opened:
        for number in (1, 2):
            wire.answer(RESET)
            with (
                idempotently.Session(opened, base_url=wire.url, policy=ONE_TRY) as session,
                pytest.raises(idempotently.OperationPendingError),
            ):
                session.post(
                    "/v1/charges", json={**CHARGE, "amount": number}, operation_id=f"op-{number}"
                )
    conn = sqlite3.connect(journal)
    column = {"bodies-swapped": "request_body", "digest-copied": "body_digest"}.get(tampering)
    if column is None:
        conn.execute("UPDATE operations SET body_digest = NULL WHERE operation_id = 'op-1'")
    else:
        conn.execute(
            f"UPDATE operations SET {column} = "
            f"(SELECT {column} FROM operations WHERE operation_id = 'op-2') "
            "WHERE operation_id = 'op-1'"
        )
    conn.commit()
    conn.close()
    with idempotently.Journal(journal, codec=codec) as opened:
        stored = opened.operation("op-1")
        with idempotently.Session(opened, base_url=wire.url) as session:
            results = {result.operation_id: result.action for result in session.resume()}
    assert stored is not None and stored.unreadable is not None
    assert {"op-1": "not_sent", "op-2": "succeeded"} == results
    assert 3 == len(wire.arrivals) and b'"amount":2' in wire.arrivals[2].body


# -- tampered rows -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "record", ["not json", '{"names": "authorization"}', '{"names": [], "digest": 1}', "[]"]
)
def test_a_damaged_credentials_digest_is_a_refusal_not_a_send(
    journal: Path, wire: Wire, record: str
) -> None:
    """A credentials record that cannot be read back: the resume sends nothing and says the
    digest cannot be checked; the operation stays pending."""
    bound = attrs.evolve(profiles.GENERIC, name="bound", key_bound_to_credentials=True)
    pending(journal, wire, profile=bound, headers={"Authorization": "Bearer tok_damaged_1"})
    conn = sqlite3.connect(journal)
    conn.execute("UPDATE operations SET credentials_digest = ?", (record,))
    conn.commit()
    conn.close()
    with idempotently.Session(
        journal, base_url=wire.url, headers={"Authorization": "Bearer tok_damaged_1"}
    ) as session:
        (result,) = session.resume()
    assert ("not_sent", "pending", 1) == (result.action, result.status, len(wire.arrivals))
    assert "cannot be checked" in result.detail
    assert_sound(journal, operations=["op"], secrets=["tok_damaged_1"])


@pytest.mark.parametrize("value", ["not json", '{"api_key": 1}', "[1, 2]"])
def test_a_damaged_list_of_redacted_parameters_is_a_corrupt_journal_error(
    journal: Path, wire: Wire, value: str
) -> None:
    """secret_params that is not a list of names: JournalCorruptError naming the operation in
    the library, one line (exit 1) in the CLI; nothing sent."""
    pending(journal, wire, url="/v1/charges?api_key=sk_damaged_list_1")
    conn = sqlite3.connect(journal)
    conn.execute("UPDATE operations SET secret_params = ?", (value,))
    conn.commit()
    conn.close()
    with (
        idempotently.Journal(journal, create=False) as opened,
        pytest.raises(idempotently.JournalCorruptError) as caught,
    ):
        opened.operation("op")
    assert "secret_params" in str(caught.value) and "op" in str(caught.value)
    code, output = cli_run(journal, "resume")
    assert (1, True) == (code, "secret_params" in output), output
    assert 1 == len(wire.arrivals)
