"""A process that journals operations and is SIGKILLed during each one's first send.

For the first-attempt crash tests: it reads one JSON line per journal on stdin,
``{"journal": PATH, "operation_id": ID, "delivery": D, "now": T}``, and forks a
child that opens a Session on that journal (its clock fixed at ``T``) and posts
:data:`BODY` to :data:`URL` through a transport that SIGKILLs the child: the key
is committed, the send has begun, no attempt is journaled, and the dead child's
lease is left behind. Then it prints ``{"event": "killed", "signal": N}``.

Forking from this process, which never opens a journal or starts a thread itself,
makes one such journal in milliseconds instead of a new interpreter's start-up.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import httpx

import idempotently

URL = "https://api.example.test/v1/charges"
BODY = {"amount": 1000, "currency": "usd"}


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def send_and_die(journal: str, operation_id: str, delivery: str, now: float) -> None:
    def killed_mid_send(request: httpx.Request) -> httpx.Response:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL cannot be caught")

    with idempotently.Session(
        journal,
        transport=httpx.MockTransport(killed_mid_send),
        clock=lambda: now,
        headers={"Authorization": "Bearer sk_test"},
    ) as session:
        session.post(URL, json=BODY, operation_id=operation_id, delivery=delivery)  # type: ignore[arg-type]


def main() -> int:
    for line in sys.stdin:
        order = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                send_and_die(
                    order["journal"], order["operation_id"], order["delivery"], order["now"]
                )
            finally:
                os._exit(3)  # the send returned or raised: the test sees no SIGKILL
        _, status = os.waitpid(pid, 0)
        emit("killed", signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
