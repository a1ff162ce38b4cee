"""Journal(codec=...): request and answer bodies encoded at rest, named in each row.

With ``FernetCodec`` the store holds only ciphertext for bodies; the URL path,
non-secret headers, statuses, ids and keys stay in clear. A journal opened
without the codec (or with another one, or a wrong key) reads such rows without
their bodies, says why, and never sends them or prints the ciphertext.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner, Result
from cryptography.fernet import Fernet

import idempotently
from idempotently.cli import cli
from tests.at_rest import stored_bytes, stored_column
from tests.journal_commands import set_status
from tests.scripted_server import RESET, Answer, ScriptedApp

KEY = Fernet.generate_key()
CODEC = idempotently.FernetCodec(KEY)
"""Imported by the command line tests as ``tests.test_codec:CODEC``."""
OTHER_KEY_CODEC = idempotently.FernetCodec(Fernet.generate_key())
"""Same name ("fernet"), another key: decoding fails."""
CARD = "4242424242424242"
ANSWER = b'{"id": "ch_1", "holder": "Ada Lovelace"}'
ONE_TRY = idempotently.RetryPolicy(max_attempts=1)


def charge() -> dict[str, Any]:
    return {"amount": 1000, "card": CARD}


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def lost_answer(target: str, url: str, app: ScriptedApp) -> None:
    """Journal operation ``op`` with the codec: sent once, its answer lost (pending)."""
    app.answer(RESET)
    journal = idempotently.Journal(target, codec=CODEC)
    with (
        idempotently.Session(journal, base_url=url, policy=ONE_TRY) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post("/v1/charges", json=charge(), operation_id="op")
    journal.close()


def test_bodies_are_stored_encoded_and_read_back_clear(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The request and the answer are ciphertext in the store (the row names the codec);
    the same call again answers from the journal with the clear answer, sending nothing."""
    app, url = scripted
    app.answer(Answer(201, body=ANSWER))
    journal = idempotently.Journal(journal_target, codec=CODEC)
    with idempotently.Session(journal, base_url=url) as session:
        first = session.post("/v1/charges", json=charge(), operation_id="op")
        again = session.post("/v1/charges", json=charge(), operation_id="op")
        stored = journal.operation("op")
    journal.close()
    raw = stored_bytes(journal_target)
    assert (CARD.encode() in app.arrivals[0].body, 1) == (True, len(app.arrivals))
    assert CARD.encode() not in raw and b"Ada Lovelace" not in raw
    assert "fernet" == stored_column(journal_target, "op", "codec")
    assert CODEC.decode(stored_column(journal_target, "op", "response_body")) == ANSWER
    assert (ANSWER, ANSWER) == (first.content, again.content)
    assert again.extensions["idempotently"].replayed_locally
    assert stored is not None and json.loads(stored.request_body) == charge()
    assert (stored.codec, stored.unreadable) == ("fernet", None)


def test_what_stays_in_clear_is_the_url_headers_statuses_ids_and_keys(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A codec encodes bodies only: the audit (list, stats) works without it."""
    _app, url = scripted
    path = str(tmp_path / "j.db")
    with idempotently.Session(
        idempotently.Journal(path, codec=CODEC), base_url=url, headers={"X-Tenant": "acme"}
    ) as session:
        session.post("/v1/charges", json=charge(), operation_id="order-42")
    raw = stored_bytes(path)
    assert all(part in raw for part in (b"/v1/charges", b"X-Tenant", b"acme", b"order-42"))
    listed = run("--journal", path, "list", "--json")
    assert (0, "succeeded") == (listed.exit_code, json.loads(listed.stdout)[0]["status"])


def test_the_same_call_again_is_recognised_by_its_clear_bytes(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """Fernet gives every encoding a fresh IV, so the stored bytes never repeat: the call
    again continues the operation (compared in clear), another body is KeyReuseError
    naming the field, never its value."""
    app, url = scripted
    lost_answer(journal_target, url, app)
    journal = idempotently.Journal(journal_target, codec=CODEC)
    with idempotently.Session(journal, base_url=url) as session:
        with pytest.raises(idempotently.KeyReuseError) as caught:
            session.post(
                "/v1/charges", json={**charge(), "card": "4000000000000002"}, operation_id="op"
            )
        response = session.post("/v1/charges", json=charge(), operation_id="op")
    journal.close()
    assert "$.card" in str(caught.value) and CARD not in str(caught.value)
    assert 201 == response.status_code
    first, second = app.arrivals
    assert (first.key, first.body) == (second.key, second.body)


def test_resume_with_the_codec_sends_the_clear_bytes_again(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The resend is byte-identical to the first send, never the ciphertext."""
    app, url = scripted
    lost_answer(journal_target, url, app)
    with idempotently.Session(
        idempotently.Journal(journal_target, codec=CODEC), base_url=url
    ) as session:
        (result,) = session.resume()
    assert "succeeded" == result.action
    first, second = app.arrivals
    assert (first.key, first.body) == (second.key, second.body)


@pytest.mark.parametrize("codec", [None, OTHER_KEY_CODEC], ids=["no-codec", "wrong-key"])
def test_without_the_right_codec_nothing_is_sent_and_no_ciphertext_is_shown(
    journal_target: str, scripted: tuple[ScriptedApp, str], codec: Any
) -> None:
    """No codec, or one that cannot decode: the operation reads without its bodies (saying
    why), resume sends nothing (not_sent), a call again raises CodecError; it stays pending."""
    app, url = scripted
    lost_answer(journal_target, url, app)
    journal = idempotently.Journal(journal_target, codec=codec)
    with idempotently.Session(journal, base_url=url) as session:
        stored = journal.operation("op")
        (planned,) = session.resume(dry_run=True)
        (result,) = session.resume()
        with pytest.raises(idempotently.CodecError) as caught:
            session.post("/v1/charges", json=charge(), operation_id="op")
    journal.close()
    assert stored is not None and stored.unreadable is not None
    assert (b"", "fernet") == (stored.request_body, stored.codec)
    assert ("not_sent", "not_sent", "pending") == (planned.action, result.action, result.status)
    assert "codec 'fernet'" in result.detail and "nothing was sent" in result.detail
    assert "op" == caught.value.operation_id and "nothing was sent" in str(caught.value)
    assert 1 == len(app.arrivals)


@pytest.mark.anyio
async def test_async_bodies_are_encoded_and_resent_clear(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """AsyncSession on asyncio and trio: encoded at rest, resent clear, refused without."""
    app, url = scripted
    app.answer(RESET)
    journal = idempotently.Journal(journal_target, codec=CODEC)
    async with idempotently.AsyncSession(journal, base_url=url, policy=ONE_TRY) as session:
        with pytest.raises(idempotently.OperationPendingError):
            await session.post("/v1/charges", json=charge(), operation_id="op")
    raw = await anyio.to_thread.run_sync(stored_bytes, journal_target)
    assert CARD.encode() not in raw
    async with idempotently.AsyncSession(journal_target, base_url=url) as bare:
        (refused,) = await bare.resume()
    async with idempotently.AsyncSession(journal, base_url=url) as session:
        (result,) = await session.resume()
    journal.close()
    assert ("not_sent", "succeeded") == (refused.action, result.action)
    first, second = app.arrivals
    assert first.body == second.body


def test_a_reconcilers_answer_is_stored_encoded(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """A needs_reconcile operation settled with the object found: its answer is stored
    under the row's codec, like any other."""
    import httpx

    app, url = scripted
    path = str(tmp_path / "j.db")
    app.answer(Answer(500, body=b"{}"))
    profile = idempotently.profiles.GENERIC
    journal = idempotently.Journal(path, codec=CODEC)
    with idempotently.Session(journal, base_url=url, policy=ONE_TRY, profile=profile) as session:
        with pytest.raises(idempotently.IdempotentlyError):
            session.post("/v1/charges", json=charge(), operation_id="op")
        set_status(journal, "op", "needs_reconcile", reason="test", now=0.0)
        session.resume(
            reconciler=lambda operation, client: idempotently.Settlement(
                "succeeded", "found", httpx.Response(200, content=ANSWER)
            )
        )
        stored = journal.operation("op")
    journal.close()
    assert stored is not None and (stored.status, stored.response_body) == ("succeeded", ANSWER)
    assert b"Ada Lovelace" not in stored_bytes(path)


# -- bad codecs ----------------------------------------------------------------------------------


class Reversing:
    """A codec that is no cipher (for tests): reverses the bytes."""

    name = "reversing"

    def encode(self, data: bytes) -> bytes:
        return data[::-1]

    def decode(self, data: bytes) -> bytes:
        return data[::-1]


class Lossy(Reversing):
    name = "lossy"

    def decode(self, data: bytes) -> bytes:
        return b""


class FailsOnBigBodies(Reversing):
    name = "fails-on-big-bodies"

    def encode(self, data: bytes) -> bytes:
        if len(data) > 100:
            raise RuntimeError(f"refusing {data!r}")  # quotes the body: must not travel
        return data[::-1]


def test_a_codec_is_checked_before_the_journal_is_opened(tmp_path: Path) -> None:
    """Not a codec, a bad name, or one that does not give back what it encoded: a clear
    error, and no journal file."""
    path = tmp_path / "j.db"
    with pytest.raises(TypeError, match="encode"):
        idempotently.Journal(path, codec=object())  # type: ignore[arg-type]
    bad_name = Reversing()
    bad_name.name = " spaced "
    with pytest.raises(ValueError, match="name"):
        idempotently.Journal(path, codec=bad_name)
    with pytest.raises(ValueError, match="does not give back"):
        idempotently.Journal(path, codec=Lossy())
    assert not path.exists()


def test_a_codec_that_fails_on_a_body_journals_and_sends_nothing(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """encode() raising for one body: CodecError naming the codec, not the body, and the
    operation id and key of the named call; nothing journaled or sent for it."""
    app, url = scripted
    journal = idempotently.Journal(tmp_path / "j.db", codec=FailsOnBigBodies())
    with idempotently.Session(journal, base_url=url) as session:
        with pytest.raises(idempotently.CodecError) as caught:
            session.post("/v1/charges", json={"card": CARD, "pad": "x" * 200}, operation_id="op")
        assert journal.operation("op") is None
    journal.close()
    assert CARD not in str(caught.value) and "fails-on-big-bodies" in str(caught.value)
    assert "nothing was journaled or sent" in str(caught.value)
    assert ("op", True) == (caught.value.operation_id, caught.value.key is not None)
    assert [] == app.arrivals


# -- the command line ----------------------------------------------------------------------------


def test_cli_show_needs_the_codec_and_never_prints_ciphertext(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """show without --codec: the operation without its bodies, saying why, exit 1, no
    Fernet token (gAAAAA...) printed; with --codec the clear body."""
    app, url = scripted
    lost_answer(journal_target, url, app)
    ciphertext = stored_column(journal_target, "op", "request_body")
    for args in (("show", "op"), ("show", "op", "--json")):
        without = run("--journal", journal_target, *args)
        assert 1 == without.exit_code, without.output
        assert "codec 'fernet'" in without.output
        assert ciphertext.decode() not in without.output and "gAAAAA" not in without.output
        assert CARD not in without.output
    shown = run("--journal", journal_target, "show", "op", "--codec", "tests.test_codec:CODEC")
    assert (0, True) == (shown.exit_code, CARD in shown.output), shown.output


def test_cli_resume_needs_the_codec(journal_target: str, scripted: tuple[ScriptedApp, str]) -> None:
    """resume without --codec sends nothing (not_sent, exit 1); with it, the clear bytes."""
    app, url = scripted
    lost_answer(journal_target, url, app)
    without = run("--journal", journal_target, "resume", "--json")
    assert (1, 1) == (without.exit_code, len(app.arrivals)), without.output
    assert "not_sent" == json.loads(without.stdout)[0]["action"]
    given = run("--journal", journal_target, "resume", "--codec", "tests.test_codec:CODEC")
    assert 0 == given.exit_code, given.output
    first, second = app.arrivals
    assert (first.key, first.body) == (second.key, second.body)


@pytest.mark.parametrize(
    "value",
    [
        "tests.test_codec",
        "tests.test_codec:NO_SUCH_CODEC",
        "no_such_module_for_idempotently:CODEC",
        "tests.test_codec:Lossy",
        ":CODEC",
    ],
)
def test_cli_a_bad_codec_is_a_usage_error(tmp_path: Path, value: str) -> None:
    """--codec that is not module:NAME, cannot be imported, or is no working codec: exit 2
    naming the option, before the journal is opened."""
    path = tmp_path / "j.db"
    idempotently.Journal(path).close()
    result = run("--journal", str(path), "show", "op", "--codec", value)
    assert (2, True) == (result.exit_code, "--codec" in result.output), result.output
    assert "Traceback" not in result.output


# -- a process killed mid-send ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["after_charge", "before_journal_update"])
def test_a_worker_killed_after_the_server_charged_is_resumed_once_with_the_codec(
    tmp_path: Path, phase: str
) -> None:
    """SIGKILLed after the server charged an encoded operation: a resume without the codec
    sends nothing; `resume --codec` sends it once (a replay); every order is charged once."""
    import signal

    from idempotently.testing import serve
    from tests.crash_child import USER, operation_id
    from tests.fixed_codec import CODEC as FIXED
    from tests.test_crash_safety import DOOMED, ORDERS, charge_args, run_worker

    journal = tmp_path / "journal.db"
    codec = ("--codec", "tests.fixed_codec:CODEC")
    child_codec = ("--codec", "fixed_codec:CODEC")  # the child runs with tests/ on its path
    with serve() as server:
        killed_args = ("--kill-at", phase, "--kill-on-order", str(DOOMED), *child_codec)
        code, killed = run_worker(tmp_path, *charge_args(journal, server.url, *killed_args))
        assert -signal.SIGKILL == code, killed.diagnosis()
        assert b'"order-' not in stored_bytes(str(journal))  # bodies encoded at rest
        requests = server.stats().requests
        without = run("--journal", str(journal), "resume", "--json")
        assert (1, requests) == (without.exit_code, server.stats().requests), without.output
        assert [operation_id(DOOMED)] == [r["operation_id"] for r in json.loads(without.stdout)]
        resumed = CliRunner().invoke(
            cli,
            [
                "--journal",
                str(journal),
                "resume",
                "--json",
                "--header-env",
                "Authorization=SHOP",
                *codec,
            ],
            env={"SHOP": f"Bearer {USER}"},
        )
        assert 0 == resumed.exit_code, resumed.output
        (result,) = json.loads(resumed.stdout)
        assert ("succeeded", True) == (result["action"], result["replayed"])
        code, rerun = run_worker(tmp_path, *charge_args(journal, server.url, *child_codec))
        assert 0 == code, rerun.diagnosis()
        assert {} == server.ledger.duplicates()
        assert {(USER, f"order-{i}"): 1 for i in range(ORDERS)} == server.charge_count_by_order()
        charges = {charge.order_id: charge for charge in server.charges()}
        with idempotently.Journal(journal, create=False, codec=FIXED) as journaled:
            assert {"succeeded": ORDERS} == {n: c for n, c in journaled.counts().items() if c}
            for i in range(ORDERS):
                operation = journaled.operation(operation_id(i))
                assert operation is not None and operation.response_body is not None
                assert charges[f"order-{i}"].key == operation.key
                assert charges[f"order-{i}"].id == json.loads(operation.response_body)["id"]


def test_a_transport_encodes_bodies_too(tmp_path: Path, scripted: tuple[ScriptedApp, str]) -> None:
    """Under an SDK's own client (Transport over Journal(codec=...)): encoded at rest, and a
    settled key answers from the journal with the clear answer."""
    import httpx

    app, url = scripted
    app.answer(Answer(201, body=ANSWER))
    path = str(tmp_path / "j.db")
    journal = idempotently.Journal(path, codec=CODEC)
    with httpx.Client(transport=idempotently.Transport(journal), base_url=url) as sdk:
        headers = {"Idempotency-Key": "sdk-key-1"}
        first = sdk.post("/v1/charges", json=charge(), headers=headers)
        again = sdk.post("/v1/charges", json=charge(), headers=headers)
    journal.close()
    assert (ANSWER, ANSWER, 1) == (first.content, again.content, len(app.arrivals))
    assert CARD.encode() not in stored_bytes(path) and b"Ada Lovelace" not in stored_bytes(path)


def test_a_watch_worker_resends_encoded_operations_only_with_the_codec(tmp_path: Path) -> None:
    """`resume --watch`'s worker claims encoded operations like any: without the codec it
    sends none of them (not_sent); with it, each one's clear bytes once."""
    import threading

    import httpx

    from tests.support import FakeTime
    from tests.test_watch import NOW, refuse, run_worker

    path = tmp_path / "journal.db"
    fake = FakeTime(now=NOW - 60)
    with idempotently.Session(
        idempotently.Journal(path, codec=CODEC, durability="os"),
        transport=httpx.MockTransport(refuse),
        policy=ONE_TRY,
        clock=fake.clock,
        sleep=fake.sleep,
    ) as session:
        for number in range(3):
            with pytest.raises(idempotently.IdempotentlyError):
                session.post(
                    "https://api.example.test/v1/charges",
                    json={**charge(), "n": number},
                    operation_id=f"op-{number}",
                )
    for codec, expected in ((None, "not_sent"), (CODEC, "succeeded")):
        sent: list[bytes] = []
        results: list[idempotently.ResumeResult] = []
        stop = threading.Event()

        def server(request: httpx.Request, sent: list[bytes] = sent) -> httpx.Response:
            sent.append(request.content)
            return httpx.Response(201)

        def on_batch(batch: Any, results: list[Any] = results, stop: Any = stop) -> None:
            stop.set()

        worker_time = FakeTime(now=NOW)
        with idempotently.Session(
            idempotently.Journal(path, codec=codec),
            host_id="worker-1",
            transport=httpx.MockTransport(server),
            policy=ONE_TRY,
            clock=worker_time.clock,
            sleep=worker_time.sleep,
        ) as worker:
            run_worker(worker, stop, on_batch=on_batch, results=results)
            worker.journal.close()
        assert {expected} == {result.action for result in results}
        assert 3 == len(results)
        if codec is None:
            assert [] == sent
        else:
            assert sorted(json.loads(body)["n"] for body in sent) == [0, 1, 2]
            assert all(CARD.encode() in body for body in sent)
