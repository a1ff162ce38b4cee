import idempotently
from idempotently.testing import serve  # a local stand-in for a payments API

charge = {"amount": 1000, "currency": "usd", "customer": "cus_42", "metadata": {}}
# A fixed port: run this script again in the same folder and the request is the
# same as the first time, so the journal answers it (a new port would be a new URL).
with serve(port=8401) as api:
    auth = {"Authorization": "Bearer user_1"}
    with idempotently.Session("idempotently.db", base_url=api.url, headers=auth) as session:
        r = session.post("/v1/charges", json=charge, operation_id="order-42:charge")
        again = session.post("/v1/charges", json=charge, operation_id="order-42:charge")
        print(r.status_code, r.json()["id"], again.extensions["idempotently"].replayed_locally)
