"""A codec that does not authenticate, read with the wrong key, decodes a stored body to
other bytes without raising: every resend (resume, the same call again, a watch worker,
`idempotently resume`) checks the decoded body against the digest journaled with it, and
sends nothing under the operation's key unless they match. With the right key the first
attempt's bytes are resent, once.

Rows journaled with a codec before the digest existed (schema version 5) are resent only
through a codec that says it authenticates (FernetCodec does)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import sqlite3
import threading
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

import idempotently
from idempotently.cli import cli
from tests.scripted_server import RESET, Answer, ScriptedApp

ONE_TRY = idempotently.RetryPolicy(max_attempts=1)
CHARGE = {"amount": 1000, "currency": "usd", "card": "4242424242424242", "order": "o-1"}
REPLAYED = Answer(201, headers=(("Idempotent-Replayed", "true"),))


class Xor:
    """Repeating-key XOR: no authentication at all."""

    name = "xor"

    def __init__(self, key: bytes) -> None:
        self.key = key

    def encode(self, data: bytes) -> bytes:
        return bytes(byte ^ mask for byte, mask in zip(data, itertools.cycle(self.key)))

    decode = encode


class Keystream:
    """A counter-mode keystream (as AES-CTR, with SHA-256 for the block): encrypts, does
    not authenticate."""

    name = "keystream"

    def __init__(self, key: bytes) -> None:
        self.key = key

    def _stream(self, size: int) -> bytes:
        blocks = (
            hashlib.sha256(self.key + counter.to_bytes(8, "big")).digest()
            for counter in range(size // 32 + 1)
        )
        return b"".join(blocks)[:size]

    def encode(self, data: bytes) -> bytes:
        return bytes(a ^ b for a, b in zip(data, self._stream(len(data)), strict=True))

    decode = encode


class Deflate:
    """A compression "codec": raw deflate with a preset dictionary as its key. Raw deflate
    carries no checksum, so another dictionary inflates to other bytes."""

    name = "deflate-dictionary"

    def __init__(self, key: bytes) -> None:
        self.key = key

    def encode(self, data: bytes) -> bytes:
        packer = zlib.compressobj(wbits=-15, zdict=self.key)
        return packer.compress(data) + packer.flush()

    def decode(self, data: bytes) -> bytes:
        unpacker = zlib.decompressobj(wbits=-15, zdict=self.key)
        return unpacker.decompress(data) + unpacker.flush()


class AuthenticatingXor(Xor):
    """A codec that says it authenticates: trusted with rows from before the digest."""

    authenticates = True


DICTIONARY = json.dumps(CHARGE).encode()
RIGHT = {
    "xor": Xor(b"right key 123456"),
    "keystream": Keystream(b"right key"),
    "deflate": Deflate(DICTIONARY),
}
WRONG = {
    "xor": Xor(b"wrong key 654321"),
    "keystream": Keystream(b"wrong key"),
    "deflate": Deflate(DICTIONARY.replace(b"4242424242424242", b"9999999999999999")),
}
WRONG_XOR = WRONG["xor"]
RIGHT_XOR = RIGHT["xor"]
"""For the command line: ``--codec tests.test_codec_wrong_key:WRONG_XOR``."""
KINDS = sorted(RIGHT)


def body() -> bytes:
    return httpx.Request("POST", "http://x", json=CHARGE).content


def lost_answer(target: str, url: str, app: ScriptedApp, codec: Any) -> str:
    """Journal operation ``op`` through ``codec``: sent once, its answer lost (pending);
    returns its key."""
    app.answer(RESET)
    journal = idempotently.Journal(target, codec=codec)
    with (
        idempotently.Session(journal, base_url=url, policy=ONE_TRY) as session,
        pytest.raises(idempotently.OperationPendingError) as caught,
    ):
        session.post("/v1/charges", json=CHARGE, operation_id="op")
    journal.close()
    assert caught.value.key is not None
    return caught.value.key


@pytest.mark.parametrize("kind", KINDS)
def test_the_wrong_key_decodes_to_other_bytes_without_an_error(kind: str) -> None:
    """What makes these codecs dangerous: no exception, just other bytes."""
    assert body() != WRONG[kind].decode(RIGHT[kind].encode(body()))
    assert body() == RIGHT[kind].decode(RIGHT[kind].encode(body()))


@pytest.mark.parametrize("kind", KINDS)
def test_resume_with_the_wrong_key_sends_nothing_and_with_the_right_one_resends_once(
    journal_target: str, scripted: tuple[ScriptedApp, str], kind: str
) -> None:
    """Wrong key: resume is not_sent (saying the body does not match its digest), the call
    again is a CodecError with the operation id and key, nothing reaches the server and the
    operation stays pending. Right key: the first bytes again, under the same key, once."""
    app, url = scripted
    key = lost_answer(journal_target, url, app, RIGHT[kind])
    journal = idempotently.Journal(journal_target, codec=WRONG[kind])
    with idempotently.Session(journal, base_url=url) as session:
        (refused,) = session.resume()
        with pytest.raises(idempotently.CodecError) as caught:
            session.post("/v1/charges", json=CHARGE, operation_id="op")
        kept = journal.operation("op")
    journal.close()
    assert ("not_sent", "pending") == (refused.action, refused.status)
    assert "does not match the digest" in refused.detail
    assert ("op", key) == (caught.value.operation_id, caught.value.key)
    assert "does not match the digest" in str(caught.value)
    assert kept is not None and "pending" == kept.status
    assert 1 == len(app.arrivals)
    app.answer(REPLAYED)
    with idempotently.Session(
        idempotently.Journal(journal_target, codec=RIGHT[kind]), base_url=url
    ) as session:
        (resent,) = session.resume()
    assert ("succeeded", True) == (resent.action, resent.replayed)
    first, second = app.arrivals
    assert (key, key, body(), body()) == (first.key, second.key, first.body, second.body)


@pytest.mark.anyio
async def test_async_resume_and_call_with_the_wrong_key_send_nothing(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncSession on asyncio and trio: the same refusal, the same single resend."""
    app, url = scripted
    key = lost_answer(journal_target, url, app, RIGHT["keystream"])
    journal = idempotently.Journal(journal_target, codec=WRONG["keystream"])
    async with idempotently.AsyncSession(journal, base_url=url) as session:
        (refused,) = await session.resume()
        with pytest.raises(idempotently.CodecError) as caught:
            await session.post("/v1/charges", json=CHARGE, operation_id="op")
    journal.close()
    assert ("not_sent", "pending") == (refused.action, refused.status)
    assert ("op", key) == (caught.value.operation_id, caught.value.key)
    assert 1 == len(app.arrivals)
    async with idempotently.AsyncSession(
        idempotently.Journal(journal_target, codec=RIGHT["keystream"]), base_url=url
    ) as session:
        (resent,) = await session.resume()
    assert "succeeded" == resent.action
    assert [key, key] == [arrival.key for arrival in app.arrivals]
    assert {body()} == {arrival.body for arrival in app.arrivals}


def test_cli_resume_with_the_wrong_key_sends_nothing(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """`idempotently resume --codec` with the wrong key: not_sent, exit 1, nothing sent;
    `show` says why and prints no wrongly decoded body."""
    app, url = scripted
    path = str(tmp_path / "journal.db")
    lost_answer(path, url, app, RIGHT_XOR)
    runner = CliRunner()
    wrong = runner.invoke(
        cli,
        ["--journal", path, "resume", "--json", "--codec", "tests.test_codec_wrong_key:WRONG_XOR"],
    )
    assert (1, 1) == (wrong.exit_code, len(app.arrivals)), wrong.output
    assert "not_sent" == json.loads(wrong.stdout)[0]["action"]
    shown = runner.invoke(
        cli, ["--journal", path, "show", "op", "--codec", "tests.test_codec_wrong_key:WRONG_XOR"]
    )
    garbage = WRONG_XOR.decode(RIGHT_XOR.encode(body())).decode("latin-1")
    assert (1, True) == (shown.exit_code, "does not match the digest" in shown.output)
    assert garbage[:12] not in shown.output
    right = runner.invoke(
        cli, ["--journal", path, "resume", "--codec", "tests.test_codec_wrong_key:RIGHT_XOR"]
    )
    assert (0, 2) == (right.exit_code, len(app.arrivals)), right.output
    assert app.arrivals[0].body == app.arrivals[1].body


def test_a_watch_worker_with_the_wrong_key_sends_nothing(tmp_path: Path) -> None:
    """`resume --watch`'s worker claims the operations, sends none of them (not_sent), and
    leaves them pending for a worker with the right key."""
    from tests.support import FakeTime
    from tests.test_watch import NOW, refuse, run_worker

    path = tmp_path / "journal.db"
    fake = FakeTime(now=NOW - 60)
    with idempotently.Session(
        idempotently.Journal(path, codec=RIGHT["keystream"], durability="os"),
        transport=httpx.MockTransport(refuse),
        policy=ONE_TRY,
        clock=fake.clock,
        sleep=fake.sleep,
    ) as session:
        for number in range(2):
            with pytest.raises(idempotently.IdempotentlyError):
                session.post(
                    "https://api.example.test/v1/charges",
                    json={**CHARGE, "n": number},
                    operation_id=f"op-{number}",
                )
    sent: list[bytes] = []
    results: list[idempotently.ResumeResult] = []
    stop = threading.Event()

    def server(request: httpx.Request) -> httpx.Response:
        sent.append(request.content)
        return httpx.Response(201)

    worker_time = FakeTime(now=NOW)
    with idempotently.Session(
        idempotently.Journal(path, codec=WRONG["keystream"]),
        host_id="worker-1",
        transport=httpx.MockTransport(server),
        policy=ONE_TRY,
        clock=worker_time.clock,
        sleep=worker_time.sleep,
    ) as worker:
        run_worker(worker, stop, on_batch=lambda batch: stop.set(), results=results)
        statuses = [op.status for op in worker.journal.operations()]
        worker.journal.close()
    assert (["not_sent", "not_sent"], []) == ([result.action for result in results], sent)
    assert ["pending", "pending"] == statuses


# -- rows journaled through a codec without the digest -------------------------------------


def without_digest(target: str) -> None:
    """Take the digest off every row, as development journals before schema version 5
    wrote them (a journal of this version has one on every encoded row: only an edit by
    hand takes it off)."""
    if target.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(target, autocommit=True) as conn:
            conn.execute("UPDATE idempotently.operations SET body_digest = NULL")
        return
    with contextlib.closing(sqlite3.connect(target, isolation_level=None)) as conn:
        conn.execute("UPDATE operations SET body_digest = NULL")


def test_a_row_from_before_the_digest_is_resent_only_through_a_codec_that_authenticates(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """A row without a digest: XOR (which says nothing) resends nothing and says
    why and what to do; a codec with ``authenticates = True`` resends it as before."""
    app, url = scripted
    lost_answer(journal_target, url, app, RIGHT_XOR)
    without_digest(journal_target)
    with idempotently.Session(
        idempotently.Journal(journal_target, codec=RIGHT_XOR), base_url=url
    ) as session:
        (refused,) = session.resume()
    assert ("not_sent", 1) == (refused.action, len(app.arrivals))
    assert "authenticates = True" in refused.detail and "settle" in refused.detail
    trusted = AuthenticatingXor(RIGHT_XOR.key)
    with idempotently.Session(
        idempotently.Journal(journal_target, codec=trusted), base_url=url
    ) as session:
        (resent,) = session.resume()
    assert "succeeded" == resent.action
    assert app.arrivals[0].body == app.arrivals[1].body


def test_a_fernet_row_from_before_the_digest_is_resent_as_before(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """FernetCodec authenticates (a wrong key fails to decode): its old rows resend."""
    from tests.test_codec import CODEC

    app, url = scripted
    lost_answer(journal_target, url, app, CODEC)
    without_digest(journal_target)
    with idempotently.Session(
        idempotently.Journal(journal_target, codec=CODEC), base_url=url
    ) as session:
        (resent,) = session.resume()
    assert "succeeded" == resent.action
    assert app.arrivals[0].body == app.arrivals[1].body


def test_a_row_in_clear_stores_no_digest(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """Without a codec nothing new is stored; through one, the digest is stored encoded."""
    from tests.at_rest import stored_column

    _app, url = scripted
    with idempotently.Session(journal_target, base_url=url) as session:
        session.post("/v1/charges", json=CHARGE, operation_id="clear")
    with idempotently.Session(
        idempotently.Journal(journal_target, codec=RIGHT_XOR), base_url=url
    ) as session:
        session.post("/v1/charges", json=CHARGE, operation_id="encoded")
    digest = hashlib.sha256(body()).digest()
    assert stored_column(journal_target, "clear", "body_digest") is None
    stored = stored_column(journal_target, "encoded", "body_digest")
    assert (RIGHT_XOR.encode(digest), False) == (stored, digest in stored)


@pytest.mark.parametrize("kind", ["xor", "keystream"])
def test_the_providers_ledger_shows_one_charge_whatever_key_resume_is_given(
    journal_target: str, kind: str
) -> None:
    """Against the mock provider: the charge is made and its answer lost; resume with the
    wrong key sends nothing (one request, one charge under the key); with the right key
    the provider replays it, and the ledger still holds exactly one charge."""
    from idempotently.testing import Fault, serve

    charge = {"amount": 1000, "currency": "usd", "customer": "cus_1", "metadata": {"o": "1"}}
    headers = {"Authorization": "Bearer shop_1"}
    with serve() as server:
        server.faults.push(Fault.lose_response())
        with (
            idempotently.Session(
                idempotently.Journal(journal_target, codec=RIGHT[kind]),
                base_url=server.url,
                headers=headers,
                policy=ONE_TRY,
            ) as session,
            pytest.raises(idempotently.OperationPendingError) as caught,
        ):
            session.post("/v1/charges", json=charge, operation_id="op")
        key = caught.value.key
        assert key is not None
        with idempotently.Session(
            idempotently.Journal(journal_target, codec=WRONG[kind]),
            base_url=server.url,
            headers=headers,
        ) as session:
            (refused,) = session.resume()
        assert ("not_sent", 1) == (refused.action, len(server.requests))
        assert {("shop_1", key): 1} == server.charge_count_by_key()
        with idempotently.Session(
            idempotently.Journal(journal_target, codec=RIGHT[kind]),
            base_url=server.url,
            headers=headers,
        ) as session:
            (resent,) = session.resume()
        assert ("succeeded", True) == (resent.action, resent.replayed)
        assert {("shop_1", key): 1} == server.charge_count_by_key()
        assert 2 == len(server.requests)
