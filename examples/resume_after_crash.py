"""After a crash: finish every pending operation with its stored key, exactly once.

Run it from a cron job or at worker start-up; `idempotently resume` does the same
from the command line.
"""

import httpx

import idempotently
from idempotently.testing import Fault, serve

# A fixed port and a file for the stand-in API's own records: run this script
# again in the same folder and every request is the same as the first time, so
# the journal answers it (no KeyReuseError for a URL that changed), and the
# API still remembers the charges it made, as a real one would.
with serve(port=8405, db="resume_after_crash-api.db") as api:
    # A process sends a charge; the server charges, but the response is lost and
    # the process dies before it can retry (max_attempts=1 stands in for the crash).
    api.faults.for_order("invoice-7", Fault.lose_response())
    with idempotently.Session(
        "idempotently.db",
        base_url=api.url,
        headers={"Authorization": "Bearer user_1"},
        policy=idempotently.RetryPolicy(max_attempts=1),
    ) as session:
        try:
            session.post(
                "/v1/charges",
                json={
                    "amount": 500,
                    "currency": "usd",
                    "customer": "cus_7",
                    "metadata": {"order_id": "invoice-7"},
                },
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

    # Charged once, although sent twice (and once more, answered by the journal, on a re-run).
    assert len(api.charges(order_id="invoice-7")) == 1
