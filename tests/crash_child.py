"""A worker process for the crash-safety tests: charges orders, resumes, and dies on cue.

``charge`` mode posts ``order-{i}:charge`` for each order through a Session,
one after the other, printing one JSON line per answer. With ``--kill-at
PHASE --kill-on-order K`` it stops itself (SIGKILL, or SIGSTOP to stay alive
holding its lease) at that exact point of order K's call, by wrapping the
library in this process only:

- ``before_commit``: before the operation's row is committed to the journal;
- ``before_send``: journaled and leased, before a byte goes on the wire;
- ``after_charge``: the request was written on a raw socket and the server's
  charge can be looked up, but not a byte of the answer was read;
- ``before_journal_update``: the answer arrived, its attempt is not yet journaled.

``resume`` mode runs ``Session.resume()``; with ``--barrier`` it reads the
pending queue, prints ``ready`` and waits for a line on stdin before sending,
so two resumers start from the same snapshot at the same moment.

Every line is flushed as it is written, so a test waits on lines, never on sleeps.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import httpx

import idempotently
from idempotently import profiles
from idempotently._commands import Insert, Record
from idempotently._commands_rare import Queue

PHASES = ("before_commit", "before_send", "after_charge", "before_journal_update")
USER = "shop_1"
CHARGES_PATH = "/v1/charges"
# How long after_charge waits for the server's charge to show before giving up.
CHARGE_LOOKUP_TIMEOUT = 20.0
CLIENT_TIMEOUT = 60.0


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def operation_id(order: int) -> str:
    return f"order-{order}:charge"


def charge_body(order: int) -> dict[str, Any]:
    return {
        "amount": 100 + order,
        "currency": "usd",
        "customer": "cus_1",
        "metadata": {"order_id": f"order-{order}"},
    }


def die(phase: str, signal_name: str, **fields: Any) -> None:
    emit("stopping", phase=phase, signal=signal_name, pid=os.getpid(), **fields)
    os.kill(os.getpid(), getattr(signal, f"SIG{signal_name}"))
    if signal_name == "KILL":
        raise SystemExit(99)  # never reached: SIGKILL cannot be caught


def order_of(request: httpx.Request) -> str:
    return str(json.loads(request.content)["metadata"]["order_id"])


class CrashingTransport(httpx.BaseTransport):
    """The real transport, except for the doomed order's request."""

    def __init__(self, phase: str, order_id: str, signal_name: str, url: str) -> None:
        self._inner = httpx.HTTPTransport()
        self._phase = phase
        self._order_id = order_id
        self._signal = signal_name
        self._url = url

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if order_of(request) == self._order_id:
            if self._phase == "before_send":
                die(self._phase, self._signal, order_id=self._order_id)
            if self._phase == "after_charge":
                self._write_then_die(request)
        return self._inner.handle_request(request)

    def _write_then_die(self, request: httpx.Request) -> None:
        # The request goes out whole on a socket nobody reads from: the server
        # charges and answers into the void.
        url = request.url
        assert url.port is not None
        sock = socket.create_connection((url.host, url.port))
        head = f"{request.method} {url.raw_path.decode('ascii')} HTTP/1.1\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in request.headers.items())
        sock.sendall(head.encode("latin-1") + b"\r\n" + request.content)
        charge = self._look_up_charge(request.headers["authorization"])
        die(self._phase, self._signal, order_id=self._order_id, charge_id=charge["id"])

    def _look_up_charge(self, authorization: str) -> dict[str, Any]:
        deadline = time.monotonic() + CHARGE_LOOKUP_TIMEOUT
        with httpx.Client(base_url=self._url, headers={"Authorization": authorization}) as client:
            while time.monotonic() < deadline:
                found = client.get(
                    CHARGES_PATH, params={"metadata[order_id]": self._order_id}
                ).json()["data"]
                if found:
                    return dict(found[0])
                time.sleep(0.005)
        emit("error", detail=f"no charge for {self._order_id} after {CHARGE_LOOKUP_TIMEOUT} s")
        raise SystemExit(3)

    def close(self) -> None:
        self._inner.close()


def wrap_journal(
    journal: idempotently.Journal, phase: str, doomed_operation_id: str, signal_name: str
) -> None:
    """Make this process stop at ``phase`` of the doomed operation's journal writes.

    At the one seam every write passes (the journal's commit of a batch, seen
    through `Journal.observe_commits`): before its key's row is committed, or
    before the attempt that answers it is.
    """

    def dying(writes: Sequence[Any], durable: bool) -> None:
        for write in writes:
            doomed_key = isinstance(write, Insert) and write.new.operation_id == doomed_operation_id
            if phase == "before_commit" and doomed_key:
                die(phase, signal_name, operation_id=doomed_operation_id)
            doomed_answer = isinstance(write, Record) and write.operation_id == doomed_operation_id
            if phase == "before_journal_update" and doomed_answer:
                assert isinstance(write, Record)
                die(
                    phase,
                    signal_name,
                    operation_id=doomed_operation_id,
                    status=write.record.status_code,
                )

    journal.observe_commits(before=dying)


BOUND = attrs.evolve(profiles.GENERIC, name="bound", key_bound_to_credentials=True)


def set_token(request: httpx.Request) -> None:
    request.headers["Authorization"] = f"Bearer {USER}"


def die_in_hook(request: httpx.Request) -> None:
    die("in_request_hook", "KILL", key=request.headers.get("idempotency-key"))


def charge(args: argparse.Namespace, session: idempotently.Session) -> None:
    for order in range(args.first, args.orders):
        response = session.post(
            CHARGES_PATH, json=charge_body(order), operation_id=operation_id(order)
        )
        receipt = response.extensions["idempotently"]
        emit(
            "answered",
            operation_id=receipt.operation_id,
            key=receipt.key,
            status=response.status_code,
            charge_id=response.json().get("id"),
            replayed=receipt.replayed,
            replayed_locally=receipt.replayed_locally,
        )


def wait_at_barrier(pending: int) -> None:
    emit("ready", pending=pending)
    if not sys.stdin.readline():
        raise SystemExit("stdin closed before the go line")


def resume(args: argparse.Namespace, session: idempotently.Session) -> None:
    if args.barrier:
        journal = session.journal
        execute = journal._execute

        def queue_then_wait(command: Any) -> Any:
            reply = execute(command)
            if isinstance(command, Queue):
                wait_at_barrier(len(reply))
            return reply

        journal._execute = queue_then_wait  # type: ignore[method-assign]
    session.resume(
        base_url=args.url,
        on_result=lambda result: emit("resumed", pid=os.getpid(), **result.to_json()),
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("mode", choices=("charge", "resume"))
    parser.add_argument("--journal", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--first", type=int, default=0, help="first order number")
    parser.add_argument("--orders", type=int, default=0, help="orders [first, orders) are charged")
    parser.add_argument("--kill-at", choices=PHASES)
    parser.add_argument("--kill-on-order", type=int, default=0)
    parser.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    parser.add_argument("--barrier", action="store_true")
    parser.add_argument("--durability", choices=("fsync", "os"), default="fsync")
    parser.add_argument("--codec", help="module:NAME of the journal's codec (bodies encoded)")
    parser.add_argument(
        "--token-by-hook",
        action="store_true",
        help="credentials set by a request hook (not headers=), keys bound to them",
    )
    parser.add_argument(
        "--die-in-hook",
        action="store_true",
        help="with --token-by-hook: SIGKILL in the hook, key journaled, nothing bound or sent",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    options: dict[str, Any] = {}
    codec = None
    if args.codec is not None:
        module, _, name = args.codec.partition(":")
        codec = getattr(importlib.import_module(module), name)
    journal = idempotently.Journal(args.journal, durability=args.durability, codec=codec)
    if args.kill_at is not None:
        wrap_journal(journal, args.kill_at, operation_id(args.kill_on_order), args.signal)
        options["transport"] = CrashingTransport(
            args.kill_at, f"order-{args.kill_on_order}", args.signal, args.url
        )
    run: Callable[[argparse.Namespace, idempotently.Session], None] = (
        charge if args.mode == "charge" else resume
    )
    if args.token_by_hook:
        # The usual token-refresh pattern: the token is set as the request leaves.
        options["event_hooks"] = {"request": [die_in_hook if args.die_in_hook else set_token]}
        options["profile"] = BOUND
    else:
        options["headers"] = {"Authorization": f"Bearer {USER}"}
    with idempotently.Session(
        journal,
        base_url=args.url,
        policy=idempotently.RetryPolicy(initial_backoff=0.001, max_backoff=0.01),
        # Generous: a request the test holds at the proxy must not time out and be retried.
        timeout=CLIENT_TIMEOUT,
        **options,
    ) as session:
        run(args, session)
    emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
