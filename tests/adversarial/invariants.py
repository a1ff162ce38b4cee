"""What must hold after every hostile case: the journal still reads, nothing is lost,
nothing was sent twice, and no secret is on disk or on screen."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import attrs
import httpx
from click.testing import CliRunner

import idempotently
from idempotently.cli import cli


def cli_run(journal: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Exit code and everything printed (stdout and stderr) by one CLI command."""
    result = CliRunner().invoke(cli, ["--journal", str(journal), *args], env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(
            f"`idempotently {' '.join(args)}` raised {result.exception!r}"
        ) from result.exception
    return result.exit_code, result.output


def strict_json(text: str) -> object:
    """JSON as a script reads it: NaN and Infinity are not JSON."""

    def refuse(constant: str) -> object:
        raise AssertionError(f"{constant} in the CLI's JSON output")

    return json.loads(text, parse_constant=refuse)


def journal_bytes(journal: Path) -> bytes:
    """The journal file and its write-ahead log, as they are on disk."""
    data = b""
    for suffix in ("", "-wal"):
        path = f"{journal}{suffix}"
        if os.path.exists(path):
            with open(path, "rb") as file:
                data += file.read()
    return data


def audit(journal: Path, *, show: bool = True) -> str:
    """Run every read-only command on the journal; each must succeed. Returns all output.

    ``show=False`` leaves out ``show`` (for a case whose ``show`` has its own test)."""
    outputs = []
    commands: list[tuple[str, ...]] = [
        ("list",),
        ("list", "--json"),
        ("stats",),
        ("stats", "--json"),
    ]
    for args in commands:
        code, output = cli_run(journal, *args)
        assert (0, args) == (code, args), output
        outputs.append(output)
        if "--json" in args:
            strict_json(output)
    with idempotently.Journal(journal, create=False) as opened:
        ids = [operation.operation_id for operation in opened.operations()] if show else []
    for operation_id in ids:
        shows: list[tuple[str, ...]] = [("show", operation_id), ("show", operation_id, "--json")]
        for args in shows:
            code, output = cli_run(journal, *args)
            assert (0, args) == (code, args), output
            outputs.append(output)
            if "--json" in args:
                strict_json(output)
    return "\n".join(outputs)


def assert_sound(
    journal: Path,
    *,
    operations: Iterable[str] | None = None,
    secrets: Iterable[str | bytes] = (),
    screens: Iterable[str] = (),
    show: bool = True,
) -> list[idempotently.Operation]:
    """The journal opens and every command reads it; exactly ``operations`` are in it
    (when given); no secret is in the file, its WAL, the CLI output or ``screens``."""
    with idempotently.Journal(journal, create=False) as opened:
        found = opened.operations()
        for operation in found:
            assert opened.operation(operation.operation_id) is not None
    printed = audit(journal, show=show)
    if operations is not None:
        assert sorted(operations) == sorted(operation.operation_id for operation in found)
    on_disk = journal_bytes(journal)
    for secret in secrets:
        text = secret if isinstance(secret, str) else secret.decode("latin-1")
        raw = secret if isinstance(secret, bytes) else secret.encode("utf-8")
        assert raw not in on_disk, f"{secret!r} is in the journal file"
        assert text not in printed, f"{secret!r} is printed by the CLI"
        for screen in screens:
            assert text not in screen, f"{secret!r} is in {screen!r}"
    return found


def sent_once_per_key(keys: Iterable[bytes | None]) -> bool:
    """Every key reached the server exactly once."""
    return all(count == 1 for count in Counter(keys).values())


@attrs.define
class Recorder:
    """An httpx handler (``httpx.MockTransport(recorder)``): answers in order, then 201;
    keeps every request it was sent."""

    answers: list[httpx.Response | Exception] = attrs.field(factory=list)
    sent: list[httpx.Request] = attrs.field(factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.sent.append(request)
        answer = self.answers.pop(0) if self.answers else httpx.Response(201, json={"id": "ch_1"})
        if isinstance(answer, Exception):
            raise answer
        return answer

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)
