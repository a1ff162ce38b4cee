"""A salted, slow digest of a request's credentials (never their values).

For servers that fold the credentials into the stored key (a key is "this
key, for this API token"), an operation made under one token and resent under
another would be a new request to them: a second charge. With
``ServerProfile(key_bound_to_credentials=True)`` the journal keeps, for each
operation, which credentials it was made with (their names) and an scrypt
digest of their values, salted with the journal's own random namespace; a
resend whose live credentials digest differently is refused.

scrypt is slow by design (tens of milliseconds): the digest of one set of
values is computed once per process and kept in memory, never on disk.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

import httpx

from idempotently._secret_params import redacted_url

CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key"})
"""Headers that are credentials whatever else is redacted."""
NOT_CREDENTIAL_HEADERS = frozenset({"cookie"})
"""Headers never journaled but never credentials either, even when named in
``redact_headers``. Cookie is not one: a cookie jar changes with answers that set one
(a load balancer's affinity cookie, a refreshed session), so a key bound to it would
keep every resend refused, and a pause scoped to it would stop applying to the very
client it was answered to."""

SCRYPT_N = 2**14
SCRYPT_R = 8
SCRYPT_P = 1
"""scrypt's cost (16 MiB, a few tens of milliseconds): the interactive-login setting."""

_SALT_PREFIX = b"idempotently credentials digest\0"


def is_credential_header(name: str, redacted_headers: frozenset[str]) -> bool:
    """Whether a request header of this (lowercase) name is a credential: one of
    `CREDENTIAL_HEADERS`, or one the journal redacts, save `NOT_CREDENTIAL_HEADERS`."""
    return name in CREDENTIAL_HEADERS or (
        name in redacted_headers and name not in NOT_CREDENTIAL_HEADERS
    )


def credential_names(
    request: httpx.Request, redacted_headers: frozenset[str], secret_params: Collection[str]
) -> tuple[str, ...]:
    """What in ``request`` counts as its credentials, by name: ``header:NAME`` for each
    credential header it carries (`is_credential_header`), ``query:NAME`` for each
    secret query parameter it carries (``secret_params``: the journal's secret names,
    compared without case; NAME as the URL spells it); sorted.

    The one definition of a request's credentials: what a key bound to credentials is
    bound to, and what an origin pause is scoped to."""
    names = {
        f"header:{lowered}"
        for raw_name, _ in request.headers.raw
        if is_credential_header(lowered := raw_name.decode("latin-1").lower(), redacted_headers)
    }
    _, carried = redacted_url(request.url, frozenset(name.lower() for name in secret_params))
    names.update(f"query:{name}" for name in carried)
    return tuple(sorted(names))


def credential_values(request: httpx.Request, names: Iterable[str]) -> tuple[bytes, ...]:
    """The values of the credentials ``names`` in ``request`` (b"" where one is missing,
    so a missing credential digests differently from any given one)."""
    query: dict[str, list[str]] = {}
    if request.url.query:
        for pair in request.url.query.decode("ascii").split("&"):
            raw_name, sep, raw_value = pair.partition("=")
            if sep:
                query.setdefault(urllib.parse.unquote_plus(raw_name), []).append(raw_value)
    values = []
    for name in names:
        kind, _, wanted = name.partition(":")
        if kind == "header":
            found = [value for key, value in request.headers.raw if key.lower() == wanted.encode()]
            values.append(b"\0missing" if not found else b"\n".join(found))
        else:
            given = query.get(wanted)
            values.append(b"\0missing" if not given else "&".join(given).encode("ascii"))
    return tuple(values)


DigestKey = tuple[bytes, tuple[str, ...], tuple[bytes, ...]]
"""(salt, credential names, their values): what one digest is of."""

_CACHE: OrderedDict[DigestKey, str] = OrderedDict()
_CACHE_SIZE = 256
_CACHE_LOCK = threading.Lock()


def digest_key(salt: bytes, request: httpx.Request, names: Sequence[str]) -> DigestKey:
    names = tuple(names)
    return salt, names, credential_values(request, names)


def cached_digest(key: DigestKey) -> str | None:
    """The digest of ``key`` if this process computed it already (it costs nothing)."""
    with _CACHE_LOCK:
        digest = _CACHE.get(key)
        if digest is not None:
            _CACHE.move_to_end(key)
        return digest


def compute_digest(key: DigestKey) -> str:
    """scrypt over the names and values (tens of milliseconds), kept in memory after."""
    salt, names, values = key
    material = b"".join(
        len(part).to_bytes(4, "big") + part for part in (*(n.encode() for n in names), *values)
    )
    digest = hashlib.scrypt(
        material, salt=_SALT_PREFIX + salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=32
    ).hex()
    with _CACHE_LOCK:
        _CACHE[key] = digest
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return digest


def credentials_record(names: Sequence[str], digest: str) -> str:
    """What ``operations.credentials_digest`` holds: the names digested, the scrypt
    cost and the digest (never a value)."""
    return json.dumps(
        {"names": list(names), "scrypt": [SCRYPT_N, SCRYPT_R, SCRYPT_P], "digest": digest},
        separators=(",", ":"),
    )


def read_record(text: str) -> tuple[tuple[str, ...], str]:
    """The names and the digest of a `credentials_record`; ValueError if it is
    not one this version can check."""
    try:
        parsed = json.loads(text)
    except ValueError:
        raise ValueError("credentials_digest is not JSON") from None
    if (
        not isinstance(parsed, dict)
        or not isinstance(parsed.get("names"), list)
        or not all(isinstance(name, str) for name in parsed["names"])
        or not isinstance(parsed.get("digest"), str)
    ):
        raise ValueError("credentials_digest is not a digest record")
    if parsed.get("scrypt") != [SCRYPT_N, SCRYPT_R, SCRYPT_P]:
        raise ValueError(
            f"credentials_digest was made with scrypt cost {parsed.get('scrypt')!r}, which "
            "this version does not use"
        )
    return tuple(parsed["names"]), parsed["digest"]


def same_digest(left: str, right: str) -> bool:
    return hmac.compare_digest(left, right)


def described(names: Sequence[str]) -> str:
    """``the Authorization header and the api_key query parameter``."""
    parts = []
    for name in names:
        kind, _, what = name.partition(":")
        parts.append(f"the {what} header" if kind == "header" else f"the {what} query parameter")
    if not parts:
        return "no credentials"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
