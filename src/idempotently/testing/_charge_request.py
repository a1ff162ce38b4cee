"""What a charge request must look like before any work starts (pure functions).

Everything here runs before the key is claimed, so a refusal saves nothing:
a malformed request may be fixed and resent with the same key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import attrs

from idempotently.testing._config import KeyFormat
from idempotently.testing._problems import bad_request

_FIELDS = frozenset({"amount", "currency", "customer", "metadata"})


@attrs.frozen
class ChargeRequest:
    """A validated `POST /v1/charges` body."""

    amount: int
    currency: str
    customer: str
    metadata: dict[str, str]

    @property
    def order_id(self) -> str | None:
        return self.metadata.get("order_id")


def parse_charge(body: bytes) -> tuple[ChargeRequest, Any]:
    """The validated charge and the decoded JSON it came from; raises a 400 `Problem`."""
    try:
        document = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad_request(f"the body is not valid JSON: {error}", slug="invalid-json") from None
    if not isinstance(document, dict):
        raise bad_request("the body must be a JSON object")
    unknown = sorted(set(document) - _FIELDS)
    if unknown:
        raise bad_request(
            f"unknown field(s) {', '.join(unknown)}; a charge has {', '.join(sorted(_FIELDS))}"
        )
    amount = document.get("amount")
    if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
        raise bad_request(f"amount must be a positive integer (minor units), got {amount!r}")
    currency = document.get("currency")
    if not isinstance(currency, str) or not currency:
        raise bad_request(f"currency must be a non-empty string, got {currency!r}")
    customer = document.get("customer")
    if not isinstance(customer, str) or not customer:
        raise bad_request(f"customer must be a non-empty string, got {customer!r}")
    metadata = document.get("metadata", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(value, str) for value in metadata.values()
    ):
        raise bad_request("metadata must be an object of string values")
    return ChargeRequest(amount, currency, customer, dict(metadata)), document


def request_hash(method: str, path: str, query: Iterable[tuple[str, str]], document: Any) -> str:
    """SHA-256 over what makes two requests the same request.

    Method, path, the sorted query and a canonical (key-sorted, whitespace-free)
    rendering of the JSON body: two semantically equal bodies agree however
    they were serialised, and no header (Date, trace ids) takes part.
    """
    canonical_query = "&".join(f"{name}={value}" for name, value in sorted(query))
    canonical_body = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    material = "\n".join((method.upper(), path, canonical_query, canonical_body))
    return hashlib.sha256(material.encode("utf-8")).hexdigest()


def parse_key(value: str | None, *, key_format: KeyFormat, max_length: int) -> str:
    """The idempotency key carried by the header value; raises a 400 `Problem`."""
    if value is None or not value.strip():
        raise bad_request(
            "this endpoint needs an Idempotency-Key header: one key per logical operation,"
            " reused on every retry",
            slug="missing-idempotency-key",
        )
    value = value.strip()
    key = _parse_sf_string(value) if key_format == "quoted" else value
    if not key:
        raise bad_request("the Idempotency-Key is empty", slug="invalid-idempotency-key")
    if len(key) > max_length:
        raise bad_request(
            f"the Idempotency-Key is {len(key)} characters long; at most {max_length} are allowed",
            slug="invalid-idempotency-key",
        )
    return key


def _parse_sf_string(value: str) -> str:
    """Decode an RFC 8941 sf-string (`"abc"`, with `\\"` and `\\\\` escapes)."""

    def invalid(reason: str) -> Exception:
        return bad_request(
            f'the Idempotency-Key must be an RFC 8941 string such as "abc" ({reason})',
            slug="invalid-idempotency-key",
        )

    if not value.startswith('"'):
        raise invalid("it is not quoted")
    characters: list[str] = []
    index = 1
    while index < len(value):
        char = value[index]
        if char == "\\":
            if index + 1 >= len(value) or value[index + 1] not in '"\\':
                raise invalid('only \\" and \\\\ may be escaped')
            characters.append(value[index + 1])
            index += 2
            continue
        if char == '"':
            if value[index + 1 :].strip():
                raise invalid("there is text after the closing quote")
            return "".join(characters)
        if not " " <= char <= "~":
            raise invalid(f"{char!r} is not printable ASCII")
        characters.append(char)
        index += 1
    raise invalid("the closing quote is missing")
