"""The operation flow: one sans-I/O core for calls, transports and resume.

Like httpx's ``auth_flow`` or h11, the flow does no I/O. It is a generator
that yields commands (``_store.py``): send this request, sleep this long, make
this journal write durable, report this result; and receives their results.
The drivers (``_drivers.py``) decide how: the sync one inline, the async one
with every journal command off its event loop. The same flow serves
``Session.request``, ``Transport.handle_request`` and ``resume``.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import random
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from typing import Any, Literal, TypeVar

import attrs
import httpx

from idempotently._answers import DEFAULT_MAX_RESPONSE_BYTES, RETRIED_ANSWER_BYTES, AnswerBody
from idempotently._budget import BUDGETS, RetryBudgets, origin_of
from idempotently._codec import Codec, body_digest, encoded
from idempotently._commands import (
    AuditNote,
    AuditTrail,
    Command,
    Discard,
    Emit,
    Enqueue,
    Find,
    ForksTaken,
    Insert,
    Lease,
    LookUpLater,
    PauseOrigin,
    Pauses,
    PlanReconcile,
    Queue,
    ReadAnswer,
    RebaseOperation,
    RebasePause,
    Reconcile,
    ReconcilePlan,
    Record,
    Release,
    RenewLease,
    Report,
    Send,
    SetStatus,
    Sleep,
    TakeLease,
)
from idempotently._credentials import (
    credential_names,
    credential_values,
)
from idempotently._differences import first_difference, shown_url
from idempotently._events import (
    AsyncHook,
    AttemptFinished,
    Event,
    OperationFinished,
    OperationStarted,
    RetryRefused,
    RetryScheduled,
    finished_level,
    heard,
    log,
)
from idempotently._exceptions import (
    RESUME_HINT,
    AnswerNotReadError,
    CodecError,
    ErrorContext,
    IdempotentlyError,
    JournalCorruptError,
    KeyReuseError,
    NeedsReconcileError,
    NoStoredAnswerError,
    OperationAbandonedError,
    OperationInProgressError,
    OperationPendingError,
    RequestNotSentError,
    RetryBudgetError,
    RetryLaterError,
    StoredProfileError,
)
from idempotently._gate import Gate, GateRefusal, binding_differs
from idempotently._keys import (
    DIGEST_PREFIX,
    RequestHeaders,
    derived_key,
    fingerprint,
    header_value,
    is_journaled,
    journaled_request_headers,
    new_key,
    new_operation_id,
    read_request_headers,
    redaction_set,
    request_digest,
    same_body,
    secret_values,
    stored_header,
)
from idempotently._lookup import (
    LOOKUP_ACTOR,
    LOOKUP_DEFERRED,
    LOOKUP_VERDICT,
    AnsweredBy,
    Verdict,
    answered_by,
    unsettled_lookups,
)
from idempotently._numbers import as_float
from idempotently._operator import plan as plan_action
from idempotently._overrides import read_overrides
from idempotently._pauses import PAUSE_STATUS_CODES, REFRESH, PauseBoard, credentials_digest
from idempotently._policy import (
    Answer,
    CallState,
    Decision,
    Failure,
    RetryPolicy,
    capped_timeouts,
    classify,
    classify_error,
    classify_read,
    decide,
    decide_read,
    jittered,
    key_born_at,
    key_expiry_margin,
    key_past_margin,
    longest_timeout,
    may_be_retried,
    may_have_been_delivered,
    never_sent,
    refused,
)
from idempotently._profiles import (
    GENERIC,
    MAX_DEFAULT_KEY_EXPIRY_MARGIN,
    ProfileRule,
    ServerProfile,
    journaled_profile,
    stored_profile,
)
from idempotently._rows import AttemptRecord, NewOperation, Operation, OriginPause
from idempotently._secret_params import (
    LiveValues,
    MissingParams,
    journaled_answer_headers,
    reapplied_url,
    redacted_url,
    secret_param_names,
    values_in_url,
)
from idempotently._text import storable, storable_text
from idempotently._vocabulary import (
    DELIVERIES,
    RESUME_ACTION_OF,
    RESUME_ACTION_OF_BLOCKER,
    STATUS_AFTER,
    Blocker,
    Delivery,
    ResumeAction,
    Status,
)

logger = logging.getLogger("idempotently")

T = TypeVar("T")
Flow = Generator[Command, Any, T]

DEFAULT_LEASE_DURATION = 60.0
DEFAULT_KEY_EXPIRY_MARGIN = MAX_DEFAULT_KEY_EXPIRY_MARGIN
"""The margin of keys living 10 h or more (``_profiles.default_key_expiry_margin``): what
``stats --expiring-within`` counts by default."""
MAX_OPERATION_ID_LENGTH = 255
EXTENSION = "idempotently"
"""``response.extensions[EXTENSION]`` holds the `Receipt`."""

# A second caller of an operation in flight looks again after these waits.
_FIRST_POLL = 0.01
_MAX_POLL = 0.25

HOST_ID_ENVVAR = "IDEMPOTENTLY_HOST_ID"
MAX_HOST_ID_LENGTH = 128


def check_host_id(host_id: object) -> str:
    """A valid host identity (what lease owners start with), or a ValueError saying why not."""
    if not isinstance(host_id, str):
        raise TypeError(f"host_id must be a str (e.g. 'worker-3'), not {type(host_id).__name__}")
    if not host_id or len(host_id) > MAX_HOST_ID_LENGTH:
        raise ValueError(
            f"host_id must be 1 to {MAX_HOST_ID_LENGTH} characters, not {len(host_id)}"
        )
    if ":" in host_id or not host_id.isprintable() or host_id != host_id.strip():
        raise ValueError(
            f"host_id {host_id[:60]!r} must be printable, without ':' or surrounding spaces "
            "(e.g. the pod or machine name)"
        )
    return host_id


def default_host_id() -> str:
    """``$IDEMPOTENTLY_HOST_ID`` if set and not empty (checked), else this machine's
    hostname. Empty counts as unset, as it does for the command line's ``--host-id``."""
    configured = os.environ.get(HOST_ID_ENVVAR)
    if configured:
        try:
            return check_host_id(configured)
        except ValueError as error:
            raise ValueError(f"{HOST_ID_ENVVAR}: {error}") from None
    host = socket.gethostname().replace(":", "_")[:MAX_HOST_ID_LENGTH]
    return host if host and host.isprintable() else "localhost"


_HOST = socket.gethostname().replace(":", "_")[:MAX_HOST_ID_LENGTH] or "localhost"

SETTLED_REASONS = ("settled ", "reconciled: ")
"""How the reason of an operation an operator or a reconciler settled begins."""


def json_text(value: object) -> str:
    import json

    return json.dumps(value, sort_keys=True)


RECONCILE_HINT = (
    "it will not be resent: look the object up on the server and settle it with "
    "Session.resume(reconciler=...) (idempotently.Lookup looks it up for you), or "
    "`idempotently reconcile --lookup URL`, or by hand with `idempotently settle` or `fork`"
)
ABANDON_HINT = "check whether it arrived; a new operation_id sends it once more"

BuildRequest = Callable[[str, httpx.URL, list[tuple[bytes, bytes]], bytes], httpx.Request]
"""Builds a request from its journaled parts (the client's defaults re-applied)."""


@attrs.frozen
class Receipt:
    """What idempotently knows about a returned response.

    Found at ``response.extensions["idempotently"]``.
    """

    operation_id: str
    """The operation's id."""
    key: str
    """The operation's idempotency key."""
    attempts: int
    """Attempts journaled for the operation so far, across calls and restarts."""
    replayed: bool
    """The server marked the final answer as a replay of a stored response."""
    replayed_locally: bool
    """Returned from the journal without any network call."""
    answered_by: AnsweredBy = "server"
    """Whose answer this is: ``"server"`` (the server's answer to this request),
    ``"lookup"`` (the object a lookup found, with the status of the lookup's GET and its
    URL as ``Content-Location``: not the create's answer) or ``"reconciler"`` (the
    response a reconciler of your own settled the operation with)."""


@attrs.frozen
class ResumeResult:
    """What resume did with one operation."""

    operation_id: str
    """The operation's id."""
    key: str
    """The operation's idempotency key."""
    status: Status
    """The operation's status in the journal afterwards."""
    action: ResumeAction
    """What happened: ``succeeded``, ``failed``, ``still_pending``, ``unresolved``,
    ``not_sent``, ``waiting``, ``leased``, ``needs_reconcile``, ``abandoned``,
    ``reconciled``, ``skipped``; with ``dry_run``: ``would_send``, ``would_wait``,
    ``would_skip_leased``, ``would_abandon``, ``would_need_reconcile`` or
    ``would_reconcile``."""
    detail: str
    """What happened or what to do about it, in words (the error, the server's hint, which
    option to pass)."""
    status_code: int | None = None
    """The HTTP status of the last answer this resume got, or None."""
    replayed: bool = False
    """That answer was the server's stored one for this key (a replay)."""

    @classmethod
    def of(
        cls,
        operation: Operation,
        status: Status,
        action: ResumeAction,
        detail: str | None,
        status_code: int | None = None,
        replayed: bool = False,
    ) -> ResumeResult:
        return cls(
            operation.operation_id,
            operation.key,
            status,
            action,
            detail or "",
            status_code,
            replayed,
        )

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class Settlement:
    """A reconciler's verdict: what really happened to a needs_reconcile operation.

    ``succeeded`` with the object it found (as a response, optional), or
    ``failed`` when it is sure the operation never took effect.
    """

    status: Literal["succeeded", "failed"] = attrs.field(
        validator=attrs.validators.in_(("succeeded", "failed"))
    )
    """`succeeded`: it took effect (the object was found); `failed`: it surely never did."""
    note: str
    """Why, in words: journaled as the operation's reason and shown by `show`."""
    response: httpx.Response | None = None
    """The object found, as an `httpx.Response`, stored as the operation's answer (None: none
    stored)."""


@attrs.define
class Held:
    """What a running flow holds, so that its driver can clean up if the flow ends
    early (cancelled, interrupted, a journal error)."""

    lease: tuple[str, str] | None = None
    """(operation_id, owner)"""
    owners: list[str] = attrs.Factory(list)
    """The lease owners this flow made: in flight until the driver calls `end`."""
    interrupted: tuple[str, str, str | None, float, Delivery] | None = None
    """While an attempt is being sent: (operation_id, key, owner, started_at, delivery)
    of the attempt to journal if it never returns (it may have been delivered), which
    also releases the lease; the record itself (`interrupted_attempt`) is built
    only then, not before every send."""
    lease_until: float = 0.0
    """When the lease this flow last wrote runs out (by the engine's clock)."""

    def take(self, operation_id: str, owner: str) -> None:
        """This flow is about to hold (or try to take) the operation's lease as ``owner``."""
        mark_in_flight(owner)
        self.owners.append(owner)
        self.lease = (operation_id, owner)

    def end(self) -> None:
        """The flow has ended: its owners are no longer in flight."""
        for owner in self.owners:
            unmark_in_flight(owner)
        self.owners.clear()

    def recorded(self, record: Record) -> None:
        """A Record of this flow is in the journal: nothing to journal for it if we stop
        now, and no lease to release once it released it (the driver calls this as soon
        as the write returns, before a cancellation can be delivered)."""
        self.interrupted = None
        if record.record.lease_until == 0:
            self.lease = None

    def cleanup(self) -> Record | Release | None:
        """The journal command that leaves things right after an early end."""
        if self.interrupted is not None:
            return interrupted_attempt(*self.interrupted)
        if self.lease is not None:
            return Release(*self.lease)
        return None


def interrupted_attempt(
    operation_id: str, key: str, owner: str | None, started: float, delivery: Delivery
) -> Record:
    """The record of an attempt whose send never returned (cancelled, interrupted)."""
    return Record(
        operation_id,
        AttemptRecord(
            started_at=started,
            elapsed=0.0,
            outcome="maybe_delivered",
            error="interrupted while sending: it may have been delivered",
            status="abandoned" if delivery == "at_most_once" else "pending",
            reason=(
                "interrupted while sending an at-most-once operation: it may have been "
                "delivered, so it is never resent"
                if delivery == "at_most_once"
                else "interrupted while sending; the key makes a resend safe"
            ),
        ),
        started,
        owner,
        key,
    )


@attrs.frozen
class Call:
    """One call's request and what its caller said about it (already validated)."""

    request: httpx.Request
    """Rendered, its body read."""
    operation_id: str | None = None
    key: str | None = None
    keep_journaled_key: bool = False
    """A named operation keeps the key it was first sent with, whatever ``key`` says
    (an SDK that draws a fresh key on every call, behind a Transport)."""
    delivery: Delivery = "exactly_once"
    deadline_at: float | None = None
    new_operation_id: str | None = None
    """The id a new operation gets when ``operation_id`` is None (else a random one)."""
    overrides: str | None = None
    """The call's own policy and timeouts, journaled (``_overrides.py``) for resume."""


@attrs.frozen
class End:
    """How an operation's attempts ended this time."""

    operation_id: str
    key: str
    decision: Decision
    attempts: int
    """Attempts journaled for the operation so far."""
    response: httpx.Response | None = None
    error: BaseException | None = None
    unkept: str | None = None
    """Why the final answer's body was not kept (too large, too slow), if it was not:
    the operation is journaled with its status and headers only."""


class _Reading:
    """How far the driver reads an attempt's answer as it arrives (under the send's
    heartbeat): one the built-in table may retry (`may_be_retried`) to a 64 KiB excerpt
    and within one read timeout of its arrival (a trickled excerpt must not eat the time
    a retry needs); a final one up to ``max_response_bytes`` and within the call's time
    limit (else the attempt's longest timeout). Called by the driver with each attempt's
    answer; ``body`` is then what was read of it (the flow clears it before each send)."""

    __slots__ = (
        "body",
        "clock",
        "excerpt",
        "limit",
        "longest",
        "max_bytes",
        "profile",
        "request",
        "until",
    )

    def __init__(
        self,
        engine: Engine,
        profile: ServerProfile,
        request: httpx.Request,
        limit: float | None,
        longest: float,
    ) -> None:
        self.clock = engine.clock
        self.max_bytes = engine.max_response_bytes
        self.profile = profile
        self.request = request
        self.limit = limit
        self.longest = longest
        self.body: AnswerBody | None = None
        self.excerpt = False
        self.until: float | None = limit
        """When the reading of a final answer must be over."""

    def __call__(
        self, response: httpx.Response
    ) -> tuple[AnswerBody, int, float | None, Callable[[], float]]:
        """The body to read, its byte limit, its time limit and the clock (`read_answer`)."""
        clock = self.clock
        until = self.limit
        if until is None and self.longest != _INFINITY:
            until = clock() + self.longest
        self.until = until
        body = self.body = AnswerBody(response)
        if not may_be_retried(self.profile, response.status_code):
            self.excerpt = False
            return body, self.max_bytes, until, clock
        self.excerpt = True
        timeouts = self.request.extensions.get("timeout")
        read = timeouts.get("read") if isinstance(timeouts, dict) else None
        if read is not None:
            soon: float = clock() + read
            until = soon if until is None else min(soon, until)
        return body, RETRIED_ANSWER_BYTES, until, clock


def check_call_arguments(
    *,
    operation_id: object,
    idempotency_key: object,
    delivery: object,
    deadline_at: object,
) -> None:
    """The boundary: a wrong type or value is an error before anything is journaled or sent."""
    if operation_id is not None:
        if not isinstance(operation_id, str):
            raise TypeError(
                f"operation_id must be a str (e.g. 'order-42:charge'), not "
                f"{type(operation_id).__name__}"
            )
        if not operation_id or len(operation_id) > MAX_OPERATION_ID_LENGTH:
            raise ValueError(
                f"operation_id must be 1 to {MAX_OPERATION_ID_LENGTH} characters, not "
                f"{len(operation_id)}; leave it out to have one generated"
            )
        if not operation_id.isprintable():
            raise ValueError(
                f"operation_id {operation_id[:60]!r} holds control characters; use "
                "printable characters only"
            )
    if idempotency_key is not None and not isinstance(idempotency_key, str):
        raise TypeError(f"idempotency_key must be a str, not {type(idempotency_key).__name__}")
    if delivery not in DELIVERIES:
        raise ValueError(f"delivery must be 'exactly_once' or 'at_most_once', not {delivery!r}")
    if deadline_at is not None:
        if isinstance(deadline_at, bool) or not isinstance(deadline_at, (int, float)):
            raise TypeError(
                "deadline_at must be seconds since the epoch (a number, e.g. "
                f"time.time() + 3600), not {type(deadline_at).__name__}"
            )
        if not (0 < deadline_at < 1e11):  # 1e11 s is the year 5138: a unit mistake
            raise ValueError(
                f"deadline_at must be seconds since the epoch (e.g. time.time() + 3600), "
                f"not {deadline_at!r}"
            )


_INFINITY = float("inf")


def check_timeouts(request: httpx.Request) -> None:
    """The request's timeouts (from ``timeout=``) are seconds or None, before anything is
    journaled: httpx would only fail on them at the socket."""
    timeouts = request.extensions.get("timeout") or {}
    for phase, value in timeouts.items():
        if value is None:
            continue
        if type(value) is not float and (  # a float (the usual case) needs no more looks
            isinstance(value, bool) or not isinstance(value, (int, float))
        ):
            raise TypeError(
                f"timeout must be seconds (a number), None or an httpx.Timeout; its {phase} "
                f"timeout is a {type(value).__name__}"
            )
        # As a float first: an int past a float's range (10**400) passes any comparison
        # and would overflow only at the socket, after the operation is journaled.
        seconds = as_float(value, f"timeout ({phase})")
        if not (0 < seconds < _INFINITY):
            raise ValueError(
                f"timeout must be a finite number of seconds > 0, not {value!r} (its {phase} "
                "timeout); None waits without a limit"
            )


UNREADABLE_ROW = (Exception,)
"""What a journaled value that cannot be used raises while its operation is resumed (an
OverflowError, a URL httpx cannot parse, a JSON or Unicode error...): that operation is
reported, the resume goes on. So is the codec's failure on that operation's body or
answer (a `CodecError`). Any other `IdempotentlyError` is a verdict (the journal's own
failure included), never a damaged row: it is raised as before."""

# A random tag of this process, at the start of every owner token it makes: another
# process with the same host id and the same pid (pid 1 in two containers that share
# a hostname) is told apart from an ended flow of ours. Made again after a fork.
_PROCESS_TAG: tuple[int, str] = (os.getpid(), uuid.uuid4().hex[:6])


def _process_tag() -> str:
    global _PROCESS_TAG
    pid, tag = _PROCESS_TAG
    if pid != os.getpid():
        _PROCESS_TAG = pid, tag = os.getpid(), uuid.uuid4().hex[:6]
    return tag


def new_lease_owner(host_id: str = _HOST) -> str:
    # Six random hex digits, as the first six of a uuid4's hex (which are random too),
    # without building a UUID: one is made per call.
    return f"{host_id}:{os.getpid()}:{_process_tag()}{os.urandom(3).hex()}"


# The lease owners of this process's flows that are running now (counted: a resume
# worker's owner is shared by the flows of the operations it claimed). A lease held
# by one of them is live even past its lease_until (a long attempt in flight); one
# of this process's owners that is not here belongs to a flow that has ended.
_IN_FLIGHT: Counter[str] = Counter()
_IN_FLIGHT_LOCK = threading.Lock()


def mark_in_flight(owner: str) -> None:
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[owner] += 1


def unmark_in_flight(owner: str) -> None:
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[owner] -= 1
        if _IN_FLIGHT[owner] <= 0:
            del _IN_FLIGHT[owner]


def lease_owner_alive(owner: str, host_id: str = _HOST) -> bool:
    """False only when the owner is provably gone: a dead process on this host, or a
    flow of this process that has ended. An owner of another host id (even another
    process on this machine with another ``host_id``) is alive until its lease expires."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != host_id or not pid_text.isdigit():
        return True
    pid = int(pid_text)
    if pid == os.getpid():
        if not owner.rpartition(":")[2].startswith(_process_tag()):
            return True  # another process with our pid: a container with our host id
        return in_flight(owner)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def in_flight(owner: str) -> bool:
    """Whether ``owner`` is a running flow of this process."""
    with _IN_FLIGHT_LOCK:
        return owner in _IN_FLIGHT


@attrs.define
class Engine:
    """What every flow of one Session or Transport shares: its configuration."""

    policy: RetryPolicy = attrs.field(factory=RetryPolicy)
    profile: ServerProfile = GENERIC
    profile_rule: ProfileRule = "stored"
    """How operations' journaled profiles are read (``_profiles.ProfileRule``)."""
    clock: Callable[[], float] = time.time
    rand: Callable[[], float] = random.random
    redact_headers: frozenset[str] = attrs.field(factory=redaction_set)
    fingerprint_headers: tuple[str, ...] = ()
    lease_duration: float = DEFAULT_LEASE_DURATION
    key_expiry_margin: float | None = None
    """A margin given to this engine (a resume's ``--key-expiry-margin``): applied where it
    is larger than the one journaled with an operation's profile. None: the journaled one."""
    namespace: uuid.UUID | None = None
    """The journal's own namespace: a named operation's key is derived from it."""
    host_id: str = _HOST
    """This host's identity: lease owners are ``host_id:pid:token``; the pid of an owner
    is checked only when its host id is this one."""
    # Data at rest: the journal's codec and secret query parameters, and where a resume
    # finds the values of redacted parameters (the session's client params, --param-env).
    codec: Codec | None = None
    secret_params: frozenset[str] = attrs.field(factory=secret_param_names)
    param_values: LiveValues | None = None
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    """The largest final answer read and journaled (decoded bytes); a larger one is
    journaled with its status and headers only (`AnswerNotReadError`)."""

    def overridden(self, policy: RetryPolicy | None, profile: ServerProfile | None) -> Engine:
        """This engine for one call with its own policy or profile (itself without)."""
        if policy is None and profile is None:
            return self
        return attrs.evolve(
            self,
            policy=self.policy if policy is None else policy,
            profile=self.profile if profile is None else profile,
        )

    def new_owner(self) -> str:
        """A new lease owner of this engine's host."""
        return new_lease_owner(self.host_id)

    def lease(self, operation_id: str, owner: str) -> Lease:
        """What a heartbeat needs to keep ``owner``'s lease on the operation alive."""
        return Lease(operation_id, owner, self.lease_duration, self.clock)

    hooks: tuple[AsyncHook, ...] = ()
    """Called with every event (``_events.py``), through the driver."""
    budgets: RetryBudgets = BUDGETS
    """The retry ledgers per origin the policy's budget is spent from: the process's."""
    pauses: PauseBoard = attrs.Factory(PauseBoard)
    """What this engine last read of its journal's origin pauses."""

    # -- one call ------------------------------------------------------------------------

    def _read_request(self, request: httpx.Request) -> tuple[RequestHeaders, str]:
        """The request's headers as the journal sees them, and its digest: one reading
        for a call and an enqueue, so the two journal the same request alike."""
        headers = read_request_headers(
            request.headers,
            self.redact_headers,
            request.url,
            self.fingerprint_headers,
            self.profile.key_header,
        )
        return headers, request_digest(request.method, request.url, headers.fingerprinted)

    def call(self, call: Call, build: BuildRequest, held: Held) -> Flow[httpx.Response]:
        """Journal the operation (or find it), then attempt until the decision settles.

        Returns the final answer (2xx, 3xx, a final 4xx, or the stored answer of a
        settled operation), or raises what the end means.
        """
        started = self.clock()
        request = call.request
        headers, print_ = self._read_request(request)
        secrets = headers.secrets
        pause = yield from self._origin_pause(self.profile, request, started, call.operation_id)
        if pause is not None:
            key = call.key
            if key is None and call.operation_id is not None and self.namespace is not None:
                key = derived_key(self.namespace, call.operation_id)
            yield from self._wait_out(
                self.profile,
                request,
                pause,
                started,
                call.deadline_at,
                operation_id=call.operation_id,
                key=key,
            )
        named = call.operation_id is not None or call.key is not None
        wait_until = started + self.policy.deadline
        poll = _FIRST_POLL
        taken_key: str | None = None  # a key our insert found already journaled
        # Insert first, then read (the claim that cannot race): a new operation, the
        # common case, costs one statement; only an insert that finds the id or the key
        # taken looks the operation up.
        insert_first = True
        while True:
            operation = (
                (yield Find(call.operation_id, call.key or taken_key))
                if named and not insert_first
                else None
            )
            if operation is None:
                now = self.clock()
                if call.deadline_at is not None and call.deadline_at <= now:
                    if named and insert_first:
                        insert_first = False  # a settled operation is still answered
                        continue
                    raise ValueError(
                        f"deadline_at ({_iso(call.deadline_at)}) has already passed for "
                        f"operation {call.operation_id!r}: nothing was journaled or sent; "
                        "give a deadline in the future, or none"
                    )
                # A key bound to credentials is bound by its first send, to those it
                # leaves with (after the client's request hooks and auth flow): `_gate`.
                new, owner = self._new_operation(call, print_, headers, now)
                # Held before the write: a call stopped while the write runs releases
                # whatever it got (a release of a lease it did not get changes nothing).
                held.take(new.operation_id, owner)
                held.lease_until = now + self.lease_duration
                if (yield Insert(new, owner, held.lease_until)):
                    state = CallState(
                        started_at=started, deadline_at=call.deadline_at, delivery=call.delivery
                    )
                    end = yield from self._attempts(
                        new.operation_id,
                        new.key,
                        request,
                        state,
                        self.profile,
                        0,
                        held,
                        secrets,
                        self.codec,
                    )
                    return self._finish(end)
                held.lease = None
                # Journaled already (a call again, or another caller first: find it), or
                # the key is taken by another operation (the Find returns that one: a
                # KeyReuseError).
                taken_key = new.key
                insert_first = False
                continue
            if operation.unreadable is not None:
                raise CodecError(
                    f"operation cannot be read with this journal: {operation.unreadable}; "
                    "nothing was sent and it keeps its state",
                    **_ids(operation),
                )
            self._check_same(operation, call, print_)
            if operation.status != "pending":
                return self.stored_response(operation, build)
            self.profile_for(operation)  # one that cannot be read is an error: nothing sent
            operation = yield from self._times_from_now(operation)
            blocker = self.blocker(operation)
            if blocker is not None and blocker[0] != "leased":
                yield from self._apply_blocker(operation, blocker[0], blocker[1])
                raise _blocker_error(operation, blocker[0], blocker[1])
            owner = self.new_owner()
            now = self.clock()
            if blocker is None:
                held.take(operation.operation_id, owner)
                held.lease_until = now + self.lease_duration
            if blocker is not None or not (
                yield TakeLease(operation, owner, now + self.lease_duration, now)
            ):
                held.lease = None
                # Another thread, task or process is sending it (or took the lease
                # between our read and our swap): wait for its answer.
                if self.clock() + poll > min(wait_until, operation.deadline_at or wait_until):
                    reason = blocker[1] if blocker else "another caller took its lease first"
                    raise OperationInProgressError(reason, **_ids(operation))
                yield Sleep(poll)
                poll = min(poll * 2, _MAX_POLL)
                continue
            end = yield from self._attempts(
                operation.operation_id,
                operation.key,
                self.rebuild(operation, build, live=request),
                self._state_of(operation, started, resuming=False),
                self.profile_for(operation),
                operation.attempt_count,
                held,
                secrets,
                self._codec_of(operation),
                binding=operation.credentials_digest,
            )
            return self._finish(end)

    def _new_operation(
        self, call: Call, print_: str, headers: RequestHeaders, now: float
    ) -> tuple[NewOperation, str]:
        request = call.request
        key = call.key or self.key_for(call.operation_id)
        key_header = self.profile.key_header
        rendered = self.profile.render_key(key)
        request.headers[key_header] = rendered
        if headers.has_key_header:
            # Replaced where it stood (httpx's __setitem__): read the headers again.
            journaled = journaled_request_headers(request.headers, self.redact_headers)
        else:
            # Appended: what the one pass read, and the key header last.
            journaled = list(headers.journaled)
            if is_journaled(key_header, self.redact_headers):
                journaled.append((key_header, rendered))
        # Data at rest: secret query values redacted, the body encoded by the codec, with
        # the digest a resend checks it against (the plain path computes nothing more).
        url, redacted = redacted_url(request.url, self.secret_params)
        codec = self.codec
        operation_id = call.operation_id or call.new_operation_id or new_operation_id()
        body, digest = request.content, None
        if codec is not None:
            try:
                body, digest = encoded(codec, body), body_digest(codec, body)
            except CodecError as error:
                raise CodecError(
                    f"{error.message}; nothing was journaled or sent",
                    operation_id=operation_id,
                    key=key,
                ) from None
        new = NewOperation(
            operation_id=operation_id,
            key=key,
            delivery=call.delivery,
            method=request.method,
            url=url,
            request_headers=journaled,
            request_body=body,
            body_digest=digest,
            fingerprint=print_,
            profile=journaled_profile(self.profile),
            key_header=self.profile.key_header,
            created_at=now,
            key_expires_at=now + self.profile.key_lifetime,
            deadline_at=call.deadline_at,
            overrides=call.overrides,
            codec=None if codec is None else codec.name,
            secret_params=json.dumps(list(redacted)) if redacted else None,
        )
        return new, self.new_owner()

    # -- enqueue: the client-side outbox ---------------------------------------------------

    def enqueue(self, call: Call, connection: object | None) -> Flow[Operation]:
        """Journal ``call`` as a pending operation that nothing has sent yet; send nothing.

        Rendered and journaled exactly as `call` journals a new operation (the
        same key, headers, body bytes, fingerprint and profile), but unleased and marked
        enqueued, with no first send: until a send begins it is provably undelivered,
        and its key's lifetime starts at that first send. On ``connection`` it is written
        inside the application's transaction. An operation id already journaled (the
        application's transaction run again) returns that operation, unchanged, after
        the same check a call makes (`KeyReuseError` for another request).
        """
        request = call.request
        headers, print_ = self._read_request(request)
        now = self.clock()
        if call.deadline_at is not None and call.deadline_at <= now:
            raise ValueError(
                f"deadline_at ({_iso(call.deadline_at)}) has already passed for operation "
                f"{call.operation_id!r}: nothing was journaled; give a deadline in the future, "
                "or none"
            )
        new, _ = self._new_operation(call, print_, headers, now)
        # Bound to credentials (if its profile says so) by its first send, as a call's is.
        new = attrs.evolve(new, enqueued_at=now)
        if (yield Enqueue(new, connection)):
            # What a read of the row would return: its body in clear.
            return attrs.evolve(new.as_row(), request_body=request.content)
        found: Operation | None = yield Find(call.operation_id, new.key, connection)
        if found is None:
            # Taken when the insert ran, gone when we looked (pruned meanwhile): the
            # caller's transaction is the one to run again.
            raise OperationInProgressError(
                f"operation {new.operation_id!r} was journaled by another transaction and "
                "removed before this one could read it; nothing was journaled here: run "
                "your transaction again",
                operation_id=new.operation_id,
                key=new.key,
            )
        self._check_same(found, call, print_)
        return found

    # -- data at rest: codecs, secret query parameters, credentials -------------------------

    def _codec_of(self, operation: Operation) -> Codec | None:
        """The codec an answer to ``operation`` is stored with: the journal's, when the
        row's bodies are encoded (it was read, so with this codec); None for a row in clear."""
        return self.codec if operation.codec is not None else None

    def _salt(self) -> bytes:
        return b"" if self.namespace is None else self.namespace.bytes

    def _credentials_differ(self, operation: Operation, request: httpx.Request) -> Flow[str | None]:
        """None when ``request`` carries the credentials ``operation`` was made with (its
        digest agrees), else why it must not be sent."""
        return (
            yield from binding_differs(operation.credentials_digest or "", request, self._salt())
        )

    def _redacted_request(self, request: httpx.Request) -> httpx.Request:
        """``request`` with its URL as it would be journaled (for messages)."""
        url, redacted = redacted_url(request.url, self.secret_params)
        if not redacted:
            return request
        return httpx.Request(
            request.method, url, headers=request.headers.raw, content=request.content
        )

    def key_for(self, operation_id: str | None) -> str:
        """A new operation's key: derived for a named operation, random otherwise.

        Derived as UUIDv5(journal namespace, operation id): a caller that runs the
        operation again after the journal lost its row (a power cut with
        durability "os", a restored backup) sends the same key, and the server
        replays instead of acting twice.
        """
        if operation_id is not None and self.namespace is not None:
            return derived_key(self.namespace, operation_id)
        return new_key()

    def _check_same(self, operation: Operation, call: Call, print_: str) -> None:
        """Raise `KeyReuseError` unless ``call`` is the journaled operation again."""
        ids = _ids(operation)
        if call.operation_id is not None and operation.operation_id != call.operation_id:
            raise KeyReuseError(
                f"the idempotency key {operation.key!r} already belongs to operation "
                f"{operation.operation_id!r}, not {call.operation_id!r} (was it passed as "
                "idempotency_key for another operation?); use a new key for a new operation",
                **ids,
            )
        if call.key is not None and operation.key != call.key and not call.keep_journaled_key:
            raise KeyReuseError(
                f"operation {operation.operation_id!r} was journaled with another key; "
                "pass the same idempotency_key, or none",
                **ids,
            )
        if not self._same_request(operation, call.request, print_):
            # Off the hot path: worked out only once the requests disagree.
            difference = first_difference(
                method=operation.method,
                url=operation.url,
                headers=operation.request_headers,
                body=operation.request_body,
                request=self._redacted_request(call.request),
                fingerprint_headers=self.fingerprint_headers,
            )
            if difference is None and operation.secret_params:
                difference = (
                    "the value of a secret query parameter "
                    f"({', '.join(json.loads(operation.secret_params))}; values are not shown)"
                )
            raise KeyReuseError(
                f"operation {operation.operation_id!r} was first sent as "
                f"{operation.method} {shown_url(operation.url)} and this call differs in "
                f"{difference or 'what it fingerprints (a header not journaled?)'}; nothing "
                "was sent. Use a new operation_id for a different request",
                **ids,
            )

    def _same_request(self, operation: Operation, request: httpx.Request, digest: str) -> bool:
        """Whether ``request`` is the journaled operation's request again:
        its `request_digest` agrees, and its body has the journaled bytes or, only
        when the bytes differ, means the same (canonical JSON, multipart boundary)."""
        if not operation.fingerprint.startswith(DIGEST_PREFIX):
            # Journaled by an earlier version: a canonical fingerprint of the whole request.
            return operation.fingerprint == fingerprint(
                request.method,
                request.url,
                request.content,
                request.headers,
                self.fingerprint_headers,
            )
        return operation.fingerprint == digest and same_body(
            operation.request_body,
            stored_header(operation.request_headers, "content-type"),
            request.content,
            header_value(request.headers, b"content-type"),
        )

    def _finish(self, end: End) -> httpx.Response:
        """The final answer of a call, or the error its end means."""
        decision = end.decision
        action = decision.action
        ids: ErrorContext = {
            "operation_id": end.operation_id,
            "key": end.key,
            "response": end.response,
        }
        if action in ("succeed", "fail") and end.response is not None:
            if end.unkept is not None:
                raise AnswerNotReadError(
                    f"the server answered {end.response.status_code}, so the operation is "
                    f"journaled {STATUS_AFTER[action]} with that status and its headers, but "
                    f"{end.unkept}: there is no whole response to return. It is never sent "
                    "again: look the object up on the server, and raise max_response_bytes "
                    "(Session(max_response_bytes=...)) or the policy's deadline for answers "
                    "that large or that slow",
                    **ids,
                )
            return end.response
        if isinstance(end.error, GateRefusal) and action in ("unsent", "pending"):
            raise end.error.error(ids) from None
        if action == "fail" or action == "unsent":
            # The error may quote a secret header's value: only the scrubbed text
            # travels, and the original is not chained.
            state = "failed" if action == "fail" else "pending"
            raise RequestNotSentError(
                f"{decision.reason}; nothing reached the server on this attempt, the "
                f"operation is {state}. Fix the URL or headers"
                + (" and call again" if state == "pending" else " and use a new operation_id"),
                **ids,
            ) from None
        error: IdempotentlyError
        not_before = decision.not_before
        if action == "retry_later" and not_before is not None:
            error = RetryLaterError(
                f"{decision.reason}; not before {_iso(not_before)}: {RESUME_HINT}",
                not_before=not_before,
                **ids,
            )
        elif action == "reconcile":
            error = NeedsReconcileError(f"{decision.reason}; {RECONCILE_HINT}", **ids)
        elif action == "abandon":
            error = OperationAbandonedError(f"{decision.reason}; {ABANDON_HINT}", **ids)
        elif decision.refused_by is not None:
            error = RetryBudgetError(
                f"{decision.reason}; " + RESUME_HINT, origin=decision.refused_by, **ids
            )
        else:
            attempts = decision.state.attempts
            error = OperationPendingError(
                f"outcome unknown after {attempts} attempt{'' if attempts == 1 else 's'} "
                f"({decision.reason}); " + RESUME_HINT,
                **ids,
            )
        raise error from end.error

    # -- attempts: shared by calls and resume ----------------------------------------------

    def _attempts(
        self,
        operation_id: str,
        key: str,
        request: httpx.Request,
        state: CallState,
        profile: ServerProfile,
        attempts: int,
        held: Held,
        secrets: Sequence[str],
        codec: Codec | None = None,
        *,
        binding: str | None = None,
    ) -> Flow[End]:
        """Send until the decision is anything but a retry; journal every attempt.

        ``binding`` is the credentials record the operation's key is bound to (None: not
        bound yet, or its profile does not bind keys): each attempt's request is checked
        by its `Gate` as it leaves, after the client's request hooks and auth flow."""
        owner = held.lease[1] if held.lease is not None else None
        lease = None if owner is None else self.lease(operation_id, owner)  # one per call
        gate = Gate(
            request,
            operation_id=operation_id,
            key=key,
            key_header=profile.key_header,
            # A key the journal holds as bound stays bound, whatever profile resends it
            # (`--force-profile`, a damaged row): its digest is checked, never ignored.
            bind=profile.key_bound_to_credentials or binding is not None,
            binding=binding,
            owner=owner,
            salt=self._salt(),
            redact_headers=self.redact_headers,
            secret_params=self.secret_params,
            fingerprint_headers=self.fingerprint_headers,
        )
        began = self.clock()
        # Events are built only when a hook or the logger would see them (``heard``).
        hooks = self.hooks
        if heard(hooks, logging.DEBUG):
            yield from self._emit(
                OperationStarted(
                    operation_id=operation_id,
                    key=key,
                    method=request.method,
                    delivery=state.delivery,
                    resuming=state.resuming,
                    attempts=attempts,
                    at=began,
                )
            )
        budget = self.policy.budget
        origin = None if budget is None else origin_of(request.url)
        first = True
        limit = self._time_limit(state)
        timeouts = request.extensions.get("timeout")
        longest = longest_timeout(timeouts)
        reading = _Reading(self, profile, request, limit, longest)
        while True:
            started = self.clock()
            paused_until: float | None = None  # the origin pause this attempt's answer set
            if limit is not None and limit - started < longest:
                request.extensions = {
                    **request.extensions,
                    "timeout": capped_timeouts(timeouts, limit - started),
                }
            if first:
                first = False
                if origin is not None:
                    # A resume's (or a call's) first send of the operation: what the
                    # budget's ratio of retries is counted against.
                    self.budgets.first_attempt(origin, started)
            if owner is not None and started > held.lease_until - self.lease_duration / 2:
                # Half the lease gone before the bytes leave (a slow hook, a long wait):
                # another caller may have found it expired and taken it. Renew it by a
                # compare-and-swap on its owner; if that fails, someone else is sending.
                held.lease_until = started + self.lease_duration
                if not (yield RenewLease(operation_id, owner, held.lease_until, started)):
                    held.lease = None
                    raise OperationInProgressError(
                        f"the lease of operation {operation_id!r} ran out before this call "
                        "could send it (a hook or a wait took longer than lease_duration), and "
                        "meanwhile another caller or a resume took it over, or it was settled: "
                        "this call sent nothing. Call again with the same operation_id for its "
                        "outcome (the same key, so it is never sent twice)",
                        operation_id=operation_id,
                        key=key,
                    )
            # From here until its Record is journaled the send may have begun: an early end
            # journals the attempt as maybe delivered, and any error raised says so (the
            # drivers' one rule). The answer's body is read by the driver as it arrives,
            # within the bounds `_Reading` sets; an error while reading is the attempt's.
            held.interrupted = (operation_id, key, owner, started, state.delivery)
            reading.body = None
            gate.passes = 0
            reply = yield Send(request, lease, reading, gate)
            if isinstance(reply, (httpx.Response, httpx.TransportError)):
                if gate.bind and gate.passes == 0:
                    reply = yield from self._checked_late(gate, reply, request, reading)
                elif gate.passes and gate.changed_since(_sent(reply, request)):
                    reply = yield from self._checked_late(gate, reply, request, reading, again=True)
            body = reading.body if isinstance(reply, httpx.Response) else None
            unkept: str | None = None
            if body is not None and not reading.excerpt and not body.complete:
                unkept = self._unkept(body)
            now = self.clock()
            attempts += 1
            response = reply if isinstance(reply, httpx.Response) else None
            error = None if response is not None else reply
            signal = (
                classify(profile, response, now=now)
                if response is not None
                else Failure(reply.outcome, storable_text(reply.reason), refused=True)
                if isinstance(reply, GateRefusal)
                else classify_error(reply, secrets=secrets)
            )
            if (
                response is not None
                and response.history
                and not state.acted
                and _sent(response, request).method != request.method
            ):
                # A redirect made the write a GET (a 303 after a POST: it acted there); what
                # the GET is answered is not the server's first word on the write.
                state = attrs.evolve(state, acted=True)
            decision = decide(self.policy, profile, state, signal, now=now, rand=self.rand)
            if (
                decision.action == "retry"
                and budget is not None
                and origin is not None
                and not self.budgets.try_retry(budget, origin, now)
            ):
                decision = refused(decision, origin)
            state = decision.state
            action = decision.action
            retrying = action == "retry"
            keep = response is not None and action in ("succeed", "fail", "reconcile")
            if body is not None and not body.complete:
                if keep and unkept is None:
                    # Only an excerpt was read, and the answer is kept: read the rest.
                    failure = yield ReadAnswer(
                        body, self.max_response_bytes, reading.until, self.clock, lease
                    )
                    if failure is not None:
                        unkept = f"its body could not be read whole ({type(failure).__name__})"
                    elif not body.complete:
                        unkept = self._unkept(body)
                if not body.complete:
                    yield Discard(body.response, body)
            if not keep:
                unkept = None
            answer = signal if isinstance(signal, Answer) else None
            record = AttemptRecord(
                started_at=started,
                elapsed=now - started,
                outcome=signal.outcome,
                status_code=None if answer is None else answer.status_code,
                replayed=answer is not None and answer.replayed,
                error=None if answer is not None else storable(signal.text),  # type: ignore[union-attr]
                wait=decision.wait if retrying else None,
                status=STATUS_AFTER[action],
                reason=(
                    None
                    if action == "succeed" and unkept is None
                    else storable(
                        decision.reason if unkept is None else f"{decision.reason}; {unkept}"
                    )
                ),
                not_before=decision.not_before,
                lease_until=now + decision.wait + self.lease_duration if retrying else 0.0,
                response_status=response.status_code if keep and response else None,
                response_headers=journaled_answer_headers(
                    response.headers, self.redact_headers, self.secret_params
                )
                if keep and response
                else None,
                response_body=(
                    (response.content if codec is None else encoded(codec, response.content))
                    if keep and response and unkept is None
                    else None
                ),
            )
            yield Record(operation_id, record, now, owner, key)
            if (
                answer is not None
                and answer.server_wait
                and answer.status_code in PAUSE_STATUS_CODES
                and profile.pause_origin
            ):
                paused_until = yield from self._pause(request, answer, now)
            if retrying:
                held.lease_until = record.lease_until
            held.interrupted = None  # the answer is journaled: nothing to add if we stop now
            if not retrying:
                held.lease = None  # the record released it
            if response is not None:
                response.extensions = {
                    **response.extensions,
                    EXTENSION: Receipt(
                        operation_id=operation_id,
                        key=key,
                        attempts=attempts,
                        replayed=answer is not None and answer.replayed,
                        replayed_locally=False,
                    ),
                }
            if heard(hooks, logging.DEBUG):
                yield from self._emit(
                    AttemptFinished(
                        operation_id=operation_id,
                        key=key,
                        attempt=attempts,
                        outcome=signal.outcome,
                        status_code=record.status_code,
                        replayed=record.replayed,
                        error=record.error,
                        action=action,
                        status=record.status,
                        started_at=started,
                        elapsed=now - started,
                    )
                )
            if decision.refused_by is not None:
                yield from self._emit(
                    RetryRefused(
                        operation_id=operation_id,
                        key=key,
                        attempt=attempts,
                        origin=decision.refused_by,
                        reason=decision.reason,
                    )
                )
            if retrying:
                yield from self._emit(
                    RetryScheduled(
                        operation_id=operation_id,
                        key=key,
                        attempt=attempts,
                        wait=decision.wait,
                        reason=decision.reason,
                    )
                )
                yield from self._sleep_on(profile, request, decision.wait, paused_until)
                continue
            if heard(hooks, finished_level(record.status)):
                yield from self._emit(
                    OperationFinished(
                        operation_id=operation_id,
                        key=key,
                        status=record.status,
                        action=action,
                        reason=decision.reason,
                        attempts=attempts,
                        status_code=record.status_code,
                        replayed=record.replayed,
                        not_before=decision.not_before,
                        elapsed=now - began,
                    )
                )
            return End(operation_id, key, decision, attempts, response, error, unkept)

    def _checked_late(
        self,
        gate: Gate,
        reply: httpx.Response | httpx.TransportError,
        request: httpx.Request,
        reading: _Reading,
        *,
        again: bool = False,
    ) -> Flow[httpx.Response | BaseException]:
        """A bound request that reached the transport without passing its gate (a client
        whose ``send`` runs no request hooks, so not the Session's last one), or one a
        request hook changed after it passed (``again``: a hook appended while the send
        ran, so after the Session's last one): what it left with is checked, and bound if
        it was bound to none, after the fact; the attempt is ``maybe_delivered`` and the
        operation stays pending if it differs."""
        sent = _sent(reply, request)
        try:
            yield from (gate.again(sent) if again else gate.leaving(sent))
        except GateRefusal as refusal:
            if isinstance(reply, httpx.Response):
                yield Discard(reply, reading.body)
            refusal.delivered(
                "a request hook that ran after the library's check (one added while the "
                "request was being sent) changed it, so it could be checked only after it "
                "left, and it may have been delivered"
                if again
                else "the client sent this request without running its request hooks (a "
                "Client whose send skips them?), so it could be checked only after it left, "
                "and it may have been delivered"
            )
            return refusal
        return reply

    def _unkept(self, body: AnswerBody) -> str:
        """Why a final answer's body is not kept: what stopped its reading."""
        if body.refused is not None:
            return body.refused
        if body.over:
            return (
                f"its body is larger than max_response_bytes ({self.max_response_bytes} "
                "bytes), so only its status and headers are journaled"
            )
        return (
            f"its body was still arriving at the call's deadline ({body.size} bytes read), "
            "so only its status and headers are journaled"
        )

    # -- reads: retried, never journaled ----------------------------------------------------

    def read(self, request: httpx.Request) -> Flow[httpx.Response]:
        """Send a read (a method the server may repeat) until its answer is final, under
        the same policy, retry budget and origin pauses as the writes; no operation is
        journaled and no key is added. Returns the last answer, its body unread, or
        raises the last error, as they came; an answer it retries is closed unread.

        A journaled pause of the origin for the read's credentials is waited out before
        the first send, or, when longer than the read may wait, is a RetryLaterError
        without sending; a 429 or 503 with Retry-After pauses the origin for every
        caller, as a write's does."""
        started = self.clock()
        state = CallState(started_at=started)
        profile = self.profile
        pause = yield from self._origin_pause(profile, request, started)
        if pause is not None:
            yield from self._wait_out(
                profile, request, pause, started, None, operation_id=None, key=None
            )
        budget = self.policy.budget
        origin = None if budget is None else origin_of(request.url)
        if origin is not None:
            self.budgets.first_attempt(origin, self.clock())
        limit = self._time_limit(state)
        timeouts = request.extensions.get("timeout")
        longest = longest_timeout(timeouts)
        while True:
            paused_until: float | None = None  # the origin pause this answer set
            if limit is not None and limit - self.clock() < longest:
                request.extensions = {
                    **request.extensions,
                    "timeout": capped_timeouts(timeouts, limit - self.clock()),
                }
            reply = yield Send(request)
            now = self.clock()
            response = reply if isinstance(reply, httpx.Response) else None
            signal = (
                classify_read(profile, response, now=now)
                if response is not None
                else classify_error(
                    reply,
                    secrets=secret_values(request.headers, self.redact_headers, request.url),
                )
            )
            if (
                isinstance(signal, Answer)
                and signal.server_wait
                and signal.status_code in PAUSE_STATUS_CODES
                and profile.pause_origin
            ):
                paused_until = yield from self._pause(request, signal, now)
            decision = decide_read(self.policy, state, signal, now=now, rand=self.rand)
            state = decision.state
            if (
                decision.action == "retry"
                and budget is not None
                and origin is not None
                and not self.budgets.try_retry(budget, origin, now)
            ):
                logger.info(
                    "a %s to %s is not retried: the retry budget of that origin is spent "
                    "(%s); its last answer or error is returned",
                    request.method,
                    origin,
                    decision.reason,
                )
            elif decision.action == "retry":
                if response is not None:
                    yield Discard(response)
                yield from self._sleep_on(profile, request, decision.wait, paused_until)
                continue
            if response is not None:
                return response
            raise reply

    # -- origin pauses -------------------------------------------------------------------

    def _origin_pause(
        self,
        profile: ServerProfile,
        request: httpx.Request,
        now: float,
        operation_id: str | None = None,
    ) -> Flow[OriginPause | None]:
        """The journal's pause of the request's origin for its credentials, if one runs
        now (the journal read again at most once a second)."""
        if not profile.pause_origin:
            return None
        board = self.pauses
        if board.stale(now):
            # One flow reads for all: the others go on with what was read last meanwhile.
            board.read_at = now
            board.replace((yield Pauses(now, operation_id)), now)
        if not board.by_origin:
            return None
        origin = origin_of(request.url)
        if not board.has(origin):
            return None
        pause = board.find(origin, self._pause_scope(request), now)
        if pause is not None and pause.set_at > now and math.isfinite(pause.until - pause.set_at):
            # Written by a clock ahead of ours (a host 10 years fast answering
            # `Retry-After: 5`): counted from our now, in the journal, so that no reader
            # waits longer than its length from when it first saw it. A clamp at each
            # read (min(until, now + length)) would move with every reader's now and
            # never end for a reader whose clock stays behind. A length that is no
            # number (a damaged row) is not rebased: it is waited on as written, so the
            # call is refused naming `unpause`, never sent nor a NaN journaled.
            rebased = yield RebasePause(pause.origin, pause.credentials, now)
            if rebased is None:
                board.remove_pause(pause)
                return None
            board.add(rebased)
            pause = rebased if rebased.until > now else None
        return pause

    def _pause_scope(self, request: httpx.Request) -> str:
        """The digest of the request's credentials a pause is scoped to: the same
        credentials (`credential_names`) a key bound to credentials is bound to."""
        names = credential_names(request, self.redact_headers, self.secret_params)
        values = credential_values(request, names)
        return credentials_digest(self.namespace, [value.decode("latin-1") for value in values])

    def _wait_out(
        self,
        profile: ServerProfile,
        request: httpx.Request,
        pause: OriginPause,
        now: float,
        deadline_at: float | None,
        *,
        operation_id: str | None,
        key: str | None,
    ) -> Flow[None]:
        """Sleep until the pause ends, or raise RetryLaterError, before anything is
        journaled or sent, when that is longer than this call (or read) may wait."""
        limit = self._time_limit(CallState(started_at=now, deadline_at=deadline_at))
        current: OriginPause | None = pause
        began, slept = now, 0.0
        while current is not None:
            wait = current.until - now
            if wait > self.policy.max_retry_after or (limit is not None and current.until > limit):
                raise RetryLaterError(
                    f"{current.origin} is paused until {_iso(current.until)} "
                    f"({current.reason}), longer than this call may wait (max_retry_after="
                    f"{self.policy.max_retry_after:g}s, or its deadline): nothing was "
                    "journaled or sent; call again after that, or lift the pause with "
                    f"`idempotently unpause {current.origin}`",
                    not_before=current.until,
                    operation_id=operation_id,
                    key=key,
                )
            # In slices of at most the board's refresh, each followed by a look at the
            # journal: a pause lifted meanwhile (`idempotently unpause`, in any process)
            # ends the wait within a second, not at its planned end.
            # Counted in slices slept too: an injected clock that a sleep does not move
            # must not make the wait endless.
            wait = min(wait, current.until - began - slept)
            if wait <= 0:
                return
            yield Sleep(min(wait, REFRESH))
            slept += min(wait, REFRESH)
            now = self.clock()
            current = yield from self._origin_pause(profile, request, now, operation_id)

    def _sleep_on(
        self,
        profile: ServerProfile,
        request: httpx.Request,
        seconds: float,
        paused_until: float | None,
    ) -> Flow[None]:
        """Sleep before a retry; when the answer paused its origin until ``paused_until``,
        in slices of at most a second, each followed by a look at the journal, so that a
        pause lifted meanwhile (`idempotently unpause`) ends the sleep within a second."""
        if paused_until is None:
            yield Sleep(seconds)
            return
        end, slept = self.clock() + seconds, 0.0
        # Counted in slices slept too: a clock that a sleep does not move ends it all the same.
        while (left := min(end - self.clock(), seconds - slept)) > 0:
            yield Sleep(min(left, REFRESH))
            slept += min(left, REFRESH)
            now = self.clock()
            if (
                now < paused_until
                and (yield from self._origin_pause(profile, request, now)) is None
            ):
                return

    def _pause(self, request: httpx.Request, answer: Answer, now: float) -> Flow[float]:
        """Journal the pause a 429 or 503 with Retry-After (to a call, a read or a lookup)
        asks of its whole origin."""
        wait = answer.server_wait or 0.0
        pause = OriginPause(
            origin=origin_of(request.url),
            credentials=self._pause_scope(request),
            until=now + wait,
            reason=f"{answer.status_code} with Retry-After {wait:g}s",
            set_at=now,
        )
        yield PauseOrigin(pause.origin, pause.credentials, pause.until, pause.reason or "", now)
        self.pauses.add(pause)
        return pause.until

    def _time_limit(self, state: CallState) -> float | None:
        """When this call's attempts must be over: its policy's deadline (unless a custom
        ``stop=`` replaced it) or the operation's own deadline, whichever comes first."""
        limits = [] if self.policy.stop is not None else [state.started_at + self.policy.deadline]
        if state.deadline_at is not None:
            limits.append(state.deadline_at)
        return min(limits) if limits else None

    def _emit(self, event: Event) -> Flow[None]:
        """Log ``event``; hand it to the hooks, if there are any (through the driver)."""
        log(event)
        if self.hooks:
            yield Emit(event, self.hooks)

    def _state_of(self, operation: Operation, started: float, *, resuming: bool) -> CallState:
        """A new call's state, from what the journal knows of the operation's attempts."""
        profile = self.profile_for(operation)
        in_progress_since = None
        for attempt in operation.attempts:
            if attempt.status_code in profile.in_progress_statuses:
                in_progress_since = in_progress_since or attempt.started_at
            else:
                in_progress_since = None
        return CallState(
            started_at=started,
            deadline_at=operation.deadline_at,
            delivery=operation.delivery,
            # An operation picked up again (resume, or a second call with its id) whose
            # first attempt left no record may have been delivered: a final 4xx is then
            # no proof that nothing happened.
            acted=may_have_been_delivered(operation),
            in_progress_since=in_progress_since,
            resuming=resuming,
        )

    # -- what stops a pending operation ---------------------------------------------------

    def _missing_params(self, operation: Operation) -> list[str]:
        """The redacted query parameters of ``operation`` that a resume has no value for."""
        if not operation.secret_params:
            return []
        source = self.param_values
        return [
            name
            for name in json.loads(operation.secret_params)
            if source is None or not source(name)
        ]

    def blocker(
        self, operation: Operation, *, resuming: bool = False, claimed_by: str | None = None
    ) -> tuple[Blocker, str] | None:
        """Why a pending operation cannot be sent now, and the reason; None if it can.

        A lease held by ``claimed_by`` (a resume worker's claim) is no blocker."""
        now = self.clock()
        owner = operation.lease_owner
        if (
            owner is not None
            and owner != claimed_by
            and (operation.lease_until > now or in_flight(owner))
            and lease_owner_alive(owner, self.host_id)
        ):
            return "leased", (
                f"another caller ({owner}) is sending this operation; "
                f"its lease runs until {_iso(operation.lease_until)}: let it finish, or "
                "call again (or resume) after that"
            )
        if (
            operation.delivery == "at_most_once"
            # Enqueued (or forked) and never sent: nothing went out, so it is sent.
            and not never_sent(operation)
            and (resuming or owner is not None or may_have_been_delivered(operation))
        ):
            return "abandon", (
                "an at-most-once operation whose send may have gone out is never resent"
                + (
                    " (its first attempt left no record, so it may have been sent)"
                    if operation.attempt_count == 0
                    else ""
                )
            )
        margin = self.expiry_margin(operation)
        if key_past_margin(operation, now, margin):
            born = key_born_at(operation)
            return "expired", (
                f"the key was {'first sent' if born != operation.created_at else 'created'} at "
                f"{_iso(born)} and the server may have forgotten it (key lifetime "
                f"{operation.key_expires_at - born:g}s, safety margin "
                f"{margin:g}s): resending could act twice; look the object "
                "up and settle it"
            )
        if operation.deadline_at is not None and now > operation.deadline_at:
            return "deadline", (
                f"the operation's own deadline ({_iso(operation.deadline_at)}) has passed"
            )
        if operation.not_before is not None and operation.not_before > now:
            return "waiting", f"the server asked not to retry before {_iso(operation.not_before)}"
        return None

    def expiry_margin(self, operation: Operation) -> float:
        """The key-expiry margin for ``operation``: its profile's (journaled), or this
        engine's given one when larger (`_policy.key_expiry_margin`)."""
        try:
            profile: ServerProfile | None = self.profile_for(operation)
        except StoredProfileError:
            profile = None
        return key_expiry_margin(operation, profile, self.key_expiry_margin)

    def _times_from_now(self, operation: Operation) -> Flow[Operation]:
        """The operation with its not_before and lease counted from our now, in the
        journal, when the clock that wrote them (its ``updated_at``) was ahead of ours: a
        server's "not before 5 s", or a 60 s lease, from a host ten years fast is 5 s (60
        s) from when we first see it, as an origin pause is (`_origin_pause`). A live
        owner's heartbeat writes its lease again (and its own now) every third of it, so
        it keeps it as it would with clocks in step."""
        now = self.clock()
        if not operation.updated_at > now or not (
            (operation.not_before or 0.0) > now or operation.lease_until > now
        ):
            return operation
        rebased = yield RebaseOperation(operation.operation_id, operation.updated_at, now)
        if rebased is None:
            return operation  # changed meanwhile: what was read decides, as before
        not_before, lease_until = rebased
        return attrs.evolve(
            operation, not_before=not_before, lease_until=lease_until, updated_at=now
        )

    def _apply_blocker(self, operation: Operation, kind: Blocker, reason: str) -> Flow[Status]:
        """Journal what a blocker means for the operation; return its status."""
        status: Status = "pending"
        if kind == "abandon":
            status = "abandoned"
        elif kind in ("expired", "deadline"):
            status = "needs_reconcile"
        if status != "pending":
            yield SetStatus(operation.operation_id, status, storable_text(reason), self.clock())
        return status

    def profile_for(self, operation: Operation) -> ServerProfile:
        """The profile an operation was journaled under, to read its answers with.

        Its journaled spec (or the built-in it named), read as ``profile_rule`` says;
        a row written before profiles were stored (a bare name that is no built-in) is
        read with the session's profile (the legacy rule). Raises
        `StoredProfileError` rather than guess."""
        return stored_profile(
            operation.profile,
            self.profile,
            self.profile_rule,
            operation_id=operation.operation_id,
            key=operation.key,
        )

    # -- resume ---------------------------------------------------------------------------

    def resume(
        self,
        build: BuildRequest,
        held: Held,
        *,
        dry_run: bool,
        base_url: str | None,
        reconciling: bool,
    ) -> Flow[list[ResumeResult]]:
        """Every pending operation (and needs_reconcile ones for a reconciler), oldest
        first, one after the other: each reported as soon as it is known, all returned
        at the end. (With concurrency, a driver runs `resume_queue` and then
        `resume_operation` for each operation in its own flow.)"""
        results: list[ResumeResult] = []
        for listed in (yield from self.resume_queue(reconciling=reconciling)):
            result = yield from self.resume_operation(
                listed, build, held, dry_run=dry_run, base_url=base_url, reconciling=reconciling
            )
            results.append(result)
        return results

    def resume_queue(self, *, reconciling: bool) -> Flow[list[Operation]]:
        """What resume works through: pending operations (and needs_reconcile ones for a
        reconciler), oldest first."""
        statuses: tuple[Status, ...] = ("pending",)
        if reconciling:
            statuses += ("needs_reconcile",)
        queue: list[Operation] = yield Queue(statuses)
        return queue

    def resume_operation(
        self,
        listed: Operation,
        build: BuildRequest,
        held: Held,
        *,
        dry_run: bool,
        base_url: str | None,
        reconciling: bool,
        claimed_by: str | None = None,
    ) -> Flow[ResumeResult]:
        """Resume one operation of the queue (read again first): send, wait, settle or
        plan it, report the result and return it.

        ``claimed_by``: the owner that leased it for this resume (a resume worker's
        claim); that lease is its own, renewed by compare-and-swap, not raced for."""
        if listed.damaged is not None:
            # Read again, it would raise what the listing turned into this stand-in.
            result = yield from self._unresumable(listed, held, JournalCorruptError(listed.damaged))
            yield Report(result)
            return result
        operation = (yield Find(listed.operation_id, None)) or listed
        try:
            if dry_run:
                result = self.plan(operation)
            else:
                result = yield from self._resume_one(operation, build, held, base_url, claimed_by)
        except UNREADABLE_ROW as error:
            if isinstance(error, IdempotentlyError) and not isinstance(error, CodecError):
                raise
            result = yield from self._unresumable(operation, held, error)
        else:
            if reconciling and not dry_run and result.status == "needs_reconcile":
                result = yield from self.reconcile_one(operation, result)
        yield Report(result)
        return result

    def _unresumable(
        self, operation: Operation, held: Held, error: Exception
    ) -> Flow[ResumeResult]:
        """The one answer to a row that cannot be resumed (a number no float holds, a
        document that is not JSON, a value of the wrong type, from a damaged row or an
        older version): that operation is reported with what is wrong and the others go
        on. Its lease is given back, or its attempt journaled if one had begun."""
        cleanup = held.cleanup()
        held.lease = held.interrupted = None
        if cleanup is not None:
            yield cleanup
        what = storable_text(f"{type(error).__name__}: {error}"[:300])
        if isinstance(cleanup, Record):
            return ResumeResult.of(
                operation,
                cleanup.record.status,
                "still_pending",
                f"its resume stopped while sending ({what}): the request may have been "
                + (
                    "delivered; as an at-most-once operation it is never resent (look it "
                    "up on the server and settle it: `idempotently settle`)"
                    if cleanup.record.status == "abandoned"
                    else "delivered; the next resume finishes it with its key"
                ),
            )
        return ResumeResult.of(
            operation,
            operation.status,
            "not_sent",
            f"its journaled row cannot be resumed ({what}); nothing was sent and it stays "
            f"{operation.status}: `idempotently show {operation.operation_id}` says what is "
            "wrong; repair that row and resume sends it, or record what happened with "
            "`idempotently settle` or `abandon`",
        )

    def reconcile_one(self, operation: Operation, result: ResumeResult) -> Flow[ResumeResult]:
        """Hand a needs_reconcile operation to the reconciler (unless a lookup's backoff
        is still running) and journal its verdict; ``result`` if it decides nothing."""
        if operation.damaged is not None:
            return (
                yield from self._unresumable(
                    operation, Held(), JournalCorruptError(operation.damaged)
                )
            )
        current = (yield Find(operation.operation_id, None)) or operation
        if current.status != "needs_reconcile":
            return ResumeResult.of(current, current.status, "skipped", current.reason)
        if current.unreadable is not None:
            # Without its request no answer can be stored encoded, nor a fork made.
            return ResumeResult.of(
                current, current.status, "skipped", f"not reconciled: {current.unreadable}"
            )
        if (
            current.lookup_after is not None
            and current.lookup_after > self.clock()
            and not (yield from self._deferred_by_a_pause(current))
        ):
            return ResumeResult.of(
                current,
                "needs_reconcile",
                "needs_reconcile",
                f"looked up already; not again before {_iso(current.lookup_after)}",
            )
        plan: ReconcilePlan | None = yield PlanReconcile(current)
        if plan is None:
            return result
        if plan.request is not None:
            deferred = yield from self._lookup_paused(current, plan.request)
            if deferred is not None:
                return deferred
        settlement = yield Reconcile(current, plan.request)
        if isinstance(settlement, Verdict):
            return (yield from self.apply_verdict(current, settlement))
        if settlement is not None and not isinstance(settlement, Settlement):
            raise TypeError(
                f"the reconciler must return an idempotently.Settlement or None, not "
                f"{type(settlement).__name__} (for operation {current.operation_id!r})"
            )
        if settlement is not None:
            return (yield from self._settle(current, settlement, plan.actor))
        return result

    # -- lookups and origin pauses -----------------------------------------------------

    def _lookup_profile(self, operation: Operation) -> ServerProfile:
        """The profile whose ``pause_origin`` a lookup for ``operation`` honours: the
        operation's own (the session's, if its stored one cannot be read)."""
        try:
            return self.profile_for(operation)
        except StoredProfileError:
            return self.profile

    def _lookup_paused(
        self, operation: Operation, request: httpx.Request
    ) -> Flow[ResumeResult | None]:
        """Hold back a lookup whose origin is paused for its credentials: nothing is sent,
        and the operation, still needs_reconcile, is looked up once the pause is over
        (its ``lookup_after``, with an audit entry saying so); None if not paused."""
        now = self.clock()
        pause = yield from self._origin_pause(
            self._lookup_profile(operation), request, now, operation.operation_id
        )
        if pause is None:
            return None
        note = (
            f"not looked up: origin paused until {_iso(pause.until)} ({pause.origin}, "
            f"{pause.reason}); it is looked up after that"
        )
        if operation.lookup_after == pause.until:
            # Deferred to this very pause already: nothing new to journal.
            return ResumeResult.of(operation, "needs_reconcile", "waiting", note)
        yield LookUpLater(
            operation.operation_id,
            pause.until,
            now,
            AuditNote(
                operation.operation_id,
                LOOKUP_ACTOR,
                LOOKUP_DEFERRED,
                note,
                json_text({"origin": pause.origin, "paused_until": pause.until}),
            ),
        )
        return ResumeResult.of(operation, "needs_reconcile", "waiting", note)

    def _deferred_by_a_pause(self, operation: Operation) -> Flow[bool]:
        """Whether the operation's next lookup waits for a pause (its last audit entry a
        deferral), not for a lookup's backoff: then whether the pause still runs is read
        again, so a pause lifted early (`idempotently unpause`) lets it be looked up at
        once."""
        entries = yield AuditTrail(operation.operation_id)
        return bool(entries) and (entries[-1].actor, entries[-1].action) == (
            LOOKUP_ACTOR,
            LOOKUP_DEFERRED,
        )

    def _lookup_answered(
        self, operation: Operation, verdict: Verdict, now: float
    ) -> Flow[float | None]:
        """A lookup answered 429 or 503 with Retry-After pauses its origin, as any answer
        does; returns when the server asked to be asked again (None: it did not)."""
        if verdict.server_wait is None or verdict.status_code is None:
            return None
        request = verdict.request
        if (
            request is not None
            and verdict.status_code in PAUSE_STATUS_CODES
            and verdict.server_wait > 0
            and self._lookup_profile(operation).pause_origin
        ):
            answer = Answer(status_code=verdict.status_code, server_wait=verdict.server_wait)
            yield from self._pause(request, answer, now)
        return now + verdict.server_wait

    def _lookup_after(self, operation: Operation, verdict: Verdict, now: float) -> Flow[float]:
        """When an operation a lookup left unsettled is looked up next: an exponential
        backoff with full jitter, its ceiling doubled for each unsettled lookup in a row
        before this one (counted from its audit trail), capped."""
        entries = yield AuditTrail(operation.operation_id)
        streak = unsettled_lookups(entries) + 1
        return now + jittered(verdict.backoff, verdict.max_backoff, streak, self.rand)

    def reconcile_queue(self) -> Flow[list[Operation]]:
        """The needs_reconcile operations, oldest first (what ``reconcile`` works through)."""
        queue: list[Operation] = yield Queue(("needs_reconcile",))
        return queue

    def apply_verdict(self, operation: Operation, verdict: Verdict) -> Flow[ResumeResult]:
        """Journal a lookup's verdict: settled (succeeded, failed, or failed and forked)
        by one audited compare-and-swap on the row as read, or left needs_reconcile
        with its note and the lookup's backoff."""
        now = self.clock()
        if (
            verdict.outcome in ("failed", "resend")
            and operation.credentials_digest is not None
            and verdict.request is not None
        ):
            # Its key is bound to the credentials it was made with: the server keeps
            # one account's objects apart from another's, so absence seen under other
            # credentials proves nothing (and a fork would charge again).
            differ = yield from self._credentials_differ(operation, verdict.request)
            if differ is not None:
                verdict = attrs.evolve(
                    verdict,
                    outcome="stay",
                    note=(
                        "absent from the lookup, but the lookup was made with other "
                        "credentials than the operation's, so absence proves nothing; look "
                        "it up with the original ones"
                    ),
                )
        if verdict.outcome == "stay":
            lookup_after = yield from self._lookup_after(operation, verdict, now)
            asked = yield from self._lookup_answered(operation, verdict, now)
            if asked is not None:
                lookup_after = max(lookup_after, asked)
            yield LookUpLater(
                operation.operation_id,
                lookup_after,
                now,
                AuditNote(
                    operation.operation_id,
                    LOOKUP_ACTOR,
                    LOOKUP_VERDICT,
                    verdict.note,
                    json_text({"lookup_failed": verdict.lookup_failed}),
                ),
            )
            return ResumeResult.of(operation, "needs_reconcile", "needs_reconcile", verdict.note)
        forks_taken: tuple[str, ...] = ()
        if verdict.outcome == "resend":
            # Never an id another operation holds, nor one an earlier fork had: the
            # operator's fork's rule (`Journal._free_forks`).
            taken: tuple[str, ...] | IdempotentlyError = yield ForksTaken(operation)
            if isinstance(taken, IdempotentlyError):
                return ResumeResult.of(
                    operation, operation.status, "needs_reconcile", taken.message
                )
            forks_taken = taken
        try:
            planned = plan_action(
                "fork" if verdict.outcome == "resend" else "settle",
                operation,
                actor=LOOKUP_ACTOR,
                note=verdict.note,
                now=now,
                lease_alive=operation.lease_owner is not None
                and lease_owner_alive(operation.lease_owner, self.host_id),
                namespace=self.namespace,
                status="succeeded" if verdict.outcome == "found" else "failed",
                key_expiry_margin=self.key_expiry_margin,
                forks_taken=forks_taken,
            )
        except IdempotentlyError as error:
            return ResumeResult.of(operation, operation.status, "needs_reconcile", error.message)
        write = planned.write
        codec = self._codec_of(operation)
        if codec is not None and write.fork is not None:
            # The fork keeps its parent's codec, so its bytes are stored as the parent's
            # are: encoded (``operation`` was read, and so decoded).
            write = attrs.evolve(
                write,
                fork=attrs.evolve(write.fork, request_body=encoded(codec, write.fork.request_body)),
            )
        if verdict.answer is not None:
            write = attrs.evolve(
                write,
                sets_answer=True,
                response_status=verdict.answer_status,
                response_headers=verdict.answer_headers(),
                response_body=(verdict.answer if codec is None else encoded(codec, verdict.answer)),
            )
        if not (yield write):
            return ResumeResult.of(
                operation,
                operation.status,
                "skipped",
                "it changed while it was looked up (another worker or an operator); "
                "nothing was written",
            )
        status: Status = "succeeded" if verdict.outcome == "found" else "failed"
        detail = verdict.note
        if write.fork is not None:
            detail += f"; forked as {write.fork.operation_id}, sent by the next resume"
        return ResumeResult.of(operation, status, "reconciled", detail)

    def plan(self, operation: Operation) -> ResumeResult:
        """What resume would do with this operation, without doing it (dry run)."""
        if operation.status != "pending":
            return ResumeResult.of(operation, operation.status, "would_reconcile", operation.reason)
        blocked = self.blocker(operation, resuming=True)
        if blocked is None:
            try:
                self.profile_for(operation)
            except StoredProfileError as error:
                return ResumeResult.of(operation, "pending", "not_sent", error.message)
            if operation.unreadable is not None:
                return ResumeResult.of(
                    operation,
                    "pending",
                    "not_sent",
                    f"{operation.unreadable}; nothing would be sent",
                )
            missing = self._missing_params(operation)
            if missing:
                return ResumeResult.of(
                    operation, "pending", "not_sent", _missing_params_reason(missing)
                )
            return ResumeResult.of(operation, "pending", "would_send", "would resend its key")
        kind, reason = blocked
        return ResumeResult.of(operation, "pending", RESUME_ACTION_OF_BLOCKER[kind][1], reason)

    def _resume_one(
        self,
        operation: Operation,
        build: BuildRequest,
        held: Held,
        base_url: str | None,
        claimed_by: str | None = None,
    ) -> Flow[ResumeResult]:
        if operation.status != "pending":
            return ResumeResult.of(operation, operation.status, "skipped", operation.reason)
        claimed = claimed_by is not None and operation.lease_owner == claimed_by
        if claimed_by is not None and claimed:
            # Ours: whatever ends this flow early releases it (a blocker's SetStatus does too).
            held.take(operation.operation_id, claimed_by)
        operation = yield from self._times_from_now(operation)
        blocked = self.blocker(operation, resuming=True, claimed_by=claimed_by)
        if blocked is not None:
            kind, reason = blocked
            status = yield from self._apply_blocker(operation, kind, reason)
            return ResumeResult.of(operation, status, RESUME_ACTION_OF_BLOCKER[kind][0], reason)
        try:
            profile = self.profile_for(operation)
        except StoredProfileError as error:
            return ResumeResult.of(operation, "pending", "not_sent", error.message)
        if operation.unreadable is not None:
            return ResumeResult.of(
                operation,
                "pending",
                "not_sent",
                f"{operation.unreadable}; nothing was sent and it stays pending",
            )
        try:
            request = self.rebuild(operation, build, base_url=base_url)
        except MissingParams as missing:
            return ResumeResult.of(
                operation, "pending", "not_sent", _missing_params_reason(missing.names)
            )
        except (httpx.HTTPError, ValueError, TypeError) as error:
            return ResumeResult.of(
                operation,
                "pending",
                "not_sent",
                f"the journaled request cannot be rebuilt ({type(error).__name__}): it keeps "
                f"its state; see `idempotently show {operation.operation_id}`",
            )
        budget = self.policy.budget
        if budget is not None:
            # What the origin's retries have met so far in this process: nothing but
            # failures (the budget spent). A resume then leaves the rest of that origin's
            # operations pending instead of trying every one in turn.
            origin = origin_of(request.url)
            if self.budgets.spent(budget, origin, self.clock()):
                return ResumeResult.of(
                    operation,
                    "pending",
                    "still_pending",
                    f"not sent: the retry budget of {origin} is spent (its recent retries "
                    "met only failures); it stays pending with its key for a later resume",
                )
        secrets = secret_values(request.headers, self.redact_headers, request.url)
        pause = yield from self._origin_pause(
            profile, request, self.clock(), operation.operation_id
        )
        if pause is not None:
            # still_pending, not waiting (a not_before of its own): a watch worker parks
            # it with its backoff instead of claiming it again at once.
            return ResumeResult.of(
                operation,
                "pending",
                "still_pending",
                f"not sent: {pause.origin} is paused until {_iso(pause.until)} "
                f"({pause.reason}); it stays pending with its key",
            )
        engine = self
        if operation.overrides is not None:
            # The caller's own policy and timeouts, as journaled with the operation.
            try:
                policy, timeouts = read_overrides(operation.overrides)
            except ValueError as error:
                return ResumeResult.of(
                    operation,
                    "pending",
                    "not_sent",
                    f"{error}; nothing was sent and it stays pending (see "
                    f"`idempotently show {operation.operation_id}`)",
                )
            # Within this run's bounds (a resume's --max-attempts and --deadline bound
            # each operation, so a dead host costs what the run allows): the stricter of
            # the two. The journaled timeouts stay: the deadline caps every attempt's.
            if policy is not None:
                policy = attrs.evolve(
                    policy,
                    max_attempts=min(policy.max_attempts, self.policy.max_attempts),
                    deadline=min(policy.deadline, self.policy.deadline),
                )
            engine = self.overridden(policy, None)
            if timeouts is not None:
                request.extensions = {**request.extensions, "timeout": timeouts}
        # A claimed lease is renewed by the same compare-and-swap on the row just read:
        # it fails only if the claim expired and another caller took the operation.
        owner = claimed_by if claimed_by is not None and claimed else self.new_owner()
        now = self.clock()
        held.take(operation.operation_id, owner)
        held.lease_until = now + self.lease_duration
        if not (yield TakeLease(operation, owner, held.lease_until, now)):
            held.lease = None
            return ResumeResult.of(
                operation, "pending", "leased", "another caller took its lease first"
            )
        end = yield from engine._attempts(
            operation.operation_id,
            operation.key,
            request,
            self._state_of(operation, now, resuming=True),
            profile,
            operation.attempt_count,
            held,
            secrets,
            self._codec_of(operation),
            binding=operation.credentials_digest,
        )
        decision = end.decision
        code = None if end.response is None else end.response.status_code
        replayed = bool(end.response is not None and end.response.extensions[EXTENSION].replayed)
        detail = decision.reason
        if decision.action == "succeed" and replayed:
            detail += " (replayed by the server)"
        if end.unkept is not None:
            detail += f"; {end.unkept}"
        return ResumeResult.of(
            operation,
            STATUS_AFTER[decision.action],
            RESUME_ACTION_OF[decision.action],  # never "retry": the attempts end otherwise
            detail,
            code,
            replayed,
        )

    def _settle(
        self, operation: Operation, settlement: Settlement, actor: str
    ) -> Flow[ResumeResult]:
        """Journal a reconciler's Settlement as an operator's settle is journaled: one
        compare-and-swap on the row as read, with its audit entry (``actor`` names the
        reconciler), in one transaction; refused as an operator's would be."""
        now = self.clock()
        note = storable_text(f"{settlement.note}")
        try:
            planned = plan_action(
                "settle",
                operation,
                actor=actor,
                note=note,
                now=now,
                lease_alive=operation.lease_owner is not None
                and lease_owner_alive(operation.lease_owner, self.host_id),
                namespace=self.namespace,
                status=settlement.status,
                key_expiry_margin=self.key_expiry_margin,
            )
        except IdempotentlyError as error:
            return ResumeResult.of(operation, operation.status, "needs_reconcile", error.message)
        response = settlement.response
        codec = self._codec_of(operation)
        write = attrs.evolve(
            planned.write,
            reason=f"reconciled: {note}",
            sets_answer=True,
            response_status=None if response is None else response.status_code,
            response_headers=None
            if response is None
            else journaled_answer_headers(
                response.headers, self.redact_headers, self.secret_params
            ),
            response_body=None
            if response is None
            else (response.content if codec is None else encoded(codec, response.content)),
        )
        if not (yield write):
            return ResumeResult.of(
                operation,
                operation.status,
                "skipped",
                "it changed while the reconciler looked at it (another worker or an "
                "operator); nothing was written",
            )
        return ResumeResult.of(
            operation,
            settlement.status,
            "reconciled",
            settlement.note,
            None if response is None else response.status_code,
        )

    # -- requests and answers from the journal ------------------------------------------------

    def rebuild(
        self,
        operation: Operation,
        build: BuildRequest,
        *,
        live: httpx.Request | None = None,
        base_url: str | None = None,
        strict: bool = True,
    ) -> httpx.Request:
        """The journaled request, byte for byte, with live credentials re-applied (and
        the values of its redacted query parameters: `MissingParams` if one has
        none, unless not ``strict``: a request that is not to be sent).

        ``base_url`` moves it to another origin (scheme, host, port), keeping path and query.
        """
        url = httpx.URL(operation.url)
        if base_url is not None:
            base = httpx.URL(base_url)
            url = url.copy_with(scheme=base.scheme, host=base.host, port=base.port)
        if operation.secret_params:
            # Redacted in the journal: the live request's values, else the session's.
            names = json.loads(operation.secret_params)
            source = values_in_url(live.url) if live is not None else self.param_values
            try:
                url = reapplied_url(url, names, source or (lambda name: None))
            except MissingParams:
                if strict:
                    raise
        if live is not None and live.url.userinfo and live.url.host == url.host:
            url = url.copy_with(username=live.url.username, password=live.url.password)
        headers = [
            (name.encode("latin-1"), value.encode("latin-1"))
            for name, value in operation.request_headers
        ]
        if live is not None:
            # The live request's credentials, as the bytes it carries (latin-1 included).
            headers.extend(
                (raw_name, raw_value)
                for raw_name, raw_value in live.headers.raw
                if raw_name.decode("latin-1").lower() in self.redact_headers
            )
        return build(operation.method, url, headers, operation.request_body)

    def stored_response(self, operation: Operation, build: BuildRequest) -> httpx.Response:
        """The stored answer of a finished operation, or the error that ended it."""
        ids = _ids(operation)
        if operation.status == "needs_reconcile":
            raise NeedsReconcileError(
                f"operation needs reconciling ({operation.reason}); it is never resent: look "
                "it up on the server and settle it with Session.resume(reconciler=...) or "
                "`idempotently reconcile --lookup URL` (or `idempotently settle`), see "
                f"`idempotently show {operation.operation_id}`",
                **ids,
            )
        if operation.status == "abandoned":
            raise OperationAbandonedError(
                f"operation was abandoned ({operation.reason}); it is never sent again: check "
                "whether it arrived, and use a new operation_id to send it once more",
                **ids,
            )
        if (
            operation.response_status is not None
            and operation.response_body is None
            and operation.status in ("succeeded", "failed")
        ):
            # Its answer's body was too large (or too slow) to keep: only its status was.
            raise AnswerNotReadError(
                f"operation {operation.status} with the server's {operation.response_status} "
                f"answer ({operation.reason}); there is no whole response to return. It is "
                "never sent again: look the object up on the server",
                **ids,
            )
        if operation.response_status is None and operation.status == "succeeded":
            raise NoStoredAnswerError(
                f"operation succeeded ({operation.reason}), but no answer of the server is "
                "stored, so there is no response to return; it is never sent again: look the "
                "object up on the server",
                **ids,
            )
        if operation.response_status is None and (operation.reason or "").startswith(
            SETTLED_REASONS
        ):
            # Settled failed by an operator or a reconciler, not by an answer.
            raise RequestNotSentError(
                f"operation was settled failed ({operation.reason}); it is never sent again: "
                "send it under a new operation_id (or `idempotently fork` it)",
                **ids,
            )
        if operation.response_status is None:
            raise RequestNotSentError(
                f"operation failed before anything reached the server ({operation.reason}); "
                "fix the request and send it under a new operation_id",
                **ids,
            )
        response = httpx.Response(
            operation.response_status,
            headers=[
                (name.encode("latin-1"), value.encode("latin-1"))
                for name, value in operation.response_headers or ()
            ],
            content=operation.response_body or b"",
            request=self.rebuild(operation, build, strict=False),
        )
        response.extensions = {
            **response.extensions,
            EXTENSION: Receipt(
                operation_id=operation.operation_id,
                key=operation.key,
                attempts=operation.attempt_count,
                replayed=False,
                replayed_locally=True,
                answered_by=answered_by(operation),
            ),
        }
        return response


def _missing_params_reason(names: Sequence[str]) -> str:
    listed = ", ".join(repr(name) for name in names)
    return (
        f"the secret query parameter{'s' if len(names) > 1 else ''} {listed} "
        f"{'were' if len(names) > 1 else 'was'} journaled redacted and this resume has no "
        "value for it: give the session's client params={...} with it, or "
        "`idempotently resume --param-env NAME=ENVVAR` (or call again with the same "
        "operation_id and the full URL); nothing was sent and it stays pending"
    )


def _blocker_error(operation: Operation, kind: Blocker, reason: str) -> IdempotentlyError:
    ids = _ids(operation)
    if kind == "waiting" and operation.not_before is not None:
        return RetryLaterError(f"{reason}; {RESUME_HINT}", not_before=operation.not_before, **ids)
    if kind == "abandon":
        return OperationAbandonedError(f"{reason}; {ABANDON_HINT}", **ids)
    if kind == "leased":
        return OperationInProgressError(reason, **ids)
    return NeedsReconcileError(f"{reason}; {RECONCILE_HINT}", **ids)


def _sent(reply: httpx.Response | httpx.TransportError, request: httpx.Request) -> httpx.Request:
    """The request ``reply`` answers (or failed to send), as it left (``request`` if the
    transport did not say)."""
    try:
        return reply.request
    except RuntimeError:
        return request


def _ids(operation: Operation) -> ErrorContext:
    return {"operation_id": operation.operation_id, "key": operation.key}


def _iso(timestamp: float) -> str:
    try:
        moment = datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return f"{timestamp:g} (seconds since the epoch)"
    return moment.isoformat(timespec="seconds")
