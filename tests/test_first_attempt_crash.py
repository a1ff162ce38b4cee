"""A first attempt cut off before its outcome was journaled may have been delivered.

The key is committed before the first byte can leave, so an operation with no
journaled attempt is one whose first send began and whose process died (issue
18 item 1): that send may have reached the server and charged. DESIGN §3.3:
a later final 4xx that is not the server's stored replay proves nothing about
it, so the operation stays pending or goes to needs_reconcile, never `failed`;
an at-most-once one is never sent again. The same holds for a resume, a second
call with the same operation id, the reconciler and `idempotently show`.

The journals are made for real: ``tests/dying_sender.py`` forks a process that
journals the operation and SIGKILLs itself inside its transport; the slow test
kills ``tests/crash_child.py`` workers at each step of the first attempt against
the mock server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from click.testing import CliRunner

import idempotently
from idempotently.cli import cli
from idempotently.testing import serve
from tests import scripted_server
from tests.crash_child import USER
from tests.dying_sender import BODY, URL
from tests.support import FakeTime, JsonLinesProcess, make_session
from tests.test_crash_safety import JOURNALED_PHASES, charge_args, run_worker, session

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="dying_sender.py forks")

OP = "order-7:charge"
REPO = Path(__file__).parent.parent
SENDER = Path(__file__).with_name("dying_sender.py")


@attrs.frozen
class FinalAnswer:
    """A final answer to the resend of an operation whose first attempt was cut off."""

    name: str
    status: int
    journaled: str
    """The operation's status afterwards, as DESIGN §3.3 says."""
    raised: type[idempotently.IdempotentlyError] | None
    """What a second call with the same operation id raises (None: it returns the answer)."""
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b'{"error": "no"}'

    def response(self, request: httpx.Request | None = None) -> httpx.Response:
        return httpx.Response(self.status, headers=self.headers, content=self.body)


PENDING = idempotently.OperationPendingError
RECONCILE = idempotently.NeedsReconcileError
FINAL_ANSWERS = [
    FinalAnswer("400 from a WAF", 400, "pending", PENDING),
    FinalAnswer("401, a token expired", 401, "pending", PENDING),
    FinalAnswer("404 from a proxy", 404, "pending", PENDING),
    FinalAnswer(
        "409 payload mismatch",
        409,
        "needs_reconcile",
        RECONCILE,
        body=b'{"error": "idempotency key mismatch: different payload"}',
    ),
    FinalAnswer("422", 422, "needs_reconcile", RECONCILE),
    # The server's stored answer for this key: its word on the first attempt too.
    FinalAnswer("replayed 400", 400, "failed", None, headers=(("Idempotent-Replayed", "true"),)),
]
answers = pytest.mark.parametrize("answer", FINAL_ANSWERS, ids=lambda answer: answer.name)


class DyingSender(JsonLinesProcess):
    """``tests/dying_sender.py``: makes journals whose operation died in its first send."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SENDER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        self._start_reading("dying_sender.py")

    def kill_first_send(self, journal: Path, delivery: str, now: float) -> None:
        order = {"journal": str(journal), "operation_id": OP, "delivery": delivery, "now": now}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(order) + "\n")
        self.proc.stdin.flush()
        event = self.next_event()
        assert {"event": "killed", "signal": signal.SIGKILL} == event

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=self.wait)


@pytest.fixture(scope="module")
def _sender() -> Iterator[DyingSender]:
    sender = DyingSender()
    try:
        yield sender
    finally:
        sender.close()


KillFirstSend = Callable[..., Path]


@pytest.fixture
def kill_first_send(_sender: DyingSender, tmp_path: Path, fake_time: FakeTime) -> KillFirstSend:
    """Journal OP at ``fake_time.now`` in a process SIGKILLed during its first send; the
    journal's path. The operation is pending, with no attempt and the dead process's lease."""

    def kill(delivery: str = "exactly_once") -> Path:
        path = tmp_path / "journal.db"
        _sender.kill_first_send(path, delivery, fake_time.now)
        with idempotently.Journal(path, create=False) as journal:
            operation = journal.operation(OP)
        assert operation is not None
        assert ("pending", 0, ()) == (
            operation.status,
            operation.attempt_count,
            operation.attempts,
        )
        assert operation.lease_owner is not None
        return path

    return kill


def answering(answer: FinalAnswer, sent: list[httpx.Request] | None = None) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        if sent is not None:
            sent.append(request)
        return answer.response()

    return httpx.MockTransport(handler)


def status_of(path: Path) -> str | None:
    with idempotently.Journal(path, create=False) as journal:
        operation = journal.operation(OP)
    return None if operation is None else operation.status


def second_call_outcome(call: Callable[[], httpx.Response]) -> tuple[Any, int]:
    """What a second call raised (None if it returned) and the status of the answer."""
    try:
        response = call()
    except idempotently.IdempotentlyError as error:
        assert error.response is not None
        return type(error), error.response.status_code
    return None, response.status_code


# -- resume and a second call, sync ---------------------------------------------------------


@answers
def test_a_resume_after_a_killed_first_attempt_writes_failed_only_for_a_replay(
    kill_first_send: KillFirstSend, tmp_path: Path, fake_time: FakeTime, answer: FinalAnswer
) -> None:
    """Resumed after a SIGKILL in its first send, a final 4xx leaves the operation pending
    or needs_reconcile; only the server's replayed answer makes it failed."""
    path = kill_first_send()
    with make_session(tmp_path, fake_time, transport=answering(answer)) as s:
        results = s.resume()
    assert [(answer.journaled, answer.status)] == [(r.status, r.status_code) for r in results]
    assert answer.journaled == status_of(path)


@answers
def test_a_second_call_after_a_killed_first_attempt_writes_failed_only_for_a_replay(
    kill_first_send: KillFirstSend, tmp_path: Path, fake_time: FakeTime, answer: FinalAnswer
) -> None:
    """Called again with the same operation id after a SIGKILL in its first send: a final
    4xx raises (pending or needs_reconcile) unless it is the server's replay."""
    path = kill_first_send()
    with make_session(tmp_path, fake_time, transport=answering(answer)) as s:
        outcome = second_call_outcome(lambda: s.post(URL, json=BODY, operation_id=OP))
    assert (answer.raised, answer.status) == outcome
    assert answer.journaled == status_of(path)


def test_a_call_interrupted_before_its_first_attempt_was_journaled_is_not_failed_by_a_400(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A call stopped after its key commit with nothing journaled of its send (a hook's
    KeyboardInterrupt, the lease released): the next call's 400 leaves it pending."""

    def interrupt(event: idempotently.Event) -> None:
        if isinstance(event, idempotently.OperationStarted):
            raise KeyboardInterrupt

    with (
        make_session(tmp_path, fake_time, hooks=[interrupt]) as s,
        pytest.raises(KeyboardInterrupt),
    ):
        s.post(URL, json=BODY, operation_id=OP)
    bad_request = FINAL_ANSWERS[0]
    with make_session(tmp_path, fake_time, transport=answering(bad_request)) as s:
        outcome = second_call_outcome(lambda: s.post(URL, json=BODY, operation_id=OP))
    assert (PENDING, 400) == outcome
    assert "pending" == status_of(tmp_path / "journal.db")


# -- asyncio and trio ------------------------------------------------------------------------


def async_session(path: Path, fake_time: FakeTime, **options: Any) -> idempotently.AsyncSession:
    return idempotently.AsyncSession(
        path,
        clock=fake_time.clock,
        sleep=fake_time.async_sleep,
        headers={"Authorization": "Bearer sk_test"},
        **options,
    )


@pytest.mark.anyio
@answers
async def test_async_resume_after_a_killed_first_attempt_writes_failed_only_for_a_replay(
    kill_first_send: KillFirstSend, fake_time: FakeTime, answer: FinalAnswer
) -> None:
    """AsyncSession.resume (asyncio and trio) after a SIGKILL in the first send: a final
    4xx is failed only when replayed."""
    path = kill_first_send()
    async with async_session(path, fake_time, transport=answering(answer)) as s:
        results = await s.resume()
    assert [(answer.journaled, answer.status)] == [(r.status, r.status_code) for r in results]
    assert answer.journaled == status_of(path)


@pytest.mark.anyio
@answers
async def test_async_second_call_after_a_killed_first_attempt_writes_failed_only_for_a_replay(
    kill_first_send: KillFirstSend, fake_time: FakeTime, answer: FinalAnswer
) -> None:
    """AsyncSession (asyncio and trio) called again after a SIGKILL in the first send: a
    final 4xx raises unless it is the server's replay."""
    path = kill_first_send()
    async with async_session(path, fake_time, transport=answering(answer)) as s:
        try:
            response = await s.post(URL, json=BODY, operation_id=OP)
            outcome: tuple[Any, int] = (None, response.status_code)
        except idempotently.IdempotentlyError as error:
            assert error.response is not None
            outcome = (type(error), error.response.status_code)
    assert (answer.raised, answer.status) == outcome
    assert answer.journaled == status_of(path)


# -- the reconciler --------------------------------------------------------------------------

MISMATCH = FINAL_ANSWERS[3]


def test_a_mismatch_after_a_killed_first_attempt_goes_to_the_reconciler(
    kill_first_send: KillFirstSend, tmp_path: Path, fake_time: FakeTime
) -> None:
    """A payload mismatch answered to the resend of a killed first attempt is the
    reconciler's to settle (it looks the charge up), not failed by the resume."""
    path = kill_first_send()
    asked: list[str] = []

    def reconciler(
        operation: idempotently.Operation, client: httpx.Client
    ) -> idempotently.Settlement:
        asked.append(operation.operation_id)
        return idempotently.Settlement("succeeded", "found the charge")

    with make_session(tmp_path, fake_time, transport=answering(MISMATCH)) as s:
        results = s.resume(reconciler=reconciler)
    assert [OP] == asked
    assert [("succeeded", "reconciled")] == [(r.status, r.action) for r in results]
    assert "succeeded" == status_of(path)


@pytest.mark.anyio
async def test_async_a_mismatch_after_a_killed_first_attempt_goes_to_the_reconciler(
    kill_first_send: KillFirstSend, fake_time: FakeTime
) -> None:
    """AsyncSession.resume (asyncio and trio) hands the mismatch to its reconciler too."""
    path = kill_first_send()
    asked: list[str] = []

    async def reconciler(
        operation: idempotently.Operation, client: httpx.AsyncClient
    ) -> idempotently.Settlement:
        asked.append(operation.operation_id)
        return idempotently.Settlement("succeeded", "found the charge")

    async with async_session(path, fake_time, transport=answering(MISMATCH)) as s:
        results = await s.resume(reconciler=reconciler)
    assert [OP] == asked
    assert [("succeeded", "reconciled")] == [(r.status, r.action) for r in results]


# -- at most once ----------------------------------------------------------------------------

NO_RECORD = "its first attempt left no record, so it may have been sent"


def interrupted_before_its_first_attempt(path: Path, fake_time: FakeTime) -> Path:
    """An at-most-once OP whose call was stopped after its key commit, its lease released."""

    def interrupt(event: idempotently.Event) -> None:
        if isinstance(event, idempotently.OperationStarted):
            raise KeyboardInterrupt

    with (
        idempotently.Session(path, clock=fake_time.clock, hooks=[interrupt]) as s,
        pytest.raises(KeyboardInterrupt),
    ):
        s.post(URL, json=BODY, operation_id=OP, delivery="at_most_once")
    return path


@pytest.mark.parametrize("picked_up_by", ["a second call", "resume"])
@pytest.mark.parametrize("cut_off", ["killed", "interrupted"])
def test_an_at_most_once_operation_without_a_journaled_attempt_is_abandoned_unsent(
    kill_first_send: KillFirstSend,
    tmp_path: Path,
    fake_time: FakeTime,
    cut_off: str,
    picked_up_by: str,
) -> None:
    """At most once, its first attempt cut off before it was journaled (SIGKILLed, or
    interrupted with its lease released): a second call or a resume abandons it, saying
    why, and sends nothing."""
    if cut_off == "killed":
        kill_first_send("at_most_once")
    else:
        interrupted_before_its_first_attempt(tmp_path / "journal.db", fake_time)
    sent: list[httpx.Request] = []
    with make_session(tmp_path, fake_time, transport=answering(FINAL_ANSWERS[0], sent)) as s:
        if picked_up_by == "resume":
            [result] = s.resume()
            said = result.detail
        else:
            with pytest.raises(idempotently.OperationAbandonedError) as caught:
                s.post(URL, json=BODY, operation_id=OP, delivery="at_most_once")
            said = str(caught.value)
        operation = s.journal.operation(OP)
    assert [] == sent
    assert NO_RECORD in said
    assert operation is not None and operation.reason is not None
    assert ("abandoned", True) == (operation.status, NO_RECORD in operation.reason)


@pytest.mark.anyio
async def test_async_resume_abandons_an_at_most_once_operation_killed_in_its_first_send(
    kill_first_send: KillFirstSend, fake_time: FakeTime
) -> None:
    """AsyncSession.resume (asyncio and trio) abandons an at-most-once operation killed in
    its first send, saying why, and sends nothing."""
    path = kill_first_send("at_most_once")
    sent: list[httpx.Request] = []
    async with async_session(path, fake_time, transport=answering(FINAL_ANSWERS[0], sent)) as s:
        results = await s.resume()
    assert [] == sent
    assert [("abandoned", True)] == [(r.status, NO_RECORD in r.detail) for r in results]


# -- the command line ------------------------------------------------------------------------


def test_show_says_an_operation_without_attempts_may_have_been_delivered(
    kill_first_send: KillFirstSend,
) -> None:
    """`show` of an operation killed in its first send says it may have been delivered,
    in text and in JSON, instead of showing it as not sent yet."""
    path = kill_first_send()
    runner = CliRunner()
    text = runner.invoke(cli, ["--journal", os.fspath(path), "show", OP])
    shown = runner.invoke(cli, ["--journal", os.fspath(path), "show", OP, "--json"])
    assert (0, 0) == (text.exit_code, shown.exit_code)
    assert "may have been delivered" in text.stdout
    assert (True, []) == (
        json.loads(shown.stdout)["may_have_been_delivered"],
        json.loads(shown.stdout)["history"],
    )


# -- real processes: a SIGKILL at each step of the first attempt ------------------------------


def scripted_answer(answer: FinalAnswer) -> scripted_server.Answer:
    return scripted_server.Answer(status=answer.status, headers=answer.headers, body=answer.body)


@pytest.mark.slow
@pytest.mark.parametrize("phase", JOURNALED_PHASES)
def test_a_worker_killed_in_its_first_attempt_is_never_failed_by_a_final_4xx(
    tmp_path: Path, scripted: tuple[scripted_server.ScriptedApp, str], phase: str
) -> None:
    """Workers SIGKILLed at one step of their first attempt (before the send, after the
    server charged, before the answer was journaled), then resumed against a server
    answering each final 4xx: failed only for the replay; resumed again against the real
    server, each order is charged at most once, and once if it was still pending."""
    journal = tmp_path / "journal.db"
    app, scripted_url = scripted
    with serve() as server:
        # One worker per order, each killed in its order's first attempt.
        for order in range(len(FINAL_ANSWERS)):
            code, killed = run_worker(
                tmp_path,
                *charge_args(journal, server.url, "--first", str(order), orders=order + 1),
                "--kill-at",
                phase,
                "--kill-on-order",
                str(order),
            )
            assert -signal.SIGKILL == code, killed.diagnosis()
        with idempotently.Journal(journal, create=False) as journaled:
            queue = journaled.operations(status="pending", newest_first=False)
        # Resume sends them oldest first: the scripted server answers each its own way.
        answer_of = {
            operation.operation_id: answer
            for operation, answer in zip(queue, FINAL_ANSWERS, strict=True)
        }
        app.answer(*(scripted_answer(answer) for answer in answer_of.values()))
        with session(journal, scripted_url) as resumer:
            results = resumer.resume(base_url=scripted_url)
        assert [(op, answer.journaled) for op, answer in answer_of.items()] == [
            (result.operation_id, result.status) for result in results
        ]

        with session(journal, server.url) as resumer:
            resumer.resume(base_url=server.url)
        charged = server.charge_count_by_order()
        assert {} == server.ledger.duplicates()
        with idempotently.Journal(journal, create=False) as journaled:
            for op, answer in answer_of.items():
                operation = journaled.operation(op)
                assert operation is not None
                count = charged.get((USER, op.removesuffix(":charge")), 0)
                if answer.journaled == "pending":
                    # Kept with its key, it is resent and charged exactly once.
                    assert ("succeeded", 1) == (operation.status, count)
                else:
                    # Not resent: charged only if the killed attempt had reached the server.
                    charged_before = phase != "before_send"
                    assert (answer.journaled, int(charged_before)) == (operation.status, count)
