"""The operator's commands: settle, abandon, retry and fork, with --dry-run, --actor and
--note; show printing (and --format json exporting) the audit trail; on SQLite and
PostgreSQL."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner, Result

from idempotently import Journal
from idempotently._operator import default_actor
from idempotently.cli import cli
from tests.journal_commands import record_attempt
from tests.test_operator_actions import make


@pytest.fixture(autouse=True)
def on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests read what a person sees on a terminal (piped output: test_cli_pipes)."""
    monkeypatch.setattr("idempotently._cli_watch.stdout_is_terminal", lambda: True)


def run(journal: str, *args: str) -> Result:
    return CliRunner().invoke(cli, ["--journal", journal, *args], catch_exceptions=False)


def test_settle_then_show_prints_and_exports_the_audit_entry(journal_target: str) -> None:
    """settle --failed --note writes the operator's word; show prints who, when, what and
    why, and --format json exports the same entry."""
    with Journal(journal_target) as journal:
        make(journal, "op-1")
    settled = run(journal_target, "settle", "op-1", "--failed", "--note", "no charge found")
    shown = run(journal_target, "show", "op-1")
    exported = json.loads(run(journal_target, "show", "op-1", "--format", "json").output)
    assert (0, "op-1: needs_reconcile -> failed\n") == (settled.exit_code, settled.output)
    assert f"{default_actor()}  settle (needs_reconcile -> failed)" in shown.output
    assert "    no charge found" in shown.output
    (entry,) = exported["audit"]
    assert (default_actor(), "settle", "no charge found") == (
        entry["actor"],
        entry["action"],
        entry["note"],
    )
    assert {"from": "needs_reconcile", "to": "failed"} == entry["detail"]
    assert "failed" == exported["status"]


def test_a_dry_run_says_what_it_would_do_and_writes_nothing(journal_target: str) -> None:
    """Each command's --dry-run prints what it would do, exits 0 and changes nothing."""
    with Journal(journal_target) as journal:
        make(journal, "op-1")
    outputs = [
        run(journal_target, "settle", "op-1", "--succeeded", "--note", "n", "--dry-run"),
        run(journal_target, "abandon", "op-1", "--note", "n", "--dry-run"),
        run(journal_target, "fork", "op-1", "--note", "n", "--dry-run"),
    ]
    assert [0, 0, 0] == [result.exit_code for result in outputs]
    assert all(result.output.startswith("dry run, nothing written: ") for result in outputs)
    assert "op-1~fork1" in outputs[2].output
    with Journal(journal_target) as journal:
        operation = journal.operation("op-1")
        assert operation is not None and "needs_reconcile" == operation.status
        assert [] == journal.audit("op-1")
        assert None is journal.operation("op-1~fork1")


def test_fork_and_retry_with_an_actor(journal_target: str) -> None:
    """fork --actor links the new operation; retry makes the fork due now; --format json
    names the new operation."""
    with Journal(journal_target) as journal:
        make(journal, "op-1")
    forked = run(journal_target, "fork", "op-1", "--note", "resend", "--actor", "bob@ops", "--json")
    retried = run(journal_target, "retry", "op-1~fork1", "--actor", "bob@ops")
    document = json.loads(forked.output)
    assert ("op-1~fork1", "pending", "bob@ops") == (
        document["operation"]["operation_id"],
        document["operation"]["status"],
        document["actor"],
    )
    assert (0, "op-1~fork1 is due now: the next resume sends it with its key\n") == (
        retried.exit_code,
        retried.output,
    )
    shown = run(journal_target, "show", "op-1~fork1").output
    assert "forked from  op-1" in shown
    assert "bob@ops  retry" in shown
    assert "forked as    op-1~fork1" in run(journal_target, "show", "op-1").output


def test_a_refusal_is_one_line_and_exit_1(journal_target: str) -> None:
    """A senseless transition exits 1 with one line naming the operation; a live lease
    too."""
    with Journal(journal_target) as journal:
        make(journal, "done", "succeeded")
        make(journal, "busy", "pending", owner="other-host:1:abc", lease_until=4e9)
    refused = run(journal_target, "settle", "done", "--failed", "--note", "n")
    leased = run(journal_target, "abandon", "busy", "--note", "n")
    assert 1 == refused.exit_code == leased.exit_code
    assert 1 == len(refused.output.strip().splitlines())
    assert "cannot settle: it is already succeeded" in refused.output
    assert "'done'" in refused.output
    assert "other-host:1:abc holds this operation's lease" in leased.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("settle", "op-1", "--note", "n"), "--succeeded or --failed"),
        (("abandon", "op-1"), "Missing option '--note'"),
        (("fork", "op-1", "--note", "  "), "note must say why"),
        (("settle", "op-1", "--failed", "--note", "n", "--actor", ""), "actor must be"),
    ],
)
def test_usage_errors_exit_2(journal_target: str, args: tuple[str, ...], words: str) -> None:
    """No status, no note, a blank note or a blank actor: exit 2, nothing written."""
    with Journal(journal_target) as journal:
        make(journal, "op-1")
    result = run(journal_target, *args)
    assert 2 == result.exit_code
    assert words in result.output
    with Journal(journal_target) as journal:
        assert [] == journal.audit("op-1")


def test_fork_after_prune_takes_a_new_number_and_its_dry_run_says_which(
    journal_target: str,
) -> None:
    """`idempotently prune` removes a settled fork while its parent stays (its last change
    is newer); `fork --dry-run --format json` then names the fork it would make,
    op-1~fork2, and `fork` makes that one, under a key the pruned fork never had."""
    import time

    from idempotently._keys import derived_key
    from idempotently._rows import AttemptRecord

    with Journal(journal_target) as journal:
        make(journal, "op-1", "failed")
        first = journal.fork("op-1", note="retry")
        behind = time.time() - 7200  # a resume worker whose clock runs two hours behind
        record_attempt(
            journal,
            first.operation_id,
            AttemptRecord(behind, 0.1, "answered", 402, status="failed"),
            now=behind,
        )
        namespace = journal.namespace
    pruned = run(journal_target, "prune", "--older-than", "1h")
    assert 0 == pruned.exit_code, pruned.output
    dry = run(journal_target, "fork", "op-1", "--note", "n", "--dry-run", "--format", "json")
    assert "op-1~fork2" == json.loads(dry.output)["fork_id"]
    forked = run(journal_target, "fork", "op-1", "--note", "declined twice, once more")
    second_key = derived_key(namespace, "op-1~fork2")
    assert f"forked op-1 as op-1~fork2 (key {second_key})\n" == forked.output
    assert second_key != first.key


def test_settle_with_both_flags_is_a_usage_error(journal_target: str) -> None:
    """settle --succeeded --failed contradicts itself: exit 2, nothing written (the last
    flag never silently wins)."""
    with Journal(journal_target) as journal:
        make(journal, "op-1")
    result = run(journal_target, "settle", "op-1", "--succeeded", "--failed", "--note", "n")
    reversed_ = run(journal_target, "settle", "op-1", "--failed", "--succeeded", "--note", "n")
    assert (2, 2) == (result.exit_code, reversed_.exit_code)
    assert "--succeeded and --failed contradict" in result.output
    with Journal(journal_target) as journal:
        assert [] == journal.audit("op-1")
        assert "needs_reconcile" == journal.operation("op-1").status  # type: ignore[union-attr]


def test_fork_passes_over_an_unrelated_operation_holding_the_fork_id(journal_target: str) -> None:
    """An unrelated operation already called x~fork1 is no fork of x: fork x makes
    x~fork2 (never a false "forked already"), and leaves x~fork1 as it was."""
    with Journal(journal_target) as journal:
        make(journal, "x", "failed")
        unrelated = make(journal, "x~fork1", "succeeded")
    forked = run(journal_target, "fork", "x", "--note", "resend")
    assert (0, "x~fork2") == (forked.exit_code, forked.output.split(" as ")[1].split(" ")[0])
    with Journal(journal_target) as journal:
        fork = journal.operation("x~fork2")
        assert fork is not None and ("x", "pending") == (fork.forked_from, fork.status)
        assert unrelated == journal.operation("x~fork1")


def test_fork_of_a_forked_operation_says_as_which(journal_target: str) -> None:
    """Only a fork this operation really made is "forked already", and it is named."""
    with Journal(journal_target) as journal:
        make(journal, "x", "failed")
        journal.fork("x", note="first")
    again = run(journal_target, "fork", "x", "--note", "again")
    assert 1 == again.exit_code
    assert "forked already, as 'x~fork1' (pending)" in again.output


def test_a_note_with_line_breaks_cannot_forge_an_audit_entry(journal_target: str) -> None:
    """show prints exactly one audit line per entry: a note (or actor) holding a line
    break shows it as \\n, never as a second entry by someone else."""
    import re

    forged = "checked\n  2026-12-01T00:00:00Z  mallory@ops  settle (pending -> succeeded)\r\tx"
    with Journal(journal_target) as journal:
        make(journal, "op-1")
        journal.settle("op-1", "failed", note=forged, actor="alice@ops")
    shown = run(journal_target, "show", "op-1").output
    audit = shown.split("\naudit\n", 1)[1].splitlines()
    entries = [line for line in audit if re.match(r"  \d{4}-\d\d-\d\dT", line)]
    assert 1 == len(entries)
    assert "alice@ops  settle (needs_reconcile -> failed)" in entries[0]
    assert (
        "    checked\\n  2026-12-01T00:00:00Z  mallory@ops  settle (pending -> succeeded)\\r\\tx"
        in audit
    )
