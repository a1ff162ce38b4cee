"""Request identity: the bytes sent on every attempt and every resume are the bytes
first sent, for every body httpx can send, and the fingerprint never raises.

Each case loses the first answer (the operation stays pending), calls again
with the same arguments (the flow continues it), loses that answer too, and
resumes; the raw server compares what reached it each time.
"""

from __future__ import annotations

import io
import json
import random
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import idempotently
from idempotently._keys import fingerprint
from tests.adversarial.invariants import Recorder, assert_sound
from tests.adversarial.wire import RESET, Wire

ONE_TRY = idempotently.RetryPolicy(max_attempts=1)
SOME = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def lost_twice_then_resumed(
    journal: Path, wire: Wire, send: Callable[[idempotently.Session], object], **options: Any
) -> list[idempotently.ResumeResult]:
    """First call and its continuation both lose their answer; resume then settles it."""
    wire.answer(RESET, RESET)
    with idempotently.Session(journal, policy=ONE_TRY, **options) as session:
        for _ in range(2):
            with pytest.raises(idempotently.OperationPendingError):
                send(session)
        return session.resume()


def assert_one_identity(wire: Wire) -> None:
    """Three attempts reached the server, all with the same key and the same bytes."""
    assert 3 == len(wire.arrivals)
    assert 1 == len({arrival.identity for arrival in wire.arrivals}), [
        arrival.identity for arrival in wire.arrivals
    ]


# -- multipart ---------------------------------------------------------------------------------

UPLOADS: dict[str, Callable[[], dict[str, Any]]] = {
    "one-file": lambda: {"files": {"receipt": ("r.txt", b"paid 10 EUR")}},
    "file-and-fields": lambda: {
        "files": {"receipt": ("r.txt", b"paid")},
        "data": {"order": "42", "note": "caf\xe9"},
    },
    "two-files": lambda: {
        "files": [("a", ("a.bin", b"\x00\x01")), ("b", ("b.json", b"{}", "application/json"))]
    },
    "file-object": lambda: {"files": {"receipt": ("r.pdf", io.BytesIO(b"%PDF-1.7 ..."))}},
    "empty-file": lambda: {"files": {"receipt": ("empty", b"")}},
}


@pytest.mark.parametrize("shape", UPLOADS)
def test_the_same_upload_under_one_operation_id_is_one_operation(
    journal: Path, wire: Wire, shape: str
) -> None:
    """Repeating a multipart upload continues the operation (httpx draws a new boundary
    each time): no KeyReuseError, and every attempt and the resume send the first bytes."""
    results = lost_twice_then_resumed(
        journal,
        wire,
        lambda s: s.post(f"{wire.url}/v1/uploads", operation_id="upload", **UPLOADS[shape]()),
    )
    assert ["succeeded"] == [result.action for result in results]
    assert_one_identity(wire)
    assert_sound(journal, operations=["upload"])


def test_a_settled_upload_repeated_is_answered_from_the_journal(journal: Path, wire: Wire) -> None:
    """The same upload after success returns the stored answer without a second send."""
    with idempotently.Session(journal) as s:
        first = s.post(f"{wire.url}/v1/uploads", operation_id="up", **UPLOADS["one-file"]())
        again = s.post(f"{wire.url}/v1/uploads", operation_id="up", **UPLOADS["one-file"]())
    assert (201, True) == (again.status_code, again.extensions["idempotently"].replayed_locally)
    assert first.content == again.content
    assert 1 == len(wire.arrivals)


@pytest.mark.anyio
async def test_async_session_repeats_an_upload_as_one_operation(
    journal: Path, wire: Wire, anyio_backend: str
) -> None:
    """AsyncSession keeps one identity for a repeated upload, on asyncio and trio."""
    wire.answer(RESET)
    async with idempotently.AsyncSession(journal, policy=ONE_TRY) as s:
        with pytest.raises(idempotently.OperationPendingError):
            await s.post(f"{wire.url}/v1/u", operation_id="up", **UPLOADS["file-and-fields"]())
        response = await s.post(
            f"{wire.url}/v1/u", operation_id="up", **UPLOADS["file-and-fields"]()
        )
    assert 201 == response.status_code
    assert 1 == len({arrival.identity for arrival in wire.arrivals})
    assert 2 == len(wire.arrivals)


def test_transport_repeats_an_sdk_upload_as_one_operation(journal: Path, wire: Wire) -> None:
    """Behind a Transport, an SDK that re-renders an upload (new boundary) under one
    operation id continues the operation with the first bytes."""
    wire.answer(RESET)
    transport = idempotently.Transport(journal, policy=ONE_TRY)
    headers = {"Idempotency-Operation-Id": "upload"}
    with httpx.Client(transport=transport) as client:
        with pytest.raises(idempotently.OperationPendingError):
            client.post(f"{wire.url}/v1/u", headers=headers, **UPLOADS["two-files"]())
        assert (
            201
            == client.post(
                f"{wire.url}/v1/u", headers=headers, **UPLOADS["two-files"]()
            ).status_code
        )
    assert 2 == len(wire.arrivals)
    assert 1 == len({arrival.identity for arrival in wire.arrivals})


# -- header bytes ------------------------------------------------------------------------------

HEADER_VALUES = [
    pytest.param(b"caf\xe9", id="latin-1"),
    pytest.param("café".encode(), id="utf-8-bytes"),
    pytest.param(b"\xff\xfe\x80", id="high-bytes"),
    pytest.param(b"a\tb  c", id="inner-whitespace"),
    pytest.param(b"plain-ascii", id="ascii"),
]


@pytest.mark.parametrize("value", HEADER_VALUES)
def test_header_bytes_are_resent_byte_for_byte(journal: Path, wire: Wire, value: bytes) -> None:
    """A header given as bytes (latin-1 included) reaches the server unchanged on every
    attempt and on resume; continuing and resuming never raise UnicodeEncodeError."""
    results = lost_twice_then_resumed(
        journal,
        wire,
        lambda s: s.post(
            f"{wire.url}/v1/charges",
            json={"a": 1},
            headers=[(b"X-Label", value)],
            operation_id="op",
        ),
    )
    assert ["succeeded"] == [result.action for result in results]
    assert_one_identity(wire)
    assert [value] * 3 == [arrival.header("X-Label") for arrival in wire.arrivals]
    assert_sound(journal, operations=["op"])


def test_resume_goes_on_after_an_operation_with_latin1_header_bytes(
    journal: Path, wire: Wire
) -> None:
    """An operation holding latin-1 header bytes neither breaks its own resume nor stops
    resume for the operations after it."""
    wire.answer(RESET, RESET, RESET)
    with idempotently.Session(journal, policy=ONE_TRY) as session:
        for operation_id, label in (("a", b"caf\xe9"), ("b", b"\xff"), ("c", b"plain")):
            with pytest.raises(idempotently.OperationPendingError):
                session.post(
                    f"{wire.url}/v1/charges",
                    json={"a": 1},
                    headers=[(b"X-Label", label)],
                    operation_id=operation_id,
                )
        results = session.resume()
    assert [("a", "succeeded"), ("b", "succeeded"), ("c", "succeeded")] == [
        (result.operation_id, result.action) for result in results
    ]
    assert [b"caf\xe9", b"\xff", b"plain"] * 2 == [a.header("X-Label") for a in wire.arrivals]
    assert_sound(journal, operations=["a", "b", "c"])


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(
            b"Bearer caf\xe9",
            id="latin-1",
        ),
        pytest.param(b"Bearer plain", id="ascii"),
    ],
)
def test_secret_header_bytes_are_resent_byte_for_byte(
    journal: Path, wire: Wire, value: bytes
) -> None:
    """A credential header (never journaled, re-applied from the live client) is sent with
    the same bytes on the first attempt, a continued call and a resume."""
    lost_twice_then_resumed(
        journal,
        wire,
        lambda s: s.post(f"{wire.url}/v1/charges", json={"a": 1}, operation_id="op"),
        headers={"Authorization": value},
    )
    assert [value] * 3 == [arrival.header("Authorization") for arrival in wire.arrivals]
    assert_sound(journal, operations=["op"], secrets=[value])


LEGAL_EDGE = [*range(0x21, 0x7F), *range(0x80, 0x100)]
LEGAL_INNER = [0x09, 0x20, *LEGAL_EDGE]
HEADER_BYTES = st.builds(
    lambda first, middle, last: bytes([first, *middle, last]),
    st.sampled_from(LEGAL_EDGE),
    st.lists(st.sampled_from(LEGAL_INNER), max_size=12),
    st.sampled_from(LEGAL_EDGE),
)


@SOME
@given(value=HEADER_BYTES)
def test_any_legal_header_bytes_survive_continue_and_resume(
    scratch: Path, wire: Wire, value: bytes
) -> None:
    """Whatever legal bytes a header holds, every attempt and the resume send them as given."""
    wire.reset()
    journal = scratch / f"{value.hex()}.db"
    lost_twice_then_resumed(
        journal,
        wire,
        lambda s: s.post(
            f"{wire.url}/v1/charges", content=b"x", headers=[(b"X-Label", value)], operation_id="op"
        ),
    )
    assert [value] * 3 == [arrival.header("X-Label") for arrival in wire.arrivals]


# -- JSON and other bodies ---------------------------------------------------------------------


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


BODIES = [
    pytest.param(nested(5_000), "application/json", id="json-5000-deep"),
    pytest.param(nested(200_000), "application/json", id="json-200000-deep"),
    pytest.param(b'{"n": ' + b"9" * 5000 + b"}", "application/json", id="json-5000-digit-int"),
    pytest.param(b'{"a": "\xff\xfe"}', "application/json", id="json-not-utf8"),
    pytest.param(b"NaN", "application/json", id="json-nan"),
    pytest.param(b'{"a": 1e999}', "application/json", id="json-overflowing-float"),
    pytest.param(b"\xef\xbb\xbf{}", "application/json; charset=utf-8", id="json-bom"),
    pytest.param(b"--x\r\n\r\n--x--", "multipart/form-data; boundary=", id="empty-boundary"),
    pytest.param(b"--\r\n--", 'multipart/form-data; boundary=""', id="quoted-empty-boundary"),
    pytest.param(b"\x00" * 1000, "application/octet-stream", id="binary"),
]


@pytest.mark.parametrize("body, content_type", BODIES)
def test_odd_bodies_keep_one_identity(
    journal: Path, wire: Wire, body: bytes, content_type: str
) -> None:
    """A body that cannot be canonicalised (too deep, not JSON, not UTF-8) is fingerprinted
    as raw bytes: never a RecursionError, and the same bytes on every attempt."""
    results = lost_twice_then_resumed(
        journal,
        wire,
        lambda s: s.post(
            f"{wire.url}/v1/charges",
            content=body,
            headers={"Content-Type": content_type},
            operation_id="op",
        ),
    )
    assert ["succeeded"] == [result.action for result in results]
    assert_one_identity(wire)
    assert body == wire.arrivals[0].body
    # `show` of these bodies has its own test (test_wire_values.py).
    assert_sound(journal, operations=["op"], show=False)


def test_a_streamed_body_repeated_is_one_operation(journal: Path, wire: Wire) -> None:
    """A body given as an iterator of chunks is read once, journaled, and resent whole."""

    def chunks() -> Iterator[bytes]:
        yield b'{"amount": '
        yield b"1000}"

    results = lost_twice_then_resumed(
        journal,
        wire,
        lambda s: s.post(
            f"{wire.url}/v1/charges",
            content=chunks(),
            headers={"Content-Type": "application/json"},
            operation_id="op",
        ),
    )
    assert ["succeeded"] == [result.action for result in results]
    assert [b'{"amount": 1000}'] * 3 == [arrival.body for arrival in wire.arrivals]


def test_query_parameters_in_another_order_are_the_same_operation(
    journal: Path, wire: Wire
) -> None:
    """Reordered query parameters name the same operation; the first URL is the one resent."""
    orders = iter([{"b": "2", "a": "1"}, {"a": "1", "b": "2"}])
    lost_twice_then_resumed(
        journal,
        wire,
        lambda s: s.post(
            f"{wire.url}/v1/ch%C3%A4rges", params=next(orders), json={}, operation_id="op"
        ),
    )
    assert [b"/v1/ch%C3%A4rges?b=2&a=1"] * 3 == [arrival.target for arrival in wire.arrivals]


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


def shuffled(value: Any, rand: random.Random) -> Any:
    """The same JSON value with every object's keys in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rand.shuffle(items)
        return {key: shuffled(item, rand) for key, item in items}
    if isinstance(value, list):
        return [shuffled(item, rand) for item in value]
    return value


@settings(max_examples=200, deadline=None)
@given(value=JSON, seed=st.integers(), indent=st.sampled_from([None, 0, 2]))
def test_fingerprint_of_any_json_never_raises_and_ignores_key_order_and_spacing(
    value: Any, seed: int, indent: int | None
) -> None:
    """Two renderings of one JSON value (keys reordered, whitespace added) fingerprint alike."""
    url = httpx.URL("https://api.example.test/v1/charges")
    headers = httpx.Headers({"Content-Type": "application/json"})
    compact = json.dumps(value).encode()
    other = json.dumps(shuffled(value, random.Random(seed)), indent=indent).encode()
    assert fingerprint("POST", url, compact, headers) == fingerprint("POST", url, other, headers)


@settings(max_examples=50, deadline=None)
@given(
    body=st.one_of(
        st.binary(max_size=64),
        st.builds(lambda depth: b"[" * depth + b"]" * depth, st.integers(0, 100_000)),
        st.builds(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth, st.integers(0, 50_000)),
    ),
    content_type=st.sampled_from(
        ["application/json", "application/merge-patch+json", "multipart/form-data; boundary=a", ""]
    ),
)
def test_fingerprint_of_any_body_never_raises(body: bytes, content_type: str) -> None:
    """Whatever the body and its Content-Type, the fingerprint is a SHA-256 hex digest."""
    headers = httpx.Headers({"Content-Type": content_type} if content_type else {})
    digest = fingerprint("POST", httpx.URL("https://h/x"), body, headers)
    assert 64 == len(digest)


@SOME
@given(value=st.dictionaries(st.text(max_size=6), JSON, min_size=2, max_size=5), seed=st.integers())
def test_the_same_json_with_keys_reordered_continues_with_the_first_bytes(
    scratch: Path, value: dict[str, Any], seed: int
) -> None:
    """Calling again with the same JSON in another key order continues the operation and
    resends the bytes first journaled, not a new rendering."""
    recorder = Recorder(answers=[httpx.ReadError("lost")])
    journal = scratch / f"{uuid.uuid4().hex}.db"
    with idempotently.Session(journal, transport=recorder.transport, policy=ONE_TRY) as s:
        with pytest.raises(idempotently.OperationPendingError):
            s.post("https://api.example.test/v1/c", json=value, operation_id="op")
        again = s.post(
            "https://api.example.test/v1/c",
            json=shuffled(value, random.Random(seed)),
            operation_id="op",
        )
    assert 201 == again.status_code
    assert [recorder.sent[0].content] * 2 == [request.content for request in recorder.sent]
