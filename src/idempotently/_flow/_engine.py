"""The engine: a Session's or Transport's configuration with one call's path (journal the
operation, then attempt until the decision settles), shared by calls and resume.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import httpx

from idempotently._answers import RETRIED_ANSWER_BYTES, AnswerBody
from idempotently._budget import origin_of
from idempotently._codec import Codec, body_digest, encoded
from idempotently._commands import (
    Discard,
    Emit,
    Find,
    Insert,
    PauseOrigin,
    Pauses,
    ReadAnswer,
    RebasePause,
    Record,
    RenewLease,
    Send,
    Sleep,
    TakeLease,
)
from idempotently._credentials import (
    credential_names,
    credential_values,
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
    OperationAbandonedError,
    OperationInProgressError,
    OperationPendingError,
    RequestNotSentError,
    RetryBudgetError,
    RetryLaterError,
)
from idempotently._flow._config import Config
from idempotently._flow._operation import (
    ABANDON_HINT,
    EXTENSION,
    RECONCILE_HINT,
    BuildRequest,
    Call,
    End,
    Flow,
    Held,
    Receipt,
    _blocker_error,
    _ids,
    _iso,
    apply_blocker,
    blocker_of,
    codec_of,
    profile_for,
    rebuild,
    state_of,
    stored_response,
    times_from_now,
)
from idempotently._gate import Gate, GateRefusal, binding_differs
from idempotently._hooks import heard
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
    request_digest,
    same_body,
    stored_header,
)
from idempotently._pauses import (
    PAUSE_STATUS_CODES,
    REFRESH,
    after_attempt,
    credentials_digest,
    is_breaker,
    is_probing,
    probe_claim,
)
from idempotently._policy import (
    Answer,
    CallState,
    Failure,
    RetryPolicy,
    Signal,
    breaker_refused,
    capped_timeouts,
    classify,
    classify_error,
    decide,
    longest_timeout,
    may_be_retried,
    origin_wait,
    refused,
)
from idempotently._profiles import (
    ServerProfile,
    journaled_profile,
)
from idempotently._rows import AttemptRecord, NewOperation, Operation, OriginPause
from idempotently._secret_params import (
    journaled_answer_headers,
    redacted_url,
)
from idempotently._text import storable, storable_text
from idempotently._vocabulary import STATUS_AFTER, finished_level

if TYPE_CHECKING:
    from idempotently._breaker import Breaker
    from idempotently._events import Event
    from idempotently._pauses import BreakerStep

_INFINITY = float("inf")


# A second caller of an operation in flight looks again after these waits.
_FIRST_POLL = 0.01


_MAX_POLL = 0.25


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


def _sent(reply: httpx.Response | httpx.TransportError, request: httpx.Request) -> httpx.Request:
    """The request ``reply`` answers (or failed to send), as it left (``request`` if the
    transport did not say)."""
    try:
        return reply.request
    except RuntimeError:
        return request


class Engine(Config):
    """One Session's or Transport's configuration (`Config`) with one call's path: the
    flows of the other use cases are functions taking the engine."""

    # No attrs decorator: Engine adds methods, no fields, so Config's generated methods
    # (and fields, for attrs.evolve) serve it as they are; decorating it again made
    # attrs generate and compile them a second time at import (6 M instructions).
    __slots__ = ()

    def resuming(self) -> Engine:
        """This engine as a resume sends with: a resume meets dead origins more than any
        call (that is what it is for), so it always runs with a circuit breaker, its
        policy's or `Breaker`'s defaults, built once per engine (not per operation)."""
        if self.policy.breaker is not None:
            return self
        made: Engine | None = self._resuming
        if made is None:
            from idempotently._breaker import Breaker

            made = self.overridden(attrs.evolve(self.policy, breaker=Breaker()), None)
            self._resuming = made
        return made

    def overridden(self, policy: RetryPolicy | None, profile: ServerProfile | None) -> Engine:
        """This engine for one call with its own policy or profile (itself without)."""
        if policy is None and profile is None:
            return self
        return attrs.evolve(
            self,
            policy=self.policy if policy is None else policy,
            profile=self.profile if profile is None else profile,
        )

    def read_request(self, request: httpx.Request) -> tuple[RequestHeaders, str]:
        """The request's headers as the journal sees them, and its digest: one reading
        for a call and an enqueue, so the two journal the same request alike."""
        attempt_header = self.profile.attempt_header
        if attempt_header is not None and attempt_header in request.headers:
            # Set by the flow on each send: a caller's value is neither journaled nor
            # fingerprinted, and is replaced (`_attempt_header`).
            del request.headers[attempt_header]
        headers = read_request_headers(
            request.headers,
            self.redact_headers,
            request.url,
            self.fingerprint_headers,
            self.profile.key_header,
        )
        return headers, request_digest(request.method, request.url, headers.fingerprinted)

    def call(self, call: Call, build: BuildRequest, held: Held) -> Flow[httpx.Response]:
        """`_call`, and the half-open breaker's probe handed back if the call took it but
        sent nothing (`release_probe`)."""
        try:
            response = yield from self._call(call, build, held)
        except Exception:
            if self.pauses.probes:
                # The call's own error is the one raised: a journal that failed the call
                # fails the hand-back too, and the claim then simply expires.
                with contextlib.suppress(Exception):
                    yield from self.release_probe(call.request)
            raise
        if self.pauses.probes:
            yield from self.release_probe(call.request)
        return response

    def release_probe(self, request: httpx.Request) -> Flow[None]:
        """A probe claimed (`_half_open`) whose attempt never reported to the breaker (an
        operation answered from the journal, a refusal before sending, an attempt that
        never left): its claim is handed back as the ended breaker it was, so the next
        caller probes at once instead of the whole fleet waiting the claim out."""
        from idempotently._commands_rare import SwapPause
        from idempotently._pauses import open_length, opened_reason

        scope = (origin_of(request.url), self._pause_scope(request))
        probe = self.pauses.probes.pop(scope, None)
        if probe is None:
            return
        now = self.clock()
        ended = OriginPause(
            probe.origin,
            probe.credentials,
            now,
            opened_reason(open_length(probe), "its probe was not sent"),
            now,
        )
        row: OriginPause | None = yield SwapPause(
            probe.origin, probe.credentials, probe.reason or "", None, ended
        )
        if row is None:
            self.pauses.remove_pause(probe)
        else:
            self.pauses.add(row)  # the next caller here claims it at once

    def _call(self, call: Call, build: BuildRequest, held: Held) -> Flow[httpx.Response]:
        """Journal the operation (or find it), then attempt until the decision settles.

        Returns the final answer (2xx, 3xx, a final 4xx, or the stored answer of a
        settled operation), or raises what the end means.
        """
        started = self.clock()
        request = call.request
        headers, print_ = self.read_request(request)
        secrets = headers.secrets
        pause = yield from self.origin_pause(self.profile, request, started, call.operation_id)
        if pause is not None:
            key = call.key
            if key is None and call.operation_id is not None and self.namespace is not None:
                key = derived_key(self.namespace, call.operation_id)
            yield from self.wait_out(
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
        followed: set[str] | None = None  # the forked steps' ids this call went past
        while True:
            operation = (
                (yield Find(call.operation_id, call.key or taken_key))
                if named and not insert_first
                else None
            )
            if operation is None:
                if call.group is not None and taken_key is not None:
                    # The step's insert found no row of its own: an earlier step of its
                    # group has not succeeded (nothing journaled, nothing sent).
                    from idempotently._flow import _groups

                    yield from _groups.refuse(
                        self, call.group, call.operation_id or "", taken_key, None
                    )
                    raise _groups.unjournaled(call.group, call.operation_id or "", taken_key)
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
                new, owner = self.new_operation(call, print_, headers, now)
                # Held before the write: a call stopped while the write runs releases
                # whatever it got (a release of a lease it did not get changes nothing).
                held.take(new.operation_id, owner)
                held.lease_until = now + self.lease_duration
                if (yield Insert(new, owner, held.lease_until)):
                    state = CallState(
                        started_at=started, deadline_at=call.deadline_at, delivery=call.delivery
                    )
                    end = yield from self.attempts(
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
            self.check_same(operation, call, print_)
            if operation.successor is not None:
                # A forked group step: its fork took its place in the group.
                followed = {operation.operation_id} | (followed or set())
                if operation.successor in followed:
                    # A damaged link that leads back would be followed forever.
                    raise JournalCorruptError(
                        f"the successor of step {operation.operation_id!r} "
                        f"({storable_text(operation.successor)!r}) leads back to a step "
                        "already followed: its row is damaged; nothing was sent. Look at "
                        "the group with `idempotently show`, then repair or abandon it",
                        **_ids(operation),
                    )
                call = attrs.evolve(call, operation_id=operation.successor, key=None)
                taken_key, insert_first = None, False
                continue
            if operation.status != "pending":
                return stored_response(self, operation, build)
            profile_for(self, operation)  # one that cannot be read is an error: nothing sent
            sending = self
            if operation.overrides is not None:
                # A cap its first call journaled binds a call again too (the stricter);
                # read before the lease is taken: overrides that cannot be read send nothing.
                sending = _with_journaled_cap(self, operation, operation.overrides)
            operation = yield from times_from_now(self, operation)
            blocker = blocker_of(self, operation)
            if blocker is not None and blocker[0] != "leased":
                yield from apply_blocker(self, operation, blocker[0], blocker[1])
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
                if operation.group_id is not None:
                    # Refused for an earlier step of its group that has not succeeded?
                    from idempotently._flow import _groups

                    yield from _groups.refuse(
                        self,
                        operation.group_id,
                        operation.operation_id,
                        operation.key,
                        operation.step,
                    )
                # Another thread, task or process is sending it (or took the lease
                # between our read and our swap): wait for its answer.
                if self.clock() + poll > min(wait_until, operation.deadline_at or wait_until):
                    reason = blocker[1] if blocker else "another caller took its lease first"
                    raise OperationInProgressError(reason, **_ids(operation))
                yield Sleep(poll)
                poll = min(poll * 2, _MAX_POLL)
                continue
            end = yield from sending.attempts(
                operation.operation_id,
                operation.key,
                rebuild(self, operation, build, live=request),
                state_of(self, operation, started, resuming=False),
                profile_for(self, operation),
                operation.attempt_count,
                held,
                secrets,
                codec_of(self, operation),
                binding=operation.credentials_digest,
                journaled=operation,
            )
            return self._finish(end)

    def new_operation(
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
        if call.group is not None:
            new = attrs.evolve(new, group_id=call.group, in_order=True)
        return new, self.new_owner()

    def _salt(self) -> bytes:
        return b"" if self.namespace is None else self.namespace.bytes

    def credentials_differ(self, operation: Operation, request: httpx.Request) -> Flow[str | None]:
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

    def check_same(self, operation: Operation, call: Call, print_: str) -> None:
        """Raise `KeyReuseError` unless ``call`` is the journaled operation again."""
        ids = _ids(operation)
        if call.operation_id is not None and operation.operation_id != call.operation_id:
            raise KeyReuseError(
                f"the idempotency key {operation.key!r} already belongs to operation "
                f"{operation.operation_id!r}, not {call.operation_id!r} (was it passed as "
                "idempotency_key for another operation?); use a new key for a new operation",
                **ids,
            )
        if call.group is not None and operation.group_id != call.group:
            # Else the step is sent (or answered) outside its group's order: a later
            # step would go out after it failed, or while it is in flight.
            raise KeyReuseError(
                f"operation {operation.operation_id!r} is journaled outside group "
                f"{call.group!r}, so it cannot be that group's step; nothing was sent. "
                "Give the group another id (or the lone operation another operation_id)",
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
            from idempotently._differences import first_difference, shown_url

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
        if decision.cap_reason is not None:
            from idempotently._exceptions import attempts_cap_error

            raise attempts_cap_error(
                STATUS_AFTER[action], decision.reason, decision.cap_reason, ids
            ) from end.error
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

    def attempts(
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
        journaled: Operation | None = None,
    ) -> Flow[End]:
        """Send until the decision is anything but a retry; journal every attempt.

        ``binding`` is the credentials record the operation's key is bound to (None: not
        bound yet, or its profile does not bind keys): each attempt's request is checked
        by its `Gate` as it leaves, after the client's request hooks and auth flow.
        ``journaled``: the operation as read (None: new), whose attempts count towards
        the policy's ``max_total_attempts``."""
        cap = self.policy.max_total_attempts
        # Attempts that reached the server (answered or maybe delivered), counted from the
        # journal across processes: what the cap bounds and what the attempt header numbers.
        counted = 0
        count = cap is not None or profile.attempt_header is not None
        unseen = False  # the row may hide an attempt: never failed at the cap
        if count:
            from idempotently._flow import _cap

            counted = yield from _cap.journaled_count(operation_id, journaled)
            unseen = cap is not None and _cap.unrecorded(journaled, held)
            if cap is not None and counted >= cap:
                return (
                    yield from _cap.before_send(
                        self, operation_id, key, state, cap, counted, held, attempts, unseen
                    )
                )
        owner = held.lease[1] if held.lease is not None else None
        lease = None if owner is None else self.lease(operation_id, owner)  # one per call
        # A key the journal holds as bound stays bound, whatever profile resends it
        # (`--force-profile`, a damaged row): its digest is checked, never ignored.
        bind = profile.key_bound_to_credentials or binding is not None
        # Unbound, on a client where nothing can change the request on its way out, an
        # attempt needs no gate: asked again before every attempt.
        quiet = None if bind else self.quiet_client
        gate: Gate | None = None
        began = self.clock()
        # Events are built only when a hook or the logger would see them (``heard``).
        hooks = self.hooks
        if heard(hooks, logging.DEBUG):
            # The events load with the first one made (`heard`: hooks, or a logger that
            # listens), not with the package.
            from idempotently import _events

            yield from self._emit(
                _events.OperationStarted(
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
        breaker = self.policy.breaker if profile.pause_origin else None
        first = True
        limit = self.time_limit(state)
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
            # Asked as each attempt leaves, not once per call: a hook or an auth given to
            # the client while the call waited (a retry's wait, an event hook, another
            # thread) is checked like any other. Once gated, the call stays gated.
            if gate is None and (quiet is None or not quiet()):
                gate = Gate(
                    request,
                    operation_id=operation_id,
                    key=key,
                    key_header=profile.key_header,
                    bind=bind,
                    binding=binding,
                    owner=owner,
                    salt=self._salt(),
                    redact_headers=self.redact_headers,
                    secret_params=self.secret_params,
                    # The attempt header the flow sets is no change to refuse, even where
                    # this session fingerprints it (a stored profile may name one).
                    fingerprint_headers=[
                        name
                        for name in self.fingerprint_headers
                        if name.lower() != (profile.attempt_header or "").lower()
                    ],
                )
            if gate is not None:
                gate.passes = 0
            if profile.attempt_header is not None:
                from idempotently._attempt_header import mark_attempt

                mark_attempt(request, profile.attempt_header, counted + 1, self.policy)
            reply = yield Send(request, lease, reading, gate)
            if gate is None and quiet is not None and not quiet():
                # A hook or auth was given to the client while this request was sent
                # (another thread): it may have run on it after the journal saw it.
                reply = yield from self._unvouched(reply, reading)
            elif gate is not None and isinstance(reply, (httpx.Response, httpx.TransportError)):
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
            if count:
                counted += signal.outcome != "not_sent"
                if cap is not None and counted >= cap and decision.action in _cap.GOES_ON:
                    decision = _cap.at_cap(
                        decision.state, cap, counted, decision.reason, unseen=unseen
                    )
            step = None
            if breaker is not None or self.pauses.probes:
                if breaker is not None and decision.action == "retry":
                    # Another process may have opened it meanwhile: its row, not our count.
                    yield from self.fresh_pauses(now, operation_id)
                step = self.breaker_step(request, signal, now, breaker)
                if step is not None and step.pause is not None and decision.action == "retry":
                    decision = breaker_refused(decision, step.pause)
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
                cap_reason=decision.cap_reason,
            )
            yield Record(operation_id, record, now, owner, key)
            if step is not None and step.write is not None:
                yield step.write
                if step.change is not None and heard(hooks, logging.INFO):
                    from idempotently import _events

                    yield from self._emit(
                        _events.BreakerChanged(
                            operation_id=operation_id,
                            key=key,
                            origin=origin_of(request.url),
                            change=step.change,
                            until=None if step.pause is None else step.pause.until,
                            reason=(
                                "its probe was answered"
                                if step.pause is None
                                else step.pause.reason or ""
                            ),
                        )
                    )
            if (
                answer is not None
                and (
                    answer.quota is not None
                    or (answer.server_wait and answer.status_code in PAUSE_STATUS_CODES)
                )
                and profile.pause_origin
            ):
                paused_until = yield from self.pause(request, answer, now)
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
                from idempotently import _events

                yield from self._emit(
                    _events.AttemptFinished(
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
                from idempotently import _events

                yield from self._emit(
                    _events.RetryRefused(
                        operation_id=operation_id,
                        key=key,
                        attempt=attempts,
                        origin=decision.refused_by,
                        reason=decision.reason,
                    )
                )
            if retrying:
                from idempotently import _events

                yield from self._emit(
                    _events.RetryScheduled(
                        operation_id=operation_id,
                        key=key,
                        attempt=attempts,
                        wait=decision.wait,
                        reason=decision.reason,
                    )
                )
                yield from self.sleep_on(profile, request, decision.wait, paused_until)
                continue
            if heard(hooks, finished_level(record.status)):
                from idempotently import _events

                yield from self._emit(
                    _events.OperationFinished(
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

    def _unvouched(
        self, reply: httpx.Response | BaseException, reading: _Reading
    ) -> Flow[BaseException]:
        """An attempt sent unchecked while a request hook or ``auth`` was being added to
        its client: whatever came back, the journal cannot vouch for what left under the
        key, so the attempt is maybe delivered and the operation stays pending."""
        if isinstance(reply, httpx.Response):
            yield Discard(reply, reading.body)
        return GateRefusal(
            "a request hook or auth flow was given to the client while this request was "
            "being sent, so it may have changed the request after the journal recorded it "
            "and the server may have got under this key a request the journal cannot vouch "
            "for: it may have been delivered, and the operation stays pending with its key",
            outcome="maybe_delivered",
        )

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

    def origin_pause(
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
            yield from self.fresh_pauses(now, operation_id)
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
            pause = rebased if rebased.until > now or is_breaker(rebased) else None
        if pause is not None and pause.until <= now:
            # A circuit breaker's pause that ended: half-open (`_pauses.probe_claim`).
            pause = yield from self._half_open(pause, request, now)
        if pause is not None and is_probing(pause):
            # Another caller's probe is in flight: wait for its answer a second at a
            # time, as long as this call may wait, never refused for the claim's length
            # (which covers the probe's whole timeout, longer than most calls wait).
            pause = attrs.evolve(pause, until=min(pause.until, now + REFRESH))
        return pause

    def fresh_pauses(self, now: float, operation_id: str | None = None) -> Flow[None]:
        """The journal's pauses read again if the board's last read is over a second old."""
        board = self.pauses
        if board.stale(now):
            # One flow reads for all: the others go on with what was read last meanwhile.
            board.read_at = now
            board.replace((yield Pauses(now, operation_id)), now)

    def _half_open(
        self, pause: OriginPause, request: httpx.Request, now: float
    ) -> Flow[OriginPause | None]:
        """Claim the one probe of a half-open breaker by a compare-and-swap on its row:
        None when this caller sends it (or the breaker closed meanwhile), else the pause
        the others keep waiting on."""
        hold = min(longest_timeout(request.extensions.get("timeout")), self.policy.max_retry_after)
        board, claim = self.pauses, probe_claim(pause, now, hold, self.policy.max_retry_after)
        row: OriginPause | None = yield claim
        if row is None:
            board.remove_pause(pause)
            return None
        board.add(row)
        if row == claim.new:
            board.probes[(row.origin, row.credentials)] = row
            return None
        # Another caller's probe (or, its claim's reply racing ours, a swap under way):
        # look again after a slice of waiting, as at the board's next read.
        return row if row.until > now else attrs.evolve(row, until=now + REFRESH)

    def breaker_step(
        self, request: httpx.Request, signal: Signal, now: float, breaker: Breaker | None
    ) -> BreakerStep | None:
        """What one attempt's outcome does to its origin's circuit breaker (`_pauses`):
        a network error or a 5xx without Retry-After counts as a failure, any other
        answer as the origin answering; an attempt that never left counts as neither."""
        if isinstance(signal, Answer):
            failed = signal.status_code >= 500 and not signal.server_wait
            if not failed and not self.pauses.failing and not self.pauses.probes:
                return None  # the happy path: no failure counted, no probe held
            failure = f"answered {signal.status_code}" if failed else None
        elif signal.unsendable or signal.refused or signal.unreadable:
            return None
        else:
            failure = f"failed ({signal.text.split(':', 1)[0]})"
        return after_attempt(
            self.pauses,
            breaker,
            origin_of(request.url),
            self._pause_scope(request),
            failure,
            now,
            self.policy.max_retry_after,
        )

    def _pause_scope(self, request: httpx.Request) -> str:
        """The digest of the request's credentials a pause is scoped to: the same
        credentials (`credential_names`) a key bound to credentials is bound to."""
        names = credential_names(request, self.redact_headers, self.secret_params)
        values = credential_values(request, names)
        return credentials_digest(self.namespace, [value.decode("latin-1") for value in values])

    def wait_out(
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
        limit = self.time_limit(CallState(started_at=now, deadline_at=deadline_at))
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
            current = yield from self.origin_pause(profile, request, now, operation_id)

    def sleep_on(
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
            if now < paused_until and (yield from self.origin_pause(profile, request, now)) is None:
                return

    def pause(self, request: httpx.Request, answer: Answer, now: float) -> Flow[float | None]:
        """Journal the pause an answer (to a call, a read or a lookup) asks of its whole
        origin: a 429 or 503 with Retry-After, or a request quota its trusted rate-limit
        headers say is spent (`_policy.origin_wait`); None when it asks none."""
        asked = origin_wait(answer, self.policy.max_retry_after)
        if asked is None:
            return None
        wait, reason = asked
        pause = OriginPause(
            origin=origin_of(request.url),
            credentials=self._pause_scope(request),
            until=now + wait,
            reason=reason,
            set_at=now,
        )
        yield PauseOrigin(pause.origin, pause.credentials, pause.until, pause.reason or "", now)
        self.pauses.add(pause)
        return pause.until

    def time_limit(self, state: CallState) -> float | None:
        """When this call's attempts must be over: its policy's deadline (unless a custom
        ``stop=`` replaced it) or the operation's own deadline, whichever comes first."""
        limits = [] if self.policy.stop is not None else [state.started_at + self.policy.deadline]
        if state.deadline_at is not None:
            limits.append(state.deadline_at)
        return min(limits) if limits else None

    def _emit(self, event: Event) -> Flow[None]:
        """Log ``event``; hand it to the hooks, if there are any (through the driver)."""
        from idempotently._events import log

        log(event)
        if self.hooks:
            yield Emit(event, self.hooks)


def _with_journaled_cap(engine: Engine, operation: Operation, overrides: str) -> Engine:
    """``engine`` for a call again of an operation whose ``overrides`` journaled a cap:
    under the stricter of that cap and its own. Overrides that cannot be read may hold
    a cap: nothing is sent (as a resume does), a JournalCorruptError says why."""
    from idempotently._flow._cap import stricter
    from idempotently._overrides import read_overrides

    try:
        policy, _ = read_overrides(overrides)
    except ValueError as error:
        raise JournalCorruptError(
            f"{error}: it may hold a cap on attempts this call would send past, so nothing "
            "was sent and the operation stays pending (see `idempotently show "
            f"{operation.operation_id}`; fork it to send it under a new key)",
            operation_id=operation.operation_id,
            key=operation.key,
        ) from None
    own = engine.policy.max_total_attempts
    cap = stricter(None if policy is None else policy.max_total_attempts, own)
    if cap == own:
        return engine
    return engine.overridden(attrs.evolve(engine.policy, max_total_attempts=cap), None)
