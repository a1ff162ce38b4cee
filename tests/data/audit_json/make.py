"""Build the issue-29 audit cases in a new journal and print what the audits show.

    PYTHONPATH=<a build's src> python tests/data/audit_json/make.py JOURNAL > OUT.json

Run once with the build at git tag v0.1.0.dev-journal5 (its output is
development_journal5.json, beside this file) and by tests/test_journal_audit_json.py
with this build: the two must agree field by field, ids and times aside. Public API
only (Session, MockTransport, the CLI), so the same script runs on both builds.
"""

from __future__ import annotations

import json
import os
import sys

import httpx
from click.testing import CliRunner

import idempotently
from idempotently.cli import cli

URL = "https://api.example.test/v1/charges"
SCRIPTS: dict[str, list[httpx.Response | Exception]] = {
    "ok": [httpx.Response(201, json={"id": "ch_1"})],
    "bad": [httpx.Response(400, json={"error": "card declined"})],
    "replayed": [httpx.Response(201, json={"id": "ch_2"}, headers={"Idempotent-Replayed": "true"})],
    "several": [
        httpx.Response(503, headers={"Retry-After": "0"}),
        httpx.ConnectError("refused"),
        httpx.Response(409, json={"error": "in progress"}),
        httpx.Response(201, json={"id": "ch_3"}),
    ],
    "unread": [httpx.Response(201, content=b"x" * 4096)],
    "killed": [httpx.Response(201, json={"id": "ch_4"})],
}


def handler(request: httpx.Request) -> httpx.Response:
    operation = json.loads(request.content)["case"]
    answer = SCRIPTS[operation].pop(0)
    if isinstance(answer, Exception):
        raise answer
    return answer


def main() -> None:
    path = sys.argv[1]
    transport = httpx.MockTransport(handler)
    policy = idempotently.RetryPolicy(max_attempts=6, initial_backoff=0.001, max_backoff=0.001)
    pid = os.fork()
    if pid == 0:  # the first attempt of "killed" dies in flight

        def die(request: httpx.Request) -> httpx.Response:
            os._exit(9)

        with idempotently.Session(path, transport=httpx.MockTransport(die)) as session:
            session.post(URL, json={"case": "killed"}, operation_id="killed")
    os.waitpid(pid, 0)
    with idempotently.Session(
        path, transport=transport, policy=policy, max_response_bytes=1024
    ) as session:
        for case in ("ok", "bad", "replayed", "several", "unread"):
            try:
                session.post(URL, json={"case": case}, operation_id=case)
            except idempotently.IdempotentlyError as error:
                print(f"{case}: {type(error).__name__}", file=sys.stderr)
        session.resume()
    runner = CliRunner()
    shown = {}
    for case in (*SCRIPTS,):
        result = runner.invoke(cli, ["--journal", path, "show", case, "--format", "json"])
        shown[case] = json.loads(result.output) if result.output.strip() else result.output
    with idempotently.Journal(path, readonly=True) as journal:
        attempts = {
            case: [
                list(map(str, attempt.__attrs_attrs__))
                and {a.name: getattr(attempt, a.name) for a in attempt.__attrs_attrs__}
                for attempt in journal.operation(case).attempts
            ]
            for case in SCRIPTS
        }
    out = {
        "show": shown,
        "list": json.loads(
            runner.invoke(cli, ["--journal", path, "list", "--format", "json"]).output
        ),
        "stats": json.loads(
            runner.invoke(cli, ["--journal", path, "stats", "--format", "json"]).output
        ),
        "prometheus": runner.invoke(
            cli, ["--journal", path, "stats", "--format", "prometheus"]
        ).output,
        "attempts": attempts,
    }
    print(json.dumps(out, indent=1, sort_keys=True, default=str))


if __name__ == "__main__":
    main()
