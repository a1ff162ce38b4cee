"""The `idempotently` command line, on real journal files written by a real Session."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result

import idempotently
from idempotently import cli as cli_module
from idempotently._cli_durations import format_duration, parse_duration
from idempotently.cli import cli
from tests.postgres_server import PostgresServer
from tests.scripted_server import Answer, ScriptedApp
from tests.support import FakeTime

ONE_TRY = idempotently.RetryPolicy(max_attempts=1)
SECRET = "sk_secret"
BASE = "https://api.example.test"
HOUR = 3600.0

# What the fake API answers, by path: one kind of operation each.
ANSWERS: dict[str, Callable[[httpx.Request], httpx.Response]] = {
    "/v1/ok": lambda request: httpx.Response(201, json={"id": "ch_1", "amount": 100}),
    "/v1/bad": lambda request: httpx.Response(422, json={"error": "amount must be positive"}),
    "/v1/binary": lambda request: httpx.Response(201, content=b"\xff\xfe\x00\x01"),
    "/v1/reconcile": lambda request: httpx.Response(
        500, headers={"Idempotent-Replayed": "true"}, json={"error": "boom"}
    ),
    "/v1/later": lambda request: httpx.Response(429, headers={"Retry-After": "86000"}),
}


def fake_api(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/v1/timeout":
        raise httpx.ReadTimeout("the response never came", request=request)
    return ANSWERS[request.url.path](request)


def journal_with(path: Path | str, *kinds: str, age: float = HOUR) -> Path | str:
    """A journal holding one operation per kind (`ok`, `bad`, `timeout`, ...), `age` seconds old.

    The operation id is the kind; the session carried a secret Authorization header.
    """
    fake = FakeTime(now=time.time() - age)
    with idempotently.Session(
        path,
        transport=httpx.MockTransport(fake_api),
        headers={"Authorization": f"Bearer {SECRET}"},
        policy=ONE_TRY,
        clock=fake.clock,
        sleep=fake.sleep,
    ) as session:
        for kind in kinds:
            fake.now += 1  # distinct creation times: newest-first order is checkable
            # Pending or needs_reconcile raise: exactly what the journal should show.
            with contextlib.suppress(idempotently.IdempotentlyError):
                session.post(f"{BASE}/v1/{kind}", json={"amount": 100}, operation_id=kind)
    return path


ALL_KINDS = ("ok", "bad", "binary", "timeout", "reconcile", "later")


@pytest.fixture
def journal(journal_target: str) -> str:
    """A journal with one operation of every kind, created an hour ago (on each store)."""
    return str(journal_with(journal_target, *ALL_KINDS))


@pytest.fixture
def sqlite_journal(tmp_path: Path) -> str:
    """The same journal in an SQLite file, for tests that edit the file behind its back."""
    return str(journal_with(tmp_path / "journal.db", *ALL_KINDS))


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def run_json(*args: str) -> Any:
    result = run(*args, "--json")
    assert 0 == result.exit_code, result.output
    return json.loads(result.stdout)


# -- list --------------------------------------------------------------------------


def test_list_json_has_the_documented_fields(journal: str) -> None:
    """`list --json` prints one object per operation with every promised field."""
    rows = run_json("--journal", str(journal), "list")
    assert list(reversed(ALL_KINDS)) == [row["operation_id"] for row in rows]
    required = {
        "operation_id",
        "key",
        "status",
        "method",
        "url",
        "attempts",
        "created_at",
        "updated_at",
        "last_status_code",
        "reason",
        "delivery",
        "not_before",
    }
    assert all(required <= set(row) for row in rows)
    by_id = {row["operation_id"]: row for row in rows}
    assert ("succeeded", 201, 1, "POST") == (
        by_id["ok"]["status"],
        by_id["ok"]["last_status_code"],
        by_id["ok"]["attempts"],
        by_id["ok"]["method"],
    )
    assert "failed" == by_id["bad"]["status"]
    assert "pending" == by_id["timeout"]["status"]
    assert "needs_reconcile" == by_id["reconcile"]["status"]
    assert by_id["later"]["not_before"] is not None
    assert f"{BASE}/v1/ok" == by_id["ok"]["url"]
    assert by_id["ok"]["created_at"].endswith("+00:00")


def test_list_table_is_aligned_newest_first(journal: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal people get one aligned row per operation, newest first, with ages."""
    monkeypatch.setattr("idempotently._cli_watch.stdout_is_terminal", lambda: True)
    result = run("--journal", str(journal), "list", env={"COLUMNS": "200"})
    assert 0 == result.exit_code
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["operation", "status", "method", "url", "tries", "last", "age"]
    assert list(reversed(ALL_KINDS)) == [line.split()[0] for line in lines[1:]]
    status_column = lines[0].index("status")
    assert all(line[status_column - 2 : status_column] == "  " for line in lines[1:])
    assert re.search(r" (59m|1h)$", lines[-1])


def test_list_piped_is_one_tab_separated_record_per_operation(journal: str) -> None:
    """Piped (`idempotently list | grep failed`), each operation is one line of
    tab-separated fields, its id first, every value whole; no header, no blank line."""
    result = run("--journal", str(journal), "list")
    records = [line.split("\t") for line in result.stdout.splitlines()]
    assert list(reversed(ALL_KINDS)) == [fields[0] for fields in records]
    assert {7} == {len(fields) for fields in records}
    (failed,) = [line for line in result.stdout.splitlines() if "\tfailed\t" in line]
    assert failed.startswith("bad\t")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", records[0][6])


def test_list_filters_by_status_since_and_limit(tmp_path: Path) -> None:
    """--status (repeatable), --since and --limit narrow the listing."""
    path = journal_with(tmp_path / "j.db", "ok", "timeout", age=2 * HOUR)
    journal_with(path, "bad", "reconcile", age=60)

    def ids(*args: str) -> list[str]:
        return [row["operation_id"] for row in run_json("--journal", str(path), "list", *args)]

    assert ["timeout"] == ids("--status", "pending")
    assert ["reconcile", "timeout"] == ids("--status", "pending", "--status", "needs_reconcile")
    assert ["reconcile", "bad"] == ids("--since", "1h")
    assert ["reconcile"] == ids("--limit", "1")
    assert [] == ids("--since", "0s")


def test_list_rejects_an_unknown_status(journal: str) -> None:
    """An unknown --status is a usage error (exit 2) naming the accepted ones."""
    result = run("--journal", str(journal), "list", "--status", "done")
    assert 2 == result.exit_code
    assert "needs_reconcile" in result.stderr


def test_journal_option_after_the_command_and_env_var(journal: str, tmp_path: Path) -> None:
    """IDEMPOTENTLY_JOURNAL is the default path; --journal after the command also works."""
    by_env = run("list", "--json", env={"IDEMPOTENTLY_JOURNAL": str(journal)})
    assert 0 == by_env.exit_code
    assert len(ALL_KINDS) == len(json.loads(by_env.stdout))
    after = run("list", "--journal", str(journal), "--json")
    assert by_env.stdout == after.stdout
    missing = str(tmp_path / "nope.db")
    overridden = run("list", "--journal", missing, env={"IDEMPOTENTLY_JOURNAL": str(journal)})
    assert 1 == overridden.exit_code


# -- show --------------------------------------------------------------------------


def test_show_json_has_every_attempt_and_the_bodies(journal: str) -> None:
    """`show --json` prints the operation, its attempts, and both bodies decoded."""
    shown = run_json("--journal", str(journal), "show", "ok")
    assert "succeeded" == shown["status"]
    assert [1] == [attempt["number"] for attempt in shown["history"]]
    attempt = shown["history"][0]
    assert ("answered", 201, False) == (
        attempt["outcome"],
        attempt["status_code"],
        attempt["replayed"],
    )
    assert {"amount": 100} == shown["request_body"]["json"]
    assert '{"amount":100}' == shown["request_body"]["text"]
    assert {"id": "ch_1", "amount": 100} == shown["response_body"]["json"]
    assert 201 == shown["response_status"]
    header_names = {name.lower() for name, _ in shown["request_headers"]}
    assert "idempotency-key" in header_names
    assert "authorization" not in header_names


def test_show_finds_an_operation_by_key(journal: str) -> None:
    """The argument may be the idempotency key instead of the operation id."""
    key = run_json("--journal", str(journal), "show", "timeout")["key"]
    shown = run_json("--journal", str(journal), "show", key)
    assert "timeout" == shown["operation_id"]
    assert "maybe_delivered" == shown["history"][0]["outcome"]
    assert "ReadTimeout" in shown["history"][0]["error"]


def test_show_for_people_lists_attempts_and_pretty_bodies(
    journal: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a terminal show has the attempt table and pretty-printed JSON bodies."""
    monkeypatch.setattr("idempotently._cli_watch.stdout_is_terminal", lambda: True)
    result = run("--journal", str(journal), "show", "bad")
    assert 0 == result.exit_code
    out = result.stdout
    assert "failed" in out
    assert "outcome" in out and "answered" in out and "422" in out
    assert '"amount": 100' in out  # pretty-printed, not the compact wire bytes
    assert '"error": "amount must be positive"' in out


def test_show_binary_body_as_base64_or_a_count(journal: str) -> None:
    """A body that is not UTF-8 is base64 in JSON and a byte count for people."""
    shown = run_json("--journal", str(journal), "show", "binary")
    assert {"size": 4, "base64": "//4AAQ=="} == shown["response_body"]
    assert "4 bytes of binary data" in run("--journal", str(journal), "show", "binary").stdout


def test_show_never_prints_secret_headers_even_if_journaled(sqlite_journal: str) -> None:
    journal = sqlite_journal
    """A journal written by something else may hold secrets: show still hides them."""
    conn = sqlite3.connect(journal)
    with conn:
        conn.execute(
            "UPDATE operations SET request_headers = ? WHERE operation_id = 'ok'",
            (json.dumps([["Authorization", "Bearer leaked"], ["X-Api-Key", "leaked2"]]),),
        )
    conn.close()
    for args in (("show", "ok"), ("show", "ok", "--json")):
        result = run("--journal", str(journal), *args)
        assert 0 == result.exit_code
        assert "leaked" not in result.output
        assert "[redacted]" in result.output


def test_show_unknown_operation_exits_1(journal: str) -> None:
    """An unknown id or key: exit 1, saying what was looked for and where."""
    result = run("--journal", str(journal), "show", "nope")
    assert 1 == result.exit_code
    assert f"no operation or key 'nope' in {journal}" in result.stderr


def test_no_command_output_contains_the_session_secret(journal: str) -> None:
    """The Authorization the session carried appears in no command's output."""
    commands = [
        ("list",),
        ("list", "--json"),
        ("stats",),
        ("stats", "--json"),
        ("resume", "--dry-run"),
        ("resume", "--dry-run", "--json"),
        ("prune", "--older-than", "7d", "--dry-run"),
    ]
    commands += [("show", kind) for kind in ALL_KINDS]
    commands += [("show", kind, "--json") for kind in ALL_KINDS]
    for args in commands:
        result = run("--journal", str(journal), *args)
        assert 0 == result.exit_code, (args, result.output)
        assert SECRET not in result.output, args


# -- stats -------------------------------------------------------------------------


def test_stats_json_keys_and_counts(journal: str) -> None:
    """`stats --json`: every status counted (zeros included), rates, stuck, oldest pending."""
    stats = run_json("--journal", str(journal), "stats")
    assert {
        "pending": 2,
        "succeeded": 2,
        "failed": 1,
        "needs_reconcile": 1,
        "abandoned": 0,
    } == stats["counts"]
    for name in (
        "replay_rate",
        "in_progress_rate",
        "retries_per_operation",
        "oldest_pending_age",
        "stuck",
        "needs_reconcile",
        "stuck_after",
    ):
        assert name in stats
    assert 1 == stats["needs_reconcile"]
    assert 0.2 == stats["replay_rate"]  # one replayed answer of five
    assert stats["oldest_pending_age"] > HOUR - 60
    # Both pending operations are idle for an hour, but one waits for the not_before
    # its server asked for: resume could not send it yet, so it is not stuck.
    assert 1 == stats["stuck"]


def test_stats_for_people(journal: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal stats names each count and rate."""
    monkeypatch.setattr("idempotently._cli_watch.stdout_is_terminal", lambda: True)
    out = run("--journal", str(journal), "stats").stdout
    for word in ("needs_reconcile", "replay rate", "409 rate", "retries/op", "oldest pending"):
        assert word in out
    assert re.search(r"^stuck +1 ", out, re.MULTILINE)


def test_fail_on_stuck_exit_codes(tmp_path: Path) -> None:
    """--fail-on-stuck exits 1 (reason on stderr) when something is stuck or needs reconciling."""
    fresh = journal_with(tmp_path / "fresh.db", "ok", "timeout", age=10)
    assert 0 == run("--journal", str(fresh), "stats", "--fail-on-stuck").exit_code
    stuck = run("--journal", str(fresh), "stats", "--fail-on-stuck", "--stuck-after", "0s")
    assert 1 == stuck.exit_code
    assert "1 operation stuck" in stuck.stderr
    reconcile = journal_with(tmp_path / "reconcile.db", "ok", "reconcile", age=10)
    failed = run("--journal", str(reconcile), "stats", "--fail-on-stuck")
    assert 1 == failed.exit_code
    assert "1 operation needs reconciling" in failed.stderr
    assert 0 == run("--journal", str(reconcile), "stats").exit_code  # only when asked


# -- resume ------------------------------------------------------------------------


def test_resume_sends_the_journaled_key_with_credentials_from_the_env(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """resume re-sends the stored key and bytes; the credential comes from --header-env."""
    app, url = scripted
    path = journal_with(tmp_path / "j.db", "ok", "timeout")
    key = run_json("--journal", str(path), "show", "timeout")["key"]
    app.journal_path = str(path)
    app.answer(Answer(201, headers=(("Idempotent-Replayed", "true"),)))
    monkeypatch.setenv("TEST_TOKEN", "Bearer from_env")
    result = run(
        "--journal",
        str(path),
        "resume",
        "--base-url",
        url,
        "--header-env",
        "Authorization=TEST_TOKEN",
    )
    assert 0 == result.exit_code, result.output
    assert [(key, "Bearer from_env", True)] == [
        (arrival.key, arrival.authorization, arrival.key_in_journal) for arrival in app.arrivals
    ]
    assert b'{"amount":100}' == app.arrivals[0].body
    assert "timeout\tsucceeded\tsucceeded\t201\t" in result.stdout  # piped: one record
    assert "resumed 1 operation: 1 succeeded" in result.stderr  # piped: not a record
    assert "succeeded" == run_json("--journal", str(path), "show", "timeout")["status"]


def test_resume_json_prints_one_result_per_operation(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """`resume --json` prints ResumeResult.to_json() for each operation."""
    app, url = scripted
    path = journal_with(tmp_path / "j.db", "timeout")
    results = run_json("--journal", str(path), "resume", "--base-url", url)
    assert [("timeout", "succeeded", "succeeded", 201)] == [
        (r["operation_id"], r["status"], r["action"], r["status_code"]) for r in results
    ]
    assert 1 == len(app.arrivals)


def test_resume_dry_run_sends_nothing_and_exits_0(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """--dry-run says what would happen and sends nothing, even with work left."""
    app, url = scripted
    path = journal_with(tmp_path / "j.db", "timeout", "later", "reconcile")
    result = run("--journal", str(path), "resume", "--dry-run", "--base-url", url)
    assert 0 == result.exit_code, result.output
    assert [] == app.arrivals
    assert "would_send" in result.stdout and "would_wait" in result.stdout
    assert "pending" == run_json("--journal", str(path), "show", "timeout")["status"]


def test_resume_exits_1_when_work_is_left(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """An operation the server asked to wait for stays pending: resume exits 1 and says so."""
    app, url = scripted
    path = journal_with(tmp_path / "j.db", "timeout", "later")
    result = run("--journal", str(path), "resume", "--base-url", url)
    assert 1 == result.exit_code
    assert 1 == len(app.arrivals)  # only the one not told to wait
    assert "1 waiting; " in result.stderr
    assert "has 1 pending and 0 needs_reconcile" in result.stderr
    assert "waiting" in result.stdout


def test_resume_with_nothing_to_do(tmp_path: Path) -> None:
    """A journal with only finished operations: nothing to resume, exit 0."""
    path = journal_with(tmp_path / "j.db", "ok", "bad")
    result = run("--journal", str(path), "resume")
    assert 0 == result.exit_code
    assert ("", "nothing to resume") == (result.stdout, result.stderr[:17])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("Authorization", "NAME=ENVVAR"),
        ("Authorization=IDEMPOTENTLY_TEST_UNSET_VAR", "IDEMPOTENTLY_TEST_UNSET_VAR is not set"),
    ],
)
def test_resume_header_env_usage_errors(journal: str, value: str, message: str) -> None:
    """A --header-env without '=' or naming an unset variable is a usage error (exit 2)."""
    os.environ.pop("IDEMPOTENTLY_TEST_UNSET_VAR", None)
    result = run("--journal", str(journal), "resume", "--header-env", value)
    assert 2 == result.exit_code
    assert message in result.stderr


TOKEN = "sk_live_4eC39HqLyjWDarjtT1zdp7dc"


@pytest.mark.parametrize("option", ["--header-env", "--param-env"])
@pytest.mark.parametrize(
    "value",
    [
        f"Authorization=Bearer {TOKEN}",
        f"api_key={TOKEN}-x",
        f"Bearer {TOKEN}",
        f"Authorization: Bearer {TOKEN}=X",
    ],
)
def test_resume_never_echoes_a_credential_given_where_a_name_belongs(
    journal: str, option: str, value: str
) -> None:
    """A value where the variable's name belongs (or a malformed pair holding one) is a
    usage error that says what belongs there and never prints what was given."""
    result = run("--journal", str(journal), "resume", option, value)
    assert 2 == result.exit_code
    assert TOKEN not in result.stdout + result.stderr
    assert "sk_live" not in result.stdout + result.stderr
    if "=" in value and ":" not in value:
        assert "ENVVAR must be an environment variable's name" in result.stderr


def test_resume_rejects_a_base_url_that_is_not_http(journal: str) -> None:
    """--base-url must be an http(s) origin (exit 2)."""
    assert 2 == run("--journal", str(journal), "resume", "--base-url", "ftp://x").exit_code


def test_resume_progress_bar_on_a_terminal(
    tmp_path: Path, scripted: tuple[ScriptedApp, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a terminal the progress bar runs on stderr; the table still goes to stdout."""
    _app, url = scripted
    path = journal_with(tmp_path / "j.db", "timeout")
    monkeypatch.setattr(cli_module, "stderr_is_terminal", lambda: True)
    result = run("--journal", str(path), "resume", "--base-url", url)
    assert 0 == result.exit_code, result.output
    assert "resuming" in result.stderr
    assert "succeeded" in result.stdout


# -- prune -------------------------------------------------------------------------


def test_prune_deletes_only_finished_operations(journal: str) -> None:
    """prune deletes succeeded/failed operations; pending and needs_reconcile stay."""
    result = run("--journal", str(journal), "prune", "--older-than", "30m")
    assert 0 == result.exit_code
    assert "deleted 3 finished operations" in result.stdout
    left = {
        row["operation_id"]: row["status"] for row in run_json("--journal", str(journal), "list")
    }
    assert {"timeout": "pending", "later": "pending", "reconcile": "needs_reconcile"} == left


def test_prune_dry_run_and_window(journal: str) -> None:
    """--dry-run deletes nothing; a window longer than the operations' age deletes nothing."""
    dry = run("--journal", str(journal), "prune", "--older-than", "0s", "--dry-run")
    assert "would delete 3 finished operations" in dry.stdout
    assert len(ALL_KINDS) == len(run_json("--journal", str(journal), "list"))
    assert {"deleted": 0, "dry_run": False, "older_than": 7200.0} == run_json(
        "--journal", str(journal), "prune", "--older-than", "2h"
    )


def test_prune_requires_older_than(journal: str) -> None:
    """--older-than has no default: deleting history is always an explicit choice."""
    assert 2 == run("--journal", str(journal), "prune").exit_code


# -- durations ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0s", 0),
        ("30s", 30),
        ("15m", 900),
        ("12h", 43200),
        ("7d", 604800),
        ("1h30m", 5400),
        ("90", 90),
        ("1.5h", 5400),
        ("2w", 1209600),
        ("1h 30m", 5400),
    ],
)
def test_durations_people_type(text: str, expected: float) -> None:
    """Durations read like 0s, 30s, 15m, 12h, 7d; combinations and bare seconds work."""
    assert expected == parse_duration(text)


@pytest.mark.parametrize("seconds", [0, 59, 60, 61, 3599, 3600, 5400, 86400, 90061, 604800])
def test_formatted_durations_read_back(seconds: int) -> None:
    """What the CLI prints as a duration is accepted back as a duration (to the second)."""
    printed = format_duration(seconds)
    assert abs(parse_duration(printed) - seconds) < max(60, seconds * 0.02)


@pytest.mark.parametrize("text", ["", "7x", "d", "-5s", "-5", "1h-30m", "inf", "nan", "1.2.3s"])
def test_bad_duration_is_a_usage_error(journal: str, text: str) -> None:
    """A duration that does not parse: exit 2, saying the accepted forms."""
    result = run("--journal", str(journal), "list", "--since", text)
    assert 2 == result.exit_code
    assert "30s, 15m, 12h or 7d" in result.stderr


# -- journals that cannot be used ----------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("list",),
        ("show", "x"),
        ("stats",),
        ("resume",),
        ("prune", "--older-than", "1d"),
    ],
)
def test_missing_journal_is_one_line_and_never_created(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    """Every command on a missing journal: exit 1, one line naming the file, no file created."""
    path = tmp_path / "missing.db"
    result = run("--journal", str(path), *args)
    assert 1 == result.exit_code
    assert 1 == len(result.stderr.strip().splitlines())
    assert str(path) in result.stderr
    assert "--journal" in result.stderr  # what to do
    assert [] == list(tmp_path.iterdir())


def test_corrupt_journal_is_a_clear_error(tmp_path: Path) -> None:
    """A file of random bytes: exit 1, one line naming it, the file untouched."""
    path = tmp_path / "corrupt.db"
    garbage = bytes(range(256)) * 64
    path.write_bytes(garbage)
    result = run("--journal", str(path), "list")
    assert 1 == result.exit_code
    assert 1 == len(result.stderr.strip().splitlines())
    assert str(path) in result.stderr
    assert garbage == path.read_bytes()


def test_newer_journal_says_upgrade(sqlite_journal: str) -> None:
    journal = sqlite_journal
    """A journal from a newer version: exit 1, says to upgrade, file not rewritten."""
    conn = sqlite3.connect(journal)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    for args in (("stats",), ("resume",), ("prune", "--older-than", "0s")):
        result = run("--journal", str(journal), *args)
        assert 1 == result.exit_code
        assert "upgrade" in result.stderr
        assert str(journal) in result.stderr
    conn = sqlite3.connect(journal)
    assert 99 == conn.execute("PRAGMA user_version").fetchone()[0]
    assert len(ALL_KINDS) == conn.execute("SELECT count(*) FROM operations").fetchone()[0]
    conn.close()


# -- PostgreSQL ----------------------------------------------------------------------


@pytest.mark.postgres
def test_no_command_prints_the_password_of_a_postgres_url(
    postgres: PostgresServer, scripted: tuple[ScriptedApp, str]
) -> None:
    """--journal and IDEMPOTENTLY_JOURNAL take a URL; its password is never on screen."""
    app, url = scripted
    database = postgres.new_database().rsplit("/", 1)[1]
    secret_url = postgres.url(database, password="pg-pass-123")
    journal_with(secret_url, *ALL_KINDS)
    shown = postgres.url(database, password="***")
    commands: list[tuple[str, ...]] = [
        ("list",),
        ("list", "--status", "abandoned"),
        ("stats", "--json"),
        ("stats", "--fail-on-stuck", "--stuck-after", "0s"),
        ("show", "ok", "--json"),
        ("show", "nope"),
        ("prune", "--older-than", "7d"),
        ("resume", "--dry-run"),
    ]
    outputs = []
    for args in commands:
        outputs.append(run("--journal", secret_url, *args))
        outputs.append(run(*args, env={"IDEMPOTENTLY_JOURNAL": secret_url}))
    app.answer(Answer(201), Answer(201))
    resumed = run("--journal", secret_url, "resume", "--base-url", url)
    missing = run("--journal", postgres.url("no_such_db", password="pg-pass-123"), "list")

    for result in [*outputs, resumed, missing]:
        assert "pg-pass-123" not in result.stdout + result.stderr
    assert "resumed 2 operations: 1 succeeded, 1 waiting" in resumed.stderr, resumed.output
    assert f"{shown} has 1 pending" in resumed.stderr
    assert f"no operations in {shown} match" in outputs[2].stderr  # piped: not a record
    assert shown == json.loads(outputs[4].stdout)["journal"]
    assert 1 == missing.exit_code and "createdb" in missing.stderr
