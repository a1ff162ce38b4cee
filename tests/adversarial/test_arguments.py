"""Arguments that poison later work: every public entry point refuses them up front.

A wrong value is a TypeError or ValueError naming the argument, raised before
anything is journaled or sent; afterwards the journal is intact and every
later call, resume and CLI command still works.
"""

from __future__ import annotations

import datetime
import decimal
import math
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import idempotently
from idempotently import profiles
from tests.adversarial.invariants import Recorder, assert_sound, cli_run
from tests.adversarial.wire import Wire
from tests.support import FakeTime

URL = "https://api.example.test/v1/charges"
CHARGE = {"amount": 1000, "currency": "usd"}
ONE_TRY = idempotently.RetryPolicy(max_attempts=1)
NOW = 1_800_000_000.0
ARGUMENT_ERRORS = (TypeError, ValueError)
SOME = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def ident(value: Any) -> str:
    """A stable test id: the value for plain data, the type or name for objects."""
    if isinstance(value, (str, bytes, int, float, list, type(None))):
        return repr(value)[:40]
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, idempotently.ServerProfile):
        return value.name
    if isinstance(value, dict):
        return ",".join(f"{key}={ident(item)}" for key, item in value.items())
    return type(value).__name__


def session(journal: Path, recorder: Recorder, **options: Any) -> idempotently.Session:
    options.setdefault("clock", FakeTime(now=NOW).clock)
    return idempotently.Session(journal, transport=recorder.transport, **options)


def operation_ids(journal: Path) -> list[str]:
    with idempotently.Journal(journal, create=False) as opened:
        return [operation.operation_id for operation in opened.operations()]


# -- operation_id ------------------------------------------------------------------------------

HOSTILE_OPERATION_IDS = [
    pytest.param("", id="empty"),
    pytest.param(123, id="int"),
    pytest.param(b"order-42", id="bytes"),
    pytest.param(4.2, id="float"),
    pytest.param(True, id="bool"),
    pytest.param("x" * 256, id="too-long"),
    pytest.param("order\n42", id="newline"),
    pytest.param("order\x0042", id="nul"),
    pytest.param("order\u202e42", id="bidi-override"),
    pytest.param(["order-42"], id="list"),
    pytest.param(uuid.UUID(int=42), id="uuid-object"),
]


@pytest.mark.parametrize("value", HOSTILE_OPERATION_IDS)
def test_hostile_operation_id_is_refused_before_anything_is_journaled(
    journal: Path, value: Any
) -> None:
    """A wrong operation_id is a TypeError/ValueError naming it; nothing is journaled or sent."""
    recorder = Recorder()
    with session(journal, recorder) as s:
        with pytest.raises(ARGUMENT_ERRORS, match="operation_id"):
            s.post(URL, json=CHARGE, operation_id=value)
        assert [] == operation_ids(journal)
        assert 201 == s.post(URL, json=CHARGE, operation_id="after").status_code
    assert 1 == len(recorder.sent)
    assert_sound(journal, operations=["after"])


@pytest.mark.anyio
@pytest.mark.parametrize("value", ["", 123, b"order-42", "order\r42"])
async def test_async_session_refuses_hostile_operation_ids_too(
    journal: Path, anyio_backend: str, value: Any
) -> None:
    """AsyncSession checks operation_id at the same boundary, on asyncio and trio."""
    recorder = Recorder()
    async with idempotently.AsyncSession(journal, transport=recorder.transport) as s:
        with pytest.raises(ARGUMENT_ERRORS, match="operation_id"):
            await s.post(URL, json=CHARGE, operation_id=value)
    assert [] == recorder.sent
    assert_sound(journal, operations=[])


@pytest.mark.parametrize("value", ["", "x" * 256, "order\t42"])
def test_transport_refuses_a_hostile_operation_id_header(journal: Path, value: str) -> None:
    """An Idempotency-Operation-Id header a Session would refuse is refused by the Transport."""
    recorder = Recorder()
    transport = idempotently.Transport(journal, transport=recorder.transport)
    with (
        httpx.Client(transport=transport) as client,
        pytest.raises(ARGUMENT_ERRORS, match="operation_id"),
    ):
        client.post(URL, json=CHARGE, headers={"Idempotency-Operation-Id": value})
    assert [] == recorder.sent
    assert_sound(journal, operations=[])


ANY_VALUE = st.one_of(
    st.text(max_size=300),
    st.binary(max_size=16),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.lists(st.text(max_size=3), max_size=2),
)


@SOME
@given(value=ANY_VALUE)
def test_any_operation_id_is_refused_or_names_one_repeatable_operation(
    scratch: Path, value: Any
) -> None:
    """Whatever operation_id is passed, it is refused up front, or calling twice is one
    operation: one send, the second call answered from the journal."""
    journal = scratch / f"{uuid.uuid4().hex}.db"
    recorder = Recorder()
    with session(journal, recorder) as s:
        try:
            first = s.post(URL, json=CHARGE, operation_id=value)
        except ARGUMENT_ERRORS as error:
            assert "operation_id" in str(error)
            assert [] == operation_ids(journal)
            assert [] == recorder.sent
            return
        second = s.post(URL, json=CHARGE, operation_id=value)
        listed = operation_ids(journal)
    assert (201, 201) == (first.status_code, second.status_code)
    assert second.extensions["idempotently"].replayed_locally
    assert 1 == len(recorder.sent)
    assert [value] == listed
    code, _ = cli_run(journal, "list", "--json")
    assert 0 == code


# -- deadline_at -------------------------------------------------------------------------------

HOSTILE_DEADLINES = [
    pytest.param("tomorrow", id="text"),
    pytest.param(b"1900000000", id="bytes"),
    pytest.param(math.nan, id="nan"),
    pytest.param(math.inf, id="inf"),
    pytest.param(-math.inf, id="-inf"),
    pytest.param(-1, id="negative"),
    pytest.param(0, id="zero"),
    pytest.param(True, id="bool"),
    pytest.param(1e11, id="milliseconds"),
    pytest.param(10**400, id="huge-int"),
    pytest.param(datetime.datetime(2030, 1, 1, tzinfo=datetime.timezone.utc), id="datetime"),
    pytest.param(datetime.timedelta(hours=1), id="timedelta"),
    pytest.param(decimal.Decimal("1900000000"), id="decimal"),
    pytest.param(NOW - 1, id="already-past"),
]


@pytest.mark.parametrize("value", HOSTILE_DEADLINES)
def test_hostile_deadline_at_is_refused_before_anything_is_journaled(
    journal: Path, value: Any
) -> None:
    """A deadline_at that is not a future epoch time is refused, naming it; nothing is sent,
    and later calls, resume and the CLI are untouched."""
    recorder = Recorder()
    with session(journal, recorder) as s:
        with pytest.raises(ARGUMENT_ERRORS, match="deadline_at"):
            s.post(URL, json=CHARGE, operation_id="op", deadline_at=value)
        assert [] == recorder.sent
        assert 201 == s.post(URL, json=CHARGE, operation_id="op").status_code
        assert [] == s.resume()
    assert_sound(journal, operations=["op"])


@SOME
@given(
    value=st.one_of(
        st.floats(),
        st.integers(min_value=-(10**30), max_value=10**30),
        st.floats(min_value=NOW - 10, max_value=NOW + 1e9),
        st.text(max_size=5),
    )
)
def test_any_deadline_at_is_refused_or_stored_readably(scratch: Path, value: Any) -> None:
    """A deadline_at is refused up front, or it is a future time the CLI can print."""
    journal = scratch / f"{uuid.uuid4().hex}.db"
    recorder = Recorder()
    with session(journal, recorder) as s:
        try:
            s.post(URL, json=CHARGE, operation_id="op", deadline_at=value)
        except ARGUMENT_ERRORS as error:
            assert "deadline_at" in str(error)
            assert [] == recorder.sent
            assert [] == operation_ids(journal)
            return
    assert isinstance(value, (int, float)) and NOW < value
    assert 1 == len(recorder.sent)
    assert_sound(journal, operations=["op"])


# -- idempotency_key, the key header, delivery -------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [123, b"key-1", "", " ", "key\n", "ключ", "k" * 256, 'a"b', "a\\b", "key 1"],
    ids=ident,
)
def test_hostile_idempotency_key_is_refused_before_anything_is_journaled(
    journal: Path, value: Any
) -> None:
    """An explicit key the profile would reject is a TypeError/ValueError naming the key."""
    recorder = Recorder()
    with session(journal, recorder) as s, pytest.raises(ARGUMENT_ERRORS, match=r"idempotency.key"):
        s.post(URL, json=CHARGE, idempotency_key=value)
    assert [] == recorder.sent
    assert_sound(journal, operations=[])


@pytest.mark.parametrize(
    "profile, value",
    [
        (profiles.GENERIC, ""),
        (profiles.GENERIC, "a b"),
        (profiles.GENERIC, b"\xe9key"),
        (profiles.GENERIC, "k" * 300),
        (profiles.IETF, '"unterminated'),
        (profiles.IETF, '""'),
        (profiles.IETF, '"a"b"'),
    ],
    ids=ident,
)
def test_hostile_key_header_on_the_request_is_refused(
    journal: Path, profile: idempotently.ServerProfile, value: str | bytes
) -> None:
    """A key header set by the caller is validated like idempotency_key: nothing is sent."""
    recorder = Recorder()
    with (
        session(journal, recorder, profile=profile) as s,
        pytest.raises(ValueError, match=r"idempotency.key"),
    ):
        headers: Any = {"Idempotency-Key": value}  # str or bytes, as httpx accepts
        s.post(URL, json=CHARGE, headers=headers)
    assert [] == recorder.sent
    assert_sound(journal, operations=[])


def test_key_header_disagreeing_with_idempotency_key_is_refused(journal: Path) -> None:
    """Two different keys for one call is an error, not a coin toss."""
    recorder = Recorder()
    with session(journal, recorder) as s, pytest.raises(ValueError, match=r"idempotency.key"):
        s.post(URL, json=CHARGE, headers={"Idempotency-Key": "a-1"}, idempotency_key="b-2")
    assert [] == recorder.sent


@pytest.mark.parametrize(
    "value", ["at-most-once", "", None, 1, "EXACTLY_ONCE", ["exactly_once"]], ids=ident
)
def test_hostile_delivery_is_refused(journal: Path, value: Any) -> None:
    """delivery is exactly_once or at_most_once; anything else is refused, naming it."""
    recorder = Recorder()
    with session(journal, recorder) as s, pytest.raises(ValueError, match="delivery"):
        s.post(URL, json=CHARGE, delivery=value)
    transport = idempotently.Transport(journal, transport=recorder.transport)
    with httpx.Client(transport=transport) as client, pytest.raises(ValueError, match="delivery"):
        client.post(URL, json=CHARGE, headers={"Idempotency-Delivery": str(value)})
    assert [] == recorder.sent
    assert_sound(journal, operations=[])


@pytest.mark.parametrize(
    "timeout",
    [
        pytest.param(
            "5",
            id="text",
        ),
        pytest.param(
            -1,
            id="negative",
        ),
        pytest.param(
            object(),
            id="object",
        ),
    ],
)
def test_hostile_timeout_is_refused_before_anything_is_journaled(
    journal: Path, wire: Wire, timeout: Any
) -> None:
    """A timeout httpx cannot use is an argument error naming timeout, before the journal."""
    with idempotently.Session(journal) as s, pytest.raises(ARGUMENT_ERRORS, match="timeout"):
        s.post(f"{wire.url}/v1/charges", json=CHARGE, operation_id="op", timeout=timeout)
    assert [] == wire.arrivals
    assert_sound(journal, operations=[])


UNSENDABLE = {
    "ftp-scheme": ("POST", "ftp://127.0.0.1/v1/charges", {}),
    "relative-url": ("POST", "/v1/charges", {}),
    "method-with-space": ("PO ST", "{wire}/v1/charges", {}),
    "empty-method": ("", "{wire}/v1/charges", {}),
    "header-name-with-space": ("POST", "{wire}/v1/charges", {"Bad Name": "v"}),
    "empty-header-name": ("POST", "{wire}/v1/charges", {"": "v"}),
    "header-value-with-newline": ("POST", "{wire}/v1/charges", {"X-Note": "a\nb"}),
}


@pytest.mark.parametrize("case", UNSENDABLE)
def test_a_request_httpx_refuses_is_failed_unsent_and_stays_failed(
    journal: Path, wire: Wire, case: str
) -> None:
    """A request httpx cannot send (scheme, method, header name or value) is a
    RequestNotSentError, sends nothing, and calling again says so without a send."""
    method, url, headers = UNSENDABLE[case]
    with idempotently.Session(journal) as s:
        for _ in range(2):
            with pytest.raises(idempotently.RequestNotSentError) as caught:
                s.request(
                    method,
                    url.format(wire=wire.url),
                    json=CHARGE,
                    headers=headers,
                    operation_id="op",
                )
            assert ("op", None) == (caught.value.operation_id, caught.value.__cause__)
    assert [] == wire.arrivals
    operations = assert_sound(journal, operations=["op"])
    assert ("failed", 1) == (operations[0].status, operations[0].attempt_count)


def test_the_delivery_header_never_reaches_the_server(journal: Path, wire: Wire) -> None:
    """Idempotency-Delivery chooses at-most-once for one request and is not forwarded."""
    transport = idempotently.Transport(journal)
    with httpx.Client(transport=transport) as client:
        client.post(
            f"{wire.url}/v1/charges", json=CHARGE, headers={"Idempotency-Delivery": "at_most_once"}
        )
    assert [None] == [arrival.header("Idempotency-Delivery") for arrival in wire.arrivals]
    assert "at_most_once" == assert_sound(journal)[0].delivery


# -- constructors ------------------------------------------------------------------------------

HOSTILE_OPTIONS = [
    ("policy", "aggressive"),
    ("profile", "stripe"),
    ("redact_headers", "X-Partner-Token"),
    ("fingerprint_headers", [b"X-Tenant"]),
    ("lease_duration", 0),
    ("lease_duration", -1),
    ("lease_duration", math.nan),
    ("lease_duration", math.inf),
    ("lease_duration", "60"),
    ("key_expiry_margin", -1),
    ("key_expiry_margin", -0.0),
    ("key_expiry_margin", math.nan),
    ("key_expiry_margin", math.inf),
    ("key_expiry_margin", -math.inf),
    ("key_expiry_margin", 10**400),
    ("key_expiry_margin", 59),
    ("key_expiry_margin", 86400),
    ("profile_rule", "force"),
    ("profile_rule", None),
    ("redacted_params", ["api_key"]),
    ("redacted_params", {"api_key": ""}),
    ("redacted_params", {"api key": "sk_live_1"}),
    ("clock", 5),
    ("sleep", None),
]


@pytest.mark.parametrize("name, value", HOSTILE_OPTIONS, ids=ident)
def test_hostile_session_option_is_refused_before_the_journal_is_created(
    journal: Path, name: str, value: Any
) -> None:
    """A wrong Session option names itself and leaves no journal file behind."""
    with pytest.raises(ARGUMENT_ERRORS, match=name):
        idempotently.Session(journal, **{name: value})
    assert not journal.exists()


@pytest.mark.parametrize("name, value", [("journal", 123), ("base_ur", URL), ("client", "x")])
def test_misspelt_or_mistyped_session_arguments_name_themselves(
    journal: Path, name: str, value: Any
) -> None:
    """A typo in an option or a wrong journal/client type is a TypeError naming it."""
    options: dict[str, Any] = {name: value}
    path = options.pop("journal", journal)
    with pytest.raises(TypeError, match=name):
        idempotently.Session(path, **options)
    assert not journal.exists()


@pytest.mark.parametrize(
    "cls, name, value",
    [
        (idempotently.Transport, "methods", "POST"),
        (idempotently.Transport, "delivery", "twice"),
        (idempotently.Transport, "transport", httpx.AsyncHTTPTransport()),
        (idempotently.AsyncTransport, "transport", httpx.HTTPTransport()),
        (idempotently.Transport, "profile", "generic"),
        (idempotently.AsyncTransport, "profile_rule", "checked "),
        (idempotently.AsyncSession, "lease_duration", -5),
        (idempotently.AsyncSession, "redacted_params", {"api_key": "sk_live_1\n"}),
    ],
    ids=ident,
)
def test_hostile_transport_and_async_options_are_refused(
    journal: Path, cls: type, name: str, value: Any
) -> None:
    """Transports and AsyncSession check their options like Session does."""
    with pytest.raises(ARGUMENT_ERRORS, match=name):
        cls(journal, **{name: value})
    assert not journal.exists()


@pytest.mark.parametrize(
    "cls, sleep",
    [
        pytest.param(idempotently.Session, anyio.sleep, id="Session-async-sleep"),
        pytest.param(idempotently.Transport, anyio.sleep, id="Transport-async-sleep"),
        pytest.param(idempotently.AsyncSession, time.sleep, id="AsyncSession-sync-sleep"),
        pytest.param(idempotently.AsyncTransport, time.sleep, id="AsyncTransport-sync-sleep"),
    ],
)
def test_sleep_of_the_wrong_colour_is_refused(journal: Path, cls: type, sleep: Any) -> None:
    """A sync driver needs a blocking sleep and an async one an awaitable sleep."""
    with pytest.raises(TypeError, match="sleep"):
        cls(journal, sleep=sleep)


@pytest.mark.parametrize(
    "name, value",
    [
        pytest.param(
            "key_lifetime",
            math.inf,
        ),
        pytest.param(
            "key_lifetime",
            1e300,
        ),
        pytest.param(
            "key_lifetime",
            math.nan,
        ),
        pytest.param(
            "key_lifetime",
            "1d",
        ),
        pytest.param(
            "key_header",
            "",
        ),
        pytest.param(
            "key_header",
            "Idempotency Key",
        ),
        pytest.param(
            "max_key_length",
            -1,
        ),
        pytest.param(
            "key_format",
            "base64",
        ),
    ],
    ids=ident,
)
def test_hostile_server_profile_field_is_refused(journal: Path, name: str, value: Any) -> None:
    """A ServerProfile field no server could mean is refused, naming it, before anything is
    journaled or sent (a stored key_expires_at of inf or nan would break every read)."""
    recorder = Recorder()
    with pytest.raises(ARGUMENT_ERRORS, match=name):
        profile = attrs.evolve(profiles.GENERIC, name="custom", **{name: value})
        with session(journal, recorder, profile=profile) as s:
            s.post(URL, json=CHARGE, operation_id="op")
    assert [] == recorder.sent


def test_huge_lease_duration_is_refused_or_readable_mid_flight(journal: Path) -> None:
    """A lease_duration beyond any clock is refused, or the journal stays readable while held."""
    printed: list[tuple[int, str]] = []
    recorder = Recorder(answers=[httpx.Response(503)])
    fake = FakeTime(now=NOW)

    def sleep(seconds: float) -> None:
        printed.append(cli_run(journal, "list", "--json"))
        printed.append(cli_run(journal, "show", "op"))
        fake.sleep(seconds)

    try:
        s = idempotently.Session(
            journal, transport=recorder.transport, lease_duration=1e300, sleep=sleep
        )
    except ValueError as error:
        assert "lease_duration" in str(error)
        return
    with s:
        assert 201 == s.post(URL, json=CHARGE, operation_id="op").status_code
    assert [0, 0] == [code for code, _ in printed]


# -- resume ------------------------------------------------------------------------------------


@pytest.fixture
def pending(journal: Path) -> Path:
    """A journal with two pending operations (their answers were lost)."""
    recorder = Recorder(answers=[httpx.ReadError("lost"), httpx.ReadError("lost")])
    with session(journal, recorder, policy=ONE_TRY) as s:
        for operation_id in ("first", "second"):
            with pytest.raises(idempotently.OperationPendingError):
                s.post(URL, json=CHARGE, operation_id=operation_id)
    return journal


@pytest.mark.parametrize(
    "name, value",
    [
        ("base_url", "ftp://api.example.test"),
        ("base_url", "not a url"),
        ("base_url", "http://"),
        ("base_url", 123),
        ("base_url", b"https://api.example.test"),
        pytest.param("base_url", "https://api.example.test:99999"),
        pytest.param("base_url", "https://api.example.test:0"),
        ("reconciler", 5),
        ("on_result", "print"),
    ],
    ids=ident,
)
def test_hostile_resume_argument_is_refused_before_anything_is_sent(
    pending: Path, name: str, value: Any
) -> None:
    """resume() checks base_url (an http(s) origin with a usable port), reconciler and
    on_result before it sends or journals anything."""
    recorder = Recorder()
    with session(pending, recorder) as s, pytest.raises(ARGUMENT_ERRORS, match=name):
        s.resume(**{name: value})
    assert [] == recorder.sent
    operations = assert_sound(pending, operations=["first", "second"])
    assert {1} == {operation.attempt_count for operation in operations}


def garbage_reconciler(operation: idempotently.Operation, client: httpx.Client) -> Any:
    return True


def test_reconciler_returning_garbage_is_a_clear_error(pending: Path) -> None:
    """A reconciler that returns a non-Settlement is named in a TypeError."""
    recorder = Recorder()
    clock = FakeTime(now=NOW + 2 * 86400)  # both keys past their lifetime: reconciler's turn
    with (
        session(pending, recorder, clock=clock.clock) as s,
        pytest.raises(TypeError, match="reconciler"),
    ):
        s.resume(reconciler=garbage_reconciler)
    assert [] == recorder.sent
    assert_sound(pending, operations=["first", "second"])


# -- Journal's read methods --------------------------------------------------------------------


@pytest.fixture
def settled(journal: Path) -> Path:
    """A journal holding one operation that just succeeded."""
    with idempotently.Session(journal, transport=Recorder().transport) as s:
        s.post(URL, json=CHARGE, operation_id="done")
    return journal


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"limit": -1}),
        pytest.param(
            {"limit": "10"},
        ),
        pytest.param(
            {"limit": 2.5},
        ),
        pytest.param({"limit": True}),
        pytest.param({"limit": 10**30}),
        pytest.param({"status": "bogus"}),
        pytest.param({"status": ["pending", "later"]}),
        pytest.param({"status": b"pending"}),
        pytest.param(
            {"status": 5},
        ),
        pytest.param(
            {"since": "yesterday"},
        ),
        pytest.param({"since": math.nan}),
        pytest.param(
            {"since": datetime.datetime(2020, 1, 1)},
        ),
        pytest.param({"since": 10**400}),
    ],
    ids=ident,
)
def test_hostile_operations_filter_is_refused(settled: Path, options: dict[str, Any]) -> None:
    """Journal.operations() refuses a limit, status or since it cannot honour, naming it."""
    (name,) = options
    with idempotently.Journal(settled) as opened, pytest.raises(ARGUMENT_ERRORS, match=name):
        opened.operations(**options)
    assert_sound(settled, operations=["done"])


@SOME
@given(
    limit=st.one_of(
        st.integers(min_value=-(10**30), max_value=10**30),
        st.floats(),
        st.booleans(),
        st.text(max_size=3),
    )
)
def test_any_limit_is_honoured_or_refused(settled: Path, limit: Any) -> None:
    """A limit is a count (an int, not a bool, 0 to 2**63-1) or a ValueError/TypeError
    naming it."""
    valid = isinstance(limit, int) and not isinstance(limit, bool) and 0 <= limit < 2**63
    with idempotently.Journal(settled) as opened:
        if valid:
            assert min(1, int(limit)) == len(opened.operations(limit=limit))
        else:
            with pytest.raises(ARGUMENT_ERRORS, match="limit"):
                opened.operations(limit=limit)


@pytest.mark.parametrize(
    "older_than",
    [
        pytest.param(-1, id="negative"),
        pytest.param("7d", id="text"),
        pytest.param(datetime.timedelta(days=7), id="timedelta"),
        pytest.param(math.nan, id="nan"),
        pytest.param(10**400, id="huge-int"),
    ],
)
def test_hostile_prune_window_is_refused_and_deletes_nothing(
    settled: Path, older_than: Any
) -> None:
    """prune() needs a non-negative number of seconds; anything else deletes nothing."""
    with (
        idempotently.Journal(settled) as opened,
        pytest.raises(ARGUMENT_ERRORS, match="older_than"),
    ):
        opened.prune(older_than=older_than, now=time.time())
    assert_sound(settled, operations=["done"])


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"now": "now"}, id="now-text"),
        pytest.param({"now": time.time(), "stuck_after": -5}, id="stuck-after-negative"),
        pytest.param({"now": time.time(), "stuck_after": math.nan}, id="stuck-after-nan"),
        pytest.param({"now": time.time(), "stuck_after": "1h"}, id="stuck-after-text"),
    ],
)
def test_hostile_stats_arguments_are_refused(settled: Path, options: dict[str, Any]) -> None:
    """stats() names a now or stuck_after it cannot use."""
    names = "|".join(options)
    with idempotently.Journal(settled) as opened, pytest.raises(ARGUMENT_ERRORS, match=names):
        opened.stats(**options)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"path": None}, id="path-none"),
        pytest.param({"path": 42}, id="path-int"),
        pytest.param({"busy_timeout": "30"}, id="busy-timeout-text"),
    ],
)
def test_hostile_journal_arguments_name_themselves(scratch: Path, options: dict[str, Any]) -> None:
    """Journal() names the argument it cannot use."""
    options.setdefault("path", scratch / "ops.db")
    (name,) = [name for name in options if name != "path"] or ["path"]
    with pytest.raises(ARGUMENT_ERRORS, match=rf"\b{name}\b"):
        idempotently.Journal(**options)


# -- every numeric argument at its extremes ------------------------------------------------------

EXTREMES = [
    pytest.param(0, id="0"),
    pytest.param(-1, id="-1"),
    pytest.param(-0.0, id="-0.0"),
    pytest.param(math.nan, id="nan"),
    pytest.param(math.inf, id="inf"),
    pytest.param(-math.inf, id="-inf"),
    pytest.param(10**400, id="10**400"),
]
ZEROS = (0, -0.0)


def call_with(**options: Any) -> Any:
    """A call on a fresh Session with these per-call options."""

    def call(journal: Path, recorder: Recorder, value: Any) -> None:
        with session(journal, recorder) as s:
            s.post(URL, json=CHARGE, operation_id="op", **{k: f(value) for k, f in options.items()})

    return call


def session_with(name: str) -> Any:
    """A Session made with this option, then one call."""

    def call(journal: Path, recorder: Recorder, value: Any) -> None:
        with session(journal, recorder, **{name: value}) as s:
            s.post(URL, json=CHARGE, operation_id="op")

    return call


def policy_field(name: str) -> Any:
    return call_with(policy=lambda value: idempotently.RetryPolicy(**{name: value}))


def budget_field(name: str) -> Any:
    return call_with(
        policy=lambda value: idempotently.RetryPolicy(
            budget=idempotently.RetryBudget(**{name: value})
        )
    )


def profile_field(name: str) -> Any:
    return call_with(
        profile=lambda value: attrs.evolve(profiles.GENERIC, name="custom", **{name: value})
    )


def lookup_field(name: str) -> Any:
    def call(journal: Path, recorder: Recorder, value: Any) -> None:
        idempotently.Lookup("/v1/charges", **{name: value})

    return call


def resume_with(name: str) -> Any:
    def call(journal: Path, recorder: Recorder, value: Any) -> None:
        with session(journal, recorder) as s:
            s.resume(**{name: value})

    return call


def watch_with(name: str) -> Any:
    def call(journal: Path, recorder: Recorder, value: Any) -> None:
        with session(journal, recorder) as s:
            s.watch(threading.Event(), **{name: value})

    return call


def transport_client(method: str) -> Any:
    """A request through a Transport whose httpx client has this timeout."""

    def call(journal: Path, recorder: Recorder, value: Any) -> None:
        transport = idempotently.Transport(journal, transport=recorder.transport)
        with httpx.Client(transport=transport, timeout=value) as client:
            client.request(method, URL, json=CHARGE)

    return call


def journal_call(**options: Any) -> Any:
    """A Journal opened with, or a read of it given, these options."""

    def call(journal: Path, recorder: Recorder, value: Any) -> None:
        opening = {k: f(value) for k, f in options.items() if k == "busy_timeout"}
        with idempotently.Journal(journal, **opening) as opened:
            if "stuck_after" in options:
                opened.stats(now=NOW, stuck_after=options["stuck_after"](value))

    return call


def enqueue_call(journal: Path, recorder: Recorder, value: Any) -> None:
    with session(journal, recorder) as s:
        s.enqueue("POST", URL, json=CHARGE, operation_id="op", deadline_at=value)


def async_session_call(journal: Path, recorder: Recorder, value: Any) -> None:
    async def call() -> None:
        async with idempotently.AsyncSession(journal, transport=recorder.transport) as s:
            await s.post(URL, json=CHARGE, operation_id="op", timeout=value)

    anyio.run(call)


def async_transport_call(journal: Path, recorder: Recorder, value: Any) -> None:
    async def call() -> None:
        transport = idempotently.AsyncTransport(journal, transport=recorder.transport)
        async with httpx.AsyncClient(transport=transport, timeout=value) as client:
            await client.post(URL, json=CHARGE)

    anyio.run(call)


NUMERIC_ARGUMENTS: dict[str, tuple[Any, str, tuple[Any, ...]]] = {
    "Transport.timeout": (transport_client("POST"), "timeout", ()),
    "enqueue.deadline_at": (enqueue_call, "deadline_at", ()),
    "profile.in_progress_timeout": (
        profile_field("in_progress_timeout"),
        "in_progress_timeout",
        (),
    ),
    "Journal.busy_timeout": (journal_call(busy_timeout=lambda v: v), "busy_timeout", ZEROS),
    "stats.stuck_after": (journal_call(stuck_after=lambda v: v), "stuck_after", ZEROS),
    "Transport.read-timeout": (transport_client("GET"), "timeout", ()),
    "AsyncSession.timeout": (async_session_call, "timeout", ()),
    "AsyncTransport.timeout": (async_transport_call, "timeout", ()),
    # name: (how it is passed, the name its error gives, the extremes it accepts)
    "timeout": (call_with(timeout=lambda v: v), "timeout", ()),
    "timeout-read": (call_with(timeout=lambda v: httpx.Timeout(5.0, read=v)), "timeout", ()),
    "timeout-connect": (call_with(timeout=lambda v: httpx.Timeout(5.0, connect=v)), "timeout", ()),
    "timeout-tuple": (call_with(timeout=lambda v: (v, 5.0, 5.0, 5.0)), "timeout", ()),
    "deadline_at": (call_with(deadline_at=lambda v: v), "deadline_at", ()),
    "policy.max_attempts": (policy_field("max_attempts"), "max_attempts", (10**400,)),
    "policy.deadline": (policy_field("deadline"), "deadline", ()),
    "policy.initial_backoff": (policy_field("initial_backoff"), "initial_backoff", ZEROS),
    "policy.max_backoff": (policy_field("max_backoff"), "max_backoff", ZEROS),
    "policy.max_retry_after": (policy_field("max_retry_after"), "max_retry_after", ZEROS),
    "policy.in_progress_retries": (
        policy_field("in_progress_retries"),
        "in_progress_retries",
        (0, 10**400),
    ),
    "budget.ratio": (budget_field("ratio"), "ratio", ZEROS),
    "budget.min_per_second": (budget_field("min_per_second"), "min_per_second", ZEROS),
    "Session.timeout": (session_with("timeout"), "timeout", ()),
    "Session.lease_duration": (session_with("lease_duration"), "lease_duration", ()),
    "Session.key_expiry_margin": (session_with("key_expiry_margin"), "key_expiry_margin", ZEROS),
    "Session.max_response_bytes": (
        session_with("max_response_bytes"),
        "max_response_bytes",
        (10**400,),
    ),
    "profile.key_lifetime": (profile_field("key_lifetime"), "key_lifetime", ()),
    "profile.max_key_length": (profile_field("max_key_length"), "max_key_length", ()),
    "Lookup.absent_after": (lookup_field("absent_after"), "absent_after", ZEROS),
    "Lookup.backoff": (lookup_field("backoff"), "backoff", ZEROS),
    "Lookup.max_backoff": (lookup_field("max_backoff"), "max_backoff", ()),
    "resume.concurrency": (resume_with("concurrency"), "concurrency", ()),
    "watch.interval": (watch_with("interval"), "interval", ()),
    "watch.concurrency": (watch_with("concurrency"), "concurrency", ()),
}


@pytest.mark.parametrize("value", EXTREMES)
@pytest.mark.parametrize("argument", NUMERIC_ARGUMENTS)
def test_every_numeric_argument_at_its_extremes_is_refused_before_anything_is_journaled(
    journal: Path, argument: str, value: Any
) -> None:
    """0, -1, -0.0, NaN, ±inf and 10**400 for every numeric argument: refused with an
    error naming it before anything is journaled or sent (never a raw OverflowError),
    or, where the value is in range, a call that works and a journal every later call,
    resume and CLI command can read."""
    call, name, accepted = NUMERIC_ARGUMENTS[argument]
    in_range = any(value == ok and type(value) is type(ok) for ok in accepted)
    recorder = Recorder()
    try:
        call(journal, recorder, value)
    except ARGUMENT_ERRORS as error:
        assert name in str(error)
        assert [] == recorder.sent
        assert [] == (operation_ids(journal) if journal.exists() else [])
        return
    assert in_range, f"{argument}={value!r} was accepted"
    if journal.exists():
        assert_sound(journal)
