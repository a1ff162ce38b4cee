"""ServerProfile(classify=fn): a user's classifier on (status, headers, body).

For servers that say "try again" in a 200 or "in progress" in a 202. Whatever it
says, an answer after an attempt that may have been delivered is never ``failed``
(the promise that nothing happened); a classifier that raises leaves the
operation pending with its answer journaled.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import httpx
import pytest

import idempotently
from idempotently import profiles
from tests.scripted_server import Answer as ScriptedAnswer
from tests.scripted_server import ScriptedApp
from tests.support import FakeTime

URL = "https://api.example.test/v1/charges"
POLICY = idempotently.RetryPolicy(initial_backoff=0.1, max_backoff=0.1, budget=None)


def body_status(status: int, headers: httpx.Headers, body: bytes) -> str | None:
    """Reads ``{"state": ...}`` bodies: try_again, processing, final, reused."""
    try:
        state = json.loads(body).get("state")
    except (ValueError, AttributeError):
        return None
    return {
        "try_again": "retry",
        "processing": "in_progress",
        "final": "final",
        "reused": "mismatch",
    }.get(state)


def broken(status: int, headers: httpx.Headers, body: bytes) -> str | None:
    raise RuntimeError("classifier bug")


def nonsense(status: int, headers: httpx.Headers, body: bytes) -> str | None:
    return "maybe"


CLASSIFIED = attrs.evolve(profiles.GENERIC, name="classified", classify=body_status)


def server(*steps: tuple[int, str | None] | type[httpx.TransportError]) -> httpx.MockTransport:
    queue = list(steps)

    def handler(request: httpx.Request) -> httpx.Response:
        step = queue.pop(0)
        if isinstance(step, type):
            raise step("scripted", request=request)
        status, state = step
        return httpx.Response(status, json={} if state is None else {"state": state})

    return httpx.MockTransport(handler)


def session(
    tmp_path: Path,
    fake_time: FakeTime,
    transport: httpx.MockTransport,
    profile: idempotently.ServerProfile = CLASSIFIED,
) -> idempotently.Session:
    return idempotently.Session(
        tmp_path / "journal.db",
        transport=transport,
        profile=profile,
        policy=POLICY,
        clock=fake_time.clock,
        sleep=fake_time.sleep,
    )


def test_a_200_that_says_try_again_is_retried(tmp_path: Path, fake_time: FakeTime) -> None:
    """ "retry" on a 200 sends the same key again; the next plain 200 settles it."""
    transport = server((200, "try_again"), (201, None))
    with session(tmp_path, fake_time, transport) as s:
        response = s.post(URL, json={}, operation_id="op")
        operation = s.journal.operation("op")
    assert 201 == response.status_code
    assert ("succeeded", [200, 201]) == (
        operation.status,
        [attempt.status_code for attempt in operation.attempts],
    )


def test_a_202_in_progress_is_waited_through_then_left_pending(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """ "in_progress" on a 202 counts against in_progress_retries, then stays pending."""
    transport = server(*[(202, "processing")] * 5)
    with session(tmp_path, fake_time, transport) as s:
        with pytest.raises(idempotently.OperationPendingError, match="in progress"):
            s.post(URL, json={}, operation_id="op")
        operation = s.journal.operation("op")
    assert "pending" == operation.status
    assert POLICY.in_progress_retries + 1 == len(operation.attempts)


def test_final_on_a_first_attempt_4xx_settles_it(tmp_path: Path, fake_time: FakeTime) -> None:
    """ "final" on a 400 answered to the first attempt: the server's only word, failed."""
    transport = server((400, "final"))
    with session(tmp_path, fake_time, transport) as s:
        assert 400 == s.post(URL, json={}, operation_id="op").status_code
        assert "failed" == s.journal.operation("op").status


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_final_on_a_5xx_needs_reconciling_never_failed(
    tmp_path: Path, fake_time: FakeTime, status: int
) -> None:
    """ "final" on a 5xx, even the first attempt's: the handler may have acted (a function
    behind API Gateway that charged, then raised, answers 502), so the operation goes to
    needs_reconcile, not failed, and is not sent again."""
    transport = server((status, "final"), (201, None))
    with session(tmp_path, fake_time, transport) as s:
        with pytest.raises(idempotently.NeedsReconcileError, match="may have acted"):
            s.post(URL, json={}, operation_id="op")
        operation = s.journal.operation("op")
    assert ("needs_reconcile", [status]) == (
        operation.status,
        [attempt.status_code for attempt in operation.attempts],
    )


def test_final_on_a_5xx_from_a_real_server_that_charged(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """Against a loopback server that charged and answered 502 {"state": "final"}: one
    charge, needs_reconcile, a resume sends nothing more."""
    app, url = scripted
    app.answer(ScriptedAnswer(502, body=b'{"state": "final"}'))
    with idempotently.Session(
        tmp_path / "journal.db", base_url=url, profile=CLASSIFIED, policy=POLICY
    ) as s:
        with pytest.raises(idempotently.NeedsReconcileError):
            s.post("/v1/charges", json={}, operation_id="op")
        s.resume()
        assert "needs_reconcile" == s.journal.operation("op").status
    assert 1 == len(app.arrivals)


def test_a_replayed_4xx_called_final_after_a_maybe_delivered_attempt_stays_pending(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A read timeout, then a 400 marked replayed that the classifier calls final: a
    classifier's "final" is failed only when nothing may have been delivered, so the
    operation stays pending with its key."""
    answers: list[type[httpx.TransportError] | httpx.Response] = [
        httpx.ReadTimeout,
        httpx.Response(400, headers={"Idempotent-Replayed": "true"}, json={"state": "final"}),
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        answer = answers.pop(0)
        if isinstance(answer, httpx.Response):
            return answer
        raise answer("scripted", request=request)

    with session(tmp_path, fake_time, httpx.MockTransport(handler)) as s:
        with pytest.raises(idempotently.IdempotentlyError):
            s.post(URL, json={}, operation_id="op")
        assert "pending" == s.journal.operation("op").status


def test_final_after_only_not_acted_answers_is_failed(tmp_path: Path, fake_time: FakeTime) -> None:
    """A 429 (the server did not act), then a 400 called final: nothing may have been
    delivered before it, so the 400 is the server's first word on the charge: failed."""
    transport = server((429, None), (400, "final"))
    with session(tmp_path, fake_time, transport) as s:
        assert 400 == s.post(URL, json={}, operation_id="op").status_code
        operation = s.journal.operation("op")
    assert ("failed", [429, 400]) == (
        operation.status,
        [attempt.status_code for attempt in operation.attempts],
    )


def test_a_resume_that_meets_final_on_a_4xx_keeps_the_operation_pending(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """An operation left pending by a read timeout (maybe delivered); its resume meets a
    400 called final: it says nothing about the first attempt, so it stays pending."""
    with session(tmp_path, fake_time, server(httpx.ReadTimeout)) as s:
        s._engine.policy = attrs.evolve(POLICY, max_attempts=1)
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={}, operation_id="op")
    with session(tmp_path, fake_time, server((400, "final"))) as s:
        [result] = s.resume()
    assert ("unresolved", "pending") == (result.action, result.status)


@pytest.mark.parametrize(("state", "status"), [("final", "pending"), ("reused", "needs_reconcile")])
def test_no_verdict_makes_an_answer_after_a_maybe_delivered_attempt_failed(
    tmp_path: Path, fake_time: FakeTime, state: str, status: str
) -> None:
    """A read timeout (maybe delivered), then a 400 the classifier calls final or a
    mismatch: the first attempt may have charged, so the operation is not failed."""
    transport = server(httpx.ReadTimeout, (400, state))
    with session(tmp_path, fake_time, transport) as s:
        with pytest.raises(idempotently.IdempotentlyError):
            s.post(URL, json={}, operation_id="op")
        assert status == s.journal.operation("op").status


def test_a_mismatch_on_a_first_attempt_fails(tmp_path: Path, fake_time: FakeTime) -> None:
    """ "mismatch" on the first answer: the server refused the payload, nothing happened."""
    transport = server((400, "reused"))
    with session(tmp_path, fake_time, transport) as s:
        assert 400 == s.post(URL, json={}, operation_id="op").status_code
        assert "failed" == s.journal.operation("op").status


@pytest.mark.parametrize("status", [500, 502])
def test_a_mismatch_on_a_5xx_needs_reconciling_never_failed(
    tmp_path: Path, fake_time: FakeTime, status: int
) -> None:
    """ "mismatch" on a 5xx, even the first attempt's: a server error may have acted, so a
    classifier's word cannot make it `failed` (the promise that nothing happened); it
    goes to needs_reconcile and is not sent again (before: failed, as "final" was)."""
    transport = server((status, "reused"), (201, None))
    with session(tmp_path, fake_time, transport) as s:
        with pytest.raises(idempotently.NeedsReconcileError):
            s.post(URL, json={}, operation_id="op")
        operation = s.journal.operation("op")
    assert ("needs_reconcile", [status]) == (
        operation.status,
        [attempt.status_code for attempt in operation.attempts],
    )


def test_none_leaves_the_built_in_table(tmp_path: Path, fake_time: FakeTime) -> None:
    """No verdict: a 503 is retried and a 200 succeeds, as without a classifier."""
    transport = server((503, None), (200, None))
    with session(tmp_path, fake_time, transport) as s:
        assert 200 == s.post(URL, json={}, operation_id="op").status_code


@pytest.mark.parametrize(
    ("classifier", "says"), [(broken, "raised RuntimeError: classifier bug"), (nonsense, "'maybe'")]
)
def test_a_classifier_that_fails_leaves_the_operation_pending(
    tmp_path: Path, fake_time: FakeTime, classifier: object, says: str
) -> None:
    """A classifier that raises or answers nonsense: a clear error naming it; the answer
    is journaled, the operation pending (nothing lost, no raw traceback)."""
    profile = attrs.evolve(profiles.GENERIC, name="flawed", classify=classifier)
    transport = server((201, None))
    with session(tmp_path, fake_time, transport, profile) as s:
        with pytest.raises(idempotently.OperationPendingError) as raised:
            s.post(URL, json={}, operation_id="op")
        operation = s.journal.operation("op")
    assert says in str(raised.value)
    assert classifier.__qualname__ in str(raised.value)  # type: ignore[attr-defined]
    assert ("op", operation.key) == (raised.value.operation_id, raised.value.key)
    assert ("pending", [201]) == (
        operation.status,
        [attempt.status_code for attempt in operation.attempts],
    )


def test_resume_reads_answers_with_the_journaled_classifier(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """The classifier is journaled as module:qualname: a resume by a session with the
    generic profile still retries a 200 that says try again."""
    with session(tmp_path, fake_time, server(httpx.ConnectError)) as s:
        s._engine.policy = attrs.evolve(POLICY, max_attempts=1)
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={}, operation_id="op")
        assert "tests.test_classify:body_status" in s.journal.operation("op").profile
    transport = server((200, "try_again"), (201, None))
    with session(tmp_path, fake_time, transport, profiles.GENERIC) as s:
        [result] = s.resume()
    assert ("succeeded", 201) == (result.action, result.status_code)


def test_a_classifier_resume_cannot_import_is_refused_up_front(tmp_path: Path) -> None:
    """A lambda cannot be journaled by name: a ValueError naming classify, before anything."""
    profile = attrs.evolve(profiles.GENERIC, name="inline", classify=lambda *a: None)
    with pytest.raises(ValueError, match="classify"):
        idempotently.Session(tmp_path / "journal.db", profile=profile)
    assert not (tmp_path / "journal.db").exists()


def test_a_classifier_must_be_callable() -> None:
    """classify= takes a function or None."""
    with pytest.raises(TypeError):
        attrs.evolve(profiles.GENERIC, classify="retry")
