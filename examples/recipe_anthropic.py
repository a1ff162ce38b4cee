"""Recipe: Anthropic's Python SDK (anthropic 2.x, built on httpx2) with a journaled transport.

Install: ``pip install 'idempotently[httpx2]' anthropic`` (httpx2 needs Python 3.11+).

Like every Stainless-generated SDK (OpenAI's too), anthropic sends no
idempotency key of its own and retries on its own. Under
``idempotently.Transport`` that combination is the trap this recipe shows:
each of the SDK's retries is a new request without a key, so the transport
journals it as a new operation with a new key, and the server runs it again.
So:

1. ``max_retries=0``: the transport is the only retry layer, and it retries
   with the same key and bytes;
2. name each operation with an ``Idempotency-Operation-Id`` header, so a rerun
   after a crash continues it instead of starting another.

The mock server speaks a payments API, not Anthropic's; the recipe reaches it
with the SDK's low-level ``client.post(path, cast_to=object, body=...)``, the
path ``client.messages.create(...)`` takes through the SDK, its httpx2 client
and the transport.
"""

import anthropic
import httpx2

import idempotently
from idempotently.testing import Fault, serve  # a local stand-in for the API

CHARGE = {"amount": 1000, "currency": "usd", "customer": "cus_1"}


def sdk(api_url: str, transport: idempotently.Transport, retries: int) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        auth_token="sk-ant-recipe",  # sent as Authorization: Bearer; never journaled
        base_url=api_url,
        max_retries=retries,
        http_client=httpx2.Client(transport=transport),
    )


def charge(client: anthropic.Anthropic, order: str, **headers: str) -> object:
    return client.post(
        "/v1/charges",
        cast_to=object,
        body={**CHARGE, "metadata": {"order_id": order}},
        options={"headers": headers},
    )


# A fixed port and a file for the stand-in API's own records: run this script
# again in the same folder and every request is the same as the first time, so
# the journal answers it, and the API still remembers the charges it made.
with serve(port=8408, db="recipe_anthropic-api.db") as api:
    one_try = idempotently.RetryPolicy(max_attempts=1)  # the transport gives up at once

    # The trap: the SDK's own retry after a lost answer is a new operation.
    before = len(api.charges(order_id="trap"))
    api.faults.for_order("trap", Fault.lose_response())
    trapped = sdk(api.url, idempotently.Transport("idempotently.db", policy=one_try), retries=1)
    charge(trapped, "trap")  # the SDK retried, with no key: the server charged again
    assert 2 == len(api.charges(order_id="trap")) - before, "two charges for one order"
    # The first operation, its answer lost, is still pending in the journal: resume
    # settles it with its own key (the server replays; no third charge).
    auth = {"Authorization": "Bearer sk-ant-recipe"}
    with idempotently.Session("idempotently.db", headers=auth) as session:
        session.resume()
    assert 2 == len(api.charges(order_id="trap")) - before

    # The recipe: SDK retries off, the operation named; the transport retries.
    api.faults.for_order("51", Fault.lose_response())
    client = sdk(api.url, idempotently.Transport("idempotently.db"), retries=0)
    first = charge(client, "51", **{"Idempotency-Operation-Id": "order-51"})
    again = charge(client, "51", **{"Idempotency-Operation-Id": "order-51"})  # from the journal
    assert first == again and 1 == len(api.charges(order_id="51")), "one charge"
    print("order-51 charged once:", len(api.charges(order_id="51")))
