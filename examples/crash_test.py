"""Crash-test a checkout: kill it at every journal step of every charge, restart, count.

    pip install 'idempotently[mock]'
    python examples/crash_test.py

`charge_orders` is the code under test. `crash_points` runs it in child
processes against a mock payments API, kills each with SIGKILL at one step of
one charge (before and after its key commits, after the request is sent,
after the answer arrives, before it is recorded), recovers as the application
would on restart (resume, then the code again), and compares the ledger with a
clean run's. Swap the operation id for `str(uuid.uuid4())` to see a restart
charge a customer twice.
"""

from __future__ import annotations

import idempotently
from idempotently.testing import crash_points


def charge_orders(session: idempotently.Session) -> None:
    for order in ("order-1", "order-2"):
        session.post(
            "/v1/charges",
            operation_id=f"{order}:charge",  # from the order: the same after a restart
            json={
                "amount": 2500,
                "currency": "usd",
                "customer": "cus_1",
                "metadata": {"order_id": order},
            },
        )


if __name__ == "__main__":
    report = crash_points(charge_orders)  # on a terminal, a line per point as it goes
    print(report)
    report.assert_exactly_once()
