"""Parsing of the headers a server uses to pace or stop retries (pure).

Nothing here raises on what a server sends: garbage means "no hint".
"""

from __future__ import annotations

import calendar
import email.utils
import math
import re
import time
from collections.abc import Mapping

# Anything longer than this is not a Retry-After value, it is an attack, except a run
# of digits: however long, it is a number of seconds, read as "longer than a year".
_MAX_HEADER_LENGTH = 64
_DIGITS = re.compile(r"[0-9]+", re.ASCII)
MAX_SERVER_WAIT = 366 * 24 * 60 * 60.0
"""A year: any longer wait a server asks for is read as this one.

Clamped here, before anything is stored, so that a hostile ``Retry-After:
1e20`` means "much later" and never an overflow in a stored ``not_before``."""


def parse_retry_after(value: str | None, *, now: float) -> float | None:
    """Seconds to wait from a Retry-After value, or None when there is none.

    Accepts delta-seconds (floats tolerated) and an HTTP-date in any of RFC
    9110's three forms (IMF-fixdate, RFC 850, ANSI C asctime, all GMT); a date
    in the past gives 0. Negative, infinite, NaN or unparsable values give None.
    """
    if value is None:
        return None
    value = value.strip()
    if _DIGITS.fullmatch(value):
        return _whole_number(value, MAX_SERVER_WAIT)
    if not value or len(value) > _MAX_HEADER_LENGTH:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return _parse_http_date(value, now=now)
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, MAX_SERVER_WAIT)


_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_MONTH = "(?P<month>" + "|".join(_MONTHS) + ")"
_TIME = r"(?P<hour>\d{2}):(?P<minute>\d{2}):(?P<second>\d{2})"
# RFC 9110 (section 5.6.7): two obsolete forms, which a recipient MUST accept. The
# preferred IMF-fixdate goes through email.utils, as it always has.
# Patterns, compiled by `re` (and kept in its cache) when a server first sends a date.
_DATES = re.IGNORECASE | re.ASCII
_RFC850 = (
    r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday), "
    rf"(?P<day>\d{{2}})-{_MONTH}-(?P<year>\d{{2}}) {_TIME} GMT"
)
_ASCTIME = (  # ``Sun Nov  6 08:49:37 1994``: GMT, though it says no zone
    rf"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) {_MONTH} (?P<day>[ \d]?\d) {_TIME} (?P<year>\d{{4}})"
)
_FIFTY_YEARS = 50 * 365.25 * 24 * 60 * 60


def _parse_http_date(value: str, *, now: float) -> float | None:
    try:
        moment = _obsolete_date(value, now=now)
    except (ValueError, OverflowError, OSError):  # year 0, a "now" past the calendar
        return None
    if moment is None:
        try:
            parsed = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if parsed.tzinfo is None:  # RFC 9110 dates are always GMT
            return None
        try:
            moment = parsed.timestamp()
        except (OverflowError, OSError, ValueError):
            return None
    return min(max(0.0, moment - now), MAX_SERVER_WAIT)


def _obsolete_date(value: str, *, now: float) -> float | None:
    """Seconds since the epoch of an RFC 850 or asctime date, or None if it is neither."""
    found = re.fullmatch(_RFC850, value, _DATES) or re.fullmatch(_ASCTIME, value, _DATES)
    if found is None:
        return None
    parts = found.groupdict()
    year = int(parts["year"])
    month = next(i for i, name in enumerate(_MONTHS, 1) if name.lower() == parts["month"].lower())
    fields = (month, int(parts["day"]), int(parts["hour"]), int(parts["minute"]))
    second = int(parts["second"])
    if not (fields[2] <= 23 and fields[3] <= 59 and second <= 60):
        return None
    if len(parts["year"]) == 2:
        # RFC 9110: a two-digit year that looks more than 50 years ahead is the most
        # recent past year with those digits.
        year += (time.gmtime(now).tm_year // 100) * 100
        if _timestamp(year, *fields, second) - now > _FIFTY_YEARS:
            year -= 100
    if not 1 <= fields[1] <= calendar.monthrange(year, month)[1]:
        return None  # 31 Nov is no date
    return _timestamp(year, *fields, second)


def _timestamp(year: int, month: int, day: int, hour: int, minute: int, second: int) -> float:
    return float(calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0)))


def parse_retry_after_ms(value: str | None) -> float | None:
    """Seconds from a ``retry-after-ms`` value (OpenAI, Anthropic), or None."""
    if value is None:
        return None
    if _DIGITS.fullmatch(value.strip()):
        return _whole_number(value.strip(), MAX_SERVER_WAIT * 1000.0) / 1000.0
    if len(value) > _MAX_HEADER_LENGTH:
        return None
    try:
        millis = float(value.strip())
    except ValueError:
        return None
    if not math.isfinite(millis) or millis < 0:
        return None
    return min(millis / 1000.0, MAX_SERVER_WAIT)


def _whole_number(digits: str, clamp: float) -> float:
    """``min(int(digits), clamp)`` for a run of ASCII digits of any length, without
    converting one that is obviously larger (int() refuses more than 4,300 digits)."""
    significant = digits.lstrip("0")
    if len(significant) > len(str(int(clamp))):
        return clamp
    return min(float(int(significant or "0")), clamp)


def server_wait(headers: Mapping[str, str], *, now: float) -> float | None:
    """The wait a response asks for: ``retry-after-ms`` wins over ``Retry-After``."""
    millis = parse_retry_after_ms(headers.get("retry-after-ms"))
    if millis is not None:
        return millis
    return parse_retry_after(headers.get("retry-after"), now=now)
