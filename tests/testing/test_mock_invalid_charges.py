"""Every invalid charge is refused before the key is claimed, and saves nothing.

The promise of docs/mock-server.md ("Refusals that save nothing"): a request
the server cannot accept is answered with a problem document (400, or 413 /
415 / 401 where the status says it better), no key row, no charge, no outbox
event; the corrected request under the same key is then a new request (201,
one charge). Driven in-process, so hostile headers reach the app unfiltered.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idempotently.testing import REPLAY_HEADER, MockApp, MockServer, VirtualClock, create_app
from idempotently.testing._charge_request import (
    MAX_AMOUNT,
    MAX_BODY_BYTES,
    MAX_CUSTOMER_LENGTH,
    MAX_METADATA_KEY_LENGTH,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_LENGTH,
    parse_charge,
)
from idempotently.testing._problems import PROBLEM_MEDIA_TYPE, Problem

from .conftest import charge

KEY = "k-1"
USER = "user_1"
Headers = Sequence[tuple[bytes, bytes]]
GOOD_HEADERS: Headers = [
    (b"authorization", f"Bearer {USER}".encode()),
    (b"idempotency-key", KEY.encode()),
    (b"content-type", b"application/json"),
]
NOTHING: dict[str, list[Any]] = {"keys": [], "ledger": [], "charges": [], "outbox": []}
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Send = Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]


def encoded(document: Any) -> bytes:
    return json.dumps(document).encode()


def headers_with(**changes: bytes | list[bytes] | None) -> list[tuple[bytes, bytes]]:
    """GOOD_HEADERS with some replaced (None drops one, a list repeats it)."""
    names = {name.replace("_", "-").encode(): value for name, value in changes.items()}
    headers = [(name, value) for name, value in GOOD_HEADERS if name not in names]
    for name, value in names.items():
        for one in [] if value is None else value if isinstance(value, list) else [value]:
            headers.append((name, one))
    return headers


def send(content: bytes | AsyncIterator[bytes], headers: Headers = GOOD_HEADERS) -> Send:
    def sending(client: httpx.AsyncClient) -> Awaitable[httpx.Response]:
        return client.post("/v1/charges", content=content, headers=list(headers))

    return sending


def run(app: MockApp, *sends: Send) -> list[httpx.Response]:
    """Send the requests in order to `app`, in-process."""

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://mock") as client:
            return [await one(client) for one in sends]

    return anyio.run(main)


def saved(app: MockApp) -> dict[str, list[Any]]:
    """Everything a request can leave behind: key rows, ledger, charges rows, outbox."""
    return {
        "keys": [(r.user_id, r.key, r.status) for r in app.keys.records()],
        "ledger": [(c.user, c.key) for c in app.ledger.charges()],
        "charges": [c["id"] for c in app.keys.recorded_charges()],
        "outbox": [e["charge_id"] for e in app.keys.outbox()],
    }


def refuse_then_fix(
    refused: Send,
) -> tuple[httpx.Response, dict[str, list[Any]], httpx.Response, MockApp]:
    """Send `refused`, snapshot what it saved, then a valid charge under the same key."""
    app = create_app(clock=VirtualClock())
    [refusal] = run(app, refused)
    after_refusal = saved(app)
    [retry] = run(app, send(encoded(charge())))
    return refusal, after_refusal, retry, app


def assert_one_charge_under_the_key(retry: httpx.Response, app: MockApp) -> None:
    assert (201, None) == (retry.status_code, retry.headers.get(REPLAY_HEADER))
    assert [(USER, KEY, "completed")] == saved(app)["keys"]
    assert {(USER, KEY): 1} == app.ledger.count_by_key()
    assert [retry.json()["id"]] == saved(app)["charges"] == saved(app)["outbox"]


def problem(response: httpx.Response) -> tuple[int, str, str, str]:
    document = response.json()
    return (
        response.status_code,
        response.headers["content-type"],
        document["title"],
        document["detail"],
    )


def metadata(n: int = 1, *, name: str = "k", value: str = "v") -> dict[str, str]:
    return {f"{name}{i}"[-MAX_METADATA_KEY_LENGTH:]: value for i in range(n)}


def deep(levels: int, inner: bytes = b"1") -> bytes:
    return b"[" * levels + inner + b"]" * levels


BAD_BODIES = [
    # amount
    pytest.param(encoded(charge(amount=2**63)), "amount must be an integer", id="amount-2**63"),
    pytest.param(encoded(charge(amount=2**64)), "amount must be an integer", id="amount-2**64"),
    pytest.param(encoded(charge(amount=MAX_AMOUNT + 1)), "from 1 to 99999999", id="amount-max+1"),
    pytest.param(encoded(charge(amount=-1)), "amount must be an integer", id="amount--1"),
    pytest.param(encoded(charge(amount=0)), "amount must be an integer", id="amount-0"),
    pytest.param(encoded(charge(amount=1.5)), "got 1.5", id="amount-1.5"),
    pytest.param(encoded(charge(amount=100.0)), "got 100.0", id="amount-100.0"),
    pytest.param(encoded(charge(amount="100")), 'got "100"', id="amount-string"),
    pytest.param(encoded(charge(amount=True)), "got true", id="amount-true"),
    pytest.param(encoded(charge(amount=None)), "got null", id="amount-null"),
    pytest.param(encoded(charge(amount=1e308)), "got 1e+308", id="amount-1e308"),
    pytest.param(encoded(charge(amount=[1])), "got an array", id="amount-array"),
    pytest.param(
        b'{"amount": 1' + b"0" * 5000 + b', "currency": "usd", "customer": "c"}',
        "a number with 5001 digits",
        id="amount-5001-digits",
    ),
    pytest.param(
        b'{"currency": "usd", "customer": "c"}', "missing field(s) amount", id="no-amount"
    ),
    # JSON that is not a charge, or not JSON
    pytest.param(
        encoded(charge(metadata={"x": json.loads(deep(500))})), "metadata[x]", id="nested-500"
    ),
    pytest.param(
        b'{"amount": 1, "currency": "usd", "customer": "c", "metadata": {"x": '
        + deep(5_000)
        + b"}}",
        "nested too deeply",
        id="nested-5000",
    ),
    pytest.param(deep(100_000), "nested too deeply", id="nested-100000"),
    pytest.param(
        b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply", id="objects-1e5"
    ),
    pytest.param(b"{nope", "not valid JSON", id="not-json"),
    pytest.param(encoded(charge()) + b" x", "not valid JSON", id="trailing-garbage"),
    pytest.param(b"", "the body is empty", id="empty"),
    pytest.param(b" \r\n\t", "the body is empty", id="whitespace"),
    pytest.param(
        b'{"amount": 1, "currency": "usd", "customer": "\xff"}', "not valid UTF-8", id="bad-utf-8"
    ),
    pytest.param(encoded(charge()).decode().encode("utf-16"), "not valid UTF-8", id="utf-16"),
    pytest.param(b"\xef\xbb\xbf" + encoded(charge()), "byte order mark", id="utf-8-bom"),
    pytest.param(b"[1, 2]", "must be a JSON object, got an array", id="top-level-array"),
    pytest.param(b'"charge"', 'must be a JSON object, got "charge"', id="top-level-string"),
    pytest.param(b"1000", "must be a JSON object, got 1000", id="top-level-number"),
    pytest.param(b"null", "must be a JSON object, got null", id="top-level-null"),
    pytest.param(b'{"amount": NaN, "currency": "usd", "customer": "c"}', "NaN is not", id="nan"),
    pytest.param(
        b'{"amount": Infinity, "currency": "usd", "customer": "c"}', "Infinity is not", id="inf"
    ),
    pytest.param(
        b'{"amount": 1, "currency": "usd", "customer": "c", "metadata": {"x": -Infinity}}',
        "-Infinity is not",
        id="minus-inf-in-metadata",
    ),
    pytest.param(
        b'{"amount": 1, "amount": 2, "currency": "usd", "customer": "c"}',
        'field "amount" appears twice',
        id="duplicate-field",
    ),
    pytest.param(
        b'{"amount": 1, "currency": "usd", "customer": "c", "metadata": {"o": "1", "o": "2"}}',
        'field "o" appears twice',
        id="duplicate-metadata-key",
    ),
    pytest.param(encoded(charge(surprise=1)), 'unknown field(s) "surprise"', id="unknown-field"),
    pytest.param(
        encoded(charge(**{f"f{i}": 1 for i in range(1000)})), "and 995 more", id="1000-unknown"
    ),
    # currency
    pytest.param(
        encoded(charge(currency="")), "currency must be a three-letter", id="currency-empty"
    ),
    pytest.param(encoded(charge(currency=840)), "got 840", id="currency-number"),
    pytest.param(encoded(charge(currency=None)), "got null", id="currency-null"),
    pytest.param(encoded(charge(currency="usdd")), 'got "usdd"', id="currency-4-letters"),
    pytest.param(encoded(charge(currency="u$d")), 'got "u$d"', id="currency-symbol"),
    pytest.param(encoded(charge(currency="u" * 100_000)), '"uuuu', id="currency-100000"),
    pytest.param(encoded(charge(currency="us\u0000")), "currency must be", id="currency-nul"),
    # customer
    pytest.param(encoded(charge(customer="")), "customer must be a non-empty", id="customer-empty"),
    pytest.param(encoded(charge(customer=42)), "got 42", id="customer-number"),
    pytest.param(encoded(charge(customer={})), "got an object", id="customer-object"),
    pytest.param(
        encoded(charge(customer="c" * (MAX_CUSTOMER_LENGTH + 1))),
        "customer is 256 characters long; at most 255",
        id="customer-256",
    ),
    pytest.param(encoded(charge(customer="c" * 500_000)), "at most 255", id="customer-500000"),
    pytest.param(encoded(charge(customer="cus\u00001")), '"\\u0000" at index 3', id="customer-nul"),
    pytest.param(encoded(charge(customer="cus\n1")), '"\\n" at index 3', id="customer-newline"),
    pytest.param(encoded(charge(customer="cus\u007f")), '"\\u007f"', id="customer-del"),
    pytest.param(encoded(charge(customer="cus\u0085")), '"\\u0085"', id="customer-c1"),
    pytest.param(
        b'{"amount": 1, "currency": "usd", "customer": "\\ud800"}',
        '"\\ud800" at index 0',
        id="customer-lone-surrogate",
    ),
    # metadata
    pytest.param(encoded(charge(metadata={"n": 1})), "metadata[n] must be", id="metadata-number"),
    pytest.param(encoded(charge(metadata={"n": None})), "got null", id="metadata-null-value"),
    pytest.param(encoded(charge(metadata={"n": {}})), "got an object", id="metadata-object"),
    pytest.param(encoded(charge(metadata=[])), "metadata must be an object", id="metadata-array"),
    pytest.param(encoded(charge(metadata=None)), "metadata must be an object", id="metadata-null"),
    pytest.param(encoded(charge(metadata="x")), "metadata must be an object", id="metadata-string"),
    pytest.param(
        encoded(charge(metadata=metadata(MAX_METADATA_KEYS + 1))),
        "metadata has 51 keys; at most 50",
        id="metadata-51-keys",
    ),
    pytest.param(
        encoded(charge(metadata=metadata(20_000))), "metadata has 20000 keys", id="metadata-20000"
    ),
    pytest.param(
        encoded(charge(metadata={"k" * (MAX_METADATA_KEY_LENGTH + 1): "v"})),
        "is 41 characters long; at most 40",
        id="metadata-key-41",
    ),
    pytest.param(
        encoded(charge(metadata={"k": "v" * (MAX_METADATA_VALUE_LENGTH + 1)})),
        "metadata[k] is 501 characters long; at most 500",
        id="metadata-value-501",
    ),
    pytest.param(
        encoded(charge(metadata={"": "v"})), "metadata key must be", id="metadata-key-empty"
    ),
    pytest.param(
        encoded(charge(metadata={"a]": "v"})), "square bracket", id="metadata-key-bracket"
    ),
    pytest.param(encoded(charge(metadata={"a\u0000": "v"})), '"\\u0000"', id="metadata-key-nul"),
    pytest.param(encoded(charge(metadata={"k": "v\u0000"})), '"\\u0000"', id="metadata-value-nul"),
]


@pytest.mark.parametrize(("body", "says"), BAD_BODIES)
def test_invalid_body_is_a_400_that_saves_nothing(body: bytes, says: str) -> None:
    """An invalid body is a 400 problem saying what is wrong; the key then works for the fix."""
    refusal, after_refusal, retry, app = refuse_then_fix(send(body))

    status, media_type, title, detail = problem(refusal)
    assert (400, PROBLEM_MEDIA_TYPE, "Bad Request") == (status, media_type, title)
    assert says in detail
    assert NOTHING == after_refusal
    assert_one_charge_under_the_key(retry, app)
    assert 1 == app.stats().rejected


@settings(FAST)
@given(
    st.one_of(
        st.integers(max_value=0),
        st.integers(min_value=MAX_AMOUNT + 1, max_value=10**99),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=5),
        st.booleans(),
        st.none(),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    )
)
def test_any_bad_amount_is_a_400_that_saves_nothing(amount: Any) -> None:
    """Whatever the amount, outside integers 1..99999999 it is a 400 and the key stays free."""
    refusal, after_refusal, retry, app = refuse_then_fix(send(encoded(charge(amount=amount))))

    assert 400 == refusal.status_code
    assert "amount must be an integer" in refusal.json()["detail"]
    assert NOTHING == after_refusal
    assert_one_charge_under_the_key(retry, app)


# Strings with anything in them: control characters, lone surrogates, non-ASCII.
any_text = st.text(st.characters(exclude_categories=()), max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | any_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(any_text, inner, max_size=3),
    max_leaves=8,
)
# What to put in one field of an otherwise valid charge: any JSON, plus the
# values that once got past validation and broke the server later.
hostile = st.one_of(
    json_values,
    st.integers(min_value=2**63 - 2, max_value=2**64 + 2),
    st.floats(),
    st.text(st.characters(categories=["Cc", "Cs"]), min_size=1, max_size=3),
    st.dictionaries(any_text, any_text | json_values, max_size=3),
)


def answered(document: Any) -> tuple[httpx.Response, MockApp]:
    app = create_app(clock=VirtualClock())
    # allow_nan: Infinity is sent as the literal; ensure_ascii: lone surrogates as \uXXXX.
    [response] = run(app, send(json.dumps(document, allow_nan=True).encode()))
    return response, app


def assert_charged_as_sent_or_refused(
    document: Any, response: httpx.Response, app: MockApp
) -> None:
    if response.status_code == 201:
        assert [(USER, KEY, "completed")] == saved(app)["keys"]
        [made] = app.ledger.charges()
        sent = json.loads(json.dumps(document))  # as JSON reads it: "\ud800\udc00" is one character
        assert {"metadata": {}, **sent} == {
            "amount": made.amount,
            "currency": made.currency,
            "customer": made.customer,
            "metadata": made.metadata,
        }
    else:
        assert (400, "Bad Request") == (response.status_code, response.json()["title"])
        assert NOTHING == saved(app)


@pytest.mark.parametrize("field", ["amount", "currency", "customer", "metadata", "extra"])
@settings(FAST)
@given(value=hostile)
def test_any_value_in_any_field_is_a_charge_or_a_400(field: str, value: Any) -> None:
    """A valid charge with one field set to any JSON value: 201 as sent, or a 400 saving nothing."""
    document = {**charge(), field: value}
    response, app = answered(document)

    assert_charged_as_sent_or_refused(document, response, app)


@settings(FAST)
@given(json_values)
def test_any_json_body_is_a_charge_or_a_400(document: Any) -> None:
    """Any JSON body whatsoever: 201 as sent, or a 400 that saves nothing; never a 500."""
    response, app = answered(document)

    assert_charged_as_sent_or_refused(document, response, app)


@settings(max_examples=150, deadline=None)
@given(
    st.binary(max_size=64)
    | json_values.map(lambda value: json.dumps(value).encode())
    | st.builds(
        lambda field, value: json.dumps({**charge(), field: value}).encode(),
        st.sampled_from(["amount", "currency", "customer", "metadata"]),
        hostile,
    )
)
def test_parse_charge_raises_only_400_problems(body: bytes) -> None:
    """parse_charge turns any bytes into a charge or a 400 Problem, never another exception."""
    try:
        parse_charge(body)
    except Problem as refusal:
        assert 400 == refusal.status


def test_limits_are_inclusive() -> None:
    """The largest and smallest valid values are accepted and stored as sent."""
    biggest = charge(
        amount=MAX_AMOUNT,
        currency="EUR",
        customer="c" * MAX_CUSTOMER_LENGTH,
        metadata=metadata(
            MAX_METADATA_KEYS,
            name="k" * MAX_METADATA_KEY_LENGTH,
            value="é" * MAX_METADATA_VALUE_LENGTH,
        ),
    )
    smallest = charge(amount=1, customer="c", metadata={"k": ""})
    app = create_app(clock=VirtualClock())
    responses = run(
        app,
        send(encoded(biggest)),
        send(encoded(smallest), headers_with(idempotency_key=b"k-2")),
    )

    assert [201, 201] == [r.status_code for r in responses]
    assert [
        (biggest["amount"], biggest["currency"], biggest["customer"], biggest["metadata"]),
        (1, "usd", "c", {"k": ""}),
    ] == [(c.amount, c.currency, c.customer, c.metadata) for c in app.ledger.charges()]


async def chunks(body: bytes, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    """`body` streamed without a Content-Length (chunked)."""
    for start in range(0, len(body), size):
        yield body[start : start + size]


def padded(size: int) -> bytes:
    """A valid charge padded with trailing whitespace to exactly `size` bytes."""
    body = encoded(charge())
    return body + b" " * (size - len(body))


@pytest.mark.parametrize("streamed", [False, True], ids=["content-length", "chunked"])
def test_body_over_1_mib_is_a_413_that_saves_nothing(streamed: bool) -> None:
    """One byte over 1 MiB is a 413 problem, declared or streamed; the key then works."""
    body = padded(MAX_BODY_BYTES + 1)
    refusal, after_refusal, retry, app = refuse_then_fix(send(chunks(body) if streamed else body))

    status, media_type, title, detail = problem(refusal)
    assert (413, PROBLEM_MEDIA_TYPE, "Content Too Large") == (status, media_type, title)
    assert "larger than 1048576 bytes" in detail
    assert NOTHING == after_refusal
    assert_one_charge_under_the_key(retry, app)


@pytest.mark.parametrize("streamed", [False, True], ids=["content-length", "chunked"])
def test_body_of_exactly_1_mib_is_read(streamed: bool) -> None:
    """A body of exactly 1 MiB is within the limit."""
    body = padded(MAX_BODY_BYTES)
    app = create_app(clock=VirtualClock())
    [response] = run(app, send(chunks(body) if streamed else body))

    assert 201 == response.status_code


def test_huge_declared_length_is_refused_unread() -> None:
    """A Content-Length over 1 MiB is refused from the header alone, even an absurd one."""
    app = create_app(clock=VirtualClock())
    absurd = headers_with(content_length=b"9" * 5000)
    [response] = run(app, send(encoded(charge()), absurd))

    assert 413 == response.status_code
    assert NOTHING == saved(app)


def test_body_over_1_mib_is_a_413_over_a_socket(idempotently_mock_server: MockServer) -> None:
    """Over uvicorn too, the client reads the 413 (not a broken pipe) and the key stays free."""
    server = idempotently_mock_server
    headers = {"Authorization": f"Bearer {USER}", "Idempotency-Key": KEY}
    with httpx.Client(base_url=server.url, headers=headers) as client:
        refusal = client.post("/v1/charges", content=padded(2 * MAX_BODY_BYTES))
        after_refusal = server.idempotency_keys()
        retry = client.post("/v1/charges", json=charge())

    assert 413 == refusal.status_code
    assert [] == after_refusal
    assert 201 == retry.status_code
    assert {(USER, KEY): 1} == server.charge_count_by_key()


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        pytest.param({"content_type": b"text/plain"}, "text/plain", id="text-plain"),
        pytest.param(
            {"content_type": b"multipart/form-data; boundary=x"}, "neither JSON", id="multipart"
        ),
        pytest.param({"content_type": b"application/jsonx"}, "neither JSON", id="jsonx"),
        pytest.param(
            {"content_type": b"application/x-www-form-urlencoded; charset=latin-1"},
            "latin-1",
            id="form-latin-1",
        ),
        pytest.param(
            {"content_type": b"application/json; charset=utf-16"}, "utf-16", id="charset-utf-16"
        ),
        pytest.param({"content_encoding": b"gzip"}, "Content-Encoding", id="gzip"),
    ],
)
def test_body_neither_json_nor_form_is_a_415_that_saves_nothing(
    changes: dict[str, bytes], says: str
) -> None:
    """A body declared as neither UTF-8 JSON nor a UTF-8 form is a 415; the key then works."""
    refusal, after_refusal, retry, app = refuse_then_fix(
        send(encoded(charge()), headers_with(**changes))
    )

    status, media_type, title, detail = problem(refusal)
    assert (415, PROBLEM_MEDIA_TYPE, "Unsupported Media Type") == (status, media_type, title)
    assert says in detail
    assert "application/json" in detail
    assert NOTHING == after_refusal
    assert_one_charge_under_the_key(retry, app)


@pytest.mark.parametrize(
    "content_type",
    [None, b"application/json", b"Application/JSON; charset=UTF-8", b"application/merchant+json"],
)
def test_json_media_types_are_accepted(content_type: bytes | None) -> None:
    """No Content-Type, application/json (any case, charset UTF-8) and +json types are JSON."""
    app = create_app(clock=VirtualClock())
    [response] = run(app, send(encoded(charge()), headers_with(content_type=content_type)))

    assert 201 == response.status_code


@pytest.mark.parametrize(
    ("key", "says"),
    [
        pytest.param(None, "needs an Idempotency-Key", id="missing"),
        pytest.param(b"", "needs an Idempotency-Key", id="empty"),
        pytest.param(b"   ", "needs an Idempotency-Key", id="spaces"),
        pytest.param(b"\t", "needs an Idempotency-Key", id="tab"),
        pytest.param("k-\u00e9".encode("latin-1"), '"\\u00e9" at index 2', id="latin-1"),
        pytest.param("k-\u00e9".encode(), '"\\u00c3" at index 2', id="utf-8"),
        pytest.param(b"\xa0k-1", '"\\u00a0" at index 0', id="leading-nbsp"),
        pytest.param(b"k-\x00", '"\\u0000" at index 2', id="nul"),
        pytest.param(b"k-\x01", '"\\u0001" at index 2', id="control"),
        pytest.param(b"k-\x7f", '"\\u007f" at index 2', id="del"),
        pytest.param(b"k\t1", '"\\t" at index 1', id="inner-tab"),
        pytest.param(b"k\n1", '"\\n" at index 1', id="newline"),
        pytest.param(b"k" * 256, "256 characters long; at most 255", id="256-characters"),
        pytest.param([b"k-1", b"k-2"], "2 Idempotency-Key headers", id="two-headers"),
        pytest.param([b"k-1", b"k-1"], "2 Idempotency-Key headers", id="same-key-twice"),
    ],
)
def test_hostile_idempotency_key_is_a_400_that_saves_nothing(
    key: bytes | list[bytes] | None, says: str
) -> None:
    """A missing, blank, non-ASCII, control-character or repeated key is a 400; nothing saved."""
    refusal, after_refusal, retry, app = refuse_then_fix(
        send(encoded(charge()), headers_with(idempotency_key=key))
    )

    status, media_type, title, detail = problem(refusal)
    assert (400, PROBLEM_MEDIA_TYPE, "Bad Request") == (status, media_type, title)
    assert says in detail
    assert NOTHING == after_refusal
    assert_one_charge_under_the_key(retry, app)


@pytest.mark.parametrize("key", [b'"quoted"', b"a key with spaces", b"~!@#$%^&*()", b"k" * 255])
def test_printable_ascii_keys_are_taken_verbatim(key: bytes) -> None:
    """Any printable ASCII key up to 255 characters is accepted as it was sent."""
    app = create_app(clock=VirtualClock())
    [response] = run(app, send(encoded(charge()), headers_with(idempotency_key=key)))

    assert 201 == response.status_code
    assert [key.decode()] == [record.key for record in app.keys.records()]


@pytest.mark.parametrize(
    "authorization",
    [
        pytest.param(None, id="missing"),
        pytest.param(b"Bearer", id="no-token"),
        pytest.param(b"Bearer    ", id="blank-token"),
        pytest.param(b"Basic dXNlcjpwdw==", id="basic"),
        pytest.param(b"Bearer user 1", id="space-in-token"),
        pytest.param("Bearer us\u00e9r".encode("latin-1"), id="latin-1"),
        pytest.param(b"Bearer user\x00", id="nul"),
        pytest.param(b"Bearer " + b"u" * 256, id="256-characters"),
        pytest.param([b"Bearer user_1", b"Bearer user_2"], id="two-headers"),
    ],
)
def test_malformed_bearer_token_is_a_401_that_saves_nothing(
    authorization: bytes | list[bytes] | None,
) -> None:
    """A missing, malformed or repeated bearer token is a 401 problem that saves nothing."""
    refusal, after_refusal, retry, app = refuse_then_fix(
        send(encoded(charge()), headers_with(authorization=authorization))
    )

    status, media_type, title, detail = problem(refusal)
    assert (401, PROBLEM_MEDIA_TYPE, "Unauthorized") == (status, media_type, title)
    assert "Bearer" == refusal.headers["www-authenticate"]
    assert "RFC 6750" in detail
    assert NOTHING == after_refusal
    assert_one_charge_under_the_key(retry, app)


FORM = b"application/x-www-form-urlencoded"
STRIPE_STYLE_FORM = b"amount=1000&currency=usd&customer=cus_42&metadata[order_id]=o-42"


def test_a_form_encoded_charge_is_the_same_charge_as_its_json_twin() -> None:
    """A Stripe-style form is charged like its JSON twin; the JSON twin under its key replays."""
    app = create_app(clock=VirtualClock())
    as_form, as_json = run(
        app,
        send(STRIPE_STYLE_FORM, headers_with(content_type=FORM)),
        send(encoded(charge(metadata={"order_id": "o-42"})), headers_with()),
    )

    assert (201, None) == (as_form.status_code, as_form.headers.get(REPLAY_HEADER))
    assert (1000, "usd", {"order_id": "o-42"}) == (
        as_form.json()["amount"],
        as_form.json()["currency"],
        as_form.json()["metadata"],
    )
    assert (201, "true") == (as_json.status_code, as_json.headers.get(REPLAY_HEADER))
    assert [("o-42", 1)] == [(order, n) for (_, order), n in app.ledger.count_by_order().items()]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        pytest.param(b"amount=ten&currency=usd&customer=c", "amount must be", id="amount-text"),
        pytest.param(b"amount=1&amount=2&currency=usd&customer=c", "twice", id="duplicate"),
        pytest.param(b"amount=1&currency=usd&customer=c&source[x]=1", "unknown", id="nested"),
        pytest.param(b"amount=1&currency=usd&customer=c&metadata=x", "metadata[", id="flat-meta"),
        pytest.param(b"amount=1&currency=usd", "missing", id="missing"),
        pytest.param(b"&&=", "not a valid form", id="garbage"),
        pytest.param(b"", "empty", id="empty"),
    ],
)
def test_a_malformed_form_is_a_400_that_saves_nothing(body: bytes, says: str) -> None:
    """A form passes the same checks as JSON: a bad one is a 400 problem and saves nothing."""
    refusal, after_refusal, retry, app = refuse_then_fix(
        send(body, headers_with(content_type=FORM))
    )

    status, _, _, detail = problem(refusal)
    assert 400 == status
    assert says in detail
    assert NOTHING == after_refusal
    assert_one_charge_under_the_key(retry, app)
