"""Outcomes a user can trust: `failed` only when the journal proves nothing happened."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import respx
from click.testing import CliRunner

import idempotently
from idempotently.cli import cli
from tests.scripted_server import Answer, ScriptedApp
from tests.support import URL, FakeTime, make_session

ONE_TRY = idempotently.RetryPolicy(max_attempts=1)


def leave_pending(path: Path, **options: object) -> None:
    """Journal operation "op" and leave it pending (its only attempt lost or refused)."""
    with (
        idempotently.Session(path, policy=ONE_TRY, **options) as session,  # type: ignore[arg-type]
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post("/v1/charges" if "base_url" in options else URL, json={}, operation_id="op")


def status_of(session: idempotently.Session, operation_id: str) -> str:
    operation = session.journal.operation(operation_id)
    assert operation is not None
    return operation.status


@pytest.mark.parametrize("status", [400, 401, 403, 404])
def test_a_final_4xx_after_a_maybe_delivered_attempt_leaves_it_pending(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter, status: int
) -> None:
    """Reset after sending, then a 401/404/400: raised with the answer, pending, never failed."""
    router.post(URL).mock(side_effect=[httpx.ReadError("reset"), httpx.Response(status)])
    with make_session(tmp_path, fake_time) as s:
        with pytest.raises(idempotently.OperationPendingError) as caught:
            s.post(URL, json={"amount": 1}, operation_id="op")
        assert "pending" == status_of(s, "op")
    assert caught.value.response is not None
    assert status == caught.value.response.status_code
    assert "may have been delivered" in str(caught.value)


def test_an_unresolved_operation_continues_with_its_key_once_fixed(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """After the 401 that followed a lost answer, the same call later gets the server's replay."""
    route = router.post(URL).mock(
        side_effect=[
            httpx.ReadError("reset"),
            httpx.Response(401),
            httpx.Response(201, headers={"Idempotent-Replayed": "true"}),
        ]
    )
    with make_session(tmp_path, fake_time) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={"amount": 1}, operation_id="op")
        response = s.post(URL, json={"amount": 1}, operation_id="op")
        assert "succeeded" == status_of(s, "op")
    assert 201 == response.status_code
    assert 1 == len({call.request.headers["idempotency-key"] for call in route.calls})


def test_a_final_4xx_after_a_503_is_not_failed(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A 503 may come after the handler acted: a following 404 proves nothing."""
    router.post(URL).mock(side_effect=[httpx.Response(503), httpx.Response(404)])
    with make_session(tmp_path, fake_time) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={}, operation_id="op")
        assert "pending" == status_of(s, "op")


@pytest.mark.parametrize("first", [httpx.ConnectError("refused"), httpx.Response(429)])
def test_a_final_4xx_after_attempts_that_never_acted_is_failed(
    tmp_path: Path,
    fake_time: FakeTime,
    router: respx.MockRouter,
    first: httpx.Response | Exception,
) -> None:
    """After a connect error or a 429 (nothing acted), a 400 is the server's first word: failed."""
    router.post(URL).mock(side_effect=[first, httpx.Response(400)])
    with make_session(tmp_path, fake_time) as s:
        assert 400 == s.post(URL, json={}, operation_id="op").status_code
        assert "failed" == status_of(s, "op")


def test_a_replayed_4xx_after_a_maybe_delivered_attempt_is_failed(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """The server's stored 4xx for this key is its answer to every attempt: failed."""
    router.post(URL).mock(
        side_effect=[
            httpx.ReadError("reset"),
            httpx.Response(400, headers={"Idempotent-Replayed": "true"}),
        ]
    )
    with make_session(tmp_path, fake_time) as s:
        assert 400 == s.post(URL, json={}, operation_id="op").status_code
        assert "failed" == status_of(s, "op")


def test_a_mismatch_after_a_maybe_delivered_attempt_needs_reconcile(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """'Key used with another payload' after a lost answer: something ran under this key."""
    router.post(URL).mock(side_effect=[httpx.ReadError("reset"), httpx.Response(422)])
    with make_session(tmp_path, fake_time) as s:
        with pytest.raises(idempotently.NeedsReconcileError):
            s.post(URL, json={}, operation_id="op")
        assert "needs_reconcile" == status_of(s, "op")


def test_resume_without_credentials_keeps_the_operation(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """A resume whose credentials the server refuses leaves the operation as it was."""
    router.post(URL).mock(side_effect=httpx.ConnectError("down"))
    leave_pending(tmp_path / "journal.db", clock=fake_time.clock, sleep=fake_time.sleep)
    router.post(URL).mock(return_value=httpx.Response(401))
    with make_session(tmp_path, fake_time, headers={}) as anonymous:
        results = anonymous.resume()
        assert "pending" == status_of(anonymous, "op")
    assert [("pending", "unresolved", 401)] == [
        (r.status, r.action, r.status_code) for r in results
    ]


def test_resume_to_a_base_url_it_cannot_send_to_changes_nothing(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """resume(base_url='ftp://…') is refused before anything is sent; it stays pending."""
    router.post(URL).mock(side_effect=httpx.ReadError("reset"))
    leave_pending(tmp_path / "journal.db", clock=fake_time.clock, sleep=fake_time.sleep)
    with make_session(tmp_path, fake_time) as s:
        with pytest.raises(ValueError, match="base_url"):
            s.resume(base_url="ftp://elsewhere")
        assert "pending" == status_of(s, "op")


def test_resume_that_cannot_send_keeps_the_state_and_the_secret(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """An illegal credential header (a trailing newline) is not sent: not_sent, still pending,
    and the token is in neither the result nor the journal."""
    app, url = scripted
    app.answer(Answer(reset=True))
    path = tmp_path / "journal.db"
    leave_pending(path, base_url=url)
    token = "sk_live_0123456789abcdef"
    with idempotently.Session(path, headers={"Authorization": f"Bearer {token}\n"}) as s:
        results = s.resume()
        assert "pending" == status_of(s, "op")
    assert [("pending", "not_sent")] == [(r.status, r.action) for r in results]
    assert token not in results[0].detail
    assert 1 == len(app.arrivals)
    for file in path.parent.iterdir():
        assert token.encode() not in file.read_bytes()


def test_a_live_call_with_an_illegal_header_raises_without_the_secret(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """httpx quotes an illegal header value; the error we raise never shows the token."""
    _, url = scripted
    token = "sk_live_fedcba9876543210"
    with idempotently.Session(
        tmp_path / "journal.db", base_url=url, headers={"Authorization": f"Bearer {token} "}
    ) as s:
        with pytest.raises(idempotently.RequestNotSentError) as caught:
            s.post("/v1/charges", json={}, operation_id="op")
        assert "failed" == status_of(s, "op")  # nothing had ever been sent
    assert token not in str(caught.value)
    assert caught.value.__cause__ is None
    assert ("op", caught.value.key) == (caught.value.operation_id, caught.value.key)


def test_cli_resume_exits_1_when_the_server_refuses_its_credentials(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """`idempotently resume` without --header-env meets a 401: exit 1, the operation pending."""
    app, url = scripted
    app.answer(Answer(reset=True))
    path = tmp_path / "journal.db"
    leave_pending(path, base_url=url)
    app.answer(Answer(status=401, body=b'{"error": "no token"}'))
    result = CliRunner().invoke(cli, ["--journal", os.fspath(path), "resume"])
    assert 1 == result.exit_code
    assert "unresolved" in result.stdout
    with idempotently.Journal(path) as journal:
        operation = journal.operation("op")
    assert operation is not None and "pending" == operation.status


def test_a_send_interrupted_in_flight_counts_as_maybe_delivered(
    tmp_path: Path, fake_time: FakeTime
) -> None:
    """A call interrupted mid-send (Ctrl-C) journals a maybe-delivered attempt: a later 401
    then proves nothing, so the operation stays pending instead of failed."""
    answers: list[BaseException | httpx.Response] = [KeyboardInterrupt(), httpx.Response(401)]

    def server(request: httpx.Request) -> httpx.Response:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    with make_session(tmp_path, fake_time, transport=httpx.MockTransport(server)) as s:
        with pytest.raises(KeyboardInterrupt):
            s.post(URL, json={}, operation_id="op")
        interrupted = s.journal.operation("op")
        with pytest.raises(idempotently.OperationPendingError):
            s.post(URL, json={}, operation_id="op")
        assert "pending" == status_of(s, "op")
    assert interrupted is not None
    assert [("maybe_delivered", None)] == [
        (attempt.outcome, interrupted.lease_owner) for attempt in interrupted.attempts
    ]


def test_cli_resume_reads_answers_with_a_profile_of_your_own(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`resume --profile module:NAME` reads an operation journaled under that profile with
    it: here a server that does not store 5xx, so its 500 goes to reconciliation, unsent
    again."""
    app, url = scripted
    (tmp_path / "my_profiles.py").write_text(
        "import attrs\n"
        "from idempotently import profiles\n"
        "STINGY = attrs.evolve(profiles.GENERIC, name='stingy', stores_server_errors=False)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_profiles  # type: ignore[import-not-found]

    app.answer(Answer(reset=True))
    path = tmp_path / "journal.db"
    leave_pending(path, base_url=url, profile=my_profiles.STINGY)
    app.answer(Answer(status=500, body=b'{"error": "boom"}'))
    result = CliRunner().invoke(
        cli, ["--journal", os.fspath(path), "resume", "--profile", "my_profiles:STINGY"]
    )
    assert 1 == result.exit_code
    assert "needs_reconcile" in result.stdout
    assert 2 == len(app.arrivals)  # the lost first attempt, and one resend
