"""Retry-After and hint headers (DESIGN §3.2): a server paces us, it never crashes or hangs us."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from idempotently._retry_after import (
    MAX_SERVER_WAIT,
    parse_retry_after,
    parse_retry_after_ms,
    server_wait,
)
from idempotently.profiles import GENERIC

NOW = 1_700_000_000.0  # 2023-11-14T22:13:20Z, a fixed "now" for every test


def http_dates(min_value: datetime, max_value: datetime) -> st.SearchStrategy[datetime]:
    """Whole-second UTC datetimes: what an HTTP-date can express."""
    return st.datetimes(
        min_value=min_value, max_value=max_value, timezones=st.just(timezone.utc)
    ).map(lambda moment: moment.replace(microsecond=0))


past_dates = http_dates(datetime(1970, 1, 2), datetime(2023, 11, 14, 22, 13, 20))
future_dates = http_dates(datetime(2023, 11, 14, 22, 13, 21), datetime(9999, 12, 30))


def http_date(moment: datetime) -> str:
    return format_datetime(moment, usegmt=True)


def rfc850_date(moment: datetime) -> str:
    """RFC 9110's obsolete RFC 850 form: ``Sunday, 06-Nov-94 08:49:37 GMT``."""
    return moment.strftime("%A, %d-%b-%y %H:%M:%S GMT")


def asctime_date(moment: datetime) -> str:
    """RFC 9110's obsolete ANSI C asctime form: ``Sun Nov  6 08:49:37 1994`` (GMT, unsaid)."""
    return f"{moment:%a %b} {moment.day:2d} {moment:%H:%M:%S} {moment.year}"


DATE_FORMS = {"imf-fixdate": http_date, "rfc850": rfc850_date, "asctime": asctime_date}
# A two-digit RFC 850 year is only unambiguous within 50 years of now.
near_past_dates = http_dates(datetime(1974, 1, 1), datetime(2023, 11, 14, 22, 13, 20))
near_future_dates = http_dates(datetime(2023, 11, 14, 22, 13, 21), datetime(2073, 11, 1))


def at(seconds_from_now: float) -> datetime:
    return datetime.fromtimestamp(NOW + seconds_from_now, tz=timezone.utc)


@given(value=st.text())
@example(value="Wed, 21 Oct 2015 07:28:00 GMT")
@example(value="Wed, 99 Foo 2015 99:99:99 GMT")
@example(value="Fri, 31 Dec 99999 23:59:59 GMT")
@example(value="\x00")
def test_parse_never_raises_and_gives_none_or_a_finite_wait(value: str) -> None:
    """Whatever a server sends, the wait is None or a finite, non-negative number."""
    seconds = parse_retry_after(value, now=NOW)

    assert seconds is None or (math.isfinite(seconds) and seconds >= 0)


@given(value=st.from_regex(r"\A[A-Za-z]{3}, \d{1,2} [A-Za-z]{3} \d{1,5} [\d:]{1,9} [A-Z+-]{0,5}\Z"))
def test_parse_never_raises_on_near_dates(value: str) -> None:
    """Strings shaped like HTTP-dates but broken inside give None or a finite wait, never raise."""
    seconds = parse_retry_after(value, now=NOW)

    assert seconds is None or (math.isfinite(seconds) and seconds >= 0)


def test_none_means_no_wait() -> None:
    """A missing header is no hint."""
    assert None is parse_retry_after(None, now=NOW)


@given(seconds=st.integers(min_value=0, max_value=10**40))
def test_integer_delta_seconds_round_trip(seconds: int) -> None:
    """Delta-seconds is read as that many seconds, up to a year (longer is a year)."""
    assert min(float(seconds), MAX_SERVER_WAIT) == parse_retry_after(str(seconds), now=NOW)


@given(digits=st.text(alphabet="0123456789", min_size=1, max_size=5000))
@example(digits="9" * 65)
@example(digits="0" * 100 + "5")
@example(digits="1" * 4301)
def test_any_run_of_digits_is_that_many_seconds_up_to_a_year(digits: str) -> None:
    """An all-digit Retry-After of any length (65 digits, 5,000) is min(value, a year):
    "longer than a year", never garbage retried at once."""
    significant = digits.lstrip("0") or "0"
    seconds = float(int(significant)) if len(significant) <= 30 else 1e30
    assert min(seconds, MAX_SERVER_WAIT) == parse_retry_after(digits, now=NOW)


@given(digits=st.text(alphabet="0123456789", min_size=1, max_size=5000))
@example(digits="9" * 100)
def test_any_run_of_digits_in_retry_after_ms_is_that_many_milliseconds_up_to_a_year(
    digits: str,
) -> None:
    """An all-digit ``retry-after-ms`` of any length is min(value / 1000, a year)."""
    significant = digits.lstrip("0") or "0"
    millis = float(int(significant)) if len(significant) <= 30 else 1e30
    assert min(millis / 1000.0, MAX_SERVER_WAIT) == parse_retry_after_ms(digits)


@given(seconds=st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False))
def test_float_delta_seconds_are_tolerated(seconds: float) -> None:
    """Fractional delta-seconds are tolerated and read exactly (up to a year)."""
    assert min(seconds, MAX_SERVER_WAIT) == parse_retry_after(repr(seconds), now=NOW)


def test_surrounding_whitespace_is_ignored() -> None:
    """Header values may carry optional whitespace around the number."""
    assert 12.0 == parse_retry_after("  12\t", now=NOW)


@given(moment=future_dates)
def test_future_http_date_gives_the_delta(moment: datetime) -> None:
    """An HTTP-date in the future means: wait until then."""
    expected = min(moment.timestamp() - NOW, MAX_SERVER_WAIT)
    assert expected == parse_retry_after(http_date(moment), now=NOW)


@given(moment=past_dates)
def test_past_http_date_gives_zero(moment: datetime) -> None:
    """An HTTP-date in the past (or now) means: no wait."""
    assert 0.0 == parse_retry_after(http_date(moment), now=NOW)


@pytest.mark.parametrize("form", DATE_FORMS)
@given(moment=near_future_dates)
def test_every_http_date_form_in_the_future_gives_the_delta(form: str, moment: datetime) -> None:
    """RFC 9110 §5.6.7: IMF-fixdate, RFC 850 and asctime all mean "wait until then"."""
    expected = min(moment.timestamp() - NOW, MAX_SERVER_WAIT)
    assert expected == parse_retry_after(DATE_FORMS[form](moment), now=NOW)


@pytest.mark.parametrize("form", DATE_FORMS)
@given(moment=near_past_dates)
def test_every_http_date_form_in_the_past_gives_zero(form: str, moment: datetime) -> None:
    """A past date in any of the three forms means no wait."""
    assert 0.0 == parse_retry_after(DATE_FORMS[form](moment), now=NOW)


@pytest.mark.parametrize(
    "value",
    [
        "Tue Nov 14 22:15:20 2023",
        "Tuesday, 14-Nov-23 22:15:20 GMT",
        "Tue, 14 Nov 2023 22:15:20 GMT",
    ],
)
def test_rfc9110_examples_two_minutes_ahead(value: str) -> None:
    """The three forms of one moment, two minutes after NOW, are one 120 s wait."""
    assert 120.0 == parse_retry_after(value, now=NOW)


def test_an_asctime_date_with_a_one_digit_day_is_read() -> None:
    """``Sun Nov  6 08:49:37 1994`` (two spaces) and ``Sun Nov 6 …`` are the same date."""
    now = datetime(1994, 11, 6, 8, 49, 30, tzinfo=timezone.utc).timestamp()

    assert [7.0, 7.0] == [
        parse_retry_after("Sun Nov  6 08:49:37 1994", now=now),
        parse_retry_after("Sun Nov 6 08:49:37 1994", now=now),
    ]


def test_a_two_digit_year_more_than_50_years_ahead_is_in_the_past() -> None:
    """RFC 9110: ``-99`` read in 2023 is 1999 (no wait), not 2099; ``-60`` is 2060."""
    assert [0.0, MAX_SERVER_WAIT] == [
        parse_retry_after("Friday, 01-Jan-99 00:00:00 GMT", now=NOW),
        parse_retry_after("Thursday, 01-Jan-60 00:00:00 GMT", now=NOW),
    ]


@given(value=st.from_regex(r"\A[A-Za-z]{3} [A-Za-z]{3} [ \d]{1,2}\d [\d:]{1,9} \d{1,5}\Z"))
def test_parse_never_raises_on_near_asctime_dates(value: str) -> None:
    """Strings shaped like asctime dates but broken inside give None or a finite wait."""
    seconds = parse_retry_after(value, now=NOW)

    assert seconds is None or (math.isfinite(seconds) and seconds >= 0)


@given(value=st.from_regex(r"\A[A-Za-z]{6,9}, \d{1,2}-[A-Za-z]{3}-\d{1,3} [\d:]{1,9} GMT\Z"))
def test_parse_never_raises_on_near_rfc850_dates(value: str) -> None:
    """Strings shaped like RFC 850 dates but broken inside give None or a finite wait."""
    seconds = parse_retry_after(value, now=NOW)

    assert seconds is None or (math.isfinite(seconds) and seconds >= 0)


def test_http_date_two_minutes_ahead() -> None:
    """A worked example: a date 120 s from now is a 120 s wait."""
    assert 120.0 == parse_retry_after(http_date(at(120)), now=NOW)


@pytest.mark.parametrize(
    "value",
    [
        "",
        "   ",
        "soon",
        "-5",
        "-0.5",
        "nan",
        "NaN",
        "inf",
        "-inf",
        "Infinity",
        "1e400",
        "0x10",
        "5 seconds",
        "1." + "0" * 5000,  # overlong and not a run of digits
        "0" * 200 + "5.5",
        "Wed, 21 Oct 2015 07:28:00",  # no zone
        "Wed, 21 Oct 2015 07:28:00 -0000",  # "unknown zone", naive
        "Wed, 21 Oct 2015",
        "Wed, 32 Oct 2015 07:28:00 GMT",
        "Wed, 21 Foo 2015 07:28:00 GMT",
        "Sun Nov 31 08:49:37 1994",  # asctime, no such day
        "Sun Nov  6 24:49:37 1994",
        "Sun Nov  6 08:49:37 0000",
        "Sunday, 31-Feb-94 08:49:37 GMT",
        "Sunday, 06-Nov-94 08:49:37",  # RFC 850 needs its GMT
        "Sun Nov \u0666 08:49:37 1994",  # a non-ASCII digit
    ],
)
def test_garbage_is_no_hint(value: str) -> None:
    """Negative, infinite, NaN, overlong, zone-less or unparsable values give None."""
    assert None is parse_retry_after(value, now=NOW)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1500", 1.5), ("0", 0.0), ("250.5", 0.2505), (" 100 ", 0.1)],
)
def test_retry_after_ms_is_read_in_milliseconds(value: str, expected: float) -> None:
    """``retry-after-ms`` is milliseconds, returned as seconds."""
    assert expected == parse_retry_after_ms(value)


@pytest.mark.parametrize("value", [None, "", "soon", "-1", "nan", "inf", "1e400", "9." * 40])
def test_retry_after_ms_garbage_is_no_hint(value: str | None) -> None:
    """A missing, negative, non-finite, overlong or unparsable ``retry-after-ms`` gives None."""
    assert None is parse_retry_after_ms(value)


@given(value=st.text())
def test_retry_after_ms_never_raises(value: str) -> None:
    """``retry-after-ms`` parsing gives None or a finite wait on any text."""
    seconds = parse_retry_after_ms(value)

    assert seconds is None or (math.isfinite(seconds) and seconds >= 0)


def test_server_wait_prefers_retry_after_ms() -> None:
    """``retry-after-ms`` wins over ``Retry-After`` when both are present."""
    headers = httpx.Headers({"Retry-After": "10", "Retry-After-Ms": "1500"})

    assert 1.5 == server_wait(headers, now=NOW)


def test_server_wait_falls_back_to_retry_after() -> None:
    """Without ``retry-after-ms``, ``Retry-After`` gives the wait."""
    assert 10.0 == server_wait(httpx.Headers({"Retry-After": "10"}), now=NOW)


def test_server_wait_ignores_garbage_retry_after_ms() -> None:
    """A garbage ``retry-after-ms`` does not hide a good ``Retry-After``."""
    headers = httpx.Headers({"Retry-After": "10", "retry-after-ms": "soon"})

    assert 10.0 == server_wait(headers, now=NOW)


def test_server_wait_reads_an_http_date() -> None:
    """``Retry-After`` as an HTTP-date goes through ``server_wait`` too."""
    assert 30.0 == server_wait(httpx.Headers({"Retry-After": http_date(at(30))}), now=NOW)


def test_server_wait_without_headers_is_none() -> None:
    """No pacing header, no server wait."""
    assert None is server_wait(httpx.Headers({"Content-Type": "text/plain"}), now=NOW)


def hint_of(headers: httpx.Headers) -> bool | None:
    """The retry hint the default profile reads from these headers."""
    return GENERIC.retry_hint(httpx.Response(503, headers=headers))


@pytest.mark.parametrize("name", ["Stripe-Should-Retry", "stripe-should-retry", "X-Should-Retry"])
@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("TRUE", True), (" True ", True), ("false", False), ("False", False)],
)
def test_should_retry_hint_is_read_case_insensitively(
    name: str, value: str, expected: bool
) -> None:
    """Both hint headers say true/false, whatever the case of name and value."""
    assert expected is hint_of(httpx.Headers({name: value}))


@pytest.mark.parametrize("value", ["", "yes", "no", "1", "0", "?1", "maybe", "truee"])
@pytest.mark.parametrize("name", ["Stripe-Should-Retry", "x-should-retry"])
def test_should_retry_hint_garbage_is_no_hint(name: str, value: str) -> None:
    """Anything but true/false is no hint."""
    assert None is hint_of(httpx.Headers({name: value}))


def test_no_hint_header_is_no_hint() -> None:
    """A response without hint headers gives no hint."""
    assert None is hint_of(httpx.Headers({"Retry-After": "1"}))


@given(value=st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E)))
def test_should_retry_hint_never_raises(value: str) -> None:
    """Any header value gives True, False or None, never an exception."""
    assert hint_of(httpx.Headers({"x-should-retry": value})) in (True, False, None)


def test_date_hint_is_relative_to_the_given_now() -> None:
    """The wait is measured from the injected ``now``, not the wall clock."""
    moment = datetime(2024, 1, 1, tzinfo=timezone.utc)
    later = NOW + timedelta(days=1).total_seconds()

    assert moment.timestamp() - later == parse_retry_after(http_date(moment), now=later)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("Retry-After", "99999999999999999999"),
        ("Retry-After", "9" * 65),
        ("Retry-After", "1" * 10_000),
        ("retry-after-ms", "9" * 65),
        ("Retry-After", "1e20"),
        ("Retry-After", "1e308"),
        ("retry-after-ms", "1e30"),
        ("Retry-After", "Fri, 31 Dec 9999 23:59:59 GMT"),
    ],
)
def test_a_huge_server_wait_is_clamped_to_a_year(name: str, value: str) -> None:
    """A hostile Retry-After means "a year from now", never an overflow later on."""
    assert MAX_SERVER_WAIT == server_wait(httpx.Headers({name: value}), now=NOW)
