"""Rate-limit headers beyond Retry-After (DESIGN §3.10): each trusted family read into
"this request quota is spent until then", never a crash, a NaN or an endless wait."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone

import attrs
import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from idempotently import profiles
from idempotently._policy import classify, classify_read
from idempotently._profiles import profile_from_spec, profile_spec
from idempotently._rate_limits import (
    QuotaReset,
    duration_seconds,
    request_quota,
    reset_seconds,
    rfc3339_seconds,
)
from idempotently._retry_after import MAX_SERVER_WAIT

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
ALL = ("anthropic", "openai", "ratelimit", "x-ratelimit")


def quota(
    headers: dict[str, str] | list[tuple[str, str]],
    families: tuple[str, ...] = ALL,
    *,
    limited: bool = False,
) -> QuotaReset | None:
    return request_quota(httpx.Headers(headers), families, now=NOW, limited=limited)


def iso(seconds_from_now: float) -> str:
    moment = datetime.fromtimestamp(NOW, timezone.utc) + timedelta(seconds=seconds_from_now)
    return moment.isoformat().replace("+00:00", "Z")


# -- each family ----------------------------------------------------------------------------


def test_x_ratelimit_reset_above_10_to_the_9_is_epoch_seconds() -> None:
    """``X-RateLimit-Reset: <epoch>`` with 0 left: spent until that time."""
    headers = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(NOW) + 42)}
    assert QuotaReset(42.0, "X-RateLimit-Reset") == quota(headers)


def test_x_ratelimit_reset_at_or_below_10_to_the_9_is_a_delta() -> None:
    """``X-RateLimit-Reset: 30`` is thirty seconds from now."""
    headers = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "30"}
    assert QuotaReset(30.0, "X-RateLimit-Reset") == quota(headers)
    # 10**9 itself is a delta (a year at most); one more is a time long past.
    assert (MAX_SERVER_WAIT, 0.0) == (
        reset_seconds(str(10**9), NOW),
        reset_seconds(str(10**9 + 1), NOW),
    )


def test_requests_left_means_no_quota_spent() -> None:
    """A quota with requests left says nothing to wait for, even on a 429."""
    headers = {"X-RateLimit-Remaining": "3", "X-RateLimit-Reset": "30"}
    assert (None, None) == (quota(headers), quota(headers, limited=True))


def test_a_reset_without_remaining_counts_only_on_a_limited_answer() -> None:
    """A 429/503 with only a reset header waits for it; a 200 with one does not."""
    headers = {"X-RateLimit-Reset": "30"}
    assert (None, QuotaReset(30.0, "X-RateLimit-Reset")) == (
        quota(headers),
        quota(headers, limited=True),
    )


def test_a_reset_in_the_past_or_now_is_no_wait() -> None:
    """An epoch reset already passed gives nothing to wait for."""
    headers = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": str(int(NOW) - 5)}
    assert None is quota(headers)
    assert None is quota({"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "0"})


def test_the_ietf_ratelimit_field_of_the_latest_draft() -> None:
    """``RateLimit: "default";r=0;t=30``: the default policy is spent for 30 s."""
    assert QuotaReset(30.0, "RateLimit") == quota({"RateLimit": '"default";r=0;t=30'})
    assert None is quota({"RateLimit": '"default";r=5;t=30'})


def test_the_longest_spent_policy_of_several_wins() -> None:
    """Several policies in one field: the spent one with the latest reset."""
    field = '"burst";r=0;t=5, "day";r=0;t=60, "hour";r=10;t=3000'
    assert QuotaReset(60.0, "RateLimit") == quota({"RateLimit": field})


def test_a_policy_counting_bytes_is_no_request_counter() -> None:
    """A spent policy whose quota unit (RateLimit-Policy ``qu``) is not requests never
    pauses a send; one counting requests does."""
    headers = {
        "RateLimit": '"bytes";r=0;t=30, "calls";r=0;t=7',
        "RateLimit-Policy": '"bytes";q=1000;qu="content-bytes";w=60, "calls";q=10;w=60',
    }
    assert QuotaReset(7.0, "RateLimit") == quota(headers)


def test_the_older_ietf_dictionary_form() -> None:
    """Draft 07's ``RateLimit: limit=10, remaining=0, reset=5``."""
    assert QuotaReset(5.0, "RateLimit") == quota({"RateLimit": "limit=10, remaining=0, reset=5"})
    assert None is quota({"RateLimit": "limit=10, remaining=4, reset=5"})


def test_the_oldest_ietf_separate_fields() -> None:
    """Drafts 00 to 06: ``RateLimit-Remaining`` and ``RateLimit-Reset`` (a delta)."""
    headers = {"RateLimit-Remaining": "0", "RateLimit-Reset": "12"}
    assert QuotaReset(12.0, "RateLimit-Reset") == quota(headers)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("1s", 1.0), ("6m0s", 360.0), ("20ms", 0.02), ("1h2m3.5s", 3723.5), ("0.5s", 0.5)],
)
def test_openai_durations(value: str, seconds: float) -> None:
    """``x-ratelimit-reset-requests`` is a Go duration."""
    headers = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": value}
    assert QuotaReset(seconds, "x-ratelimit-reset-requests") == quota(headers)


def test_anthropic_reset_is_an_rfc_3339_time() -> None:
    """``anthropic-ratelimit-requests-reset`` is the time the quota comes back."""
    headers = {
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": iso(12),
    }
    assert QuotaReset(12.0, "anthropic-ratelimit-requests-reset") == quota(headers)
    assert None is rfc3339_seconds("2027-01-15T08:00:12", NOW)  # no zone: no time


@pytest.mark.parametrize(
    "headers",
    [
        {"x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "20s"},
        {"anthropic-ratelimit-tokens-remaining": "0", "anthropic-ratelimit-tokens-reset": iso(9)},
        {
            "anthropic-ratelimit-input-tokens-remaining": "0",
            "anthropic-ratelimit-input-tokens-reset": iso(9),
        },
        {
            "anthropic-ratelimit-output-tokens-remaining": "0",
            "anthropic-ratelimit-output-tokens-reset": iso(9),
        },
    ],
)
def test_token_counters_are_never_read(headers: dict[str, str]) -> None:
    """A spent token quota says nothing of the next request: no wait, even on a 429."""
    assert (None, None) == (quota(headers), quota(headers, limited=True))


def test_only_trusted_families_are_read() -> None:
    """A family the profile does not trust is not read."""
    headers = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "30"}
    assert None is quota(headers, ("ratelimit", "openai", "anthropic"))
    assert None is quota(headers, ())


def test_repeated_headers_take_the_fewest_left_and_the_latest_reset() -> None:
    """A header repeated (by a proxy, or twice by the server): the cautious reading."""
    headers = [
        ("X-RateLimit-Remaining", "5"),
        ("X-RateLimit-Remaining", "0"),
        ("X-RateLimit-Reset", "10"),
        ("X-RateLimit-Reset", "25"),
    ]
    assert QuotaReset(25.0, "X-RateLimit-Reset") == quota(headers)


@pytest.mark.parametrize(
    "reset",
    ["9" * 400, "1" + "0" * 5000, str(int(NOW) + 10**9)],
)
def test_a_huge_reset_is_a_year(reset: str) -> None:
    """10**400 digits, or an epoch centuries away: a year, never an overflow."""
    headers = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": reset}
    assert QuotaReset(MAX_SERVER_WAIT, "X-RateLimit-Reset") == quota(headers)


@pytest.mark.parametrize(
    "reset", ["-5", "nan", "NaN", "inf", "-inf", "1e400", "", "soon", "30s", "0x1f", "\x00"]
)
def test_junk_resets_are_no_hint(reset: str) -> None:
    """Negative, NaN, infinite or unreadable resets are no hint."""
    assert None is quota({"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": reset})


# -- never a crash, a NaN or an endless wait ---------------------------------------------------

NAMES = (
    "X-RateLimit-Remaining",
    "X-RateLimit-Reset",
    "RateLimit",
    "RateLimit-Policy",
    "RateLimit-Remaining",
    "RateLimit-Reset",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "anthropic-ratelimit-requests-remaining",
    "anthropic-ratelimit-requests-reset",
)
values = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80),
    st.from_regex(r'\A("[a-z]{0,5}"|[a-z]{1,5})(;[a-z]{1,2}=("?[0-9a-z.-]{0,12}"?))*\Z'),
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet="0123456789", min_size=1, max_size=3000),
    st.from_regex(r"\A([0-9.]{1,8}(h|m|s|ms|us|ns)){1,4}\Z"),
)


@given(
    headers=st.lists(st.tuples(st.sampled_from(NAMES), values), max_size=8),
    limited=st.booleans(),
)
@example(headers=[("RateLimit", '"a";r=0;t=' + "9" * 500)], limited=False)
@example(headers=[("RateLimit", '"\\";r=0,,;;==;t=5')], limited=True)
@example(headers=[("x-ratelimit-reset-requests", "9" * 60 + "h")], limited=True)
@example(headers=[("anthropic-ratelimit-requests-reset", "99999-01-01T00:00:00Z")], limited=True)
@example(headers=[("RateLimit", ", " * 3000)], limited=True)
def test_any_headers_give_none_or_a_finite_wait_up_to_a_year(
    headers: list[tuple[str, str]], limited: bool
) -> None:
    """Whatever a server sends in any trusted family, repeated or not: None, or a wait
    above 0 and at most a year; never an exception, NaN or infinity."""
    found = quota(headers, limited=limited)
    assert found is None or (math.isfinite(found.wait) and 0 < found.wait <= MAX_SERVER_WAIT)


EVERY_FAMILY = attrs.evolve(
    profiles.GENERIC,
    name="every-family",
    rate_limit_headers=("retry-after", "x-ratelimit", "ratelimit", "openai", "anthropic"),
)


@given(
    status=st.sampled_from([200, 201, 409, 429, 500, 502, 503]),
    headers=st.lists(st.tuples(st.sampled_from(NAMES), values), max_size=8),
)
def test_any_answer_classifies_to_a_finite_wait_and_quota(
    status: int, headers: list[tuple[str, str]]
) -> None:
    """Through classify, as a call and a read meet them (headers scanned from the raw
    answer, names in any case): the wait and the quota are None or finite, at most a year."""
    mixed = [(name.upper() if len(value) % 2 else name, value) for name, value in headers]
    response = httpx.Response(status, headers=mixed)
    for answer in (
        classify(EVERY_FAMILY, response, now=NOW),
        classify_read(EVERY_FAMILY, response, now=NOW),
    ):
        wait = answer.server_wait
        assert wait is None or (math.isfinite(wait) and 0 <= wait <= MAX_SERVER_WAIT)
        assert answer.quota is None or 0 < answer.quota.wait <= MAX_SERVER_WAIT


@given(text=values, now=st.floats(0, 4e9))
def test_each_value_reader_gives_none_or_a_finite_wait(text: str, now: float) -> None:
    """The three readers of a reset (number, duration, RFC 3339 time) never raise and
    give None or a finite wait from 0 to a year, whatever ``now``."""
    for read in (reset_seconds, duration_seconds, rfc3339_seconds):
        seconds = read(text, now)
        assert seconds is None or (math.isfinite(seconds) and 0 <= seconds <= MAX_SERVER_WAIT)


@given(delta=st.integers(1, 10**9))
def test_any_delta_reset_is_that_many_seconds_up_to_a_year(delta: int) -> None:
    """Every delta up to 10**9 is read as that many seconds, clamped to a year."""
    assert min(float(delta), MAX_SERVER_WAIT) == reset_seconds(str(delta), NOW)


@given(ahead=st.integers(1, 366 * 24 * 3600))
def test_any_future_epoch_reset_is_the_time_left(ahead: int) -> None:
    """Every epoch reset in the future is read as the seconds left until it."""
    assert float(ahead) == reset_seconds(str(int(NOW) + ahead), NOW)


# -- the profile's field --------------------------------------------------------------------


def test_retry_after_alone_by_default() -> None:
    """The generic profile and every catalog entry trust Retry-After only."""
    assert {("retry-after",)} == {
        profile.rate_limit_headers for profile in profiles.BUILTIN_PROFILES.values()
    }


def test_the_families_are_kept_sorted_without_repeats() -> None:
    """The same trust is the same profile (and the same journaled spec), in any order."""
    one = attrs.evolve(profiles.GENERIC, rate_limit_headers=["x-ratelimit", "retry-after"])
    other = attrs.evolve(
        profiles.GENERIC, rate_limit_headers=("retry-after", "x-ratelimit", "x-ratelimit")
    )
    assert ("retry-after", "x-ratelimit") == one.rate_limit_headers
    assert one == other


@pytest.mark.parametrize(
    "value",
    ["ratelimit", ("ratelimit", "github"), ("Retry-After",), (1,), None, 5, ("openai", None)],
)
def test_an_unknown_family_is_refused_naming_the_known_ones(value: object) -> None:
    """A name no family has, a bare string, or no collection: a ValueError listing the
    families there are."""
    with pytest.raises(ValueError) as raised:
        attrs.evolve(profiles.GENERIC, rate_limit_headers=value)
    message = str(raised.value)
    assert "rate_limit_headers must be a tuple" in message
    assert "'x-ratelimit'" in message and "\n" not in message


def test_no_family_at_all_ignores_retry_after_too() -> None:
    """``rate_limit_headers=()`` trusts no header: a 429's Retry-After is not read."""
    profile = attrs.evolve(profiles.GENERIC, name="deaf", rate_limit_headers=())
    response = httpx.Response(429, headers={"Retry-After": "5"})
    assert None is classify(profile, response, now=NOW).server_wait


# -- classification ------------------------------------------------------------------------

TRUSTING = attrs.evolve(
    profiles.GENERIC, name="limits", rate_limit_headers=("retry-after", "x-ratelimit")
)


def test_a_429_without_retry_after_waits_for_the_reset() -> None:
    """The answer's wait comes from the reset, and it names the quota."""
    response = httpx.Response(429, headers={"X-RateLimit-Reset": str(int(NOW) + 20)})
    answer = classify(TRUSTING, response, now=NOW)
    assert (20.0, QuotaReset(20.0, "X-RateLimit-Reset")) == (answer.server_wait, answer.quota)


def test_retry_after_wins_over_a_reset_on_a_429() -> None:
    """Retry-After is the server's word on this answer: the reset is not read."""
    response = httpx.Response(429, headers={"Retry-After": "3", "X-RateLimit-Reset": "40"})
    answer = classify(TRUSTING, response, now=NOW)
    assert (3.0, None) == (answer.server_wait, answer.quota)


def test_a_2xx_with_nothing_left_reports_the_quota_but_no_wait() -> None:
    """A 201 with ``Remaining: 0``: the call succeeds; the quota is what pauses the origin."""
    headers = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "15"}
    answer = classify(TRUSTING, httpx.Response(201, headers=headers), now=NOW)
    assert (None, QuotaReset(15.0, "X-RateLimit-Reset")) == (answer.server_wait, answer.quota)


def test_any_retried_answer_waits_at_least_until_a_spent_quota_resets() -> None:
    """A 409 or a 500 saying no request is left: its retry waits for the reset (the
    longer of it and a Retry-After), for a retry sent sooner would only be refused."""
    spent = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "12"}
    busy = classify(TRUSTING, httpx.Response(409, headers=spent), now=NOW)
    failed = classify(TRUSTING, httpx.Response(500, headers={**spent, "Retry-After": "1"}), now=NOW)
    assert (12.0, 12.0) == (busy.server_wait, failed.server_wait)


def test_a_read_is_classified_alike() -> None:
    """A read's 429 with only a reset waits for it; its 200 with 0 left reports the quota."""
    limited = classify_read(
        TRUSTING, httpx.Response(429, headers={"X-RateLimit-Reset": "9"}), now=NOW
    )
    spent = classify_read(
        TRUSTING,
        httpx.Response(200, headers={"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "9"}),
        now=NOW,
    )
    assert (9.0, 9.0) == (limited.server_wait, spent.quota.wait if spent.quota else None)


def test_the_generic_profile_reads_no_reset() -> None:
    """Untrusted, a reset header changes nothing: no wait, no quota."""
    headers = {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "15"}
    answer = classify(profiles.GENERIC, httpx.Response(429, headers=headers), now=NOW)
    assert (None, None) == (answer.server_wait, answer.quota)


def test_at_its_default_the_field_is_left_out_of_the_journaled_spec() -> None:
    """A profile trusting Retry-After only journals the spec earlier versions wrote for
    it (no ``rate_limit_headers`` key), so their stored specs still agree byte for byte;
    one trusting more journals its families, and reads them back."""
    custom = attrs.evolve(profiles.GENERIC, name="custom", key_lifetime=3600.0)
    trusting = attrs.evolve(custom, rate_limit_headers=("x-ratelimit", "retry-after"))
    assert "rate_limit_headers" not in json.loads(profile_spec(custom))
    assert ["retry-after", "x-ratelimit"] == json.loads(profile_spec(trusting))[
        "rate_limit_headers"
    ]
    assert trusting == profile_from_spec(profile_spec(trusting))


def test_header_names_are_matched_in_any_case() -> None:
    """HTTP header names are case-insensitive: ``X-RATELIMIT-REMAINING`` counts."""
    headers = [("X-RATELIMIT-REMAINING", "0"), ("x-ratelimit-reset", "5")]
    answer = classify(TRUSTING, httpx.Response(201, headers=headers), now=NOW)
    assert QuotaReset(5.0, "X-RateLimit-Reset") == answer.quota


def test_a_header_repeated_thousands_of_times_is_junk() -> None:
    """A field repeated 3,000 times is read as no hint (one pass, no square of copies)."""
    headers = [("X-RateLimit-Remaining", "0"), ("X-RateLimit-Reset", "5")] * 3000
    answer = classify(TRUSTING, httpx.Response(201, headers=headers), now=NOW)
    assert (None, None) == (answer.server_wait, answer.quota)
