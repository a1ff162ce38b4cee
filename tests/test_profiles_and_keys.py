"""Server profiles, keys, fingerprints and header redaction (DESIGN §3.1, §3.5, §3.6)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import attrs
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idempotently import IdempotentlyError, InvalidKeyError
from idempotently._keys import (
    SENSITIVE_HEADERS,
    derived_key,
    fingerprint,
    journaled_request_headers,
    journaled_response_headers,
    new_key,
    new_operation_id,
    read_request_headers,
    redaction_set,
    secret_values,
)
from idempotently._profiles import (
    BUILTIN_PROFILES,
    GENERIC,
    IETF,
    REPLAY_MARKER_HEADERS,
    STRIPE,
    ServerProfile,
)

JSON = httpx.Headers({"Content-Type": "application/json"})
URL = httpx.URL("https://api.example.com/v1/charges")

# Visible ASCII without space, double quote and backslash: what a key may hold.
KEY_ALPHABET = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"\\')
valid_keys = st.text(alphabet=KEY_ALPHABET, min_size=1, max_size=255)
bad_characters = st.one_of(
    st.sampled_from([" ", '"', "\\", "\t", "\n", "\r", "\x00", "\x7f", "é", "€", "\u200b"]),
    st.characters(min_codepoint=0x80),
)


# -- keys ----------------------------------------------------------------------------


def test_new_keys_are_unique_uuids() -> None:
    """A generated key is a UUID4, different every time, and valid on every profile."""
    keys = {new_key() for _ in range(100)}

    assert 100 == len(keys)
    for key in keys:
        assert re.fullmatch(
            r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", key
        )
        for profile in BUILTIN_PROFILES.values():
            profile.validate_key(key)


def test_new_operation_ids_are_unique() -> None:
    """Generated operation ids do not collide."""
    assert 100 == len({new_operation_id() for _ in range(100)})


@pytest.mark.parametrize("profile", [GENERIC, STRIPE], ids=lambda profile: profile.name)
def test_token_profiles_send_the_key_bare(profile: ServerProfile) -> None:
    """Generic and Stripe send the key as a bare token."""
    assert "order-42:charge" == profile.render_key("order-42:charge")


def test_ietf_sends_the_key_as_an_sf_string() -> None:
    """The IETF draft wants an RFC 8941 quoted string."""
    assert '"order-42:charge"' == IETF.render_key("order-42:charge")


@given(key=valid_keys)
def test_valid_keys_are_accepted_and_rendered_verbatim(key: str) -> None:
    """Any 1-255 visible-ASCII key without quote or backslash is accepted as is."""
    for profile in BUILTIN_PROFILES.values():
        profile.validate_key(key)

    assert (key, f'"{key}"') == (GENERIC.render_key(key), IETF.render_key(key))


@pytest.mark.parametrize(
    "key",
    ["", "a" * 256, 'say "hi"', "back\\slash", "with space", "tab\there", "nul\x00", "café"],
    ids=["empty", "256", "quote", "backslash", "space", "tab", "nul", "non-ascii"],
)
def test_invalid_keys_are_rejected(key: str) -> None:
    """Empty, too long, quotes, backslashes, whitespace and non-ASCII are rejected."""
    with pytest.raises(InvalidKeyError) as caught:
        GENERIC.validate_key(key)

    assert key[:100] == caught.value.key


def test_invalid_key_error_is_a_value_error_under_the_root() -> None:
    """InvalidKeyError can be caught as ValueError and as IdempotentlyError."""
    with pytest.raises(InvalidKeyError) as caught:
        GENERIC.validate_key("")

    assert isinstance(caught.value, ValueError)
    assert isinstance(caught.value, IdempotentlyError)


def test_key_length_follows_the_profile() -> None:
    """``max_key_length`` is the profile's: 255 by default, shorter where a server says."""
    short = attrs.evolve(GENERIC, max_key_length=8)
    GENERIC.validate_key("a" * 255)
    short.validate_key("a" * 8)

    with pytest.raises(InvalidKeyError, match="1 to 8 characters"):
        short.validate_key("a" * 9)


@given(
    prefix=st.text(alphabet=KEY_ALPHABET, max_size=20),
    bad=bad_characters,
    suffix=st.text(alphabet=KEY_ALPHABET, min_size=1, max_size=20),
)
def test_any_bad_character_inside_a_key_is_rejected(prefix: str, bad: str, suffix: str) -> None:
    """One character outside visible ASCII (or a quote, backslash, space) spoils the key."""
    with pytest.raises(InvalidKeyError):
        GENERIC.validate_key(prefix + bad + suffix)


@pytest.mark.parametrize("profile", BUILTIN_PROFILES.values(), ids=lambda profile: profile.name)
def test_a_trailing_newline_is_rejected(profile: ServerProfile) -> None:
    """A key ending in a newline is rejected: it could never be sent as a header."""
    with pytest.raises(InvalidKeyError):
        profile.validate_key("order-42\n")


# -- replay markers ------------------------------------------------------------------


@pytest.mark.parametrize("header", REPLAY_MARKER_HEADERS)
@pytest.mark.parametrize("value", ["true", "True", " TRUE ", "?1", "1"])
def test_every_replay_marker_is_recognised(header: str, value: str) -> None:
    """Each known replay header, set to a truthy value, marks a stored response."""
    assert GENERIC.is_replay(httpx.Response(200, headers={header: value}))


@pytest.mark.parametrize("header", REPLAY_MARKER_HEADERS)
@pytest.mark.parametrize("value", ["false", "?0", "0", "", "yes"])
def test_a_falsy_replay_marker_is_not_a_replay(header: str, value: str) -> None:
    """A replay header saying false (or garbage) is not a replay."""
    assert not GENERIC.is_replay(httpx.Response(200, headers={header: value}))


def test_no_marker_is_not_a_replay() -> None:
    """A response without a marker is fresh."""
    assert not GENERIC.is_replay(httpx.Response(200, headers={"X-Request-Id": "r1"}))


def test_profiles_are_frozen() -> None:
    """A server profile is an immutable value."""
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        GENERIC.key_header = "X-Key"  # type: ignore[misc]


def test_builtin_profiles_are_registered_by_name() -> None:
    """``generic``, ``stripe``, ``ietf`` and the catalog's profiles are built in, by name."""
    assert {"generic": GENERIC, "stripe": STRIPE, "ietf": IETF}.items() <= BUILTIN_PROFILES.items()
    assert all(name == profile.name for name, profile in BUILTIN_PROFILES.items())


# -- fingerprints --------------------------------------------------------------------


def fp(
    body: bytes = b'{"amount": 1000}',
    *,
    method: str = "POST",
    url: httpx.URL | str = URL,
    headers: httpx.Headers | dict[str, str] = JSON,
    fingerprint_headers: tuple[str, ...] = (),
) -> str:
    return fingerprint(method, httpx.URL(url), body, httpx.Headers(headers), fingerprint_headers)


json_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=8)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**12), max_value=10**12),
    json_text,
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(json_text, children, max_size=4)
    ),
    max_leaves=12,
)


def shuffled_json(value: Any, permute: st.DataObject) -> Any:
    """The same JSON value with every object's keys in another order."""
    if isinstance(value, dict):
        items = permute.draw(st.permutations(list(value.items())))
        return {key: shuffled_json(child, permute) for key, child in items}
    if isinstance(value, list):
        return [shuffled_json(child, permute) for child in value]
    return value


@settings(max_examples=40)
@given(
    payload=st.dictionaries(json_text, json_values, max_size=6),
    indent=st.sampled_from([None, 0, 2, "\t"]),
    separators=st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : ")]),
    ensure_ascii=st.booleans(),
    data=st.data(),
)
def test_json_bodies_that_mean_the_same_have_one_fingerprint(
    payload: dict[str, Any],
    indent: int | str | None,
    separators: tuple[str, str],
    ensure_ascii: bool,
    data: st.DataObject,
) -> None:
    """Key order, whitespace and escaping do not change a JSON body's fingerprint."""
    first = json.dumps(payload).encode()
    second = json.dumps(
        shuffled_json(payload, data),
        indent=indent,
        separators=separators,
        ensure_ascii=ensure_ascii,
    ).encode()

    assert fp(first) == fp(second)


def test_nested_reordered_json_has_one_fingerprint() -> None:
    """A worked example: nested keys reordered, whitespace changed."""
    first = b'{"amount": 1000, "meta": {"order": 42, "note": "x"}}'
    second = b'{\n  "meta": {"note": "x", "order": 42},\n  "amount": 1000\n}'

    assert fp(first) == fp(second)


def test_json_content_type_with_parameters_is_json() -> None:
    """``application/json; charset=utf-8`` and ``+json`` types are canonicalised too."""
    headers = {"Content-Type": "application/vnd.api+json; charset=utf-8"}

    assert fp(b'{"a":1,"b":2}', headers=headers) == fp(b'{ "b": 2, "a": 1 }', headers=headers)


def test_non_json_bodies_are_fingerprinted_byte_for_byte() -> None:
    """A form body is compared as bytes: different bytes, different fingerprint."""
    form = {"Content-Type": "application/x-www-form-urlencoded"}

    assert fp(b"a=1&b=2", headers=form) != fp(b"b=2&a=1", headers=form)


def test_invalid_json_is_fingerprinted_as_bytes() -> None:
    """A body labelled JSON that does not parse is still fingerprinted, as bytes."""
    assert fp(b"{not json") != fp(b"{not  json")


@given(
    params=st.lists(st.tuples(st.text(max_size=5), st.text(max_size=5)), max_size=6), data=st.data()
)
def test_query_parameter_order_does_not_matter(
    params: list[tuple[str, str]], data: st.DataObject
) -> None:
    """The URL is normalised: query parameters in any order give one fingerprint."""
    reordered = data.draw(st.permutations(params))

    assert fp(url=URL.copy_merge_params(params)) == fp(url=URL.copy_merge_params(reordered))


def test_query_parameter_order_worked_example() -> None:
    """``?a=1&b=2`` and ``?b=2&a=1`` are the same request."""
    assert fp(url=f"{URL}?a=1&b=2") == fp(url=f"{URL}?b=2&a=1")


@pytest.mark.parametrize(
    "other",
    [
        {"body": b'{"amount": 100000}'},
        {"method": "PUT"},
        {"url": "https://api.example.com/v1/refunds"},
        {"url": f"{URL}?a=1"},
        {"url": "https://other.example.com/v1/charges"},
    ],
    ids=["body", "method", "path", "query", "host"],
)
def test_a_different_request_has_a_different_fingerprint(other: dict[str, Any]) -> None:
    """Body, method, path, query or host changed: another request, another fingerprint."""
    assert fp() != fp(**other)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("https://api.example.com/files/a%2Fb", "https://api.example.com/files/a/b"),
        ("https://api.example.com/items/1%3Fa=1", "https://api.example.com/items/1?a=1"),
        ("http://[::1]:8080/v1/charges", "http://[::1:8080]/v1/charges"),
    ],
    ids=["encoded-slash", "encoded-question-mark", "ipv6-port"],
)
def test_urls_that_differ_on_the_wire_have_different_fingerprints(first: str, second: str) -> None:
    """Paths and hosts that are different requests to a server are different operations."""
    assert fp(url=first) != fp(url=second)


def test_method_case_does_not_matter() -> None:
    """``post`` and ``POST`` are the same method."""
    assert fp(method="post") == fp(method="POST")


def test_volatile_headers_are_not_fingerprinted() -> None:
    """Date, trace ids and other headers do not change the fingerprint by default."""
    first = {"Content-Type": "application/json", "Date": "Mon", "X-Request-Id": "1"}
    second = {"Content-Type": "application/json", "Date": "Tue", "traceparent": "00-ab"}

    assert fp(headers=first) == fp(headers=second)


def test_named_headers_are_fingerprinted() -> None:
    """A header named in ``fingerprint_headers`` (any case) is part of the fingerprint."""
    first = {"Content-Type": "application/json", "X-Account": "acct_1"}
    second = {"Content-Type": "application/json", "X-Account": "acct_2"}

    assert fp(headers=first, fingerprint_headers=("x-account",)) != fp(
        headers=second, fingerprint_headers=("X-ACCOUNT",)
    )
    assert fp(headers=first, fingerprint_headers=("X-Account",)) == fp(
        headers=first, fingerprint_headers=("x-account",)
    )


def test_fingerprint_is_a_sha256_hex_digest() -> None:
    """The fingerprint is 64 lowercase hex characters."""
    assert re.fullmatch(r"[0-9a-f]{64}", fp())


# -- redaction -----------------------------------------------------------------------


def any_case(name: str) -> st.SearchStrategy[str]:
    return st.lists(st.booleans(), min_size=len(name), max_size=len(name)).map(
        lambda upper: "".join(c.upper() if u else c for c, u in zip(name, upper, strict=True))
    )


def test_redaction_set_always_holds_the_secrets() -> None:
    """The four credential headers are always redacted; user names are added, lowercased."""
    assert {
        "authorization",
        "cookie",
        "proxy-authorization",
        "x-api-key",
        "x-tenant-secret",
    } == redaction_set(["X-Tenant-Secret"])
    assert SENSITIVE_HEADERS == redaction_set()


@given(
    name=st.sampled_from(
        ["authorization", "cookie", "proxy-authorization", "x-api-key", "x-tenant-secret"]
    ).flatmap(any_case)
)
def test_secret_request_headers_are_never_journaled(name: str) -> None:
    """Credential and user-listed headers, in any case, never reach the journal."""
    headers = httpx.Headers([(name, "s3cret-value"), ("Content-Type", "application/json")])

    stored = journaled_request_headers(headers, redaction_set(["X-Tenant-Secret"]))

    assert [("content-type", "application/json")] == [(n.lower(), v) for n, v in stored]
    assert "s3cret-value" not in repr(stored)


def test_journaled_request_headers_keep_what_a_resend_needs() -> None:
    """The key header and content type are kept; derived headers and secrets are not."""
    headers = httpx.Headers(
        [
            ("Authorization", "Bearer sk_live"),
            ("Cookie", "session=1"),
            ("Proxy-Authorization", "Basic x"),
            ("X-Api-Key", "k"),
            ("Content-Type", "application/json"),
            ("Idempotency-Key", "key-1"),
            ("Content-Length", "16"),
            ("Host", "api.example.com"),
            ("X-Custom", "a"),
            ("X-Custom", "b"),
        ]
    )

    stored = journaled_request_headers(headers, redaction_set())

    assert [
        ("content-type", "application/json"),
        ("idempotency-key", "key-1"),
        ("x-custom", "a"),
        ("x-custom", "b"),
    ] == [(name.lower(), value) for name, value in stored]


@given(namespace=st.uuids(), name=st.text(alphabet=st.characters(blacklist_categories=["Cs"])))
def test_a_derived_key_is_the_uuid5_of_the_operation_id(namespace: uuid.UUID, name: str) -> None:
    """The key of a named operation is UUIDv5(the journal's namespace, operation_id)."""
    assert str(uuid.uuid5(namespace, name)) == derived_key(namespace, name)


header_names = st.sampled_from(
    [
        "Authorization",
        "Cookie",
        "Content-Type",
        "Content-Length",
        "Host",
        "X-Tenant",
        "X-Tenant-Secret",
        "X-Custom",
        "Idempotency-Key",
    ]
).flatmap(any_case)
header_values = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=8)


@given(
    headers=st.lists(st.tuples(header_names, header_values), max_size=8),
    url=st.sampled_from(
        ["https://api.example.com/v1/x", "https://u:p@api.example.com/x?api_key=1&b=2"]
    ),
    fingerprinted=st.sampled_from([(), ("X-Tenant",), ("x-custom", "Authorization")]),
)
def test_one_pass_over_the_headers_reads_what_the_separate_reads_do(
    headers: list[tuple[str, str]], url: str, fingerprinted: tuple[str, ...]
) -> None:
    """read_request_headers gives the journaled headers (the key header set afterwards
    last, or where it stood), the secret values and the fingerprinted headers that the
    separate functions give."""
    request = httpx.Request(
        "POST", url, headers=[(n.encode("latin-1"), v.encode("latin-1")) for n, v in headers]
    )
    redacted = redaction_set(["X-Tenant-Secret"])

    read = read_request_headers(
        request.headers, redacted, request.url, fingerprinted, "Idempotency-Key"
    )
    with_key = httpx.Request("POST", url, headers=request.headers)
    with_key.headers["Idempotency-Key"] = "key-1"
    expected = journaled_request_headers(with_key.headers, redacted)

    assert secret_values(request.headers, redacted, request.url) == read.secrets
    assert (any(name.lower() == "idempotency-key" for name, _ in headers)) == read.has_key_header
    if not read.has_key_header:
        assert expected == [*read.journaled, ("Idempotency-Key", "key-1")]
    names = sorted({name.lower() for name in fingerprinted})
    assert (
        b"".join(
            b"\0"
            + name.encode()
            + b"="
            + b",".join(v.encode("latin-1") for n, v in headers if n.lower() == name)
            for name in names
        )
        == read.fingerprinted
    )


def test_journaled_response_headers_drop_cookies_and_encodings() -> None:
    """Stored responses keep no session cookie and no encoding to decode twice."""
    headers = httpx.Headers(
        [
            ("Content-Type", "application/json"),
            ("Set-Cookie", "session=abc"),
            ("SET-COOKIE2", "old=1"),
            ("Content-Encoding", "gzip"),
            ("Content-Length", "20"),
            ("Transfer-Encoding", "chunked"),
            ("Idempotent-Replayed", "true"),
            ("X-Internal-Token", "t"),
        ]
    )

    stored = journaled_response_headers(headers, redaction_set(["x-internal-token"]))

    assert [("content-type", "application/json"), ("idempotent-replayed", "true")] == [
        (name.lower(), value) for name, value in stored
    ]
