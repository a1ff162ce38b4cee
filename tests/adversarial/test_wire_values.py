"""Values from the wire never poison the journal.

A hostile or broken server controls status, headers and body. Whatever it
sends is clamped or kept as bytes before it is stored, so that no later call,
resume, ``list``, ``show`` or ``stats`` can raise on it, and nothing it sends
can take over the operator's terminal.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import idempotently
from idempotently._retry_after import MAX_SERVER_WAIT
from idempotently.cli import cli
from tests.adversarial.invariants import Recorder, assert_sound, strict_json
from tests.adversarial.wire import Wire, reply
from tests.support import FakeTime

URL = "https://api.example.test/v1/charges"
CHARGE = {"amount": 1000}
NOW = 1_800_000_000.0
SOME = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def settle_or_wait(
    journal: Path, answers: list[httpx.Response | Exception], operation_id: str = "op"
) -> tuple[Recorder, FakeTime, BaseException | None]:
    """One call against scripted answers, then the same call again and a dry-run resume:
    each ends with an answer or an IdempotentlyError, never anything else."""
    recorder = Recorder(answers=answers)
    fake = FakeTime(now=NOW)
    raised: BaseException | None = None
    with idempotently.Session(
        journal, transport=recorder.transport, clock=fake.clock, sleep=fake.sleep
    ) as session:
        for _ in range(2):
            try:
                session.post(URL, json=CHARGE, operation_id=operation_id)
            except idempotently.IdempotentlyError as error:
                raised = error
        session.resume(dry_run=True)
    return recorder, fake, raised


def assert_clamped(journal: Path, fake: FakeTime) -> None:
    """Every time stored for the operations is a finite time within a year of now."""
    with idempotently.Journal(journal, create=False) as opened:
        for operation in opened.operations():
            for moment in (operation.not_before, operation.lease_until, operation.updated_at):
                if moment:
                    assert math.isfinite(moment)
                    assert moment <= fake.now + MAX_SERVER_WAIT + 3600
            full = opened.operation(operation.operation_id)
            assert full is not None
            for attempt in full.attempts:
                assert attempt.wait is None or 0 <= attempt.wait <= MAX_SERVER_WAIT


# -- Retry-After and retry-after-ms ------------------------------------------------------------

RETRY_AFTER = [
    "99999999999999999999",
    "1e20",
    "1e308",
    "1e309",
    "inf",
    "-inf",
    "nan",
    "-1",
    "-0",
    "0",
    "1e-400",
    "0x10",
    " 5 ",
    "5, 10",
    "1" * 1000,
    "Fri, 31 Dec 9999 23:59:59 GMT",
    "Mon, 01 Jan 0001 00:00:00 GMT",
    "Thu, 01 Jan 1970 00:00:00 GMT",
    "Sun, 06 Nov 1994 08:49:37 +0800",
    "Sun, 06 Nov 1994 08:49:37",
    "tomorrow",
    "",
    "\t",
]


@pytest.mark.parametrize("status", [429, 503])
@pytest.mark.parametrize("value", RETRY_AFTER, ids=lambda value: repr(value)[:30])
def test_hostile_retry_after_is_clamped_before_it_is_stored(
    journal: Path, status: int, value: str
) -> None:
    """A Retry-After of any shape is read as a wait of at most a year (or ignored): the call,
    the same call again, resume and every CLI command go on working."""
    answer = httpx.Response(status, headers=[(b"Retry-After", value.encode("latin-1"))])
    recorder, fake, _ = settle_or_wait(journal, [answer, answer])
    assert 1 <= len(recorder.sent) <= 3
    assert_clamped(journal, fake)
    assert_sound(journal, operations=["op"])


@pytest.mark.parametrize(
    "value", ["1e30", "1e309", "inf", "-5", "nan", "99999999999999999999999", "12abc", ""]
)
def test_hostile_retry_after_ms_is_clamped_before_it_is_stored(journal: Path, value: str) -> None:
    """retry-after-ms (OpenAI, Anthropic) is clamped like Retry-After."""
    answer = httpx.Response(429, headers={"retry-after-ms": value, "Retry-After": "1"})
    _, fake, _ = settle_or_wait(journal, [answer, answer])
    assert_clamped(journal, fake)
    assert_sound(journal, operations=["op"])


@pytest.mark.parametrize(
    "value", ["1e20", "9" * 65, "1" * 5000], ids=["1e20", "65-digits", "5000-digits"]
)
def test_a_huge_wait_is_retry_later_with_a_durable_readable_not_before(
    journal: Path, value: str
) -> None:
    """Retry-After: 1e20 (or a run of 65 or 5,000 digits) raises RetryLaterError whose
    not_before is a year away, and a later call before it sends nothing."""
    answer = httpx.Response(429, headers={"Retry-After": value})
    recorder, _, raised = settle_or_wait(journal, [answer])
    assert isinstance(raised, idempotently.RetryLaterError)
    assert NOW + MAX_SERVER_WAIT == raised.not_before
    assert 1 == len(recorder.sent)
    printed = assert_sound(journal, operations=["op"])
    assert NOW + MAX_SERVER_WAIT == printed[0].not_before


WIRE_TEXT = st.one_of(
    st.binary(max_size=40),
    st.from_regex(r"\A[-+ ]?[0-9]{0,30}(\.[0-9]{0,10})?([eE][-+]?[0-9]{1,4})?[ ]?\Z"),
    st.sampled_from(RETRY_AFTER).map(str.encode),
    st.datetimes().map(lambda moment: moment.strftime("%a, %d %b %Y %H:%M:%S GMT")),
).map(lambda value: value if isinstance(value, bytes) else value.encode("latin-1"))

counter = itertools.count()


@SOME
@given(retry_after=WIRE_TEXT, millis=st.one_of(st.none(), WIRE_TEXT))
@example(retry_after=b"99999999999999999999", millis=b"1e30")
def test_any_retry_after_leaves_a_readable_journal(
    journal: Path, retry_after: bytes, millis: bytes | None
) -> None:
    """Whatever bytes Retry-After and retry-after-ms hold, the journal stays readable."""
    headers = [(b"Retry-After", retry_after)]
    if millis is not None:
        headers.append((b"retry-after-ms", millis))
    answer = httpx.Response(429, headers=headers)
    _, fake, _ = settle_or_wait(journal, [answer, answer], operation_id=f"op{next(counter)}")
    assert_clamped(journal, fake)
    with idempotently.Journal(journal, create=False) as opened:
        assert opened.stats(now=fake.now).operations >= 1


def test_the_cli_reads_a_journal_after_hostile_retry_afters(journal: Path) -> None:
    """After many hostile waits in one journal, list, show and stats read every operation."""
    for number, value in enumerate(RETRY_AFTER):
        answer = httpx.Response(429, headers=[(b"Retry-After", value.encode("latin-1"))])
        _, fake, _ = settle_or_wait(journal, [answer, answer], operation_id=f"op{number}")
        with idempotently.Journal(journal, create=False) as opened:
            # The origin pause each 429 leaves is clamped too; lifted, so that the next
            # operation is journaled rather than refused before it.
            for pause in opened.origin_pauses(now=fake.now):
                assert fake.now < pause.until <= fake.now + 366 * 24 * 3600.0
            opened.unpause(URL)
    assert_sound(journal, operations=[f"op{number}" for number in range(len(RETRY_AFTER))])


# -- other headers that steer the decision -----------------------------------------------------


HOSTILE_HEADERS = [
    [(b"Stripe-Should-Retry", b"maybe")],
    [(b"Stripe-Should-Retry", b"\xff\xfe")],
    [(b"X-Should-Retry", b"")],
    [(b"X-Should-Retry", b"true"), (b"X-Should-Retry", b"false")],
    [(b"Idempotent-Replayed", b"yes")],
    [(b"Idempotent-Replayed", b"\xe9")],
    [(b"Idempotent-Replayed", b"true " * 1000)],
    [(b"Retry-After", b"5")] * 500,
    [(b"Set-Cookie", b"session=stolen")] * 50,
]


def headers_case(status: int, headers: list[tuple[bytes, bytes]]) -> object:
    name, value = headers[0]
    case_id = f"{status}-{name.decode()}:{value[:10]!r}x{len(headers)}"
    return pytest.param(status, headers, id=case_id)


@pytest.mark.parametrize(
    "status, headers",
    [
        headers_case(status, headers)
        for status in (201, 409, 429, 500, 503)
        for headers in HOSTILE_HEADERS
    ],
)
def test_hostile_hint_and_replay_headers_leave_a_readable_journal(
    journal: Path, headers: list[tuple[bytes, bytes]], status: int
) -> None:
    """Garbage in hint and replay headers is ignored or read safely, on any status."""
    answer = httpx.Response(status, headers=headers, json={"error": "x"})
    settle_or_wait(journal, [answer] * 10)
    operations = assert_sound(journal, operations=["op"], secrets=["session=stolen"])
    assert 1 == len(operations)


@pytest.mark.parametrize("status", [199, 299, 399, 599, 999])
def test_odd_status_codes_leave_a_readable_journal(journal: Path, status: int) -> None:
    """A status no RFC defines still ends the call cleanly and reads back."""
    settle_or_wait(journal, [httpx.Response(status)] * 10)
    assert_sound(journal, operations=["op"])


# -- response header bytes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(b"caf\xe9", id="latin-1"),
        pytest.param("café".encode(), id="utf-8"),
        pytest.param(b"\x80\xff", id="high-bytes"),
        pytest.param(b"plain", id="ascii"),
    ],
)
def test_a_stored_answer_with_header_bytes_replays_them(
    journal: Path, wire: Wire, value: bytes
) -> None:
    """The stored answer of a settled operation carries its headers' bytes as received."""
    wire.answer(reply(201, [(b"X-Request-Label", value)]))
    with idempotently.Session(journal) as session:
        first = session.post(f"{wire.url}/v1/charges", json=CHARGE, operation_id="op")
        again = session.post(f"{wire.url}/v1/charges", json=CHARGE, operation_id="op")
    assert again.extensions["idempotently"].replayed_locally
    assert [value] * 2 == [
        dict(response.headers.raw)[b"X-Request-Label"] for response in (first, again)
    ]
    assert 1 == len(wire.arrivals)
    assert_sound(journal, operations=["op"])


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=st.binary(min_size=1, max_size=12).filter(lambda raw: raw.strip() == raw))
def test_any_response_header_bytes_replay_from_the_journal(journal: Path, value: bytes) -> None:
    """Whatever bytes a response header holds, the stored answer replays them."""
    operation_id = f"op{next(counter)}"
    recorder = Recorder(answers=[httpx.Response(201, headers=[(b"X-Label", value)])])
    with idempotently.Session(journal, transport=recorder.transport) as session:
        session.post(URL, json=CHARGE, operation_id=operation_id)
        again = session.post(URL, json=CHARGE, operation_id=operation_id)
    assert value == dict(again.headers.raw)[b"X-Label"]


# -- bodies on screen --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"[" * 5000 + b"]" * 5000, id="json-5000-deep"),
        pytest.param(b"NaN", id="nan"),
        pytest.param(b'{"amount": 1e999}', id="overflowing-float"),
        pytest.param(b'{"a": -Infinity}', id="minus-infinity"),
        pytest.param(b"\xff\xfe\x00binary", id="binary"),
        pytest.param(b'{"a": "\xe9"}', id="json-not-utf8"),
        pytest.param(b"x" * 200_000, id="long-line"),
        pytest.param(b"", id="empty"),
    ],
)
@pytest.mark.parametrize("side", ["request", "response"])
def test_show_prints_any_stored_body(journal: Path, wire: Wire, body: bytes, side: str) -> None:
    """`show` and `show --json` print any body the journal holds, sent or received."""
    wire.answer(reply(201, body=body if side == "response" else b"{}"))
    with idempotently.Session(journal) as session:
        session.post(
            f"{wire.url}/v1/charges",
            content=body if side == "request" else b"{}",
            headers={"Content-Type": "application/json"},
            operation_id="op",
        )
    assert_sound(journal, operations=["op"])


CONTROL = [chr(code) for code in (*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F, *range(0x80, 0xA0))]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'{"note": "\x1b]0;owned\x07"}', id="osc-title"),
        pytest.param(b"\x1b[2J\x1b[Hall clear", id="csi-clear-screen"),
        pytest.param(b'{"note": "\xc2\x9b31mred"}', id="c1-csi"),
    ],
)
def test_show_never_prints_control_characters_from_the_wire(
    journal: Path, wire: Wire, body: bytes
) -> None:
    """A body from the server is printed for people with its control characters escaped."""
    wire.answer(reply(201, body=body))
    with idempotently.Session(journal) as session:
        session.post(f"{wire.url}/v1/charges", json=CHARGE, operation_id="op")
    result = CliRunner().invoke(cli, ["--journal", str(journal), "show", "op"], color=True)
    assert 0 == result.exit_code
    assert [] == [char for char in CONTROL if char in result.output]
    strict_json(CliRunner().invoke(cli, ["--journal", str(journal), "show", "op", "--json"]).output)
