"""Parsing of the headers a server uses to pace or stop retries (pure).

Nothing here raises on what a server sends: garbage means "no hint".
"""

from __future__ import annotations

import email.utils
import math
from collections.abc import Mapping

# Anything longer than this is not a Retry-After value, it is an attack.
_MAX_HEADER_LENGTH = 64
MAX_SERVER_WAIT = 366 * 24 * 60 * 60.0
"""A year: any longer wait a server asks for is read as this one.

Clamped here, before anything is stored, so that a hostile ``Retry-After:
1e20`` means "much later" and never an overflow in a stored ``not_before``."""


def parse_retry_after(value: str | None, *, now: float) -> float | None:
    """Seconds to wait from a Retry-After value, or None when there is none.

    Accepts delta-seconds (floats tolerated) and an HTTP-date; a date in the
    past gives 0. Negative, infinite, NaN or unparsable values give None.
    """
    if value is None:
        return None
    value = value.strip()
    if not value or len(value) > _MAX_HEADER_LENGTH:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return _parse_http_date(value, now=now)
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, MAX_SERVER_WAIT)


def _parse_http_date(value: str, *, now: float) -> float | None:
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if moment.tzinfo is None:  # RFC 9110 dates are always GMT
        return None
    try:
        return min(max(0.0, moment.timestamp() - now), MAX_SERVER_WAIT)
    except (OverflowError, OSError, ValueError):
        return None


def parse_retry_after_ms(value: str | None) -> float | None:
    """Seconds from a ``retry-after-ms`` value (OpenAI, Anthropic), or None."""
    if value is None or len(value) > _MAX_HEADER_LENGTH:
        return None
    try:
        millis = float(value.strip())
    except ValueError:
        return None
    if not math.isfinite(millis) or millis < 0:
        return None
    return min(millis / 1000.0, MAX_SERVER_WAIT)


def server_wait(headers: Mapping[str, str], *, now: float) -> float | None:
    """The wait a response asks for: ``retry-after-ms`` wins over ``Retry-After``."""
    millis = parse_retry_after_ms(headers.get("retry-after-ms"))
    if millis is not None:
        return millis
    return parse_retry_after(headers.get("retry-after"), now=now)
