"""Keys, request fingerprints and header redaction (pure)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Iterable
from typing import NamedTuple

import httpx

# Never written to the journal, whatever the user configures.
SENSITIVE_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization", "x-api-key"})
# Recomputed by httpx from the body on every send; storing them adds nothing.
_DERIVED_HEADERS = frozenset({"content-length", "transfer-encoding", "host"})
# Response headers that would leak a session into the journal.
_SENSITIVE_RESPONSE_HEADERS = frozenset({"set-cookie", "set-cookie2"})
# The stored body is already decoded; these would make httpx decode it again.
_ENCODING_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})


def new_key() -> str:
    return str(uuid.uuid4())


def derived_key(namespace: uuid.UUID, name: str) -> str:
    """``str(uuid.uuid5(namespace, name))``, without building a UUID object on the way
    (one per named call: the ``UUID`` constructor costs more than the SHA-1)."""
    digest = bytearray(hashlib.sha1(namespace.bytes + name.encode("utf-8")).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # the RFC 4122 variant
    text = digest.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def new_operation_id() -> str:
    return f"op_{os.urandom(16).hex()}"


def redaction_set(extra: Iterable[str] = ()) -> frozenset[str]:
    return SENSITIVE_HEADERS | {name.lower() for name in extra}


# httpx.Headers decodes every header on every lookup; the hot path reads the
# raw (bytes) list once instead. Header bytes are ASCII/latin-1 by RFC 9110.


def journaled_request_headers(
    headers: httpx.Headers, redacted: frozenset[str]
) -> list[tuple[str, str]]:
    """The request headers that may be stored: no secrets, nothing httpx derives."""
    stored = []
    for raw_name, raw_value in headers.raw:
        name = raw_name.decode("latin-1")
        lowered = name.lower()
        if lowered not in redacted and lowered not in _DERIVED_HEADERS:
            stored.append((name, raw_value.decode("latin-1")))
    return stored


class RequestHeaders(NamedTuple):
    """What the hot path needs from a request's headers, read in one pass
    (`read_request_headers`)."""

    journaled: list[tuple[str, str]]
    """What `journaled_request_headers` returns, before the key header is set."""
    secrets: list[str]
    """What `secret_values` returns."""
    fingerprinted: bytes
    """The fingerprinted headers' part of a `request_digest`."""
    has_key_header: bool
    """Whether the request already carries the profile's key header."""


def read_request_headers(
    headers: httpx.Headers,
    redacted: frozenset[str],
    url: httpx.URL,
    fingerprint_headers: Iterable[str],
    key_header: str,
) -> RequestHeaders:
    """The journaled headers, the secret values, the fingerprinted headers and whether
    the key header is set, in one pass over the raw header list instead of four."""
    journaled = []
    secrets = []
    key_header = key_header.lower()
    has_key_header = False
    for raw_name, raw_value in headers.raw:
        name = raw_name.decode("latin-1")
        lowered = name.lower()
        if lowered in redacted:
            secrets.append(raw_value.decode("latin-1"))
        elif lowered not in _DERIVED_HEADERS:
            journaled.append((name, raw_value.decode("latin-1")))
        if lowered == key_header:
            has_key_header = True
    if url.userinfo or url.query:
        _add_url_secrets(secrets, url)
    fingerprinted = b""
    if fingerprint_headers:  # rarely: a second look at the few headers named
        parts = []
        for wanted in sorted({name.lower() for name in fingerprint_headers}):
            values = [
                value for key, value in headers.raw if key.decode("latin-1").lower() == wanted
            ]
            parts.append(
                b"\0" + wanted.encode("utf-8", "backslashreplace") + b"=" + b",".join(values)
            )
        fingerprinted = b"".join(parts)
    return RequestHeaders(journaled, secrets, fingerprinted, has_key_header)


def is_journaled(name: str, redacted: frozenset[str]) -> bool:
    """Whether a request header of this name is stored (`journaled_request_headers`)."""
    lowered = name.lower()
    return lowered not in redacted and lowered not in _DERIVED_HEADERS


def journaled_response_headers(
    headers: httpx.Headers, redacted: frozenset[str]
) -> list[tuple[str, str]]:
    dropped = redacted | _SENSITIVE_RESPONSE_HEADERS | _ENCODING_HEADERS
    stored = []
    for raw_name, raw_value in headers.raw:
        name = raw_name.decode("latin-1")
        if name.lower() not in dropped:
            stored.append((name, raw_value.decode("latin-1")))
    return stored


def header_value(headers: httpx.Headers, name: bytes) -> str | None:
    """The first value of a header (``name`` lowercase), read from the raw list."""
    for raw_name, raw_value in headers.raw:
        if raw_name.lower() == name:
            return raw_value.decode("latin-1")
    return None


def normalised_url(url: httpx.URL) -> str:
    """Scheme, authority and raw path as sent on the wire, query pairs sorted.

    Raw (still percent-encoded) parts keep ``/a%2Fb`` apart from ``/a/b``.
    Built from the parts rather than ``URL.copy_with``, which re-parses the
    whole URL and costs more than the journal write on the hot path.
    """
    path, _, raw_query = url.raw_path.decode("ascii").partition("?")
    query = "&".join(sorted(raw_query.split("&"))) if raw_query else ""
    authority = url.netloc.decode("ascii")
    return f"{url.scheme}://{authority}{path}" + (f"?{query}" if query else "")


def canonical_body(body: bytes, content_type: str | None) -> bytes:
    """What identifies a body: JSON key-sorted and whitespace-free, multipart without its
    random boundary, anything else (or JSON too deep to canonicalise) as it is.

    Never raises: whatever httpx can send has a fingerprint.
    """
    if not content_type:
        return body
    lowered = content_type.lower()
    if "json" in lowered:
        try:
            return _CANONICAL_JSON.encode(json.loads(body)).encode()
        except (ValueError, RecursionError):
            return body
    if lowered.startswith("multipart/"):
        boundary = _BOUNDARY.search(content_type)
        if boundary is not None:
            return body.replace(boundary.group(1).strip('"').encode("latin-1"), b"")
    return body


# What json.dumps(parsed, sort_keys=True, separators=(",", ":")) uses, made once:
# json.dumps builds a new encoder for every call with options.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"))

_BOUNDARY = re.compile(r"(?i)boundary=(\"[^\"]+\"|[^;\s]+)")


def fingerprint(
    method: str,
    url: httpx.URL,
    body: bytes,
    headers: httpx.Headers,
    fingerprint_headers: Iterable[str] = (),
) -> str:
    """SHA-256 over what makes two requests the same operation.

    Volatile headers (Date, trace ids) are out unless named in
    ``fingerprint_headers``; the idempotency key itself is never in.
    """
    digest = hashlib.sha256()
    for part in (method.upper(), normalised_url(url)):
        digest.update(part.encode())
        digest.update(b"\0")
    digest.update(canonical_body(body, header_value(headers, b"content-type")))
    for name in sorted({name.lower() for name in fingerprint_headers}):
        values = [value for key, value in headers.raw if key.lower() == name.encode("latin-1")]
        digest.update(b"\0" + name.encode("latin-1") + b"=" + b",".join(values))
    return digest.hexdigest()


DIGEST_PREFIX = "raw:"
"""Marks a journaled ``fingerprint`` that is a `request_digest`; a value without
it was written by an earlier version and is a canonical `fingerprint`."""


def request_digest(method: str, url: httpx.URL, fingerprinted: bytes) -> str:
    """What the journal stores to recognise a request again, cheaply: a SHA-256 over the
    parts of the fingerprint that are compared exactly (method, normalised URL,
    fingerprinted headers), not the body.

    The body is journaled as it is, so a later call compares its bytes with the
    journaled ones, and canonicalises both (`same_body`) only when they differ:
    parsing and re-encoding every JSON body costs more than the rest of this per call,
    and is needed only when an ``operation_id`` is reused.
    """
    digest = hashlib.sha256()
    for part in (method.upper(), normalised_url(url)):
        digest.update(part.encode())
        digest.update(b"\0")
    digest.update(fingerprinted)  # RequestHeaders.fingerprinted
    return DIGEST_PREFIX + digest.hexdigest()


def same_body(
    journaled: bytes,
    journaled_content_type: str | None,
    live: bytes,
    live_content_type: str | None,
) -> bool:
    """Whether two bodies identify the same request: the same bytes, or the same
    canonical rendering (JSON that means the same, one upload under two boundaries)."""
    return journaled == live or canonical_body(journaled, journaled_content_type) == (
        canonical_body(live, live_content_type)
    )


def stored_header(headers: Iterable[tuple[str, str]], name: str) -> str | None:
    """The first value of a journaled header (``name`` lowercase)."""
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def journaled_url(url: httpx.URL) -> str:
    """The URL as stored: never with its userinfo (``https://user:pass@host``)."""
    if url.userinfo:
        return str(url.copy_with(username=None, password=None))
    return str(url)


def secret_values(
    headers: httpx.Headers, redacted: frozenset[str], url: httpx.URL | None = None
) -> list[str]:
    """The values an error text must never show: redacted headers, URL passwords and
    the URL's query."""
    values = [
        raw_value.decode("latin-1")
        for raw_name, raw_value in headers.raw
        if raw_name.decode("latin-1").lower() in redacted
    ]
    if url is not None:
        _add_url_secrets(values, url)
    return values


def _add_url_secrets(values: list[str], url: httpx.URL) -> None:
    if url.userinfo:
        values.extend(part for part in (url.password, url.userinfo.decode("latin-1")) if part)
    if url.query:
        # An API key in the query (?api_key=...): an error that quotes the URL (httpx's
        # raise_for_status does) must not carry it into events, logs and the journal.
        values.append(url.query.decode("ascii", "replace"))
