"""`idempotently reconcile --lookup` and `resume --reconcile-lookup` (with and without
--watch) against a real loopback mock server: exit codes, the summary, credentials from
the environment only, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import idempotently
from idempotently import Journal, Lookup
from idempotently.cli import cli
from idempotently.testing import MockServer
from tests.scripted_server import Answer, ScriptedApp
from tests.test_lookup import CARRYING, charged_but_unsettled
from tests.test_operator_actions import make

TOKEN = "sekrit_tok"
PARAM = "metadata[operation_id]={operation_id}"


def run(journal: str, *args: str, token: str | None = TOKEN) -> Result:
    env = {"LOOKUP_TOKEN": f"Bearer {token}"} if token else {}
    return CliRunner().invoke(cli, ["--journal", journal, *args], env=env, catch_exceptions=False)


def unsettled(journal: str, server: MockServer, *names: str) -> None:
    with idempotently.Session(
        journal,
        base_url=server.url,
        headers={"Authorization": f"Bearer {TOKEN}"},
        profile=CARRYING,
        sleep=lambda seconds: None,
    ) as session:
        for name in names:
            charged_but_unsettled(session, server, name)


def test_reconcile_settles_everything_and_exits_0(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    """Every operation found: exit 0, one line per operation and a summary; the lookup's
    credential came from the environment and is nowhere in the journal."""
    server = idempotently_mock_server
    unsettled(journal_target, server, "order-1", "order-2")
    result = run(
        journal_target,
        "reconcile",
        "--lookup",
        "/v1/charges",
        "--param",
        PARAM,
        "--header-env",
        "Authorization=LOOKUP_TOKEN",
    )
    assert 0 == result.exit_code, result.output
    assert "looked up 2 operations: 2 reconciled" in result.output
    with Journal(journal_target) as journal:
        assert {"succeeded": 2} == {k: v for k, v in journal.counts().items() if v}
        for name in ("order-1", "order-2"):
            assert all(TOKEN not in (entry.note or "") for entry in journal.audit(name))
            operation = journal.operation(name)
            assert operation is not None
            assert TOKEN not in json.dumps(operation.request_headers)
    if not journal_target.startswith("postgres"):
        assert TOKEN.encode() not in Path(journal_target).read_bytes()


def test_reconcile_exits_1_when_a_lookup_fails_or_anything_stays(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    """Without credentials the lookup answers 401: nothing changes, exit 1, saying so;
    --format json lists each result."""
    server = idempotently_mock_server
    unsettled(journal_target, server, "order-1")
    result = run(journal_target, "reconcile", "--lookup", "/v1/charges", "--json", token=None)
    assert 1 == result.exit_code
    (document,) = json.loads(result.output.split("idempotently:")[0])
    assert ("order-1", "needs_reconcile") == (document["operation_id"], document["action"])
    assert "the lookup answered 401" in document["detail"]
    with Journal(journal_target) as journal:
        operation = journal.operation("order-1")
        assert operation is not None and "needs_reconcile" == operation.status


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("reconcile",), "Missing option '--lookup'"),
        (("reconcile", "--lookup", "/x", "--absent", "maybe"), "'maybe' is not one of"),
        (("reconcile", "--lookup", "/x", "--param", "nope"), "is not NAME=TEMPLATE"),
        (("reconcile", "--lookup", "/x", "--backoff", "0s"), "at least 1s"),
        (
            ("reconcile", "--lookup", "/x", "--backoff", "2m", "--max-backoff", "1m"),
            "max_backoff (60 s) must be at least backoff (120 s)",
        ),
        (
            (
                "resume",
                "--reconcile-lookup",
                "/x",
                "--reconcile-backoff",
                "2m",
                "--reconcile-max-backoff",
                "1m",
            ),
            "max_backoff (60 s) must be at least backoff (120 s)",
        ),
        (("reconcile", "--lookup", "/x", "--match", "a..b"), "field names"),
    ],
)
def test_reconcile_usage_errors_exit_2(tmp_path: Path, args: tuple[str, ...], words: str) -> None:
    path = str(tmp_path / "journal.db")
    Journal(path).close()
    result = run(path, *args)
    assert 2 == result.exit_code
    assert words in result.output


def test_nothing_to_reconcile_exits_0(tmp_path: Path) -> None:
    path = str(tmp_path / "journal.db")
    Journal(path).close()
    result = run(path, "reconcile", "--lookup", "/v1/charges")
    assert (0, f"nothing needs reconciling in {path}\n") == (result.exit_code, result.output)


def test_resume_with_a_reconcile_lookup_settles_as_it_resumes(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    """resume --reconcile-lookup hands needs_reconcile operations to the lookup: the
    found one is settled and resume exits 0."""
    server = idempotently_mock_server
    unsettled(journal_target, server, "order-1")
    result = run(
        journal_target,
        "resume",
        "--header-env",
        "Authorization=LOOKUP_TOKEN",
        "--reconcile-lookup",
        "/v1/charges",
        "--reconcile-param",
        PARAM,
    )
    assert 0 == result.exit_code, result.output
    assert "1 reconciled" in result.output


def test_a_watch_worker_reconciles_as_it_goes(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    """resume --watch with a lookup: an operation already needs_reconcile is looked up
    and settled by the worker, which then stops cleanly."""
    server = idempotently_mock_server
    unsettled(journal_target, server, "order-1")
    stop = threading.Event()
    with idempotently.Session(
        journal_target, base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}
    ) as session:

        def stop_once_settled() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                operation = session.journal.operation("order-1")
                if operation is not None and operation.status == "succeeded":
                    break
                time.sleep(0.05)
            stop.set()

        poller = threading.Thread(target=stop_once_settled)
        poller.start()
        summary = session.watch(
            stop,
            interval=0.05,
            reconciler=Lookup("/v1/charges", params={"metadata[operation_id]": "{operation_id}"}),
        )
        poller.join(20)
        operation = session.journal.operation("order-1")
    assert operation is not None and "succeeded" == operation.status
    assert 1 == summary.actions["reconciled"]


def test_a_watch_worker_looks_up_what_it_finds_expired(
    journal_target: str, idempotently_mock_server: MockServer
) -> None:
    """A pending operation whose key expired is claimed by the worker, goes to
    needs_reconcile without being resent, and is looked up and settled in the same
    flow; the server charged once (the first time, before the journal lost its answer)."""
    server = idempotently_mock_server
    with server.client(token=TOKEN) as client:
        client.post(
            "/v1/charges",
            json={
                "amount": 1000,
                "currency": "usd",
                "customer": "cus_1",
                "metadata": {"operation_id": "order-9"},
            },
            headers={"Idempotency-Key": "the-first-attempt"},
        )
    with Journal(journal_target) as journal:
        make(
            journal,
            "order-9",
            "pending",
            url=f"{server.url}/v1/charges",
            created_at=time.time() - 2 * 86400,
        )
    stop = threading.Event()
    with idempotently.Session(
        journal_target, base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}
    ) as session:

        def stop_once_settled() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                operation = session.journal.operation("order-9")
                if operation is not None and operation.status == "succeeded":
                    break
                time.sleep(0.05)
            stop.set()

        poller = threading.Thread(target=stop_once_settled)
        poller.start()
        session.watch(stop, interval=0.05, reconciler=Lookup("/v1/charges"))
        poller.join(20)
        operation = session.journal.operation("order-9")
    assert operation is not None and "succeeded" == operation.status
    assert 0 == operation.attempt_count
    assert 1 == len(server.charges())


def test_reconcile_shows_a_progress_bar_on_a_terminal(
    journal_target: str, idempotently_mock_server: MockServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a terminal the progress bar runs on stderr; the results go to stdout."""
    from idempotently import cli as cli_module

    unsettled(journal_target, idempotently_mock_server, "order-1")
    monkeypatch.setattr(cli_module, "stderr_is_terminal", lambda: True)
    result = run(
        journal_target,
        "reconcile",
        "--lookup",
        "/v1/charges",
        "--header-env",
        "Authorization=LOOKUP_TOKEN",
    )
    assert 0 == result.exit_code, result.output
    assert "reconciling" in result.stderr
    assert "order-1" in result.stdout and "reconciling" not in result.stdout


def test_reconcile_sends_nothing_to_a_paused_origin_and_says_so(
    journal_target: str, scripted: tuple[ScriptedApp, str]
) -> None:
    """The first lookup is answered 429 with Retry-After: the origin is paused, the second
    operation is not looked up, exit 1, and its line and the summary say so."""
    app, url = scripted
    with Journal(journal_target) as journal:
        for name in ("order-1", "order-2"):
            make(journal, name, "needs_reconcile", url=f"{url}/v1/charges")
    app.answer(Answer(status=429, headers=(("Retry-After", "600"),), body=b"{}"))
    result = run(
        journal_target,
        "reconcile",
        "--lookup",
        "/v1/charges",
        "--header-env",
        "Authorization=LOOKUP_TOKEN",
    )
    with Journal(journal_target) as journal:
        (pause,) = journal.origin_pauses()
    assert 1 == result.exit_code
    assert 1 == len(app.arrivals)
    assert "429 with Retry-After 600s" == pause.reason
    assert "the lookup answered 429 with Retry-After 600s" in result.output
    assert "1 needs_reconcile, 1 waiting" in result.output
    assert "1 operation not looked up: origin paused" in result.output
