"""The I/O-free pieces: key parsing, request hashing, the state decision, the fault script."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idempotently.testing import Fault, Faults, MockServerConfig, VirtualClock
from idempotently.testing._charge_request import parse_key, request_hash
from idempotently.testing._problems import Problem
from idempotently.testing._states import next_step
from idempotently.testing._store import IdempotencyRecord

printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=50)


def sf_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@given(printable)
def test_quoted_key_round_trips(key: str) -> None:
    """Any printable ASCII key serialised as an RFC 8941 sf-string parses back to itself."""
    assert key == parse_key(sf_string(key), key_format="quoted", max_length=255)


@pytest.mark.parametrize("value", ['"abc', 'abc"', '"a\\b"', '"abc" x', '"é"', "abc"])
def test_malformed_quoted_keys_are_refused(value: str) -> None:
    """Unterminated, badly escaped, trailing-text, non-ASCII and bare values are 400s."""
    with pytest.raises(Problem) as caught:
        parse_key(value, key_format="quoted", max_length=255)

    assert 400 == caught.value.status


@given(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=6))
def test_request_hash_ignores_key_order(document: dict[str, object]) -> None:
    """Two renderings of the same JSON object hash alike, whatever their key order."""
    reordered = json.loads(json.dumps(dict(reversed(list(document.items())))))

    assert request_hash("POST", "/v1/charges", [], document) == request_hash(
        "post", "/v1/charges", [], reordered
    )


def test_request_hash_covers_method_path_query_and_body() -> None:
    """Changing the method, path, query or body changes the hash."""
    base = request_hash("POST", "/v1/charges", [("a", "1")], {"amount": 1})
    variants = {
        request_hash("PUT", "/v1/charges", [("a", "1")], {"amount": 1}),
        request_hash("POST", "/v1/refunds", [("a", "1")], {"amount": 1}),
        request_hash("POST", "/v1/charges", [("a", "2")], {"amount": 1}),
        request_hash("POST", "/v1/charges", [("a", "1")], {"amount": 2}),
    }

    assert base not in variants
    assert 4 == len(variants)


def record(status: str = "in_progress", locked_at: float = 0.0) -> IdempotencyRecord:
    return IdempotencyRecord("u", "k", "h", status, None, None, locked_at, 1e9)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("existing", "request_hash_", "now", "expected"),
    [
        (record("completed"), "other", 0, "mismatch"),
        (record("in_progress"), "other", 0, "mismatch"),
        (record("completed"), "h", 0, "replay"),
        (record("failed"), "h", 0, "take_over"),
        (record("in_progress", locked_at=10), "h", 99.9, "in_progress"),
        (record("in_progress", locked_at=10), "h", 100, "take_over"),
    ],
)
def test_next_step(
    existing: IdempotencyRecord, request_hash_: str, now: float, expected: str
) -> None:
    """The state machine: mismatch first, then replay, retry failed, or trust a fresh lock."""
    assert expected == next_step(existing, request_hash_, now=now, stale_after=90)


def test_fault_script_keeps_order_per_target() -> None:
    """A fault needing the work blocks later faults for the same request until a worker takes it."""
    faults = Faults()
    faults.push(Fault.crash(), Fault.unavailable())

    assert faults.take(user="u", key="k", order_id=None, doing_work=False) is None
    assert Fault.crash() == faults.take(user="u", key="k", order_id=None, doing_work=True)
    assert Fault.unavailable() == faults.take(user="u", key="k", order_id=None, doing_work=False)
    assert faults.take(user="u", key="k", order_id=None, doing_work=True) is None


def test_fault_json_round_trips() -> None:
    """Faults travel as {"kind", "seconds"} over the admin endpoint and come back equal."""
    faults = [
        Fault.unavailable(),
        Fault.unavailable(3),
        Fault.rate_limited(1.5),
        Fault.delay(0.1),
        Fault.server_error(),
        Fault.lose_response(),
        Fault.crash(),
    ]

    assert faults == [Fault.from_json(fault.to_json()) for fault in faults]


@pytest.mark.parametrize(
    "document", [{"kind": "meteor"}, {"kind": "delay"}, [], {"kind": "delay", "seconds": "x"}]
)
def test_bad_faults_are_refused(document: object) -> None:
    """An unknown kind, a missing or non-numeric delay, or a non-object is a ValueError."""
    with pytest.raises(ValueError):
        Fault.from_json(document)


def test_virtual_clock_moves_only_forward() -> None:
    """advance() moves the clock by exactly the given seconds and refuses to go back."""
    clock = VirtualClock(start=1000)

    assert 1090 == clock.advance(90)
    assert 1090 == clock.now()
    with pytest.raises(ValueError):
        clock.advance(-1)


def test_config_refuses_unknown_switches() -> None:
    """A misspelt switch value fails at construction, naming the choices."""
    with pytest.raises(ValueError, match="409, 423, wait"):
        MockServerConfig(in_progress="410")  # type: ignore[arg-type]
