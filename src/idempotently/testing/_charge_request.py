"""What a charge request must look like before any work starts (pure functions).

Everything here runs before the key is claimed, so a refusal saves nothing:
a malformed request may be fixed and resent with the same key. Every value
that passes fits the database and the fake provider as it is, so a request
that passes cannot fail later for being malformed (with its key claimed).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any, Literal, NoReturn
from urllib.parse import parse_qsl

import attrs

from idempotently.testing._config import KeyFormat
from idempotently.testing._problems import Problem, bad_request

MAX_BODY_BYTES = 1024 * 1024
"""The largest body read (1 MiB); a valid charge is a few kilobytes at most."""

MAX_AMOUNT = 99_999_999
"""Stripe's limit (eight digits of minor units); far inside SQLite's signed 64-bit INTEGER."""

MAX_CUSTOMER_LENGTH = 255
MAX_METADATA_KEYS = 50
MAX_METADATA_KEY_LENGTH = 40
MAX_METADATA_VALUE_LENGTH = 500
"""Stripe's metadata limits: 50 keys, names up to 40 characters, values up to 500."""

_REQUIRED = frozenset({"amount", "currency", "customer"})
_FIELDS = _REQUIRED | {"metadata"}
# No JSON number a charge needs is longer than this; int() of a much longer
# literal is slow and, past 4300 digits, a ValueError.
_MAX_NUMBER_DIGITS = 100
# Control characters (C0, DEL, C1) and unpaired surrogates: JSON can carry
# them as escapes, but no charge field needs them and a lone surrogate cannot
# even be encoded as UTF-8 (for the request hash and SQLite).
_UNWANTED_CHARACTER = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_CURRENCY = re.compile("[A-Za-z]{3}")
# What an Idempotency-Key may hold: printable ASCII (RFC 8941's sf-string range).
_KEY_CHARACTERS = re.compile(r"[\x20-\x7e]*")
_JSON_WHITESPACE = " \t\r\n"
_JSON_MEDIA_TYPE = re.compile(r"application/(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+\+)?json")


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


BodyFormat = Literal["json", "form"]
FORM_MEDIA_TYPE = "application/x-www-form-urlencoded"


def check_content_type(content_type: str | None, content_encoding: str | None) -> BodyFormat:
    """How the body is encoded: UTF-8 JSON or, as Stripe's SDK sends, a UTF-8 form.

    Anything else (another media type, charset or a Content-Encoding) is a
    415. No Content-Type at all is taken as JSON, as many clients send raw bytes.
    """
    if content_encoding is not None and content_encoding.strip().lower() not in ("", "identity"):
        raise _unsupported(f"Content-Encoding {_shown(content_encoding)} is not supported")
    if content_type is None:
        return "json"
    media_type, *parameters = content_type.split(";")
    media_type = media_type.strip().lower()
    body_format: BodyFormat = "form" if media_type == FORM_MEDIA_TYPE else "json"
    if body_format == "json" and not _JSON_MEDIA_TYPE.fullmatch(media_type):
        raise _unsupported(f"Content-Type {_shown(content_type)} is neither JSON nor a form")
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        charset = value.strip().strip('"').lower()
        if name.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            raise _unsupported(f"charset {_shown(charset)} is not UTF-8")
    return body_format


def _unsupported(reason: str) -> Problem:
    return Problem(
        415,
        "Unsupported Media Type",
        f"{reason}: send the charge as Content-Type: application/json (or"
        f" {FORM_MEDIA_TYPE}), UTF-8, uncompressed",
        slug="unsupported-media-type",
    )


def declared_too_large(content_length: str | None) -> bool:
    """Whether a Content-Length header announces more than `MAX_BODY_BYTES`."""
    if content_length is None:
        return False
    digits = content_length.strip().lstrip("0")
    if not (digits.isascii() and digits.isdigit()):
        return False  # not a length; reading the body finds out its size
    return len(digits) > len(str(MAX_BODY_BYTES)) or int(digits) > MAX_BODY_BYTES


def body_too_large() -> Problem:
    return Problem(
        413,
        "Content Too Large",
        f"the body is larger than {MAX_BODY_BYTES} bytes (1 MiB); a charge is a few kilobytes:"
        " send only amount, currency, customer and metadata",
        slug="body-too-large",
    )


def parse_charge(
    body: bytes, body_format: BodyFormat = "json"
) -> tuple[ChargeRequest, dict[str, Any]]:
    """The validated charge and the document it came from; raises a 400 `Problem`.

    A form (`amount=1000&currency=usd&metadata[order]=42`, as Stripe's SDK
    sends it) becomes the same document as its JSON twin and passes the same
    checks. Never raises anything else, whatever the bytes: a body the server
    cannot read is the client's to fix, not a 500.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad_request(
            f"the body is not valid UTF-8 (byte {error.start}: {error.reason});"
            f" send the {'form' if body_format == 'form' else 'JSON'} encoded as UTF-8",
            slug="invalid-json",
        ) from None
    if body_format == "form":
        document: Any = _form_document(text)
        return _validated(document), document
    if not text.strip(_JSON_WHITESPACE):
        raise bad_request(
            "the body is empty; send the charge as a JSON object", slug="invalid-json"
        )
    if text.startswith("\ufeff"):
        raise bad_request(
            "the body starts with a byte order mark; send UTF-8 JSON without one (RFC 8259)",
            slug="invalid-json",
        )
    try:
        document = json.loads(
            text,
            object_pairs_hook=_object_without_duplicates,
            parse_constant=_refuse_constant,
            parse_int=_bounded_int,
        )
    except RecursionError:
        raise bad_request(
            "the body is nested too deeply; a charge is one object whose only nested"
            " value is metadata, an object of strings",
            slug="invalid-json",
        ) from None
    except ValueError as error:  # json.JSONDecodeError among them
        raise bad_request(f"the body is not valid JSON: {error}", slug="invalid-json") from None
    return _validated(document), document


_FORM_METADATA = re.compile(r"metadata\[([^\[\]]*)\]")


def _form_document(text: str) -> dict[str, Any]:
    """The JSON-shaped document a form stands for: `amount` a number, `metadata[k]` nested."""
    if not text.strip():
        raise bad_request("the body is empty; send the charge as a form or a JSON object")
    try:
        # errors="strict": a %-escape that is not UTF-8 (%ff) is refused, not read as
        # U+FFFD, which would make different bodies one request (one fingerprint).
        pairs = parse_qsl(text, keep_blank_values=True, strict_parsing=True, errors="strict")
    except UnicodeDecodeError as error:
        raise bad_request(
            f"the form has a %-escape that is not UTF-8 ({error.reason}); percent-encode the"
            " field values' UTF-8 bytes"
        ) from None
    except ValueError as error:
        raise bad_request(f"the body is not a valid form: {error}") from None
    document: dict[str, Any] = {}
    metadata: dict[str, str] = {}
    for name, value in pairs:
        nested = _FORM_METADATA.fullmatch(name)
        target, field = (metadata, nested.group(1)) if nested else (document, name)
        if field in target:
            raise bad_request(
                f"the field {_shown(name)} appears twice in the form; send each field once"
            )
        target[field] = value
    if "metadata" in document:
        raise bad_request("send metadata as metadata[key]=value fields in a form")
    if metadata:
        document["metadata"] = metadata
    amount = document.get("amount")
    if isinstance(amount, str) and amount.isascii() and amount.isdigit():
        document["amount"] = _bounded_int(amount)
    return document


def _validated(document: Any) -> ChargeRequest:
    if not isinstance(document, dict):
        raise bad_request(f"the body must be a JSON object, got {_shown(document)}")
    unknown = sorted(set(document) - _FIELDS)
    if unknown:
        raise bad_request(
            f"unknown field(s) {', '.join(_shown(name) for name in unknown[:5])}"
            f"{'' if len(unknown) <= 5 else f' and {len(unknown) - 5} more'};"
            f" a charge has {', '.join(sorted(_FIELDS))}"
        )
    missing = sorted(_REQUIRED - set(document))
    if missing:
        raise bad_request(
            f"missing field(s) {', '.join(missing)}; a charge needs {', '.join(sorted(_REQUIRED))}"
        )
    amount = document["amount"]
    if isinstance(amount, bool) or not isinstance(amount, int) or not 1 <= amount <= MAX_AMOUNT:
        raise bad_request(
            f"amount must be an integer number of minor units (cents) from 1 to {MAX_AMOUNT},"
            f" got {_shown(amount)}"
        )
    currency = document["currency"]
    if not isinstance(currency, str) or not _CURRENCY.fullmatch(currency):
        raise bad_request(
            f'currency must be a three-letter ISO 4217 code such as "usd", got {_shown(currency)}'
        )
    customer = _text("customer", document["customer"], MAX_CUSTOMER_LENGTH)
    metadata = document.get("metadata", {})
    if not isinstance(metadata, dict):
        raise bad_request(f"metadata must be an object of strings, got {_shown(metadata)}")
    if len(metadata) > MAX_METADATA_KEYS:
        raise bad_request(
            f"metadata has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed"
        )
    for name, value in metadata.items():
        _text("a metadata key", name, MAX_METADATA_KEY_LENGTH)
        if "[" in name or "]" in name:
            raise bad_request(
                f"the metadata key {_shown(name)} contains a square bracket;"
                " keys are filtered as metadata[key], so brackets are not allowed"
            )
        _text(f"metadata[{name}]", value, MAX_METADATA_VALUE_LENGTH, may_be_empty=True)
    return ChargeRequest(amount, currency, customer, dict(metadata))


def _text(name: str, value: Any, max_length: int, *, may_be_empty: bool = False) -> str:
    """`value` if it is a string a charge may hold, else a 400 saying why."""
    if not isinstance(value, str) or not (value or may_be_empty):
        article = "a" if may_be_empty else "a non-empty"
        raise bad_request(f"{name} must be {article} string, got {_shown(value)}")
    if len(value) > max_length:
        raise bad_request(
            f"{name} is {len(value)} characters long; at most {max_length} are allowed"
        )
    unwanted = _UNWANTED_CHARACTER.search(value)
    if unwanted:
        raise bad_request(
            f"{name} contains {_shown(unwanted.group())} at index {unwanted.start()};"
            " control characters and unpaired surrogates are not allowed"
        )
    return value


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Refuse `{"amount": 1, "amount": 2}`: parsers disagree on which value wins."""
    document: dict[str, Any] = {}
    for name, value in pairs:
        if name in document:
            raise bad_request(
                f"the field {_shown(name)} appears twice in one object; send each field once",
                slug="invalid-json",
            )
        document[name] = value
    return document


def _refuse_constant(name: str) -> NoReturn:
    raise bad_request(
        f"{name} is not a JSON number (RFC 8259); send finite numbers only", slug="invalid-json"
    )


def _bounded_int(literal: str) -> int:
    if len(literal) > _MAX_NUMBER_DIGITS:
        raise bad_request(
            f"the body holds a number with {len(literal)} digits; amount is at most"
            f" {MAX_AMOUNT} and no other field is a number"
        )
    return int(literal)


def _shown(value: Any) -> str:
    """`value` as JSON for a problem detail: scalars shortened, containers named."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    rendered = json.dumps(value)
    return rendered if len(rendered) <= 40 else f"{rendered[:37]}..."


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
    """The idempotency key carried by the header value; raises a 400 `Problem`.

    `value` is the header as Starlette decodes it (latin-1), so non-ASCII
    bytes show up here as characters outside printable ASCII and are refused.
    """
    if value is None or not value.strip(" \t"):
        raise bad_request(
            "this endpoint needs an Idempotency-Key header: one key per logical operation,"
            " reused on every retry",
            slug="missing-idempotency-key",
        )
    value = value.strip(" \t")
    if not _KEY_CHARACTERS.fullmatch(value):
        index, character = next(
            (index, character)
            for index, character in enumerate(value)
            if not " " <= character <= "~"
        )
        raise bad_request(
            f"the Idempotency-Key has {_shown(character)} at index {index}; a key is printable"
            " ASCII (a UUID is a good key)",
            slug="invalid-idempotency-key",
        )
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
