"""The CLI's output formats, help and 80-column tables, on real journals written by a Session."""

from __future__ import annotations

import csv
import io
import json
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import click
import httpx
import pytest
import wcwidth
from click.testing import CliRunner, Result
from prometheus_client.parser import text_string_to_metric_families

import idempotently
from idempotently._cli_format import field_lines, plural, shorten, wrap_words
from idempotently._flow._config import DEFAULT_KEY_EXPIRY_MARGIN
from idempotently._journal import DEFAULT_EXPIRING_WITHIN, Journal
from idempotently.cli import cli
from idempotently.testing import Fault, serve
from tests.support import FakeTime
from tests.test_cli import ALL_KINDS, HOUR, journal_with

LONG_ID = "customer-cus_0123456789abcdef-order-2026-11-30-000042:charge"
LONG_URL = "https://payments.internal.example.test/v1/customers/cus_0123456789abcdef/charges"
LONG_ERROR = "the response never came " * 6
CHARGE = {"amount": 1000, "currency": "usd", "customer": "cus_1"}


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    """A journal with one operation of every kind, created an hour ago."""
    return journal_with(tmp_path / "journal.db", *ALL_KINDS)


@pytest.fixture(autouse=True)
def on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests read what a person sees: stdout is a terminal of COLUMNS columns."""
    monkeypatch.setattr("idempotently._cli_watch.stdout_is_terminal", lambda: True)


def run(*args: str, columns: int = 80) -> Result:
    return CliRunner().invoke(
        cli, list(args), env={"COLUMNS": str(columns)}, catch_exceptions=False
    )


def out(*args: str, columns: int = 80) -> str:
    result = run(*args, columns=columns)
    assert 0 == result.exit_code, result.output
    return result.stdout


def long_journal(path: Path, age: float = HOUR) -> Path:
    """One pending operation whose id, URL and last error are all long."""

    def lost(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout(LONG_ERROR, request=request)

    fake = FakeTime(now=time.time() - age)
    with (
        idempotently.Session(
            path,
            transport=httpx.MockTransport(lost),
            policy=idempotently.RetryPolicy(max_attempts=1),
            clock=fake.clock,
            sleep=fake.sleep,
        ) as session,
        pytest.raises(idempotently.IdempotentlyError),
    ):
        session.post(LONG_URL, json={"amount": 100}, operation_id=LONG_ID)
    return path


# -- formats -------------------------------------------------------------------------


def test_list_json_nl_and_csv_hold_the_same_records(journal: Path) -> None:
    """`list --format nl` is the JSON array one object per line; csv is it as rows."""
    as_json = json.loads(out("--journal", str(journal), "list", "--format", "json"))
    assert len(ALL_KINDS) == len(as_json)

    nl = out("--journal", str(journal), "list", "--format", "nl").splitlines()
    assert as_json == [json.loads(line) for line in nl]

    rows = list(
        csv.DictReader(io.StringIO(out("--journal", str(journal), "list", "--format", "csv")))
    )
    assert list(as_json[0]) == list(rows[0])  # the same columns, in the same order
    expected = [
        {name: "" if value is None else str(value) for name, value in record.items()}
        for record in as_json
    ]
    assert expected == rows


def test_json_flag_is_format_json_and_cannot_contradict_it(journal: Path) -> None:
    """`--json` is an alias of `--format json`; with another --format it is a usage error."""
    for command in (("list",), ("show", "ok"), ("stats",), ("prune", "--older-than", "7d")):
        args = ("--journal", str(journal), *command)
        by_format, by_flag = (
            json.loads(out(*args, *option)) for option in (("--format", "json"), ("--json",))
        )
        if "stats" in command:  # measured twice, a few microseconds apart
            by_format["oldest_pending_age"] = by_flag["oldest_pending_age"]
        assert by_format == by_flag
    clash = run("--journal", str(journal), "list", "--json", "--format", "csv")
    assert 2 == clash.exit_code
    assert "--json and --format csv" in clash.stderr


def test_empty_listings_in_every_format(tmp_path: Path) -> None:
    """No operations: an empty array, no lines at all, a CSV header row, and a sentence
    for people."""
    path = journal_with(tmp_path / "j.db", "ok")
    args = ("--journal", str(path), "list", "--status", "pending")
    assert [] == json.loads(out(*args, "--format", "json"))
    assert "" == out(*args, "--format", "nl")
    assert "operation_id,key,status," == out(*args, "--format", "csv")[:24]
    assert 1 == len(out(*args, "--format", "csv").splitlines())
    assert "no operations in" in out(*args)


def test_nl_and_csv_never_drive_the_terminal(tmp_path: Path) -> None:
    """An id holding terminal escapes is printed escaped in nl and csv too."""
    path = journal_with(tmp_path / "j.db", "timeout")
    conn = sqlite3.connect(path)  # as a journal written by something else could hold
    with conn:
        conn.execute("UPDATE operations SET reason = ?", ("evil\x1b]0;pwned\x07\u202e",))
    conn.close()
    for output_format in ("nl", "csv", "json"):
        text = out("--journal", str(path), "list", "--format", output_format)
        assert not re.search("[\x1b\x07\u202e]", text), output_format


def test_prune_and_resume_formats(journal: Path) -> None:
    """prune prints one sentence or one JSON object; resume a table or a JSON list."""
    pruned = json.loads(
        out(
            "--journal",
            str(journal),
            "prune",
            "--older-than",
            "0s",
            "--dry-run",
            "--format",
            "json",
        )
    )
    assert {"would_delete": 3, "dry_run": True, "older_than": 0.0} == pruned
    planned = json.loads(out("--journal", str(journal), "resume", "--dry-run", "--format", "json"))
    assert {"timeout", "later"} == {result["operation_id"] for result in planned}


# -- stats: expiring keys and Prometheus ---------------------------------------------


def test_expiring_window_defaults_to_resumes_key_expiry_margin() -> None:
    """`stats` counts by default exactly what `resume`'s margin would refuse to resend."""
    assert DEFAULT_KEY_EXPIRY_MARGIN == DEFAULT_EXPIRING_WITHIN


def test_stats_counts_pending_keys_about_to_expire(tmp_path: Path) -> None:
    """A pending key 23.5 h old (lifetime 24 h) expires within the 1 h margin; a fresh one not."""
    path = journal_with(tmp_path / "j.db", "timeout", age=23.5 * HOUR)
    journal_with(path, "later", age=60)
    journal_with(path, "ok", age=23.9 * HOUR)  # finished: its key no longer matters

    def expiring(*args: str) -> Any:
        return json.loads(out("--journal", str(path), "stats", "--json", *args))["expiring"]

    assert 1 == expiring()
    assert 0 == expiring("--expiring-within", "0s")
    assert 2 == expiring("--expiring-within", "1d")
    text = out("--journal", str(path), "stats")
    assert re.search(r"^expiring keys +1 \(pending, key expires within 1h", text, re.MULTILINE)
    # resume agrees: that one operation is the one it would no longer resend.
    planned = json.loads(out("--journal", str(path), "resume", "--dry-run", "--json"))
    assert ["timeout"] == [
        r["operation_id"] for r in planned if r["action"] == "would_need_reconcile"
    ]


def test_journal_stats_counts_expiring_only_when_asked(tmp_path: Path) -> None:
    """Without expiring_within, stats stays on its covering index and says None."""
    path = journal_with(tmp_path / "j.db", "timeout", age=23.5 * HOUR)
    with Journal(path, create=False, readonly=True) as journal:
        now = time.time()
        assert (None, None) == (
            journal.stats(now=now).expiring,
            journal.stats(now=now).expiring_within,
        )
        asked = journal.stats(now=now, expiring_within=HOUR)
        assert (1, HOUR) == (asked.expiring, asked.expiring_within)
        with pytest.raises(ValueError, match="expiring_within"):
            journal.stats(now=now, expiring_within=-1)


def test_stats_prometheus_parses_and_matches_the_json(tmp_path: Path) -> None:
    """`stats --format prometheus` is valid exposition text carrying the JSON's figures."""
    directory = tmp_path / 'a "quoted" \\new dir'  # a backslash before an n, not a newline
    directory.mkdir()
    path = journal_with(directory / "j.db", *ALL_KINDS)
    figures = json.loads(out("--journal", str(path), "stats", "--json"))
    text = out("--journal", str(path), "stats", "--format", "prometheus")

    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert {
        "idempotently_operations",
        "idempotently_attempts",
        "idempotently_replay_rate",
        "idempotently_in_progress_rate",
        "idempotently_retries_per_operation",
        "idempotently_stuck_operations",
        "idempotently_oldest_pending_age_seconds",
        "idempotently_expiring_keys",
        "idempotently_open_breakers",
        "idempotently_capped_operations",
    } == set(families)
    assert all("gauge" == family.type and family.documentation for family in families.values())
    samples = [sample for family in families.values() for sample in family.samples]
    assert {str(path)} == {sample.labels["journal"] for sample in samples}
    by_status = {
        sample.labels["status"]: sample.value
        for sample in families["idempotently_operations"].samples
    }
    assert figures["counts"] == by_status

    def value(name: str) -> float:
        return float(families[f"idempotently_{name}"].samples[0].value)

    assert figures["replay_rate"] == value("replay_rate")
    assert figures["stuck"] == value("stuck_operations")
    assert figures["expiring"] == value("expiring_keys")
    assert figures["attempts"] == value("attempts")
    assert figures["open_breakers"] == value("open_breakers")
    assert figures["capped"] == value("capped_operations")
    assert abs(figures["oldest_pending_age"] - value("oldest_pending_age_seconds")) < 5
    # The textfile collector wants each HELP and TYPE once, before its samples.
    assert len(families) == text.count("# TYPE ") == text.count("# HELP ")


def test_prometheus_oldest_pending_age_is_0_when_nothing_is_pending(tmp_path: Path) -> None:
    """No pending operation: an age of 0, not a missing or NaN sample."""
    path = journal_with(tmp_path / "j.db", "ok")
    text = out("--journal", str(path), "stats", "--format", "prometheus")
    assert f'idempotently_oldest_pending_age_seconds{{journal="{path}"}} 0.0' in text


# -- help ----------------------------------------------------------------------------


def commands() -> dict[str, click.Command]:
    assert isinstance(cli, click.Group)
    return dict(cli.commands)


@pytest.mark.parametrize("args", [(), *((name,) for name in sorted(commands()))])
def test_dash_h_is_help(args: tuple[str, ...]) -> None:
    """`-h` shows the same help as `--help`, on the group and every command."""
    short, long = run(*args, "-h"), run(*args, "--help")
    assert (0, 0) == (short.exit_code, long.exit_code)
    assert long.stdout == short.stdout


def test_top_level_help_shows_every_summary_whole_at_80_columns() -> None:
    """Each command's one-line summary fits `idempotently --help` at 80 columns, uncut."""
    text = out("--help")
    for name, command in commands().items():
        summary = command.get_short_help_str(limit=1000)
        assert re.search(rf"^  {re.escape(name)} +{re.escape(summary)}$", text, re.MULTILINE), (
            name,
            text,
        )
    assert "..." not in text.partition("Commands:")[2]


@pytest.mark.parametrize("name", ["show", "stats", "prune"])
def test_help_never_promises_a_table_where_text_is_printed(name: str) -> None:
    """Commands that print text or sentences do not say their JSON replaces a table."""
    assert "table" not in out(name, "--help")


# -- 80 columns ----------------------------------------------------------------------


def wider_than(lines: list[str], columns: int) -> list[tuple[int, str]]:
    """The lines that take more terminal columns than the terminal has."""
    return [(wcwidth.wcswidth(line), line) for line in lines if wcwidth.wcswidth(line) > columns]


def unwrapped(text: str) -> str:
    """Text with its line breaks and indentation undone: what wrapping must not change."""
    return " ".join(text.split())


@pytest.mark.parametrize("columns", [80, 200])
def test_list_fits_and_never_cuts_an_operation_id(tmp_path: Path, columns: int) -> None:
    """At 80 and 200 columns no `list` line is wider, and every operation id is shown whole."""
    path = long_journal(tmp_path / "j.db")
    journal_with(path, *ALL_KINDS)
    lines = out("--journal", str(path), "list", columns=columns).splitlines()
    assert [] == wider_than(lines, columns)
    first_words = {line.split()[0] for line in lines[1:] if not line.startswith(" ")}
    assert {LONG_ID, *ALL_KINDS} == first_words


def test_list_at_80_columns_puts_a_long_id_on_its_own_line_and_keeps_the_url_ends(
    tmp_path: Path,
) -> None:
    """A long id takes a line of its own above its row; the URL keeps its start and its end."""
    path = long_journal(tmp_path / "j.db")
    lines = out("--journal", str(path), "list").splitlines()
    row = lines[lines.index(LONG_ID) + 1]
    status, _method, shown_url = row.split()[:3]
    assert "pending" == status and row.startswith(" ")
    head, tail = shown_url.split("…")
    assert LONG_URL.startswith(head) and LONG_URL.endswith(tail) and len(shown_url) >= 24
    # Wide enough, nothing moves and nothing is cut: one line per operation.
    wide = out("--journal", str(path), "list", columns=200).splitlines()
    assert 2 == len(wide) and LONG_ID in wide[1] and LONG_URL in wide[1]


def test_list_shortens_the_url_before_moving_an_id(tmp_path: Path) -> None:
    """Where shortening the URL makes room, the id stays on its row."""
    path = long_journal(tmp_path / "j.db")
    lines = out("--journal", str(path), "list", columns=150).splitlines()
    assert 2 == len(lines) and lines[1].startswith(LONG_ID) and "…" in lines[1]


@pytest.mark.parametrize("columns", [80, 200])
def test_resume_never_cuts_the_detail_a_user_acts_on(tmp_path: Path, columns: int) -> None:
    """A resume row's id and detail are whole, broken only between words, in the width."""
    path = long_journal(tmp_path / "j.db", age=23.5 * HOUR)
    text = out("--journal", str(path), "resume", "--dry-run", columns=columns)
    detail = json.loads(out("--journal", str(path), "resume", "--dry-run", "--json"))[0]["detail"]
    assert [] == wider_than(text.splitlines(), columns)
    assert "…" not in text
    assert LONG_ID in [line.split()[0] for line in text.splitlines() if line.strip()]
    assert unwrapped(detail) in unwrapped(text)


def test_resume_shows_the_credentials_hint_whole_at_80_columns(tmp_path: Path) -> None:
    """Resumed without credentials, the server's 401 hint (which option to pass) is whole."""
    journal = tmp_path / "j.db"
    with serve() as api:
        api.faults.push(Fault.lose_response())
        with (
            idempotently.Session(
                journal,
                base_url=api.url,
                headers={"Authorization": "Bearer user_1"},
                policy=idempotently.RetryPolicy(max_attempts=1),
            ) as session,
            pytest.raises(idempotently.OperationPendingError),
        ):
            session.post("/v1/charges", json=CHARGE, operation_id=LONG_ID)
        result = run("--journal", str(journal), "resume")  # no --header-env: a 401

    assert [] == wider_than(result.stdout.splitlines(), 80)
    assert LONG_ID in result.stdout.splitlines()
    assert "pass the right ones, e.g. --header-env" in unwrapped(result.stdout), result.output


@pytest.mark.parametrize("columns", [80, 200])
def test_show_prints_everything_whole_and_wraps_only_between_words(
    tmp_path: Path, columns: int
) -> None:
    """show keeps ids, URLs and errors whole; long values wrap between words within the width."""
    path = long_journal(tmp_path / "j.db")
    text = out("--journal", str(path), "show", LONG_ID, columns=columns)
    lines = text.splitlines()
    assert LONG_ID in text and LONG_URL in text
    assert f"attempt 1: ReadTimeout: {LONG_ERROR.strip()}" in unwrapped(text)
    # Every word of the error is whole on some line: nothing was split mid-word.
    assert set(LONG_ERROR.split()) <= {word for line in lines for word in line.split()}
    # Only a line holding one word wider than the terminal may be wider (never split).
    assert [] == [line for _, line in wider_than(lines, columns) if " " in line.strip()]
    section = text.split("\nattempts\n")[1].split("\n\n")[0].splitlines()
    assert section[0].split() == [
        "#",
        "outcome",
        "status",
        "replayed",
        "started",
        "elapsed",
        "wait",
    ]


@pytest.mark.parametrize("columns", [80, 200])
def test_stats_fits_the_terminal_between_words(journal: Path, columns: int) -> None:
    """stats lines fit the width; a long figure wraps under its value, never mid-word."""
    text = out("--journal", str(journal), "stats", "--stuck-after", "90s", columns=columns)
    too_wide = [line for _, line in wider_than(text.splitlines(), columns)]
    assert [] == [line for line in too_wide if not line.startswith("journal ")]  # a long path
    assert "(pending, unleased, idle over 1m30s)" in unwrapped(text)


def test_field_lines_wrap_under_the_value_between_words() -> None:
    """A value longer than the room wraps under itself; a word wider than it stays whole."""
    long_word = "x" * 50
    fields = [("status", "alpha beta gamma delta epsilon"), ("url", long_word)]
    lines = field_lines(fields, width=28)
    assert ["status  alpha beta gamma", "        delta epsilon", f"url     {long_word}"] == lines


def test_wrap_words_measures_terminal_columns() -> None:
    """Two-column characters count twice when wrapping."""
    assert ["注文 注文", "注文"] == wrap_words("注文 注文 注文", 9)


def test_show_times_are_iso_utc_and_relative(journal: Path) -> None:
    """Times in show are ISO-8601 UTC with the age; elsewhere only the age."""
    text = out("--journal", str(journal), "show", "ok")
    assert re.search(
        r"^created +\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \((59m|1h) ago\)$", text, re.MULTILINE
    )
    assert re.search(r"^key expires +\S+Z \(in (22|23)h\)$", text, re.MULTILINE)
    stats = out("--journal", str(journal), "stats")
    assert re.search(r"^oldest pending +created (59m|1h) ago$", stats, re.MULTILINE)


WIDE_IDS = [
    "注文-2026-11-30-000042:請求処理-顧客番号-0123456789-東京支店-確認済み",
    "order-😀🎉💳🧾🚀-" * 4 + ":charge",
    "混合-mixed-🇯🇵-e\u0301-👩🏽-" * 3,
]
"""Operation ids of CJK characters, emoji (a flag, a skin tone) and a combining mark."""


def wide_journal(path: Path) -> Path:
    """Succeeded operations under ids that take two columns per character, or more."""
    answer = httpx.MockTransport(lambda request: httpx.Response(201, json={"id": "ch_1"}))
    with idempotently.Session(path, transport=answer) as session:
        for number, operation_id in enumerate(WIDE_IDS):
            session.post(f"{LONG_URL}/{number}/確認", json={"n": number}, operation_id=operation_id)
    return path


@pytest.mark.parametrize("columns", [80, 200])
def test_list_lines_fit_the_terminal_in_columns_not_characters(
    tmp_path: Path, columns: int
) -> None:
    """CJK and emoji ids: no line of `list` takes more columns than the terminal has."""
    journal = wide_journal(tmp_path / "journal.db")
    lines = out("--journal", str(journal), "list", columns=columns).splitlines()
    assert [] == wider_than(lines, columns)
    assert all(
        operation_id in lines or any(line.startswith(operation_id) for line in lines)
        for operation_id in WIDE_IDS
    )


def test_list_columns_line_up_in_terminal_columns(tmp_path: Path) -> None:
    """With wide ids the status column starts at the same terminal column on every line."""
    journal = wide_journal(tmp_path / "journal.db")
    lines = out("--journal", str(journal), "list", columns=200).splitlines()[1:]
    starts = {wcwidth.wcswidth(line[: line.index("succeeded")]) for line in lines}
    assert 1 == len(starts), lines


@pytest.mark.parametrize(
    ("text", "width", "where", "expected"),
    [
        ("日本語のテキスト", 16, "middle", "日本語のテキスト"),
        ("日本語のテキストです", 11, "middle", "日本…トです"),
        ("日本語のテキストです", 10, "middle", "日本…です"),  # 4 + 1 + 4: a column left over
        ("日本語のテキストです", 10, "end", "日本語の…"),
        ("ab😀cd😀ef", 6, "middle", "ab…ef"),
        ("e\u0301e\u0301e\u0301e\u0301", 3, "end", "e\u0301e\u0301…"),
        ("ab👩🏽cd👩🏽ef", 7, "middle", "ab…👩🏽ef"),
        ("🇯🇵🇯🇵🇯🇵", 5, "end", "🇯🇵🇯🇵…"),
    ],
)
def test_shorten_measures_terminal_columns_and_never_splits_a_wide_character(
    text: str, width: int, where: Any, expected: str
) -> None:
    """A wide character counts two columns and stays whole; a combining mark stays on its letter."""
    shortened = shorten(text, width, where)
    assert (expected, True) == (shortened, wcwidth.wcswidth(shortened) <= width)


# -- pieces --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "width", "where", "expected"),
    [
        ("abcdefghij", 10, "middle", "abcdefghij"),
        ("abcdefghijk", 10, "middle", "abcde…hijk"),
        ("abcdefghijk", 10, "end", "abcdefghi…"),
        ("the server asked", 8, "end", "the ser…"),
        ("ab", 1, "middle", "…"),
    ],
)
def test_shorten_keeps_the_width(text: str, width: int, where: Any, expected: str) -> None:
    """Shortened text is exactly `width` characters, the cut marked with one ellipsis."""
    assert expected == shorten(text, width, where)


@pytest.mark.parametrize(
    ("count", "expected"), [(0, "0 attempts"), (1, "1 attempt"), (2, "2 attempts")]
)
def test_plurals(count: int, expected: str) -> None:
    """Counts read as people write them: 1 attempt, 2 attempts."""
    assert expected == plural(count, "attempt")


def test_no_cli_output_says_s_in_parentheses(journal: Path) -> None:
    """No command prints `(s)` plurals."""
    for args in (("list",), ("stats",), ("show", "timeout"), ("resume", "--dry-run")):
        assert "(s)" not in out("--journal", str(journal), *args)
    single = journal_with(journal.parent / "single.db", "ok")
    assert "would delete 1 finished operation idle" in out(
        "--journal", str(single), "prune", "--older-than", "0s", "--dry-run"
    )


def test_piped_output_keeps_each_value_on_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off a terminal (a pipe, a file) show and resume do not wrap, whatever COLUMNS says."""
    monkeypatch.setattr("idempotently._cli_watch.stdout_is_terminal", lambda: False)
    path = long_journal(tmp_path / "j.db", age=23.5 * HOUR)
    shown = out("--journal", str(path), "show", LONG_ID, columns=80)
    resumed = out("--journal", str(path), "resume", "--dry-run", columns=80)
    detail = json.loads(out("--journal", str(path), "resume", "--dry-run", "--json"))[0]["detail"]
    (attempt,) = [line for line in shown.splitlines() if line.startswith("attempt\t")]
    assert f"\tReadTimeout: {LONG_ERROR.strip()}" in attempt
    assert [f"{LONG_ID}\twould_need_reconcile\tpending\t\t{detail}"] == resumed.splitlines()
