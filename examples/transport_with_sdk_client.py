"""Give an httpx-based SDK the journal: hand it a client whose transport is idempotently's.

Many vendor SDKs take an ``http_client=httpx.Client(...)``; ``VendorSDK`` below
stands in for one. It puts its own ``Idempotency-Key`` on each write, as such
SDKs do; the transport adopts that key, journals it before the first byte is
sent, and retries a lost answer with the same key and bytes.
"""

import uuid

import httpx

import idempotently
from idempotently.testing import Fault, serve  # a local stand-in for a payments API


class VendorSDK:
    """The shape of a typical SDK: one httpx client, a fresh key per call."""

    def __init__(self, api_key: str, base_url: str, http_client: httpx.Client) -> None:
        self._client = http_client
        self._base_url = base_url
        self._auth = {"Authorization": f"Bearer {api_key}"}

    def create_charge(self, **charge: object) -> httpx.Response:
        headers = {**self._auth, "Idempotency-Key": f"sdk-{uuid.uuid4()}"}
        response = self._client.post(f"{self._base_url}/v1/charges", json=charge, headers=headers)
        response.raise_for_status()
        return response


# A fixed port: run this script again in the same folder and the request is the
# same as the first time, so the journal answers it (a new port would be a new URL).
with serve(port=8406) as api:
    api.faults.push(Fault.lose_response())  # the first answer never arrives
    http_client = httpx.Client(transport=idempotently.Transport("idempotently.db"))
    with http_client:
        sdk = VendorSDK("user_1", api.url, http_client=http_client)
        response = sdk.create_charge(amount=1000, currency="usd", customer="cus_1", metadata={})
    receipt = response.extensions["idempotently"]
    assert [response.json()["id"]] == [charge.id for charge in api.charges()], "one charge"
    print(response.json()["id"], "key", receipt.key, "attempts", receipt.attempts)
