"""Recipe: any SDK built on httpx that accepts your ``http_client``.

Install: ``pip install idempotently`` and the SDK.

Most generated SDKs (Stainless, Speakeasy, Fern...) take ``http_client=`` and
have their own retry loop. The recipe is the same for all of them:

- give them ``httpx.Client(transport=idempotently.Transport("idempotently.db"))``
  (or ``httpx.AsyncClient(transport=idempotently.AsyncTransport(...))``);
- turn their retries off (``max_retries=0`` or the SDK's equivalent): two
  retry layers multiply attempts, and only idempotently's are journaled;
- name the operation with an ``Idempotency-Operation-Id`` header (most SDKs
  take ``extra_headers=``) when the SDK draws a fresh key per call, so a
  rerun after a crash continues the same operation instead of starting one.
"""

import uuid

import anyio
import httpx

import idempotently
from idempotently.testing import Fault, serve  # a local stand-in for the API


class PaymentsSDK:
    """A typical generated SDK: a fresh key per call, its own retries, extra_headers."""

    def __init__(self, api_key: str, base_url: str, *, http_client: httpx.Client) -> None:
        self._client = http_client
        self._base_url = base_url
        self._headers = {"Authorization": f"Bearer {api_key}"}

    def create_charge(
        self, *, extra_headers: dict[str, str] | None = None, **charge: object
    ) -> dict[str, object]:
        headers = {**self._headers, "Idempotency-Key": str(uuid.uuid4()), **(extra_headers or {})}
        response = self._client.post(f"{self._base_url}/v1/charges", json=charge, headers=headers)
        response.raise_for_status()
        return dict(response.json())


# A fixed port and a file for the stand-in API's own records: run this script
# again in the same folder and every request is the same as the first time, so
# the journal answers it (no KeyReuseError for a URL that changed), and the
# API still remembers the charges it made, as a real one would.
with serve(port=8402, db="recipe_httpx_sdk-api.db") as api:
    # Sync: the first answer is lost; the transport retries under the SDK's key.
    api.faults.for_order("7", Fault.unavailable(), Fault.lose_response())
    with httpx.Client(transport=idempotently.Transport("idempotently.db")) as http_client:
        sdk = PaymentsSDK("user_1", api.url, http_client=http_client)
        order = {"Idempotency-Operation-Id": "order-7"}
        seven = {"amount": 500, "currency": "eur", "customer": "c", "metadata": {"order_id": "7"}}
        charge = sdk.create_charge(**seven, extra_headers=order)
        # A rerun (same operation name, a fresh SDK key) is answered from the journal.
        rerun = sdk.create_charge(**seven, extra_headers=order)
    assert charge == rerun and [charge["id"]] == [made.id for made in api.charges(order_id="7")]
    # One key on the wire (the first run: three attempts; a re-run sends nothing).
    assert len({request.key for request in api.requests}) <= 1

    # Async: the same with AsyncTransport under an httpx.AsyncClient.
    async def main() -> None:
        api.faults.push(Fault.lose_response())
        transport = idempotently.AsyncTransport("idempotently.db")
        async with httpx.AsyncClient(base_url=api.url, transport=transport) as client:
            response = await client.post(
                "/v1/charges",
                json={"amount": 700, "currency": "eur", "customer": "c"},
                headers={"Authorization": "Bearer user_1"},
            )
        assert 201 == response.status_code
        print("async:", response.json()["id"], response.extensions["idempotently"].attempts)

    anyio.run(main)
    print("charges:", len(api.charges()), "requests:", len(api.requests))
