"""What differs between a journaled operation and a call reusing its id (pure).

Run only when the fingerprints already differ, so never on the hot path. The
answer names the part — the method, the URL, a header, the JSON path of the
first differing body field — and never a body value or a header value: bodies
carry personal data and card numbers, and the message goes to logs. URLs are
shown with their userinfo and secret query parameters redacted.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from collections.abc import Iterable, Sequence
from typing import Any

import httpx

from idempotently._keys import canonical_body, header_value, normalised_url
from idempotently._secret_params import DEFAULT_SECRET_PARAMS, REDACTED

SECRET_QUERY_PARAMETERS = DEFAULT_SECRET_PARAMS | {"key"}
"""Query parameters whose values are shown as ``[redacted]``: those the journal redacts,
and ``key`` (printing costs nothing; the journal keeps it, see ``DEFAULT_SECRET_PARAMS``)."""

_SECRETISH = re.compile(r"(?i)(^|[_-])(token|secret|password|passwd|signature|api[_-]?key)$")


def shown_url(url: str | httpx.URL) -> str:
    """``url`` fit for a message: no userinfo, secret query values ``[redacted]``."""
    try:
        parsed = url if isinstance(url, httpx.URL) else httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        return "(an unreadable URL)"
    if parsed.userinfo:
        parsed = parsed.copy_with(username=None, password=None)
    path, _, raw_query = parsed.raw_path.decode("ascii", "replace").partition("?")
    base = f"{parsed.scheme}://{parsed.netloc.decode('ascii', 'replace')}{path}"
    if not raw_query:
        return base
    pairs = []
    for pair in raw_query.split("&"):
        name, sep, _ = pair.partition("=")
        pairs.append(f"{name}={REDACTED}" if sep and _is_secret(name) else pair)
    return base + "?" + "&".join(pairs)


def _is_secret(name: str) -> bool:
    lowered = urllib.parse.unquote_plus(name).lower()
    return lowered in SECRET_QUERY_PARAMETERS or _SECRETISH.search(lowered) is not None


def first_difference(
    *,
    method: str,
    url: str,
    headers: Sequence[tuple[str, str]],
    body: bytes,
    request: httpx.Request,
    fingerprint_headers: Iterable[str] = (),
) -> str | None:
    """What makes ``request`` another request than the journaled one, in words; None if
    nothing shown here differs (a header that was never journaled, say)."""
    if method.upper() != request.method.upper():
        return f"the method: it was {method.upper()}, now {request.method.upper()}"
    try:
        journaled_url = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        journaled_url = None
    if journaled_url is None or normalised_url(journaled_url) != normalised_url(request.url):
        return _url_difference(url, journaled_url, request.url)
    stored = httpx.Headers(list(headers))
    body_part = _body_difference(
        canonical_body(body, header_value(stored, b"content-type")),
        canonical_body(request.content, header_value(request.headers, b"content-type")),
    )
    if body_part is not None:
        return body_part
    for name in sorted({name.lower() for name in fingerprint_headers}):
        if stored.get_list(name) != request.headers.get_list(name):
            return f"the {name} header (a fingerprinted header; its values are not shown)"
    return None


def _url_difference(url: str, journaled: httpx.URL | None, live: httpx.URL) -> str:
    before, after = shown_url(journaled or url), shown_url(live)
    if journaled is not None and (journaled.scheme, journaled.netloc) != (live.scheme, live.netloc):
        what = "the URL's origin (scheme, host or port)"
    elif (
        journaled is not None
        and journaled.raw_path.partition(b"?")[0] != live.raw_path.partition(b"?")[0]
    ):
        what = "the URL's path"
    elif journaled is not None:
        what = "the URL's query"
    else:
        what = "the URL"
    return f"{what}: it was {before}, now {after}"


_MISSING = object()


def _body_difference(before: bytes, after: bytes) -> str | None:
    if before == after:
        return None
    old, new = _json(before), _json(after)
    if old is _MISSING or new is _MISSING:
        return (
            f"the body ({len(before)} bytes then, {len(after)} now; not both JSON, so no "
            "field is named)"
        )
    path = _first_path(old, new, "$")
    return f"the body at {path} (its values are not shown)"


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return _MISSING


def _first_path(old: Any, new: Any, path: str) -> str:
    """The JSON path of the first place ``old`` and ``new`` differ (keys in sorted order)."""
    if isinstance(old, dict) and isinstance(new, dict):
        for name in sorted(set(old) | set(new)):
            if name not in old or name not in new:
                return _member(path, name) + (" (added)" if name in new else " (removed)")
            if not _same(old[name], new[name]):
                return _first_path(old[name], new[name], _member(path, name))
        return path
    if isinstance(old, list) and isinstance(new, list):
        for index, (left, right) in enumerate(zip(old, new, strict=False)):
            if not _same(left, right):
                return _first_path(left, right, f"{path}[{index}]")
        if len(old) != len(new):
            return f"{path} ({len(old)} items then, {len(new)} now)"
        return path
    return path


def _same(left: Any, right: Any) -> bool:
    if type(left) is not type(right):
        return False
    if isinstance(left, float) and math.isnan(left) and math.isnan(right):
        return True
    return bool(left == right)


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _member(path: str, name: str) -> str:
    """``$.amount``, or ``$["a key"]`` for a name that is not an identifier."""
    if _IDENTIFIER.fullmatch(name):
        return f"{path}.{name}"
    return f"{path}[{json.dumps(name)[:80]}]"
