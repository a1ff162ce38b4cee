"""The journal's row types and the checks on what they hold: neither store's.

The flow reads `Operation` and writes `NewOperation` and
`AttemptRecord`; SQLite and PostgreSQL both decode their rows into these
values and check every column the same way (`column_problem`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii as _json_str
from typing import TYPE_CHECKING, Any, Final, Literal

import attrs

from idempotently._vocabulary import LOOKUP_ACTOR, STATUSES, AnsweredBy, Delivery, Outcome, Status

if TYPE_CHECKING:
    from idempotently._rows_audit import AuditEntry as AuditEntry
    from idempotently._rows_audit import JournalStats as JournalStats

MAX_LIMIT = 2**63 - 1
"""SQLite's largest integer: the largest ``limit`` a listing takes."""

Durability = Literal["fsync", "os"]
"""``fsync``: the key's row is fsync'd before the first byte is sent; ``os``: only committed."""

DURABILITIES: Final[tuple[Durability, ...]] = ("fsync", "os")


@attrs.frozen
class Attempt:
    """One HTTP exchange of an operation, as journaled."""

    number: int
    """1 for the first attempt, counting up across calls and resumes."""
    started_at: float
    """When the attempt began (seconds since the epoch)."""
    elapsed: float
    """Seconds the attempt took, up to its answer or error."""
    outcome: Outcome
    """``not_sent``, ``maybe_delivered`` or ``answered``."""
    status_code: int | None
    """The HTTP status answered (None: no answer)."""
    replayed: bool
    """The server marked the answer as a replay of a stored response."""
    error: str | None
    """What went wrong, as `ExceptionType: message` (None: answered). Never quotes a secret
    header's value."""
    wait: float | None
    """Seconds waited after this attempt before the next one."""


@attrs.frozen
class Operation:
    """One logical operation and its key, as journaled (never any secret)."""

    operation_id: str
    """The caller's name for the operation (generated when the call gave none)."""
    key: str
    """The idempotency key, sent on every attempt exactly as first sent."""
    status: Status
    """`pending`, `succeeded`, `failed`, `needs_reconcile` or `abandoned`."""
    delivery: Delivery
    """`exactly_once` (resend with the same key) or `at_most_once` (never resend what may have
    arrived)."""
    method: str
    """The request's HTTP method."""
    url: str
    """The request's URL as journaled (userinfo and secret query values removed)."""
    request_headers: tuple[tuple[str, str], ...]
    """The request's headers as sent, minus credentials and redacted headers, as (name, value)
    pairs."""
    request_body: bytes
    """The request body's bytes, exactly as sent (encoded by the journal's codec when `codec` is
    set)."""
    fingerprint: str
    """A digest of method, URL and body that a later call with the same `operation_id` must
    match."""
    profile: str
    """The server profile the operation was made under: a built-in's name or its fields as JSON."""
    key_header: str
    """The header the key is sent in (`Idempotency-Key` by default)."""
    created_at: float
    """When the operation was journaled (seconds since the epoch)."""
    updated_at: float
    """When its row last changed (seconds since the epoch)."""
    key_expires_at: float
    """When the server may forget the key (created plus the profile's key lifetime); resume
    never resends past it."""
    deadline_at: float | None
    """The operation's own absolute deadline, which survives restarts (None: none)."""
    not_before: float | None
    """Not to be sent again before this time, as the server asked (Retry-After), or None."""
    lease_owner: str | None
    """Who holds the lease to send it (`host:pid:…`), or None."""
    lease_until: float
    """When that lease expires (0: no lease); while it lives, nobody else sends the operation."""
    attempt_count: int
    """How many attempts are journaled."""
    last_status_code: int | None
    """The HTTP status of the last attempt that was answered, or None."""
    response_status: int | None
    """The stored final answer's status (None: no final answer yet)."""
    response_headers: tuple[tuple[str, str], ...] | None
    """The stored final answer's headers, or None."""
    response_body: bytes | None
    """The stored final answer's body, or None."""
    reason: str | None
    """Why the operation is in its status (the last error, the server's hint, an operator's
    note), or None."""
    # Schema version 4 (SQLite) / 2 (PostgreSQL). Rows from older journals read as None.
    codec: str | None = None
    """The name of the codec the stored request and answer bodies were encoded in (None: clear)."""
    secret_params: str | None = None
    """JSON list of the query parameters whose values were redacted from ``url`` (None: none)."""
    credentials_digest: str | None = None
    """A salted, slow digest of the credential headers the key is bound to (never their values)."""
    overrides: str | None = None
    """JSON of the call's own policy and timeout overrides, which a resume applies (None: none)."""
    forked_from: str | None = None
    """The operation this one was forked from by an operator (None: not a fork)."""
    lookup_after: float | None = None
    """A lookup reconciler does not look this operation up before this time (epoch seconds)."""
    enqueued_at: float | None = None
    """When it was enqueued to be sent later (None: made by a call that sends at once)."""
    first_send_at: float | None = None
    """When its first send began. None with ``enqueued_at`` set: never sent."""
    # Schema version 5 (SQLite) / 3 (PostgreSQL).
    body_digest: bytes | None = None
    """The SHA-256 of the clear request body, encoded by ``codec`` as the body is (never in
    clear): what a resend checks the decoded body against. None for a row in clear, and for
    one written before schema version 5."""
    # Operation groups (schema version 10 carries the columns).
    group_id: str | None = None
    """The group the operation is a step of (``Session.group``), or None."""
    step: int | None = None
    """Its place in the group: 1 for the first step the application called, and so on.
    A fork of a step shares its place."""
    successor: str | None = None
    """The operation that took this step's place in its group (a fork's id), or None."""
    # Data at rest: not a column. Set by the journal when it reads a row whose bodies
    # it cannot decode; the bodies are then left out (empty), never shown encoded.
    unreadable: str | None = attrs.field(default=None, metadata={"column": False})
    """Why the stored bodies could not be read here (a codec missing, another codec, a
    failed decode); None when they are clear or decoded. Such an operation is never sent."""
    damaged: str | None = attrs.field(default=None, metadata={"column": False})
    """What this version cannot decode in the operation's row (a listing, the resume
    queue or a worker's claim reads it as a stand-in rather than failing, so the others
    go on); None for a sound row. A damaged operation is never sent, and its other fields
    are what could be read (the damaged ones emptied), for reporting it only."""
    attempts: tuple[Attempt, ...] = ()
    """Filled in by `Journal.operation`; empty in listings."""
    # Schema version 10: retry control, round 2.
    cap_reason: str | None = None
    """Why the operation reached its policy's ``max_total_attempts`` (None: it did not):
    the cap and the attempts counted when it went to ``needs_reconcile`` or ``failed``."""

    @classmethod
    def _from_row(cls, row: dict[str, Any], attempts: tuple[Attempt, ...] = ()) -> Operation:
        values = dict(row)
        values["request_headers"] = headers_from_json(values["request_headers"])
        if values["response_headers"] is not None:
            values["response_headers"] = headers_from_json(values["response_headers"])
        return cls(**values, attempts=attempts)

    @classmethod
    def _damaged_row(cls, row: dict[str, Any], problem: str) -> Operation:
        """The stand-in for a row that cannot be decoded (``problem`` says why): its
        readable values, each damaged one emptied, its bodies left out; `damaged` and
        `unreadable` set, so nothing ever sends it."""
        values: dict[str, Any] = {}
        for name in _OPERATION_FIELDS:
            value = row.get(name)
            if column_problem(name, value) is not None:
                value = _empty(name, value)
            values[name] = value
        values["request_body"] = b""
        values["response_headers"] = None
        values["response_body"] = None
        values["reason"] = f"its journaled row cannot be read: {problem}"
        return attrs.evolve(cls._from_row(values), damaged=problem, unreadable=values["reason"])


def _empty(column: str, value: object) -> object:
    """What a stand-in holds for a damaged ``column``: its id or key as text (to report
    it by), else nothing of the column's type."""
    types, nullable, _ = _COLUMNS[column]
    if column in ("operation_id", "key") and value is not None:
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    if nullable:
        return None
    if column == "status":
        return "pending"
    if column == "request_headers":
        return "[]"
    return types[0]()


def row_problem(row: dict[str, Any]) -> str | None:
    """The first value of ``row`` this version cannot decode (`column_problem`), or None."""
    plain = _PLAIN
    for column, value in row.items():
        # Most values are NULL where allowed, or of exactly their column's type with no
        # more to check: told apart by two lookups, not the whole rule (resume reads its
        # whole queue through here).
        allowed = plain.get(column)
        if allowed is not None and type(value) in allowed:
            continue
        problem = column_problem(column, value)
        if problem is not None:
            return problem
    return None


_OPERATION_FIELDS: Final = frozenset(
    field.name for field in attrs.fields(Operation) if field.metadata.get("column", True)
) - {"attempts"}


@attrs.frozen
class NewOperation:
    """What the engine commits before the first attempt."""

    operation_id: str
    key: str
    delivery: Delivery
    method: str
    url: str
    request_headers: Sequence[tuple[str, str]]
    request_body: bytes
    fingerprint: str
    profile: str
    key_header: str
    created_at: float
    key_expires_at: float
    deadline_at: float | None
    # The outbox: set for an operation enqueued to be sent later (Session.enqueue).
    enqueued_at: float | None = None
    """None: made by a call that sends at once, so its first send begins at
    ``created_at`` (written as ``first_send_at`` by the same insert, no extra
    statement); else unsent until a lease to send it is taken."""
    # Data at rest (schema version 4): the codec the request body is encoded in, the
    # query parameters redacted from ``url`` (JSON list), the credentials digest.
    codec: str | None = None
    secret_params: str | None = None
    credentials_digest: str | None = None
    # Retry control (schema v4): the call's own policy and timeouts, for resume.
    overrides: str | None = None
    # Schema v5: the clear body's SHA-256, encoded by the codec (None without one).
    body_digest: bytes | None = None
    # Operation groups: the group it is a step of (its place is the group's next one,
    # given by the insert), and whether the insert waits for every earlier step to have
    # succeeded (a live call) or only appends (an enqueue: the order is kept at send).
    group_id: str | None = None
    in_order: bool = False

    def row(self, owner: str | None, lease_until: float) -> tuple[Any, ...]:
        """The values of the insert that journals it (both stores' column order)."""
        return (
            self.operation_id,
            self.key,
            self.delivery,
            self.method,
            self.url,
            headers_json(self.request_headers),
            self.request_body,
            self.fingerprint,
            self.profile,
            self.key_header,
            self.created_at,
            self.created_at,
            self.key_expires_at,
            self.deadline_at,
            owner,
            lease_until,
            self.enqueued_at,
            self.created_at if self.enqueued_at is None else None,
            # Data at rest.
            self.codec,
            self.secret_params,
            self.credentials_digest,
            self.overrides,  # retry control (schema v4)
            self.body_digest,  # schema v5
        )

    def as_row(self, owner: str | None = None, lease_until: float = 0.0) -> Operation:
        """The row the insert of `row` writes, as a read of it returns it."""
        return Operation(
            operation_id=self.operation_id,
            key=self.key,
            status="pending",
            delivery=self.delivery,
            method=self.method,
            url=self.url,
            request_headers=tuple(self.request_headers),
            request_body=self.request_body,
            fingerprint=self.fingerprint,
            profile=self.profile,
            key_header=self.key_header,
            created_at=self.created_at,
            updated_at=self.created_at,
            key_expires_at=self.key_expires_at,
            deadline_at=self.deadline_at,
            not_before=None,
            lease_owner=owner,
            lease_until=lease_until,
            attempt_count=0,
            last_status_code=None,
            response_status=None,
            response_headers=None,
            response_body=None,
            reason=None,
            enqueued_at=self.enqueued_at,
            first_send_at=self.created_at if self.enqueued_at is None else None,
            codec=self.codec,
            secret_params=self.secret_params,
            credentials_digest=self.credentials_digest,
            overrides=self.overrides,
            body_digest=self.body_digest,
            group_id=self.group_id,
        )


@attrs.frozen
class OriginPause:
    """An origin the server asked every client to leave alone until ``until`` (a 429 or
    503 with Retry-After), for the credentials whose digest is ``credentials``."""

    origin: str
    """``scheme://host:port``."""
    credentials: str
    """A keyed digest of the credentials it was answered to ('' without any), never
    their value: one tenant's pause does not pause another's."""
    until: float
    """When the pause ends (seconds since the epoch), clamped to the policy's
    ``max_retry_after``."""
    reason: str | None
    """What paused it, e.g. ``429 with Retry-After 600s``, ``201 with X-RateLimit-Reset
    20s: request quota spent``, or a circuit breaker's ``circuit breaker open 5s: ...``
    (``half-open`` while its one probe is in flight)."""
    set_at: float
    """When it was set (seconds since the epoch)."""

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class AttemptRecord:
    """One attempt's result and the operation's state after it."""

    started_at: float
    elapsed: float
    outcome: Outcome
    status_code: int | None = None
    replayed: bool = False
    error: str | None = None
    wait: float | None = None
    status: Status = "pending"
    reason: str | None = None
    not_before: float | None = None
    lease_until: float = 0.0
    """0 releases the lease; a live caller keeps it while it waits to retry."""
    response_status: int | None = None
    response_headers: Sequence[tuple[str, str]] | None = None
    response_body: bytes | None = None
    cap_reason: str | None = None
    """Set when this attempt brought the operation to its ``max_total_attempts``: written
    to the row with the state, by the same transaction (only then: no cost otherwise)."""


CAPPED_META: Final = "capped_operations"
"""The journal_meta row counting the operations that reached their ``max_total_attempts``
(its cap_reason set): kept by the writes that set one, prune and a recount, since schema
version 10 has no column for it in journal_counts. No row: none yet."""


CAPPED_DIGITS: Final = 18
"""The most digits a `CAPPED_META` count has (below 2**63 on both stores): the writes
add to a value of 1 to this many digits only, and `capped_count` reads no other."""


def capped_count(value: object, path: str) -> int:
    """The `CAPPED_META` row's value as a count (None: 0), or a JournalCorruptError
    saying how to count it again."""
    if value is None:
        return 0
    text = str(value)
    # Only what the writes add to (digits alone, at most CAPPED_DIGITS): a value either
    # store would leave alone is damaged for stats too, never read as a number.
    if 0 < len(text) <= CAPPED_DIGITS and text.isascii() and text.isdigit():
        return int(text)
    from idempotently._exceptions import JournalCorruptError

    raise JournalCorruptError(
        f"{path} holds a damaged count of operations at their attempts cap "
        f"({short(value)}), as after an edit by hand; run `idempotently --journal {path} "
        "migrate --recount` to count them again from the rows"
    )


MAX_TIMESTAMP = 1e11
"""Seconds since the epoch in the year 5138: any later time is a mistake."""
MAX_WINDOW = 100 * 366 * 86400.0
DEFAULT_EXPIRING_WITHIN = 3600.0
"""The key-expiry margin ``resume`` keeps for keys living 10 h or more
(``_flow._config.DEFAULT_KEY_EXPIRY_MARGIN``)."""
"""A century, in seconds: the longest age or window a read takes."""


def check_number(name: str, value: object, *, integer: bool, low: float, high: float) -> None:
    """A read argument is a number from ``low`` to ``high`` (None allowed), or a clear error."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (integer and not isinstance(value, int))
    ):
        raise TypeError(
            f"{name} must be {'an int' if integer else 'a number'}, not {type(value).__name__}"
        )
    # Compared as they are: an int too large for a float is still simply too large.
    if not low <= value <= high:  # also false for nan
        raise ValueError(f"{name} must be a number from {low:g} to {high:g}, not {value!r:.40}")


def headers_json(headers: Sequence[tuple[str, str]]) -> str:
    """``json.dumps(list(headers))`` for (name, value) pairs of str, character for character.

    Written out because it runs twice per call and json.dumps costs three times more;
    each string goes through the encoder json.dumps itself uses for it.
    """
    pairs = [f"[{_json_str(name)}, {_json_str(value)}]" for name, value in headers]
    return "[" + ", ".join(pairs) + "]"


def headers_from_json(text: str) -> tuple[tuple[str, str], ...]:
    return tuple((name, value) for name, value in json.loads(text))


# Every row read goes through Journal._check_row, so a damaged value is a
# JournalCorruptError naming the operation, never a crash further on. Aliases in
# queries (stats, counts) must not reuse these names for something else.
_TEXT: tuple[type, ...] = (str,)
_REAL: tuple[type, ...] = (int, float)
_INT: tuple[type, ...] = (int,)
_BLOB: tuple[type, ...] = (bytes,)
_COLUMNS: dict[str, tuple[tuple[type, ...], bool, tuple[str, ...]]] = {
    "operation_id": (_TEXT, False, ()),
    "key": (_TEXT, False, ()),
    "status": (_TEXT, False, STATUSES),
    "delivery": (_TEXT, False, ("exactly_once", "at_most_once")),
    "method": (_TEXT, False, ()),
    "url": (_TEXT, False, ()),
    "request_headers": (_TEXT, False, ()),
    "request_body": (_BLOB, False, ()),
    "fingerprint": (_TEXT, False, ()),
    "profile": (_TEXT, False, ()),
    "key_header": (_TEXT, False, ()),
    "created_at": (_REAL, False, ()),
    "updated_at": (_REAL, False, ()),
    "key_expires_at": (_REAL, False, ()),
    "deadline_at": (_REAL, True, ()),
    "not_before": (_REAL, True, ()),
    "lease_owner": (_TEXT, True, ()),
    "lease_until": (_REAL, False, ()),
    "attempt_count": (_INT, False, ()),
    "last_status_code": (_INT, True, ()),
    "response_status": (_INT, True, ()),
    "response_headers": (_TEXT, True, ()),
    "response_body": (_BLOB, True, ()),
    "reason": (_TEXT, True, ()),
    # The outbox (version 4).
    "enqueued_at": (_REAL, True, ()),
    "first_send_at": (_REAL, True, ()),
    "number": (_INT, False, ()),
    "started_at": (_REAL, False, ()),
    "elapsed": (_REAL, False, ()),
    "outcome": (_TEXT, False, ("not_sent", "maybe_delivered", "answered")),
    "status_code": (_INT, True, ()),
    "replayed": (_INT, False, ()),
    "error": (_TEXT, True, ()),
    "wait": (_REAL, True, ()),
    # Data at rest (schema version 4).
    "codec": (_TEXT, True, ()),
    "secret_params": (_TEXT, True, ()),
    "credentials_digest": (_TEXT, True, ()),
    "body_digest": (_BLOB, True, ()),  # schema version 5
    # Operation groups.
    "group_id": (_TEXT, True, ()),
    "step": (_INT, True, ()),
    "successor": (_TEXT, True, ()),
    "cap_reason": (_TEXT, True, ()),  # schema version 10
}
_HEADER_COLUMNS = ("request_headers", "response_headers")
_PLAIN: dict[str, frozenset[type]] = {
    column: frozenset(types) | ({type(None)} if nullable else set())
    for column, (types, nullable, choices) in _COLUMNS.items()
    if not choices and column not in (*_HEADER_COLUMNS, "secret_params")
}
"""Per column without choices or a document to parse: the exact types that need no
further check (`row_problem`'s fast path; anything else goes through `column_problem`)."""


def column_problem(column: str, value: object) -> str | None:
    """What is wrong with ``value`` in ``column``, or None if it can be decoded."""
    rule = _COLUMNS.get(column)
    if rule is None:
        return None
    types, nullable, choices = rule
    if value is None:
        return None if nullable else f"{column} is NULL"
    if not isinstance(value, types):
        return f"{column} holds {type(value).__name__} {short(value)}"
    if choices and value not in choices:
        return f"{column} is {short(value)}, not one of {', '.join(choices)}"
    if column == "secret_params":
        try:
            names = json.loads(str(value))
        except ValueError as error:
            return f"secret_params is not valid JSON ({error})"
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            return "secret_params is not a list of parameter names"
    if column in _HEADER_COLUMNS:
        try:
            pairs = json.loads(str(value))
        except ValueError as error:
            return f"{column} is not valid JSON ({error})"
        if not isinstance(pairs, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)
            for pair in pairs
        ):
            return f"{column} is not a list of [name, value] pairs"
    return None


def short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def audit_entry_problem(row: dict[str, Any]) -> str | None:
    """What is wrong with an audit row, or None if it can be decoded."""
    for column, types, nullable in (
        ("seq", _INT, False),
        ("operation_id", _TEXT, False),
        ("at", _REAL, False),
        ("actor", _TEXT, False),
        ("action", _TEXT, False),
        ("note", _TEXT, True),
        ("detail", _TEXT, True),
    ):
        value = row.get(column)
        if value is None:
            if not nullable:
                return f"audit {column} is NULL"
        elif not isinstance(value, types) or isinstance(value, bool):
            return f"audit {column} holds {type(value).__name__} {short(value)}"
    return None


class Failed:
    """The outcome of a write whose transaction failed or that failed alone: ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def answered_by(operation: Operation) -> AnsweredBy:
    """Whose answer ``operation``'s stored response is: the server's to its request, or
    the object a lookup found (its reason, written when it settled, says so), or the
    response a reconciler of your own settled it with."""
    reason = operation.reason or ""
    if operation.response_status is None:
        return "server"
    if reason.startswith(f"settled succeeded by {LOOKUP_ACTOR}: "):
        return "lookup"
    if reason.startswith("reconciled: "):
        return "reconciler"
    return "server"


def __getattr__(name: str) -> Any:
    """`JournalStats` and `AuditEntry`, from ``_rows_audit.py``: made (by attrs) the first
    time one is named, not by ``import idempotently``, for no call reads them (PEP 562)."""
    if name not in ("JournalStats", "AuditEntry"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from idempotently import _rows_audit

    value = getattr(_rows_audit, name)
    globals()[name] = value
    return value
