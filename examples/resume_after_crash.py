"""After a crash: finish every pending operation with its stored key, exactly once.

Run it from a cron job or at worker start-up; `idempotently resume` does the same
from the command line.
"""

import httpx

import idempotently
from idempotently.testing import Fault, serve

with serve() as api:
    # A process sends a charge; the server charges, but the response is lost and
    # the process dies before it can retry (max_attempts=1 stands in for the crash).
    api.faults.push(Fault.lose_response())
    with idempotently.Session(
        "idempotently.db",
        base_url=api.url,
        headers={"Authorization": "Bearer user_1"},
        policy=idempotently.RetryPolicy(max_attempts=1),
    ) as session:
        try:
            session.post(
                "/v1/charges",
                json={"amount": 500, "currency": "usd", "customer": "cus_7", "metadata": {}},
                operation_id="invoice-7:charge",
            )
        except idempotently.OperationPendingError as error:
            print("left pending:", error.operation_id)

    # Later, a fresh process: credentials come from its client, never the journal.
    def reconcile(
        operation: idempotently.Operation, client: httpx.Client
    ) -> idempotently.Settlement | None:
        return None  # look the object up by operation id here; None leaves it to a human

    with idempotently.Session(
        "idempotently.db", base_url=api.url, headers={"Authorization": "Bearer user_1"}
    ) as session:
        for result in session.resume(reconciler=reconcile):
            print(result.operation_id, result.action, result.detail)

    assert len(api.charges()) == 1  # charged once, although sent twice
