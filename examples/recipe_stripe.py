"""Recipe: Stripe's Python SDK (stripe 16.x) with a journaled idempotency key per charge.

Install: ``pip install idempotently stripe``.

Stripe's SDK sends through an ``HTTPClient``; its ``HTTPXClient`` keeps two
private httpx clients. Subclass it and give both clients an idempotently
transport: every POST is journaled (with the key the SDK puts on it) before
the first byte is sent, and a lost answer is retried with the same key and bytes.

Set ``max_network_retries=0``: the SDK has its own retry loop, and two retry
layers multiply attempts (every SDK try runs idempotently's whole retry
budget again); worse, the SDK turns any exception from its client into an
``APIConnectionError`` and retries it, so an ``OperationPendingError`` that
idempotently raised on purpose (outcome unknown, budget spent) would be
overridden. Let idempotently be the only layer that retries.

Pass ``idempotency_key`` from your own order id: after a crash the same call
finds its journaled operation (and the server replays the charge) instead of
starting a second one. Runs against the local mock server, which accepts the
SDK's form-encoded bodies.
"""

from pathlib import Path

import httpx
import stripe

import idempotently
from idempotently.testing import Fault, serve  # a local stand-in for Stripe's API


class JournaledHTTPXClient(stripe.HTTPXClient):
    """stripe.HTTPXClient whose httpx clients journal every write in ``journal``."""

    def __init__(self, journal: str | Path, **options: object) -> None:
        super().__init__(allow_sync_methods=True, **options)  # type: ignore[arg-type]
        # The SDK keeps these two clients private; replacing them is the only hook.
        self._client = httpx.Client(
            transport=idempotently.Transport(journal), timeout=self._timeout
        )
        self._client_async = httpx.AsyncClient(
            transport=idempotently.AsyncTransport(journal), timeout=self._timeout
        )


def charge_order(client: stripe.StripeClient, order_id: str) -> stripe.Charge:
    return client.v1.charges.create(
        params={
            "amount": 1000,
            "currency": "usd",
            "customer": "cus_1",
            "metadata": {"order_id": order_id},
        },
        options={"idempotency_key": f"order-{order_id}"},  # stable across restarts
    )


# A fixed port and a file for the stand-in API's own records: run this script
# again in the same folder and every request is the same as the first time, so
# the journal answers it (no KeyReuseError for a URL that changed), and the
# API still remembers the charges it made, as a real one would.
with serve(port=8404, db="recipe_stripe-api.db") as api:
    api.faults.for_order("42", Fault.lose_response())  # the first answer never arrives
    client = stripe.StripeClient(
        "sk_test_recipe",
        base_addresses={"api": api.url},
        http_client=JournaledHTTPXClient("idempotently.db"),
        max_network_retries=0,  # one retry layer: idempotently's
    )
    charge = charge_order(client, "42")
    again = charge_order(client, "42")  # e.g. the job ran twice: the journal answers

    # The first run sends the charge and its retry, the second call never reaches
    # the server; a re-run sends nothing at all: the journal answers both calls.
    sent = api.requests
    assert len(sent) in (2, 0) and all(request.key == "order-42" for request in sent)
    assert all(
        request.document
        == {"amount": 1000, "currency": "usd", "customer": "cus_1", "metadata": {"order_id": "42"}}
        for request in sent
    )
    assert [charge.id] == [made.id for made in api.charges(order_id="42")] == [again.id]
    print(charge.id, "for order 42, sent", len(api.requests), "times, charged once")
