"""KeyReuseError names what differs — method, URL, header or body path — never a body value.

A caller who reuses an operation id with another request must learn what
changed (a new random port, a query parameter, a field) without the message
carrying personal data or credentials into logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

import idempotently
from idempotently._differences import first_difference, shown_url

FIRST = "http://127.0.0.1:5001/v1/charges"
BODY: dict[str, Any] = {
    "amount": 1000,
    "customer": {"email": "jane.doe@example.test", "card": {"last4": "4242"}},
    "items": [{"sku": "A-1", "qty": 1}, {"sku": "B-2", "qty": 2}],
}
PERSONAL = ["jane.doe@example.test", "john.roe@example.test", "4242", "9999", "1000", "2000"]
"""Values from either body: none may appear in the message."""


def reuse(tmp_path: Path, second: dict[str, Any], **session: Any) -> str:
    """The KeyReuseError message when ``op`` is called again with ``second``'s changes."""
    answer = httpx.MockTransport(lambda request: httpx.Response(201, json={"id": "ch_1"}))
    call: dict[str, Any] = {"method": "POST", "url": FIRST, "json": BODY}
    with idempotently.Session(tmp_path / "journal.db", transport=answer, **session) as opened:
        opened.request(**call, operation_id="op", headers={"X-Tenant": "t-1"})
        changed = {**call, "headers": {"X-Tenant": "t-1"}, **second}
        with pytest.raises(idempotently.KeyReuseError) as caught:
            opened.request(**changed, operation_id="op")
    return str(caught.value)


def body_with(**changes: Any) -> dict[str, Any]:
    customer = {**BODY["customer"], **changes.pop("customer", {})}
    return {**BODY, "customer": customer, **changes}


def test_a_different_method_is_named(tmp_path: Path) -> None:
    """POST then PUT: the message says the method differs, and both methods."""
    message = reuse(tmp_path, {"method": "PUT"})
    assert "the method: it was POST, now PUT" in message


def test_a_different_port_is_named_as_the_origin(tmp_path: Path) -> None:
    """A new random port: the origin differs, both URLs shown, never "another payload"."""
    message = reuse(tmp_path, {"url": "http://127.0.0.1:5002/v1/charges"})
    assert (True, True, False) == (
        "the URL's origin (scheme, host or port)" in message,
        f"it was {FIRST}, now http://127.0.0.1:5002/v1/charges" in message,
        "another payload" in message,
    )


def test_a_different_query_is_named_with_secrets_redacted(tmp_path: Path) -> None:
    """A query that differs is named; api_key, token and userinfo values never show."""
    message = reuse(
        tmp_path,
        {"url": "http://user:hunter22@127.0.0.1:5001/v1/charges?api_key=sk_live_1&token=t0k3n"},
    )
    assert (True, []) == (
        "the URL's query: it was http://127.0.0.1:5001/v1/charges, now "
        "http://127.0.0.1:5001/v1/charges?api_key=[redacted]&token=[redacted]" in message,
        [secret for secret in ("hunter22", "sk_live_1", "t0k3n", "user:") if secret in message],
    )


def test_a_different_fingerprinted_header_is_named_without_its_value(tmp_path: Path) -> None:
    """A header in fingerprint_headers that changed is named; its values are not shown."""
    message = reuse(tmp_path, {"headers": {"X-Tenant": "t-2"}}, fingerprint_headers=["X-Tenant"])
    assert (True, []) == (
        "the x-tenant header" in message,
        [value for value in ("t-1", "t-2") if value in message],
    )


def test_a_nested_body_field_is_named_by_its_json_path(tmp_path: Path) -> None:
    """A changed e-mail deep in the body: ``$.customer.email``, and neither e-mail shown."""
    message = reuse(tmp_path, {"json": body_with(customer={"email": "john.roe@example.test"})})
    assert (True, []) == (
        "the body at $.customer.email" in message,
        [value for value in PERSONAL if value in message],
    )


def test_the_first_differing_field_is_named_in_key_order(tmp_path: Path) -> None:
    """Two fields differ: the first in sorted key order (``$.amount``) is the one named."""
    message = reuse(
        tmp_path, {"json": body_with(amount=2000, customer={"card": {"last4": "9999"}})}
    )
    assert (True, []) == (
        "the body at $.amount" in message,
        [value for value in PERSONAL if value in message],
    )


def test_a_list_item_is_named_by_its_index(tmp_path: Path) -> None:
    """A changed item in a list: ``$.items[1].qty``."""
    items = [{"sku": "A-1", "qty": 1}, {"sku": "B-2", "qty": 3}]
    assert "the body at $.items[1].qty" in reuse(tmp_path, {"json": body_with(items=items)})


def test_a_body_that_is_not_json_is_named_without_its_bytes(tmp_path: Path) -> None:
    """Form bodies that differ: "the body", sizes only, never the bytes."""
    first = {"amount": "1000", "email": "jane.doe@example.test"}
    answer = httpx.MockTransport(lambda request: httpx.Response(201))
    with idempotently.Session(tmp_path / "journal.db", transport=answer) as session:
        session.post(FIRST, data=first, operation_id="op")
        with pytest.raises(idempotently.KeyReuseError) as caught:
            session.post(FIRST, data={**first, "email": "john.roe@example.test"}, operation_id="op")
    message = str(caught.value)
    assert (True, []) == (
        "the body (" in message and "not both JSON" in message,
        [value for value in PERSONAL if value in message],
    )


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://api.example.test/v1?a=1", "https://api.example.test/v1?a=1"),
        ("https://u:p@api.example.test/v1", "https://api.example.test/v1"),
        (
            "https://api.example.test/v1?access_token=x&password=y&signature=z&secret=w",
            "https://api.example.test/v1?access_token=[redacted]&password=[redacted]"
            "&signature=[redacted]&secret=[redacted]",
        ),
        (
            "https://api.example.test/v1?API_KEY=x&client_secret=y&n=1",
            "https://api.example.test/v1?API_KEY=[redacted]&client_secret=[redacted]&n=1",
        ),
    ],
)
def test_shown_urls_never_carry_credentials(url: str, expected: str) -> None:
    """Userinfo is dropped and secret query values are redacted, whatever their case."""
    assert expected == shown_url(url)


def test_nothing_shown_differs_is_none() -> None:
    """A difference in nothing it compares (a header that was never journaled) is None."""
    request = httpx.Request("POST", FIRST, json=BODY)
    assert None is first_difference(
        method="POST",
        url=FIRST,
        headers=list(request.headers.items()),
        body=request.content,
        request=request,
    )
