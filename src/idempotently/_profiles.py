"""How a given API spells the idempotency-key contract."""

from __future__ import annotations

import functools
import importlib
import json
import re
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any, Literal

import attrs
import httpx

from idempotently._exceptions import InvalidKeyError, StoredProfileError

if TYPE_CHECKING:
    from idempotently._rate_limits import QuotaReader

KeyFormat = Literal["token", "sf-string"]

DEFAULT_KEY_HEADER = "Idempotency-Key"
DEFAULT_KEY_LIFETIME = 24 * 60 * 60.0
DEFAULT_MAX_KEY_LENGTH = 255
REPLAY_MARKER_HEADERS = (
    "Idempotent-Replayed",
    "Idempotency-Replayed",
    "X-Idempotent-Replayed",
    "X-Idempotency-Replayed",
)
# Words a 409 body uses when the key was reused with another payload, as
# opposed to "in progress" (Brandur's server answers 409 for both).
MISMATCH_BODY_MARKERS = ("mismatch", "different payload", "different parameters")
DEFAULT_IN_PROGRESS_TIMEOUT = 60 * 60.0
MIN_KEY_EXPIRY_MARGIN = 60.0
"""The smallest key-expiry margin: the clock skew between the host that journaled a key's
expiry and the one that resends it, which the margin is the only protection against."""
MAX_DEFAULT_KEY_EXPIRY_MARGIN = 3600.0
"""The default margin of long-lived keys (a tenth of the lifetime, capped here)."""
RETRY_HINT_HEADERS = ("Stripe-Should-Retry", "X-Should-Retry")
RATE_LIMIT_FAMILIES = frozenset({"retry-after", "ratelimit", "x-ratelimit", "openai", "anthropic"})
"""The families of rate-limit headers a profile can trust (`ServerProfile.rate_limit_headers`)."""
DEFAULT_RATE_LIMIT_HEADERS = ("retry-after",)
"""Retry-After (and ``retry-after-ms``) only: what every profile read before the others."""

MismatchMatcher = Callable[[httpx.Response], bool]
"""Says whether an answer means "this key was used with another payload"."""

Verdict = Literal["retry", "final", "in_progress", "mismatch"]
"""What a classifier makes of an answer."""
VERDICTS: frozenset[str] = frozenset({"retry", "final", "in_progress", "mismatch"})
Classifier = Callable[[int, httpx.Headers, bytes], "str | None"]
"""``classify(status, headers, body)``: a `Verdict` (checked when it answers), or
None for the built-in table."""


@attrs.frozen
class BodyMentions:
    """A matcher: an answer with one of ``statuses`` whose body mentions one of ``words``.

    A value (equal by its words and statuses), so a profile using it is journaled as
    its fields and read back the same at resume."""

    words: tuple[str, ...]
    statuses: frozenset[int]

    def __call__(self, response: httpx.Response) -> bool:
        if response.status_code not in self.statuses:
            return False
        body = _body_text(response).lower()
        return any(word in body for word in self.words)


@attrs.frozen
class ErrorType:
    """A matcher: a JSON body ``{"error": {"type": T}}`` with T in ``types`` (Stripe's style)."""

    types: frozenset[str]
    statuses: frozenset[int]

    def __call__(self, response: httpx.Response) -> bool:
        if response.status_code not in self.statuses:
            return False
        return _error_type(_body_text(response)) in self.types


def body_mentions(*words: str, statuses: Collection[int] = frozenset({409})) -> MismatchMatcher:
    """A matcher: an answer with one of ``statuses`` whose body mentions one of ``words``.

    Args:
        *words: Words to look for in the body, case-insensitively.
        statuses: The statuses whose body is read (409 by default).
    """
    return BodyMentions(tuple(word.lower() for word in words), frozenset(statuses))


def error_type(*types: str, statuses: Collection[int] = frozenset({400})) -> MismatchMatcher:
    """A matcher: a JSON body ``{"error": {"type": T}}`` with T in ``types`` (Stripe's style).

    Args:
        *types: The error types that mean a mismatch (`idempotency_error`).
        statuses: The statuses whose body is read (400 by default).
    """
    return ErrorType(frozenset(types), frozenset(statuses))


def never(response: httpx.Response) -> bool:
    """A matcher that recognises nothing (only ``mismatch_statuses`` count).

    Args:
        response: The answer (ignored).
    """
    return False


DEFAULT_MISMATCH_MATCHER = body_mentions(*MISMATCH_BODY_MARKERS)
"""A 409 whose body mentions a mismatch (Brandur's server)."""

# Visible ASCII without the characters a quoted sf-string would need escaped:
# a key that is the same bytes in both formats is a key every server accepts.
_TRUE_VALUES = frozenset({b"true", b"?1", b"1"})

_KEY_CHARACTERS = re.compile(r"[!#-\[\]-~]+")


_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A replay marker's own value (``X-Idempotency-Status: hit``): visible ASCII, no commas.
_MARKER_VALUE = re.compile(r"[!-+\--~]+")
MAX_KEY_LIFETIME = 10 * 366 * 24 * 3600.0


def default_key_expiry_margin(lifetime: float) -> float:
    """The margin kept before a key's lifetime ends when the profile sets none:
    a tenth of the lifetime, at least `MIN_KEY_EXPIRY_MARGIN` (clock skew) and at
    most `MAX_DEFAULT_KEY_EXPIRY_MARGIN` (an hour)."""
    return min(MAX_DEFAULT_KEY_EXPIRY_MARGIN, max(MIN_KEY_EXPIRY_MARGIN, lifetime / 10))


def check_key_expiry_margin(value: object, lifetime: float | None, name: str) -> float:
    """``value`` as a margin in seconds, or a TypeError/ValueError in one line: at least
    `MIN_KEY_EXPIRY_MARGIN`, and below ``lifetime`` when it is known."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    try:
        margin = float(value)
    except OverflowError:  # an int past any float (10**400): no finite margin
        margin = float("inf")
    if not margin >= MIN_KEY_EXPIRY_MARGIN or margin == float("inf"):  # NaN fails too
        raise ValueError(
            f"{name} must be a finite number of seconds, at least {MIN_KEY_EXPIRY_MARGIN:g} "
            f"(the clock skew between hosts it protects against), not {str(value)[:40]}"
        )
    if lifetime is not None and margin >= lifetime:
        raise ValueError(
            f"{name} ({margin:g}s) must be below the key lifetime ({lifetime:g}s): no key "
            "could ever be resent"
        )
    return margin


def _as_tuple(value: Iterable[str]) -> tuple[str, ...]:
    """``tuple``, named: attrs reads each converter's signature as the class is made, and
    reading a builtin's means tokenizing its text signature (15 M instructions at import)."""
    return tuple(value)


def _replay_marker_specs(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """Each a header name (value true, ?1 or 1), or ``Name: value`` for that value."""
    if isinstance(value, str):
        value = (value,)
    for marker in value:
        name, colon, word = marker.partition(":") if isinstance(marker, str) else (None, "", "")
        if (
            not isinstance(name, str)
            or not _HEADER_NAME.fullmatch(name.strip())
            or (colon and not _MARKER_VALUE.fullmatch(word.strip()))
        ):
            raise ValueError(
                "replay_headers must be header names (letters, digits, -), each optionally "
                f"with the value that marks a replay ('X-Idempotency-Status: hit'), not {value!r}"
            )


def _handler_errors(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, frozenset) or not all(
        isinstance(status, int) and not isinstance(status, bool) and 500 <= status <= 599
        for status in value
    ):
        raise ValueError(f"handler_errors must be a frozenset of 5xx status codes, not {value!r}")


def _families(value: Any) -> Any:
    """A collection of family names as a sorted tuple without repeats (the same trust
    is the same profile, and journals alike); anything else is left to the validator."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        return value
    names = tuple(value)
    if not all(isinstance(name, str) for name in names):
        return names
    return tuple(sorted(set(names)))


def _known_families(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, tuple) or not set(value) <= RATE_LIMIT_FAMILIES:
        raise ValueError(
            "rate_limit_headers must be a tuple of the header families the server's "
            f"answers are trusted for, among {', '.join(map(repr, sorted(RATE_LIMIT_FAMILIES)))}"
            f", not {value!r:.80}"
        )


def _margin_below_lifetime(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        check_key_expiry_margin(value, instance.key_lifetime, "key_expiry_margin")


def _seconds(low_exclusive: float, high: float) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and attribute.name == "in_progress_timeout":
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"{attribute.name} must be a number of seconds, not {type(value).__name__}"
            )
        if not (low_exclusive < value <= high):
            raise ValueError(
                f"{attribute.name} must be seconds above 0 up to {high:g}, not {value!r}"
            )

    return check


def _header_names(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    names = (value,) if attribute.name == "key_header" else value
    if isinstance(names, str) or not all(
        isinstance(name, str) and _HEADER_NAME.fullmatch(name) for name in names
    ):
        raise ValueError(
            f"{attribute.name} must be HTTP header names (letters, digits, -), not {value!r}"
        )


_NEEDED_AS_SENT = {
    **dict.fromkeys(("authorization", "proxy-authorization", "cookie", "x-api-key"), "credentials"),
    **dict.fromkeys(
        (
            "host",
            "content-length",
            "transfer-encoding",
            "connection",
            "keep-alive",
            "proxy-connection",
            "te",
            "trailer",
            "upgrade",
            "expect",
        ),
        "framing",
    ),
    **dict.fromkeys(("content-type", "content-encoding"), "body"),
    **dict.fromkeys(
        ("idempotency-operation-id", "idempotency-delivery", "idempotency-policy"),
        "idempotently's own",
    ),
}
"""Headers an attempt header may not be: the flow deletes the caller's value of it and
sends the attempt's number in its place (``Authorization: 1``, ``Content-Length: 1``)."""


def _attempt_header(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A header name of its own: not the key header, nor one the profile reads, nor one
    the request needs as it is (`_NEEDED_AS_SENT`)."""
    if value is None:
        return
    if not isinstance(value, str) or not _HEADER_NAME.fullmatch(value):
        raise ValueError(
            f"attempt_header must be an HTTP header name (letters, digits, -) or None, not "
            f"{value!r}"
        )
    needed = _NEEDED_AS_SENT.get(value.lower())
    if needed is not None:
        raise ValueError(
            f"attempt_header {value!r} is one of the request's {needed} headers, which it "
            "needs as it is (the attempt's number would replace its value): name a header "
            "of its own, such as 'Idempotency-Attempt'"
        )
    taken = {instance.key_header.lower(): "key_header"}
    taken.update((name.lower(), "retry_hint_headers") for name in instance.retry_hint_headers)
    taken.update(
        (marker.partition(":")[0].strip().lower(), "replay_headers")
        for marker in instance.replay_headers
    )
    if value.lower() in taken:
        raise ValueError(
            f"attempt_header {value!r} is already the profile's {taken[value.lower()]}: "
            "name a header of its own, such as 'Idempotency-Attempt'"
        )


def _statuses(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, frozenset) or not all(
        isinstance(status, int) and not isinstance(status, bool) and 400 <= status <= 599
        for status in value
    ):
        raise ValueError(
            f"{attribute.name} must be a frozenset of 4xx/5xx status codes, not {value!r}"
        )


def _name(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value or len(value) > 100 or not value.isprintable():
        raise ValueError(f"name must be 1 to 100 printable characters, not {value!r}")


# -- the operation id carried in the request, for a lookup -------------------------------

_FIELD_PART = re.compile(r"[A-Za-z0-9_\-]+")


def check_operation_id_field(value: object, name: str = "operation_id_field") -> str:
    """A dotted path of field names (``metadata.operation_id``), or a ValueError."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str such as 'metadata.operation_id', not {value!r}")
    parts = value.split(".")
    if len(value) > 200 or not all(_FIELD_PART.fullmatch(part) for part in parts):
        raise ValueError(
            f"{name} must be field names (letters, digits, _ and -) joined by dots, such as "
            f"'metadata.operation_id', not {value[:60]!r}"
        )
    return value


def _operation_id_field(value: object) -> None:
    if value is not None:
        check_operation_id_field(value)


def carry_operation_id(
    field: str | None, operation_id: str | None, *, json: Any, data: Any
) -> tuple[Any, Any]:
    """``(json, data)`` with ``operation_id`` added at ``field``: into a JSON object
    (nested objects made as needed, copied, never the caller's own) or a form mapping
    (``a[b]``, Stripe's convention). A value already there, a path blocked by a
    non-object, or another kind of body is left as it is."""
    if field is None or operation_id is None:
        return json, data
    parts = field.split(".")
    if json is not None:
        if not isinstance(json, dict):
            return json, data
        carried = dict(json)
        level = carried
        for part in parts[:-1]:
            inner = level.get(part)
            if inner is None:
                inner = {}
            elif not isinstance(inner, dict):
                return json, data  # not an object there: nowhere to put it
            else:
                inner = dict(inner)
            level[part] = inner
            level = inner
        if parts[-1] in level:
            return json, data  # the caller's own value stands
        level[parts[-1]] = operation_id
        return carried, data
    if isinstance(data, dict):
        name = parts[0] + "".join(f"[{part}]" for part in parts[1:])
        if name in data:
            return json, data
        return json, {**data, name: operation_id}
    return json, data


@attrs.frozen(cache_hash=True)  # hashed on every call (the journaled spec's cache)
class ServerProfile:
    """The server side of the contract, as one API implements it.

    Built-ins live in `idempotently.profiles`; adapt one with
    ``attrs.evolve(profiles.GENERIC, in_progress_statuses=frozenset({409, 423}))``.
    """

    name: str = attrs.field(validator=_name)
    """What the profile is called: a built-in's name (`stripe`), or yours; journaled with each
    operation."""
    key_header: str = attrs.field(default=DEFAULT_KEY_HEADER, validator=_header_names)
    """The request header that carries the key."""
    key_format: KeyFormat = attrs.field(
        default="token", validator=attrs.validators.in_(("token", "sf-string"))
    )
    """``token`` (sent bare) or ``sf-string`` (an RFC 8941 quoted string)."""
    max_key_length: int = attrs.field(
        default=DEFAULT_MAX_KEY_LENGTH,
        validator=[
            attrs.validators.instance_of(int),
            attrs.validators.ge(1),
            attrs.validators.le(8192),
        ],
    )
    """The longest key the server takes, in characters; a longer explicit key is refused before
    anything is sent."""
    key_lifetime: float = attrs.field(
        default=DEFAULT_KEY_LIFETIME, validator=_seconds(0, MAX_KEY_LIFETIME)
    )
    """Seconds the server remembers a key; resume never resends an older one."""
    key_expiry_margin: float | None = attrs.field(default=None, validator=_margin_below_lifetime)
    """Seconds before the key's lifetime ends after which an operation is no longer resent
    (it goes to needs_reconcile): the protection against clock skew between the host that
    journaled the key and the one that resends it. None: ``min(3600, max(60, key_lifetime /
    10))``. At least 60 and below ``key_lifetime``; journaled with the profile, and a resume
    given another margin applies the larger."""
    in_progress_statuses: frozenset[int] = attrs.field(
        default=frozenset({409}), validator=_statuses
    )
    """Answers meaning "this key's first request is still running": retried, capped."""
    in_progress_timeout: float | None = attrs.field(
        default=DEFAULT_IN_PROGRESS_TIMEOUT, validator=_seconds(0, MAX_KEY_LIFETIME)
    )
    """Seconds of uninterrupted "in progress" answers after which the operation goes to
    needs_reconcile (a server lock that never expires); None waits forever."""
    mismatch_statuses: frozenset[int] = attrs.field(default=frozenset({422}), validator=_statuses)
    """Answers that always mean "this key was used with another payload"."""
    mismatch_matcher: MismatchMatcher = attrs.field(
        default=DEFAULT_MISMATCH_MATCHER, validator=attrs.validators.is_callable()
    )
    """Recognises a payload mismatch among other answers (a 409 or 400 body)."""
    stores_server_errors: bool = attrs.field(
        default=True, validator=attrs.validators.instance_of(bool)
    )
    """Whether the server stores a 5xx under the key. When False (middlewares that
    release the key and re-run the handler), a 500 may have acted: it goes to
    needs_reconcile, and only 502, 503 and 504 are retried."""
    handler_errors: frozenset[int] = attrs.field(default=frozenset(), validator=_handler_errors)
    """5xx statuses that come from the server's own handler, not from a gateway in front
    of it (API Gateway answers 502 for every error a Lambda function raises): read as the
    server's own 5xx under ``stores_server_errors``, so a server that releases its key on
    an error sends them to needs_reconcile instead of running its handler again on each
    retry. Empty by default: 502, 503 and 504 are a gateway's."""
    replay_headers: tuple[str, ...] = attrs.field(
        default=REPLAY_MARKER_HEADERS, converter=_as_tuple, validator=_replay_marker_specs
    )
    """Response headers marking a stored answer replayed: a name (its value true, ?1 or
    1), or ``Name: value`` for a server that says it with another word
    (``X-Idempotency-Status: hit``); values are compared case-insensitively."""
    retry_hint_headers: tuple[str, ...] = attrs.field(
        default=RETRY_HINT_HEADERS, converter=_as_tuple, validator=_header_names
    )
    """Response headers saying true/false to "should this be retried"."""
    classify: Classifier | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.is_callable())
    )
    """``fn(status, headers, body) -> "retry" | "final" | "in_progress" | "mismatch" |
    None``, for servers that say "try again" in a 200 or "in progress" in a 202; None
    (its answer, or no classifier) leaves the built-in table to decide. It can never
    make an answer after an attempt that may have been delivered ``failed``; one that
    raises leaves the operation pending. Journaled as its ``module:qualname``."""
    pause_origin: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    """Whether a 429 or 503 with Retry-After pauses its whole origin (for the same
    credentials), journaled, so every thread, process and resume worker sharing the
    journal waits it out; False for APIs that limit per resource."""
    key_bound_to_credentials: bool = attrs.field(
        default=False, validator=attrs.validators.instance_of(bool)
    )
    """Whether the server stores a key per credentials (the key of one API token is
    another key under another token). When True, each operation journals a salted,
    slow digest of its credentials (Authorization, Proxy-Authorization, X-Api-Key,
    the redacted headers, secret query parameters; never their values), and is never
    resent under credentials that digest differently: it stays pending until the
    original ones are given."""

    operation_id_field: str | None = attrs.field(
        default=None, validator=lambda _, attribute, value: _operation_id_field(value)
    )
    """Where a named operation's id is added to its JSON or form body before it is
    rendered (a dotted path such as ``metadata.operation_id``; in a form,
    ``metadata[operation_id]``), never overwriting a value the caller set; None adds
    nothing. A lookup reconciler finds the object by it. Session and AsyncSession only:
    a Transport sends the bytes its SDK rendered, as they are."""
    attempt_header: str | None = attrs.field(default=None, validator=_attempt_header)
    """A request header that carries each attempt's number, counted from the journal across
    processes and resumes among the attempts that reached the server (``3``), and ``;
    max=M`` when a maximum applies (``3; max=5``), so the server can tell a retry from a
    new request; None (the default) sends none. Outside the request's fingerprint and
    its journaled headers: it is the one part of a resend that differs from the first
    attempt (a server that hashes every header reads a changed one as another payload).
    A value the caller set is replaced. No built-in profile sends it."""
    rate_limit_headers: tuple[str, ...] = attrs.field(
        default=DEFAULT_RATE_LIMIT_HEADERS, converter=_families, validator=_known_families
    )
    """The rate-limit header families the server's answers are trusted for: ``retry-after``
    (Retry-After and retry-after-ms), ``x-ratelimit`` (X-RateLimit-Remaining and
    X-RateLimit-Reset, a reset above 10**9 being epoch seconds), ``ratelimit`` (the IETF
    RateLimit and RateLimit-Policy fields), ``openai`` (x-ratelimit-*-requests) and
    ``anthropic`` (anthropic-ratelimit-requests-*). A 429 or 503 without Retry-After waits
    until a trusted request quota resets, and pauses the origin as Retry-After does; any
    answer saying a trusted request quota has 0 left pauses the origin until it resets,
    before the next send (with ``pause_origin``), and a retry of it waits as long. Such
    a wait longer than the policy's ``max_retry_after`` stops the call
    (`RetryLaterError`) and pauses nothing. Token counters are never read. Retry-After
    only by default."""
    _replay_markers: frozenset[tuple[bytes, bytes | None]] = attrs.field(
        init=False, repr=False, eq=False
    )
    _quota_reader: QuotaReader | None = attrs.field(init=False, repr=False, eq=False)
    _reads_retry_after: bool = attrs.field(init=False, repr=False, eq=False)
    _hint_markers: frozenset[bytes] = attrs.field(init=False, repr=False, eq=False)

    @_replay_markers.default
    def _lowercase_replay_markers(self) -> frozenset[tuple[bytes, bytes | None]]:
        """(name, value) pairs, lowercased; value None: true, ?1 or 1."""
        markers = set()
        for marker in self.replay_headers:
            name, colon, value = marker.partition(":")
            markers.add(
                (
                    name.strip().lower().encode("latin-1"),
                    value.strip().lower().encode("latin-1") if colon else None,
                )
            )
        return frozenset(markers)

    @_quota_reader.default
    def _reader_beyond_retry_after(self) -> QuotaReader | None:
        """None for a profile that trusts Retry-After only: its answers cost no lookup,
        and the parser is loaded only for a profile that trusts more."""
        families = self.rate_limit_headers
        if not isinstance(families, tuple):  # refused by its validator, which runs last
            return None
        beyond = tuple(name for name in families if name != "retry-after")
        if not beyond:
            return None
        from idempotently._rate_limits import QuotaReader

        return QuotaReader.trusting(beyond)

    @_reads_retry_after.default
    def _trusts_retry_after(self) -> bool:
        families = self.rate_limit_headers
        return isinstance(families, tuple) and "retry-after" in families

    @_hint_markers.default
    def _lowercase_hint_markers(self) -> frozenset[bytes]:
        return frozenset(name.lower().encode("latin-1") for name in self.retry_hint_headers)

    def render_key(self, key: str) -> str:
        """The header value for ``key``, exactly as sent on every attempt."""
        if self.key_format == "sf-string":
            return f'"{key}"'
        return key

    def parse_key(self, value: str) -> str:
        """The key in a header value this profile renders (quotes removed)."""
        if self.key_format == "sf-string" and len(value) >= 2 and value[0] == value[-1] == '"':
            return value[1:-1]
        return value

    def validate_key(self, key: str) -> None:
        if not isinstance(key, str):
            raise TypeError(f"idempotency_key must be a str, not {type(key).__name__}")
        if not key or len(key) > self.max_key_length:
            raise InvalidKeyError(
                f"idempotency key must be 1 to {self.max_key_length} characters for the "
                f"{self.name!r} profile; got {len(key)}",
                key=key[:100],
            )
        if not _KEY_CHARACTERS.fullmatch(key):
            raise InvalidKeyError(
                "idempotency key may hold only visible ASCII characters, without quotes "
                "or backslashes; use a UUID or your own ASCII id",
                key=key[:100],
            )

    def is_replay(self, response: httpx.Response) -> bool:
        """Whether the server says this response is a stored one."""
        markers = self._replay_markers
        for name, value in response.headers.raw:
            name = name.lower()
            word = value.strip().lower()
            if (name, word) in markers or (word in _TRUE_VALUES and (name, None) in markers):
                return True
        return False

    @property
    def expiry_margin(self) -> float:
        """The key-expiry margin this profile keeps: its own, or the default for its
        lifetime (`default_key_expiry_margin`)."""
        if self.key_expiry_margin is not None:
            return self.key_expiry_margin
        return default_key_expiry_margin(self.key_lifetime)

    def retry_hint(self, response: httpx.Response) -> bool | None:
        """The server's explicit "retry this?" (true/false), or None (none, or garbage)."""
        markers = self._hint_markers
        for name, value in response.headers.raw:
            if name.lower() in markers:
                word = value.strip().lower()
                if word == b"true":
                    return True
                if word == b"false":
                    return False
        return None

    def is_payload_mismatch(self, response: httpx.Response) -> bool:
        """Whether the server says the key was used before with another payload."""
        if response.status_code in self.mismatch_statuses:
            return True
        if response.status_code < 400:
            return False
        try:
            return bool(self.mismatch_matcher(response))
        except Exception:  # a user's matcher must not turn an answer into a crash
            return False

    def is_in_progress(self, response: httpx.Response) -> bool:
        return response.status_code in self.in_progress_statuses and not self.is_payload_mismatch(
            response
        )


def _body_text(response: httpx.Response) -> str:
    try:
        return response.content[:4096].decode("utf-8", "replace")
    except httpx.ResponseNotRead:
        return ""


def _error_type(body: str) -> str | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        kind = parsed["error"].get("type")
        return kind if isinstance(kind, str) else None
    return None


GENERIC = ServerProfile(name="generic")
"""``Idempotency-Key`` as a bare token, 24 h lifetime, 409 in progress, 422 mismatch."""

STRIPE = ServerProfile(
    name="stripe",
    mismatch_statuses=frozenset(),
    mismatch_matcher=error_type("idempotency_error"),
)
"""Stripe: mismatch is ``400 {"error": {"type": "idempotency_error"}}``; 5xx are stored."""

IETF = ServerProfile(name="ietf", key_format="sf-string")
"""draft-ietf-httpapi-idempotency-key-header: the key is an RFC 8941 quoted string."""

# -- the catalog: servers users meet most, each from its own docs or source ----------------
# What was read for each is in the "which profile for my server" guide (docs/profiles.md),
# with the version; a profile states only what that source shows, and keeps the generic
# (conservative) answer where the source says nothing.

DJANGO_IDEMPOTENCY_KEY = ServerProfile(
    name="django-idempotency-key",
    in_progress_statuses=frozenset({409, 423}),
    mismatch_statuses=frozenset(),
    mismatch_matcher=never,
    stores_server_errors=False,
    key_lifetime=300.0,
    replay_headers=(),
)
"""django-idempotency-key (Django REST framework middleware): 409 while a request with
the key runs, 423 when its storage lock is busy; only 2xx answers are stored (any other
answer deletes the key, so a retry runs the view again); a different body under the
same key is a new request, never a mismatch; replays carry no marker. Keys live as long
as Django's cache keeps them: 300 s by default, so a resume after that goes to
needs_reconcile (raise ``key_lifetime`` if your cache keeps them longer)."""

ASGI_IDEMPOTENCY_HEADER = ServerProfile(
    name="asgi-idempotency-header",
    mismatch_statuses=frozenset(),
    mismatch_matcher=never,
    stores_server_errors=False,
)
"""asgi-idempotency-header (FastAPI/Starlette middleware): 409 while in progress; a stored
answer replays with ``Idempotent-Replayed: true``, whatever the new request's body (no
payload check: a 422 means a malformed key); JSON answers are stored, any status, but a
non-JSON one (Starlette's plain-text 500) releases the key and a retry runs again."""

EXPRESS_IDEMPOTENCY = ServerProfile(
    name="express-idempotency",
    mismatch_statuses=frozenset({417}),
    mismatch_matcher=never,
    stores_server_errors=False,
    replay_headers=(),
)
"""express-idempotency (Express middleware): 409 while in progress, 417 Expectation
Failed for a key reused with another URL, method, query or body; only 2xx answers are
stored (a 5xx deletes the key); replays carry no marker."""

ROCKET_RIDES = ServerProfile(
    name="rocket-rides",
    mismatch_statuses=frozenset(),
    key_lifetime=72 * 3600.0,
)
"""Brandur Leach's rocket-rides-atomic (the reference design of "Implementing
Stripe-like Idempotency Keys in Postgres"): 409 both for in progress and, with a body
saying "mismatch", for another payload; 422 is a validation error, not a mismatch; a
500 unlocks the key and a retry resumes from the last recovery point, so 5xx are safe to
retry; keys are reaped after 72 h; keys shorter than 20 characters are refused."""

ADYEN = ServerProfile(name="adyen", max_key_length=64, key_lifetime=31 * 24 * 3600.0)
"""Adyen: ``Idempotency-Key`` of at most 64 characters, valid for at least 31 days; the
answers to a concurrent or mismatched retry are the generic ones (409 retried, 422 final)."""

PAYPAL = ServerProfile(name="paypal", key_header="PayPal-Request-Id", key_lifetime=6 * 3600.0)
"""PayPal REST: the key is ``PayPal-Request-Id``; a retry returns the latest status of the
first request, and 5xx may be retried for as long as the ID is stored, which each API's
reference gives: 6 h here, the conservative choice (raise it to what your API says)."""

AWS_POWERTOOLS = ServerProfile(
    name="aws-powertools",
    key_lifetime=3600.0,
    in_progress_statuses=frozenset(),
    mismatch_statuses=frozenset(),
    mismatch_matcher=never,
    stores_server_errors=False,
    handler_errors=frozenset({502, 503, 504}),
    replay_headers=(),
)
"""Powertools for AWS Lambda, idempotency utility (Python and TypeScript share the
contract), a function behind API Gateway whose ``event_key_jmespath`` reads the
``Idempotency-Key`` header: records expire after 3600 s (``expires_after_seconds``);
a handler that raises deletes its record, so the next request runs it again, and API
Gateway answers every error the function raises as a 502 -- "already in progress" and
a payload that does not match (``IdempotencyValidationError``) included. So a 502, 503
or 504 is the handler's own (``handler_errors``), may have acted and is not stored: it
goes to needs_reconcile, for a lookup to settle, never resent blindly. Replays are the
stored answer as it was, without a marker."""

INCREASE = ServerProfile(
    name="increase",
    max_key_length=200,
    mismatch_statuses=frozenset(),
    mismatch_matcher=body_mentions("idempotency_key_already_used_error", statuses={409}),
)
"""Increase: ``Idempotency-Key`` of at most 200 characters; a request repeated with the
same key and arguments returns the object first created, with ``Idempotent-Replayed:
true``; the key used for another object is a 409 whose ``type`` is
``idempotency_key_already_used_error`` (a mismatch, not "in progress"). The docs give no
expiry: the generic 24 h is kept, the conservative choice. Every list endpoint filters by
``idempotency_key``, which a lookup can use."""

BUILTIN_PROFILES = {
    profile.name: profile
    for profile in (
        GENERIC,
        STRIPE,
        IETF,
        DJANGO_IDEMPOTENCY_KEY,
        ASGI_IDEMPOTENCY_HEADER,
        EXPRESS_IDEMPOTENCY,
        ROCKET_RIDES,
        ADYEN,
        PAYPAL,
        AWS_POWERTOOLS,
        INCREASE,
    )
}
"""Every built-in profile by name: what ``--profile NAME`` and a journaled name resolve to."""


# -- the profile an operation was made under, as the journal holds it ---------------------

_CALLABLE_FIELDS = frozenset({"mismatch_matcher", "classify"})
"""Fields holding a callable: journaled as a library matcher's own JSON, or as the
``module:qualname`` resume imports."""


_OMITTED_AT_DEFAULT = frozenset(
    {
        "classify",
        "pause_origin",
        "key_expiry_margin",
        "handler_errors",
        "attempt_header",
        "rate_limit_headers",
    }
)
"""Fields a spec leaves out at their default."""


class ProfileSpecError(ValueError):
    """A journaled profile spec that cannot be read back (a callable that cannot be
    imported, a field this version does not know)."""


def profile_spec(profile: ServerProfile) -> str:
    """The profile as canonical JSON: every field, frozensets as sorted lists, a
    callable as its own JSON (``body_mentions``, ``error_type``, ``never``) or as the
    ``module:qualname`` it is importable by.

    Raises ValueError for a callable that cannot be imported by name (a lambda, a
    nested function, a bound method, an object without a qualified name)."""
    fields: dict[str, Any] = {}
    for field in attrs.fields(ServerProfile):
        if not field.init:
            continue
        value = getattr(profile, field.name)
        if field.name in _OMITTED_AT_DEFAULT and value == field.default:
            # A field added later, at its default: left out, so the JSON stays what an
            # earlier version wrote for the same profile (a stored one still agrees).
            continue
        if field.name in _CALLABLE_FIELDS:
            fields[field.name] = (
                None if value is None else _callable_spec(profile, field.name, value)
            )
        elif isinstance(value, (frozenset, set)):
            fields[field.name] = sorted(value)
        elif isinstance(value, (tuple, list)):
            fields[field.name] = list(value)
        elif isinstance(value, int) and not isinstance(value, bool) and _is_float(field):
            fields[field.name] = float(value)
        elif value is None or isinstance(value, (str, int, float)):
            fields[field.name] = value
        else:  # a field added without teaching the journal how to write it
            raise TypeError(f"ServerProfile.{field.name} ({type(value).__name__}) has no spec")
    return json.dumps(
        fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def profile_from_spec(text: str) -> ServerProfile:
    """The profile `profile_spec` wrote; ProfileSpecError if it cannot be read
    back exactly (never a guess)."""
    try:
        parsed = json.loads(text)
    except ValueError as error:
        raise ProfileSpecError(f"the journaled profile is not JSON ({error})") from None
    if not isinstance(parsed, dict):
        raise ProfileSpecError("the journaled profile is not a JSON object")
    known = {field.name: field for field in attrs.fields(ServerProfile) if field.init}
    unknown = sorted(set(parsed) - set(known))
    if unknown:
        raise ProfileSpecError(
            f"the journaled profile has fields this version does not know ({', '.join(unknown)}):"
            " was it written by a newer idempotently?"
        )
    arguments: dict[str, Any] = {}
    for name, value in parsed.items():
        if name in _CALLABLE_FIELDS:
            arguments[name] = None if value is None else _callable_from_spec(name, value)
        elif isinstance(value, list):
            arguments[name] = frozenset(value) if "frozenset" in str(known[name].type) else value
        else:
            arguments[name] = value
    try:
        return ServerProfile(**arguments)
    except (TypeError, ValueError) as error:
        raise ProfileSpecError(f"the journaled profile is not valid ({error})") from None


def journaled_profile(profile: ServerProfile) -> str:
    """What the journal's ``profile`` column holds for an operation made under
    ``profile``: the name of a built-in it equals field for field, else its spec."""
    try:
        return _journaled_profile(profile)
    except TypeError:  # a matcher that cannot be hashed: not cached
        return _journaled_profile.__wrapped__(profile)


@functools.lru_cache(maxsize=64)
def _journaled_profile(profile: ServerProfile) -> str:
    if BUILTIN_PROFILES.get(profile.name) == profile:
        return profile.name
    return profile_spec(profile)


@functools.lru_cache(maxsize=256)
def cached_profile(text: str) -> ServerProfile:
    """`profile_from_spec`, once per distinct text (a failure is not cached)."""
    return profile_from_spec(text)


ProfileRule = Literal["stored", "stored_only", "checked", "forced"]
"""How an engine reads the profile journaled with an operation:

- ``stored`` (the library): the stored profile; a legacy row (a bare name that is no
  built-in, written before profiles were stored) is read with the session's profile;
- ``stored_only`` (``idempotently resume`` without ``--profile``): the stored profile;
  a legacy row is refused (it needs an explicit profile);
- ``checked`` (``--profile``): the given profile, refused where it disagrees with
  the stored one (a legacy row: where the names differ);
- ``forced`` (``--profile`` with ``--force-profile``): the given profile, always."""


def stored_profile(
    text: str, given: ServerProfile, rule: ProfileRule, *, operation_id: str, key: str
) -> ServerProfile:
    """The profile to read an operation's answers with, from its journaled ``text``.

    Raises `StoredProfileError` rather than guess: nothing is to be sent."""
    ids = {"operation_id": operation_id, "key": key}
    if rule == "forced":
        return given
    if rule == "checked":
        if (
            journaled_profile(given) == text
            or (_is_legacy(text) and text == given.name)
            or _same_fields(text, given)
        ):
            return given
        raise StoredProfileError(
            f"it was journaled under profile {_described(text)} and the profile given is "
            f"{_described(journaled_profile(given))}{_differences(text, given)}; nothing was "
            "sent (leave out --profile to use the stored one, or add --force-profile to read "
            "it with the one given; in Python, profile_rule='stored' or 'forced'; through "
            'a Transport, leave "profile" out of the request\'s extensions["idempotently"])',
            kind="disagrees",
            **ids,
        )
    if text.startswith("{"):
        try:
            return cached_profile(text)
        except ProfileSpecError as error:
            raise StoredProfileError(
                f"the profile it was journaled under cannot be read back: {error}; nothing "
                "was sent and it stays pending (make that code importable again, or resume "
                "it with an explicit profile: `idempotently resume --profile module:NAME "
                "--force-profile`)",
                kind="unavailable",
                **ids,
            ) from None
    builtin = BUILTIN_PROFILES.get(text)
    if builtin is not None:
        return given if given == builtin else builtin
    if rule == "stored":
        return given  # the legacy rule: rows written before profiles were stored
    raise StoredProfileError(
        f"it was journaled before profiles were stored, under the name {text!r} (not a "
        "built-in profile); nothing was sent: give the profile it was made under with "
        "--profile module:NAME (in Python, profile=... with profile_rule='checked')",
        kind="legacy",
        **ids,
    )


def profile_label(text: str) -> str:
    """A journaled profile as a person reads it: its name, ``(custom)`` for a spec."""
    if not text.startswith("{"):
        return text
    try:
        name = json.loads(text).get("name")
    except (ValueError, AttributeError):
        name = None
    return f"{name if isinstance(name, str) else '?'} (custom)"


def _same_fields(text: str, given: ServerProfile) -> bool:
    """Whether a journaled spec reads back as ``given``: a spec written before a field was
    added lacks it, and reads it as its default."""
    if not text.startswith("{"):
        return False
    try:
        return cached_profile(text) == given
    except (ProfileSpecError, TypeError):
        return False


def _is_legacy(text: str) -> bool:
    return not text.startswith("{") and text not in BUILTIN_PROFILES


def _described(text: str) -> str:
    if not text.startswith("{"):
        return repr(text) + (" (journaled before profiles were stored)" if _is_legacy(text) else "")
    name, _, custom = profile_label(text).rpartition(" ")
    return f"{name!r} {custom}"


def _differences(text: str, given: ServerProfile) -> str:
    """``: they differ in FIELD, ...`` when both sides have fields to compare."""
    if _is_legacy(text):
        return ""
    try:
        stored = json.loads(
            profile_spec(BUILTIN_PROFILES[text]) if text in BUILTIN_PROFILES else text
        )
        mine = json.loads(profile_spec(given))
    except (ValueError, TypeError):
        return ""
    if not isinstance(stored, dict):
        return ""
    fields = sorted(name for name in set(stored) | set(mine) if stored.get(name) != mine.get(name))
    return f": they differ in {', '.join(fields)}" if fields else ""


def _is_float(field: attrs.Attribute[Any]) -> bool:
    return str(field.type).startswith("float")


def _callable_spec(profile: ServerProfile, field: str, value: Any) -> Any:
    if isinstance(value, BodyMentions):
        return {
            "type": "body_mentions",
            "words": list(value.words),
            "statuses": sorted(value.statuses),
        }
    if isinstance(value, ErrorType):
        return {
            "type": "error_type",
            "types": sorted(value.types),
            "statuses": sorted(value.statuses),
        }
    if value is never:
        return {"type": "never"}
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    reference = f"{module}:{qualname}"
    if (
        not isinstance(module, str)
        or not isinstance(qualname, str)
        or module == "__main__"
        or _imported(reference) is not value
    ):
        raise ValueError(
            f"ServerProfile {profile.name!r}: {field} {value!r} cannot be journaled by name "
            "(a lambda, a nested function, a bound method or a function of __main__ cannot "
            "be imported when the operation is resumed); pass a function defined at the top "
            "of an importable module, or profiles.body_mentions(...) / profiles.error_type(...)"
        )
    return reference


def _callable_from_spec(field: str, value: Any) -> Any:
    if isinstance(value, str):
        try:
            found = _imported(value, strict=True)
        except Exception as error:  # whatever importing the user's module raises
            raise ProfileSpecError(
                f"its {field} {value!r} cannot be imported ({type(error).__name__}: {error})"
            ) from None
        if not callable(found):
            raise ProfileSpecError(f"its {field} {value!r} is not callable")
        return found
    kind = value.get("type") if isinstance(value, dict) else None
    try:
        if kind == "body_mentions":
            return BodyMentions(tuple(value["words"]), frozenset(value["statuses"]))
        if kind == "error_type":
            return ErrorType(frozenset(value["types"]), frozenset(value["statuses"]))
    except (KeyError, TypeError) as error:
        raise ProfileSpecError(f"its {field} {value!r} is damaged ({error})") from None
    if kind == "never":
        return never
    raise ProfileSpecError(f"its {field} {value!r} is of a kind this version does not know")


def _imported(reference: str, *, strict: bool = False) -> Any:
    """The object ``module:qualname`` names; None if it cannot be found (``strict``: raise)."""
    module_name, _, qualname = reference.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:
        if strict:
            raise
        return None
    return found
