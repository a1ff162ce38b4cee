"""Parsing of the rate-limit headers a server sends besides Retry-After (pure).

Each family a profile trusts (`ServerProfile.rate_limit_headers`) names a request
quota: how many requests are left, and when the quota resets. `request_quota` reads
the trusted ones from an answer and says how long until an exhausted quota resets:

- ``x-ratelimit``: ``X-RateLimit-Remaining`` and ``X-RateLimit-Reset`` (GitHub's style;
  a reset above 10**9 is epoch seconds, below it a delta);
- ``ratelimit``: the IETF fields (draft-ietf-httpapi-ratelimit-headers): ``RateLimit:
  "default";r=0;t=30`` with ``RateLimit-Policy`` (a policy whose quota unit is not
  requests is no request counter), the older ``RateLimit: limit=10, remaining=0,
  reset=5``, and the oldest ``RateLimit-Remaining`` / ``RateLimit-Reset``;
- ``openai``: ``x-ratelimit-remaining-requests`` and ``x-ratelimit-reset-requests``
  (a Go duration: ``1s``, ``6m0s``, ``20ms``);
- ``anthropic``: ``anthropic-ratelimit-requests-remaining`` and
  ``anthropic-ratelimit-requests-reset`` (an RFC 3339 time).

Token counters (``x-ratelimit-remaining-tokens``, ``anthropic-ratelimit-tokens-*``,
``...-input-tokens-*``) are never read: a spent token quota says nothing about the next
request's size, so it never pauses a send. Nothing here raises on what a server sends:
garbage means "no hint"; every wait is clamped to `MAX_SERVER_WAIT` and is never NaN
or infinite.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Callable, Iterable, Mapping

import attrs

from idempotently._retry_after import _DIGITS, MAX_SERVER_WAIT, _whole_number

EPOCH_ABOVE = 10**9
"""A reset value above this is a time (seconds since the epoch), at or below it a delta."""
_MAX_LENGTH = 64
"""The longest single value read (a run of digits excepted: however long, it is a number)."""
_MAX_FIELD = 4096
"""The longest whole field read: a list or repeated header longer than this is junk."""
_MAX_MEMBERS = 16
"""The most values of one field looked at (repeated headers, list members)."""
_NUMBER = r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)"
_DURATION = r"(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:h|m|s|ms|us|µs|μs|ns))+"
_DURATION_PART = r"([0-9]+\.?[0-9]*|\.[0-9]+)(h|ms|m|s|us|µs|μs|ns)"
_UNITS = {
    "h": 3600.0,
    "m": 60.0,
    "s": 1.0,
    "ms": 1e-3,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ns": 1e-9,
}


@attrs.frozen
class QuotaReset:
    """A request quota the answer reports spent, and when it comes back."""

    wait: float
    """Seconds until the quota resets, from the reader's now: above 0, at most a year."""
    header: str
    """The header that said when (named in the pause's reason)."""


@attrs.frozen
class _Limit:
    remaining: float | None
    reset: float | None
    header: str


def request_quota(
    headers: Mapping[str, str], families: Iterable[str], *, now: float, limited: bool
) -> QuotaReset | None:
    """The longest wait until a trusted request quota resets, among those the answer
    reports spent: remaining stated as 0 (or less), or, when the answer itself says
    "limited" (``limited``: a 429 or 503), not stated; a quota with requests left
    gives none. None when no such quota has a reset in the future."""
    found: QuotaReset | None = None
    for family in families:
        reader = _READERS.get(family)  # "retry-after" is read by `server_wait`
        if reader is None:
            continue
        for limit in reader(headers, now):
            if limit.reset is None or not limit.reset > 0:
                continue
            spent = limit.remaining <= 0 if limit.remaining is not None else limited
            if spent and (found is None or limit.reset > found.wait):
                found = QuotaReset(limit.reset, limit.header)
    return found


# -- values -------------------------------------------------------------------------------


def _members(value: str | None) -> list[str]:
    """The comma-separated values of a (possibly repeated) header, a bounded few."""
    if value is None:
        return []
    if len(value) > _MAX_FIELD:
        stripped = value.strip()
        return [stripped] if _DIGITS.fullmatch(stripped) else []
    return [member.strip() for member in value.split(",", _MAX_MEMBERS)[:_MAX_MEMBERS]]


def _number(text: str) -> float | None:
    """A finite number, or None; a run of digits of any length is clamped, not refused."""
    if _DIGITS.fullmatch(text):
        return _whole_number(text, 1e18)
    if len(text) > _MAX_LENGTH or not re.fullmatch(_NUMBER, text, re.ASCII):
        return None
    number = float(text)
    return number if math.isfinite(number) else None


def _remaining(value: str | None) -> float | None:
    """The fewest requests left among the values (repeated headers), or None."""
    if value is None:
        return None
    if len(value) < 16 and value.isdigit() and value.isascii():
        return float(value)  # one count, the answer of every server that sends one
    counts = [count for count in map(_number, _members(value)) if count is not None]
    return min(counts) if counts else None


def _clamped(seconds: float) -> float:
    return min(max(0.0, seconds), MAX_SERVER_WAIT)


def reset_seconds(text: str, now: float) -> float | None:
    """Seconds until a reset given as a number: above 10**9 the epoch time it resets at,
    else the delta. A time in the past gives 0; negative or no number gives None."""
    number = _number(text)
    if number is None or number < 0:
        return None
    return _clamped(number - now if number > EPOCH_ABOVE else number)


def duration_seconds(text: str, now: float) -> float | None:
    """Seconds in a Go duration (``6m0s``, ``20ms``, ``1h2m3.5s``); a bare number is
    read as `reset_seconds` reads it."""
    if len(text) > _MAX_LENGTH:
        return None
    if not re.fullmatch(_DURATION, text):
        return reset_seconds(text, now)
    total = sum(float(amount) * _UNITS[unit] for amount, unit in re.findall(_DURATION_PART, text))
    return _clamped(total) if math.isfinite(total) else None


def rfc3339_seconds(text: str, now: float) -> float | None:
    """Seconds until an RFC 3339 time (``2026-12-02T06:30:00Z``); one without a zone is
    no time a server can mean, and gives None."""
    if len(text) > _MAX_LENGTH or not text[:1].isdigit():
        return None
    try:
        moment = datetime.datetime.fromisoformat(text.replace("z", "Z"))
        if moment.tzinfo is None:
            return None
        seconds = moment.timestamp() - now
    except (ValueError, OverflowError, OSError):
        return None
    return _clamped(seconds) if math.isfinite(seconds) else None


def _latest(
    value: str | None, now: float, read: Callable[[str, float], float | None]
) -> float | None:
    """The latest reset among the values (repeated headers), or None."""
    resets = [
        seconds
        for seconds in (read(member, now) for member in _members(value))
        if seconds is not None
    ]
    return max(resets) if resets else None


# -- the families -------------------------------------------------------------------------


def _pair(
    remaining: str, reset: str, read: Callable[[str, float], float | None]
) -> Callable[[Mapping[str, str], float], list[_Limit]]:
    """A family of two headers: the requests left, and when they come back (``reset``
    as the reason names it; looked up in lowercase)."""
    remaining_key, reset_key = remaining.lower(), reset.lower()

    def limits(headers: Mapping[str, str], now: float) -> list[_Limit]:
        left = _remaining(headers.get(remaining_key))
        if left is not None and left > 0:
            return []  # requests left: whenever it resets, nothing to wait for
        when = headers.get(reset_key)
        if when is None:
            return []
        return [_Limit(left, _latest(when, now, read), reset)]

    return limits


_IETF_OLDEST = _pair("RateLimit-Remaining", "RateLimit-Reset", reset_seconds)
"""Drafts 00 to 06: ``RateLimit-Remaining`` and ``RateLimit-Reset``."""


def _ietf(headers: Mapping[str, str], now: float) -> list[_Limit]:
    limits = _IETF_OLDEST(headers, now)
    field = headers.get("ratelimit")  # lowercase: a plain dict or httpx.Headers
    if field is None or len(field) > _MAX_FIELD:
        return limits
    items = _structured_list(field)
    if any(name is None for name, _ in items):
        # draft 07's dictionary: ``limit=10, remaining=0, reset=5``
        members = {
            key: value for name, params in items if name is None for key, value in params.items()
        }
        reset = members.get("reset")
        limits.append(
            _Limit(
                _remaining(members.get("remaining")),
                None if reset is None else reset_seconds(reset, now),
                "RateLimit",
            )
        )
        return limits
    units: dict[str, str] | None = None
    for name, params in items:
        remaining = _remaining(params.get("r"))
        reset = params.get("t")
        if remaining is not None and remaining > 0:
            continue  # requests left: the unit does not matter
        if units is None:
            units = _quota_units(headers.get("ratelimit-policy"))
        if units.get(name or "", "requests") != "requests":
            continue  # a quota of bytes or of concurrent requests: no request counter
        limits.append(
            _Limit(remaining, None if reset is None else reset_seconds(reset, now), "RateLimit")
        )
    return limits


def _quota_units(policy: str | None) -> dict[str, str]:
    """Each named policy's quota unit (``qu``), from ``RateLimit-Policy``."""
    if policy is None or len(policy) > _MAX_FIELD:
        return {}
    return {
        name: params["qu"].lower()
        for name, params in _structured_list(policy)
        if name is not None and "qu" in params
    }


def _unquoted(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    return text


def _split(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` outside quoted strings."""
    parts: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for character in text:
        if escaped:
            escaped = False
        elif character == "\\" and quoted:
            escaped = True
        elif character == '"':
            quoted = not quoted
        elif character == separator and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(character)
    parts.append("".join(current))
    return parts


def _structured_list(text: str) -> list[tuple[str | None, dict[str, str]]]:
    """An RFC 8941 list of items with parameters, read leniently: each member's item
    (None for a dictionary member ``key=value``, whose pair joins the parameters) and
    its parameters, values unquoted. A bounded few members."""
    items: list[tuple[str | None, dict[str, str]]] = []
    for member in _split(text, ",")[:_MAX_MEMBERS]:
        first, *rest = _split(member, ";")
        params: dict[str, str] = {}
        for param in rest:
            key, _, value = param.partition("=")
            params.setdefault(key.strip().lower(), _unquoted(value) if value else "1")
        key, equals, value = first.partition("=")
        if equals and not first.strip().startswith('"'):
            params.setdefault(key.strip().lower(), _unquoted(value))
            items.append((None, params))
        else:
            items.append((_unquoted(first), params))
    return items


_READERS: dict[str, Callable[[Mapping[str, str], float], list[_Limit]]] = {
    "x-ratelimit": _pair("X-RateLimit-Remaining", "X-RateLimit-Reset", reset_seconds),
    "ratelimit": _ietf,
    "openai": _pair(
        "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests", duration_seconds
    ),
    "anthropic": _pair(
        "anthropic-ratelimit-requests-remaining",
        "anthropic-ratelimit-requests-reset",
        rfc3339_seconds,
    ),
}
"""Each family beyond Retry-After, by the name a profile trusts it under."""

_HEADERS = {
    "x-ratelimit": ("x-ratelimit-remaining", "x-ratelimit-reset"),
    "ratelimit": (
        "ratelimit",
        "ratelimit-policy",
        "ratelimit-remaining",
        "ratelimit-reset",
    ),
    "openai": ("x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"),
    "anthropic": (
        "anthropic-ratelimit-requests-remaining",
        "anthropic-ratelimit-requests-reset",
    ),
}


def header_names(families: Iterable[str]) -> frozenset[bytes]:
    """The lowercase names of the headers the families read: an answer with none of
    them is not read further."""
    return frozenset(
        name.encode("ascii") for family in families for name in _HEADERS.get(family, ())
    )


@attrs.frozen
class QuotaReader:
    """What one profile reads of an answer's rate-limit headers (built with the profile,
    so a call pays neither an import nor a lookup of a family it does not trust)."""

    families: tuple[str, ...]
    names: frozenset[bytes]

    @classmethod
    def trusting(cls, families: tuple[str, ...]) -> QuotaReader:
        return cls(families, header_names(families))

    def __call__(
        self, raw: Iterable[tuple[bytes, bytes]], *, now: float, limited: bool
    ) -> QuotaReset | None:
        """`request_quota` of the answer whose raw headers are ``raw``."""
        found = trusted_headers(raw, self.names)
        if not found:
            return None
        return request_quota(found, self.families, now=now, limited=limited)


def trusted_headers(raw: Iterable[tuple[bytes, bytes]], names: frozenset[bytes]) -> dict[str, str]:
    """The answer's headers among ``names``, by lowercase name, a repeated one's values
    joined by commas (as one field): one pass over the answer's headers, a set lookup
    each, and nothing decoded when none is there (the common answer)."""
    found: dict[str, list[str]] = {}
    for name, value in raw:
        lowered = name.lower()
        if lowered in names:
            found.setdefault(lowered.decode("ascii"), []).append(value.decode("latin-1"))
    # Joined once: a header repeated thousands of times costs one pass, not a square.
    return {key: ", ".join(values) for key, values in found.items()}
