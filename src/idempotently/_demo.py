"""`idempotently demo`: the whole story on loopback, in under a minute.

The mock server runs in this process; a worker process sends charges through
a journaled Session and is killed mid-batch; resume finishes what it left;
the audit and the server's ledger show one charge per order.

``python -m idempotently._demo worker ...`` is the worker the demo kills.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import httpx

from idempotently._cli_format import operations_table, plural
from idempotently._exceptions import IdempotentlyError
from idempotently._journal import Journal
from idempotently._policy import RetryPolicy
from idempotently._session import Session

USER = "demo_user"
# Quick retries so the story fits in seconds; the defaults are gentler.
# Order 5's server stays "in progress" for the provider's latency (longer on a busy
# machine) while full-jitter backoffs may be a few milliseconds each: wait through
# enough 409s that the demo never depends on the machine's speed.
DEMO_POLICY = RetryPolicy(
    max_attempts=30, initial_backoff=0.05, max_backoff=0.5, in_progress_retries=25
)
PROVIDER_LATENCY = 0.25
WORKER_ORDERS = range(7, 13)
KILLED_ORDER = 9
MOCK_EXTRA = "the demo runs the companion mock server, which needs the [mock] extra:\n" + (
    "    python3 -m pip install 'idempotently[mock]'"
)


def charge(order: int, amount: int = 1000) -> dict[str, Any]:
    return {
        "amount": amount,
        "currency": "usd",
        "customer": "cus_demo",
        "metadata": {"order_id": f"order-{order}"},
    }


def open_session(journal: str | Path, url: str) -> Session:
    return Session(
        journal,
        base_url=url,
        headers={"Authorization": f"Bearer {USER}"},
        policy=DEMO_POLICY,
        timeout=5.0,
    )


def describe(response: httpx.Response) -> str:
    receipt = response.extensions["idempotently"]
    how = (
        "from the journal, no network call"
        if receipt.replayed_locally
        else "replayed by the server"
        if receipt.replayed
        else "created"
        if response.is_success
        else "answered"
    )
    attempts = plural(receipt.attempts, "attempt")
    return f"{response.status_code} ({how}; {attempts}, key {receipt.key[:8]}…)"


def run_worker(journal: str, url: str, orders: list[int]) -> None:
    """The worker's batch: one operation per order, safe to run again after a crash."""
    with open_session(journal, url) as session:
        for order in orders:
            print(json.dumps({"order": order, "event": "sending"}), flush=True)
            response = session.post(
                "/v1/charges", json=charge(order), operation_id=f"order-{order}:charge"
            )
            print(
                json.dumps({"order": order, "event": "done", "text": describe(response)}),
                flush=True,
            )


@click.command("demo")
@click.option("--keep/--no-keep", default=True, help="Keep the demo journal to explore it.")
def demo_command(keep: bool) -> None:
    """Show the whole story on loopback: faults, a crash, resume.

    A mock payments API on a free loopback port, charges through injected
    faults, a worker killed mid-batch, resume, then the audit and the ledger.
    """
    try:
        from idempotently.testing import Fault, MockServerConfig, serve
    except ImportError as error:
        raise click.ClickException(MOCK_EXTRA) from error
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="idempotently-demo-"))
    journal = workdir / "journal.db"
    say = click.echo
    with serve(MockServerConfig(provider_latency=PROVIDER_LATENCY)) as server:
        say(f"A mock payments API is listening on {server.url};\nthe journal is {journal}.")
        say("Each order is one operation with one idempotency key, journaled before sending.\n")

        say("1. Charges through injected faults")
        faults = server.faults
        faults.for_order("order-2", Fault.unavailable(), Fault.unavailable())
        faults.for_order("order-3", Fault.rate_limited(retry_after=1))
        faults.for_order("order-4", Fault.lose_response())
        stories = {
            1: "a clean call",
            2: "two 503s before the server does any work",
            3: "a 429 asking to retry after 1 s",
            4: "the server charges, then the response is lost",
            5: "the read times out mid-charge (the key is in progress: 409)",
            6: "an invalid amount: a final 400, never retried",
        }
        with open_session(journal, server.url) as session:
            for order, story in stories.items():
                options: dict[str, Any] = {"timeout": 0.1} if order == 5 else {}
                body = charge(order, amount=-5 if order == 6 else 1000)
                response = session.post(
                    "/v1/charges", json=body, operation_id=f"order-{order}:charge", **options
                )
                say(f"   order-{order}: {story}\n      -> {describe(response)}")

        say(f"\n2. A worker process sends orders {WORKER_ORDERS[0]}-{WORKER_ORDERS[-1]}")
        # The first try is charged but its answer lost; the retry is held, so the
        # worker is certainly mid-operation when it dies.
        faults.for_order(f"order-{KILLED_ORDER}", Fault.lose_response(), Fault.delay(2.0))
        with _worker(journal, server.url, list(WORKER_ORDERS)) as worker:
            _wait_for(lambda: bool(server.charges(order_id=f"order-{KILLED_ORDER}")), 30)
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
        say(f"   killed with SIGKILL after the server charged order-{KILLED_ORDER}, before")
        say("   the worker could record the answer. The journal still holds its key:")
        with Journal(journal, create=False) as audit:
            for operation in audit.operations(status="pending"):
                say(f"   {operation.operation_id}: pending, key {operation.key[:8]}…")

        say("\n3. Resume (what `idempotently resume` does after a crash)")
        with open_session(journal, server.url) as session:
            for result in session.resume():
                say(f"   {result.operation_id}: {result.action} {result.detail}")

        say("\n4. The restarted worker runs its whole batch again")
        with _worker(journal, server.url, list(WORKER_ORDERS)) as worker:
            assert worker.stdout is not None
            for line in worker.stdout:
                event = json.loads(line)
                if event["event"] == "done":
                    say(f"   order-{event['order']}: {event['text']}")
            if worker.wait(timeout=60) != 0:
                raise click.ClickException("the restarted worker failed; see its output above")

        say("\n5. The audit: the journal, as `idempotently list` shows it")
        with Journal(journal, create=False) as audit:
            operations = audit.operations(newest_first=False)
            width = shutil.get_terminal_size().columns - 3  # the indent
            for line in operations_table(operations, time.time(), width=width):
                say(f"   {line}")
        ledger = server.ledger.count_by_order()
        stats = server.stats()
        say("\n6. The server's ledger: charges per order")
        for order in list(stories) + list(WORKER_ORDERS):
            say(f"   order-{order:<3} {plural(ledger.get((USER, f'order-{order}'), 0), 'charge')}")
        duplicates = server.ledger.duplicates()
        charged = sum(ledger.values())
        refused = [op for op in operations if op.status == "failed"]
        say(
            f"\n{plural(len(operations), 'operation')}, {plural(charged, 'charge')}, "
            f"{plural(len(duplicates), 'duplicate')}, {len(refused)} refused (never retried).\n"
            f"The server replayed {plural(stats.replays, 'answer')} and said 'in progress' "
            f"{plural(stats.conflicts, 'time')}."
        )
        if duplicates or charged != len(operations) - len(refused):
            raise click.ClickException("exactly-once did not hold: see the ledger above")
    say(f"Done in {time.monotonic() - started:.1f} s.")
    if keep:
        say(f"Explore it: idempotently --journal {journal} list   (or: show, stats)")
    else:
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()


@contextmanager
def _worker(journal: Path, url: str, orders: list[int]) -> Iterator[subprocess.Popen[str]]:
    command = [sys.executable, "-m", "idempotently._demo", "worker", str(journal), url]
    process = subprocess.Popen([*command, *map(str, orders)], stdout=subprocess.PIPE, text=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


def _wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise click.ClickException("the demo's worker did not get that far in time")
        time.sleep(0.01)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m idempotently._demo")
    parser.add_argument("role", choices=["worker"])
    parser.add_argument("journal")
    parser.add_argument("url")
    parser.add_argument("orders", nargs="+", type=int)
    args = parser.parse_args(argv)
    try:
        run_worker(args.journal, args.url, args.orders)
    except IdempotentlyError as error:
        print(json.dumps({"event": "error", "text": str(error)}), flush=True)
        raise SystemExit(1) from error


if __name__ == "__main__":
    main()
