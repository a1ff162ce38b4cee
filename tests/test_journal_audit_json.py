"""The audits read the same before and after the schema squash (issue 29): an operation
answered 2xx, 4xx or replayed at its first attempt, one with several attempts, one whose
first attempt was killed in flight, and one whose answer could not be read, shown by
`show --json`, `list --json`, `stats --json`, the Prometheus output and
`Journal.operation(id).attempts`, field by field (ids and times aside) against what the
build at git tag v0.1.0.dev-journal5 printed for the same script."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "audit_json"
SRC = str(Path(__file__).parent.parent / "src")
# What differs from run to run: times, durations, keys, lease owners, waits drawn.
VARYING = frozenset(
    {
        *("elapsed", "started_at", "created_at", "updated_at", "not_before", "deadline_at"),
        *("key_expires_at", "lease_until", "first_send_at", "enqueued_at", "now", "wait"),
        *("oldest_pending_created_at", "oldest_pending_age", "key", "lease_owner"),
    }
)


ADDED = frozenset({"group_id", "step", "successor", "cap_reason"})
"""`show --json` fields added since that build (operation groups, the attempts cap):
null for an operation outside any group and under no cap, as every operation of that
build is."""
ADDED_COUNTS = frozenset({"capped", "open_breakers"})
"""`stats --json` figures added since that build (the attempts cap, the circuit
breaker): 0 on a journal that build could write."""
ADDED_METRICS = ("idempotently_capped_operations", "idempotently_open_breakers")
"""Prometheus metrics added since that build, for the same figures."""


def without_added(value: Any) -> Any:
    """``value`` less the fields added since that build, where they hold null (or 0)."""
    if isinstance(value, dict):
        return {
            key: without_added(item)
            for key, item in value.items()
            if not (key in ADDED and item is None) and not (key in ADDED_COUNTS and item == 0)
        }
    if isinstance(value, list):
        return [without_added(item) for item in value]
    if isinstance(value, str) and "# TYPE " in value:
        return "".join(
            line
            for line in value.splitlines(keepends=True)
            if not any(re.search(rf"\b{metric}\b", line) for metric in ADDED_METRICS)
        )
    return value


def masked(value: Any, name: str | None = None) -> Any:
    if isinstance(value, dict):
        return {key: masked(item, key) for key, item in value.items()}
    if isinstance(value, list):
        return [masked(item) for item in value]
    if name in VARYING and value is not None:
        return "<varies>"
    if isinstance(value, str):
        value = re.sub(r"\d{4}-\d\d-\d\dT[\d:]+(\+00:00|Z)?", "<time>", value)
        value = re.sub(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", "<uuid>", value)
    return value


def fields(value: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of ``value`` by its path: a difference names the field."""
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() for k, v in fields(item, f"{path}/{key}").items()
        }
    if isinstance(value, list):
        return {
            k: v for n, item in enumerate(value) for k, v in fields(item, f"{path}[{n}]").items()
        }
    if isinstance(value, str) and "\n" in value:
        return {f"{path}:{n}": line for n, line in enumerate(value.splitlines())}
    return {path: value}


def test_the_audits_read_as_the_development_build_printed_them(tmp_path: Path) -> None:
    """Each case's show/list/stats JSON, Prometheus lines and attempts equal the
    development build's, field by field."""
    path = tmp_path / "journal.db"
    made = subprocess.run(
        [sys.executable, str(DATA / "make.py"), str(path)],
        env={**os.environ, "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    expected = json.loads((DATA / "development_journal5.json").read_text())
    actual = json.loads(made.stdout.replace(str(path), "<journal>"))
    assert fields(masked(expected)) == fields(masked(without_added(actual)))
