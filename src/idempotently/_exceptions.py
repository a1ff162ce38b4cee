"""Every error idempotently raises, under one root.

    IdempotentlyError
    ├── JournalError                  the journal file cannot be used
    │   ├── JournalMissingError       no journal at that path
    │   ├── JournalVersionError       written by a newer idempotently
    │   ├── JournalCorruptError       not a journal, or damaged
    │   ├── JournalMovedError         deleted or replaced while open
    │   ├── JournalWriteError         disk full, read-only, locked
    │   └── CodecError                stored bodies cannot be encoded or decoded here
    ├── KeyReuseError (ValueError)    same operation id, different request
    ├── InvalidKeyError (ValueError)  key rejected by the server profile
    ├── OperationInProgressError      another live caller holds the lease
    ├── RequestNotSentError           the request cannot be sent (bad URL, illegal header,
    │                                 a hook changed it after it was journaled)
    ├── OperationPendingError         retries ran out, outcome unknown
    │   ├── RetryLaterError           the server asked us to come back later
    │   ├── RetryBudgetError          the origin's retry budget refused the retry
    │   └── CredentialsMismatchError  the key is bound to other credentials
    ├── NeedsReconcileError           only a human or a reconciler can decide
    ├── StoredProfileError            the profile it was journaled under cannot be used
    ├── OperatorActionError (ValueError)  an operator action that makes no sense now
    ├── NoStoredAnswerError           settled succeeded, but no answer of the server kept
    │   └── AnswerNotReadError        settled by its answer's status; its body not read whole
    ├── OperationAbandonedError       at-most-once: maybe sent, never resent
    └── GroupStoppedError             an earlier step of its group failed or was abandoned

Transport errors from httpx come through as the ``__cause__`` of an
``OperationPendingError`` when the outcome is unknown, so the operation id, the
key and the way to resume travel with them. A request httpx refuses to send is
a ``RequestNotSentError`` without its cause: httpx quotes the offending header
value, which may be a credential. Every error carries ``operation_id`` and
``key`` (``None`` where no operation is concerned, e.g. a journal that cannot be
opened), and survives a pickle round trip (to a worker process and back).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal, TypedDict

if TYPE_CHECKING:
    import httpx

RESUME_HINT = (
    "it stays pending with its key; finish it with Session.resume() or "
    "`idempotently resume`, or call again with the same operation_id"
)


class ErrorContext(TypedDict, total=False):
    """What every error says about the operation it concerns."""

    operation_id: str | None
    key: str | None
    response: httpx.Response | None


class IdempotentlyError(Exception):
    """Root of every idempotently error."""

    def __init__(
        self,
        message: str,
        *,
        operation_id: str | None = None,
        key: str | None = None,
        response: httpx.Response | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.operation_id = operation_id
        self.key = key
        self.response = response

    def __str__(self) -> str:
        if self.operation_id is None:
            return self.message
        return f"{self.message} [operation {self.operation_id!r}, key {self.key!r}]"

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments (not_before) would not survive Exception's own
        # reduce; the attributes are restored as they are.
        return (_restore, (type(self), self.message), self.__dict__)


def _restore(cls: type[IdempotentlyError], message: str) -> IdempotentlyError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


class JournalError(IdempotentlyError):
    """The journal file cannot be opened, read or written."""


class JournalMissingError(JournalError, FileNotFoundError):
    """No journal at that path (only when opened with ``create=False``), or in that
    SQLite file: it holds other tables (an application's) and only `idempotently
    migrate` adds the journal's to them."""


class JournalVersionError(JournalError):
    """The journal was written by a newer idempotently; it is never rewritten."""


class JournalCorruptError(JournalError):
    """The file is not an idempotently journal, or it is damaged."""


class JournalMovedError(JournalError):
    """The file at the journal's path was deleted or replaced while it was open.

    Raised before a new key is journaled, so nothing is sent with a key that
    only a deleted (or no longer used) file would remember.
    """


class JournalWriteError(JournalError):
    """A write to the journal failed (disk full, read-only file, lock timeout)."""


class CodecError(JournalError):
    """The operation's stored bodies cannot be read or written with this journal's
    codec (none given, another one, a failed decode): nothing is sent, and the
    operation keeps its state. Open the journal with the codec it was written with."""


class KeyReuseError(IdempotentlyError, ValueError):
    """The operation id was used before for a different request.

    Raised before anything is sent: the client-side twin of a server's 422.
    """


class InvalidKeyError(IdempotentlyError, ValueError):
    """An explicit idempotency key the server profile would reject."""


class OperationInProgressError(IdempotentlyError):
    """Another live caller (thread, task or process) is sending this operation."""


class RequestNotSentError(IdempotentlyError):
    """httpx refused to send the request (a URL scheme it cannot send to, an illegal
    header value), or a request hook or auth flow changed what the journal recorded
    (its method, URL, body or key header): nothing reached the server on this attempt."""


class OperationPendingError(IdempotentlyError):
    """The retry budget ran out and the outcome is unknown.

    The operation stays pending with its key: resuming it is safe.
    """


class RetryLaterError(OperationPendingError):
    """The server asked for a wait longer than the policy allows.

    ``not_before`` (seconds since the epoch) is also stored in the journal.
    """

    def __init__(
        self,
        message: str,
        *,
        not_before: float,
        operation_id: str | None = None,
        key: str | None = None,
        response: httpx.Response | None = None,
    ) -> None:
        super().__init__(message, operation_id=operation_id, key=key, response=response)
        self.not_before = not_before


class RetryBudgetError(OperationPendingError):
    """The process's retry budget for ``origin`` (scheme, host and port) refused a retry.

    The retry was not sent: the operation stays pending with its key, and a resume (or
    a call again with its operation id) continues it once the origin recovers.
    """

    def __init__(
        self,
        message: str,
        *,
        origin: str,
        operation_id: str | None = None,
        key: str | None = None,
        response: httpx.Response | None = None,
    ) -> None:
        super().__init__(message, operation_id=operation_id, key=key, response=response)
        self.origin = origin


class CredentialsMismatchError(OperationPendingError):
    """The operation's key is bound to the credentials it was made with (its profile's
    ``key_bound_to_credentials``), and these credentials differ: the server would take
    the resend for a new request. Nothing is sent; it stays pending, to be sent with the
    original credentials (or settled once its key's lifetime runs out)."""


class NeedsReconcileError(IdempotentlyError):
    """The operation can no longer be settled by resending its key.

    A replayed 5xx, a key past its lifetime on the server, or the operation's
    own deadline passed: look the object up (by operation id) and settle it.
    """


class AttemptsCapError(IdempotentlyError):
    """The operation reached its policy's ``max_total_attempts``: the attempts that
    reached the server, counted from the journal across every call, process and resume.

    It is never sent again. ``status`` is ``needs_reconcile`` when an attempt may have
    been delivered (look the object up on the server, then settle it), else
    ``failed`` (no attempt can have acted: a 408, 425 or 429 each time). ``attempts``
    is the count reached, ``max_total_attempts`` the cap that applied.
    """

    def __init__(
        self,
        message: str,
        *,
        status: Literal["needs_reconcile", "failed"],
        attempts: int,
        max_total_attempts: int,
        operation_id: str | None = None,
        key: str | None = None,
        response: httpx.Response | None = None,
    ) -> None:
        super().__init__(message, operation_id=operation_id, key=key, response=response)
        self.status = status
        self.attempts = attempts
        self.max_total_attempts = max_total_attempts


def attempts_cap_error(
    status: str, reason: str, cap_reason: str, ids: ErrorContext
) -> AttemptsCapError:
    """What a call raises for an operation its cap ended (now or earlier)."""
    if status == "needs_reconcile":
        what = (
            "it may have been delivered, so it is needs_reconcile and never sent again: look "
            "the object up on the server, then settle it (Session.resume(reconciler=...), "
            "`idempotently reconcile --lookup URL`, or `idempotently settle`; see "
            "docs/when-the-journal-cannot-decide.md)"
        )
        final: Literal["needs_reconcile", "failed"] = "needs_reconcile"
    else:
        what = (
            "no attempt can have been acted on (each was answered 408, 425 or 429), so it "
            "is failed and never sent again: send it under a new operation_id (or "
            "`idempotently fork` it) if it is still wanted"
        )
        final = "failed"
    cap, count = _figures(cap_reason)
    return AttemptsCapError(
        f"the operation reached its cap on attempts ({reason}); {what}",
        status=final,
        attempts=count,
        max_total_attempts=cap,
        **ids,
    )


def _figures(reason: str) -> tuple[int, int]:
    """The cap and the count a `cap_reason` names (0 for one this version did not write)."""
    try:
        head, tail = reason.split(" reached: ", 1)
        return int(head.rsplit("=", 1)[1]), int(tail.split(" ", 1)[0])
    except (ValueError, IndexError):
        return 0, 0


class OperationAbandonedError(IdempotentlyError):
    """An at-most-once operation may have been delivered; it is never resent."""


class GroupStoppedError(IdempotentlyError):
    """A step of an operation group whose earlier step failed or was abandoned: the group
    stopped there, nothing of this step was sent (what to undo is the application's).

    ``group_id`` names the group, ``stopped_at`` the step it stopped at.
    """

    group_id: str | None = None
    stopped_at: str | None = None


class StoredProfileError(IdempotentlyError):
    """The profile the operation was journaled under cannot be used: nothing is sent
    and the operation stays pending.

    ``kind``: ``unavailable`` (its matcher cannot be imported: module gone or
    renamed), ``disagrees`` (an explicit profile differs from the stored one) or
    ``legacy`` (journaled before profiles were stored: it needs an explicit one).
    """

    def __init__(
        self,
        message: str,
        *,
        kind: Literal["unavailable", "disagrees", "legacy"] = "unavailable",
        operation_id: str | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(message, operation_id=operation_id, key=key)
        self.kind = kind


class OperatorActionError(IdempotentlyError, ValueError):
    """An operator action (settle, abandon, retry, fork) refused: the operation does not
    exist, its state makes the action senseless (settling a completed operation, forking
    a pending one), or another operator changed it first. Nothing was written.

    A live lease held by a caller sending it is an `OperationInProgressError`.
    """


class NoStoredAnswerError(IdempotentlyError):
    """The operation was settled ``succeeded`` by an operator or a reconciler without the
    server's answer: it took effect and is never sent again, but there is no response to
    return. Look the object up on the server (its id is the operation id)."""


class AnswerNotReadError(NoStoredAnswerError):
    """The server gave the operation its final answer, but its body could not be read
    whole: larger than the session's ``max_response_bytes``, or still arriving when the
    call's deadline came. The server acted, so the operation is journaled with that
    answer's status and headers (``succeeded`` for a 2xx or 3xx) and is never sent
    again; the body is not kept. ``response`` holds the status, the headers and the
    part of the body that was read. Look the object up on the server, or raise
    ``max_response_bytes`` (or the deadline) for answers that large."""


# -- the one rule for errors raised after a send may have begun -------------------------------

_NOTHING_SENT = re.compile(
    r"\s*[;,:(]?\s*nothing (?:was|would be|is) (?:\w+ or )?sent(?: or \w+)?[^.;)]*\)?", re.I
)
"""A claim that nothing was sent, which an error raised after a send began must not make."""


def without_nothing_sent(text: str) -> str:
    """``text`` without any claim that nothing was sent (for an error or a journaled reason
    after a send may have begun), its trailing punctuation trimmed."""
    return _NOTHING_SENT.sub("", text).rstrip(" ;,.")


def after_send_began(
    error: Exception, operation_id: str, key: str, delivery: str
) -> IdempotentlyError:
    """``error``, raised while a send of the operation may have begun and before its answer
    was journaled, saying so: the request may have been delivered, what finishes it, and
    the operation's id and key. The drivers apply it to every error that ends a flow in that
    window, so no source of an error has to know whether a send began.

    An idempotently error keeps its type (a `CodecError` is still caught as one), its
    message losing any claim that nothing was sent; any other error (a hook's, a codec's
    own) becomes an `OperationPendingError` whose ``__cause__`` it is, never quoted (it may
    hold a body or a credential)."""
    if delivery == "at_most_once":
        after = (
            "this happened after the request began to be sent, so it may have been "
            "delivered: as an at-most-once operation it is never resent (look it up on the "
            "server and settle it: `idempotently settle`)"
        )
    else:
        after = (
            "this happened after the request began to be sent, so it may have been "
            "delivered: " + RESUME_HINT + " (the same key makes the resend safe)"
        )
    if isinstance(error, IdempotentlyError):
        said = without_nothing_sent(error.message)
        error.message = f"{said}; {after}"
        error.args = (error.message,)
        error.operation_id = error.operation_id or operation_id
        error.key = error.key or key
        return error
    pending = OperationPendingError(
        f"{type(error).__name__} raised while the operation was in flight; {after}",
        operation_id=operation_id,
        key=key,
    )
    pending.__cause__ = error
    return pending
