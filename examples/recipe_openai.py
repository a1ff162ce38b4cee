"""Recipe: OpenAI's Python SDK (openai 3.x, built on httpx2) with a journaled transport.

Install: ``pip install 'idempotently[httpx2]' openai`` (httpx2 needs Python 3.11+).

openai 3.x sends through an ``httpx2`` client (Pydantic's maintained fork of
httpx); ``idempotently.Transport`` works under httpx2 clients as under httpx
ones. Three patterns, each against the local mock server (reached with the
SDK's low-level ``client.post``: the mock server speaks a payments API, not
OpenAI's, but the request path through the SDK and the transport is the same):

1. Name an operation with the ``Idempotency-Operation-Id`` header: the SDK
   sends no key of its own, so the transport derives one from the name, and
   the same name after a restart continues the same operation.
2. Resume after a crash: an operation whose answer was lost stays pending in
   the journal; ``Session.resume()`` re-sends it later with its stored key.
3. At most once for servers that ignore keys (many AI endpoints do: a resend
   is a second, billed completion): ``Idempotency-Delivery: at_most_once``
   never resends a request that may have arrived.

``max_retries=0`` turns the SDK's own retries off, so there is one retry layer.
"""

import httpx2
import openai

import idempotently
from idempotently.testing import Fault, serve  # a local stand-in for the API

CHARGE = {"amount": 1000, "currency": "usd", "customer": "cus_1"}


def sdk(api_url: str, transport: idempotently.Transport) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="sk-recipe",
        base_url=f"{api_url}/v1",
        max_retries=0,  # idempotently retries; the SDK must not retry on top
        http_client=httpx2.Client(transport=transport),
    )


# A fixed port and a file for the stand-in API's own records: run this script
# again in the same folder and every request is the same as the first time, so
# the journal answers it (no KeyReuseError for a URL that changed), and the
# API still remembers the charges it made, as a real one would.
with serve(port=8403, db="recipe_openai-api.db") as api:
    # 1. A named operation: a lost answer is retried under the same key; calling
    #    again with the same name returns the journaled answer without sending.
    api.faults.for_order("42", Fault.lose_response())
    client = sdk(api.url, idempotently.Transport("idempotently.db"))
    named = {"headers": {"Idempotency-Operation-Id": "order-42"}}
    order_42 = {**CHARGE, "metadata": {"order_id": "42"}}
    first = client.post("/charges", cast_to=object, body=order_42, options=named)
    again = client.post("/charges", cast_to=object, body=order_42, options=named)
    assert first == again and len(api.charges(order_id="42")) == 1
    assert len(api.requests) in (2, 0)  # the lost answer and its retry; a re-run sends nothing

    # 2. The process "crashes" mid-call: one attempt only, its answer lost.
    api.faults.for_order("43", Fault.lose_response())
    one_try = idempotently.Transport(
        "idempotently.db", policy=idempotently.RetryPolicy(max_attempts=1)
    )
    try:
        sdk(api.url, one_try).post(
            "/charges",
            cast_to=object,
            body={**CHARGE, "metadata": {"order_id": "43"}},
            options={"headers": {"Idempotency-Operation-Id": "order-43"}},
        )
    except idempotently.OperationPendingError as error:  # the SDK lets it through
        print("crashed:", error.operation_id, "is pending")
    # ... after the restart, resume what is pending, with the stored key and bytes:
    with idempotently.Session(
        "idempotently.db", headers={"Authorization": "Bearer sk-recipe"}
    ) as session:
        resumed = session.resume()  # a re-run finds order-43 done: nothing is pending
    assert all(
        ("order-43", "succeeded", True) == (r.operation_id, r.action, r.replayed) for r in resumed
    )
    assert len(api.charges(order_id="43")) == 1

    # 3. At most once: the answer is lost and the request is never sent again.
    api.faults.for_order("44", Fault.lose_response())
    try:
        client.post(
            "/charges",
            cast_to=object,
            body={**CHARGE, "metadata": {"order_id": "44"}},
            options={"headers": {"Idempotency-Delivery": "at_most_once"}},
        )
    except idempotently.IdempotentlyError as error:
        print("at most once:", type(error).__name__, error.operation_id)
    assert (
        len([r for r in api.requests if (r.document or {}).get("metadata") == {"order_id": "44"}])
        == 1
    )
    print("charges:", len(api.charges()), "requests:", len(api.requests))
