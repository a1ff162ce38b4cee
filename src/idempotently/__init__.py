"""Retry non-repeatable HTTP calls safely.

One idempotency key per logical operation, committed to a local SQLite journal
before the first byte is sent, reused on every attempt and after a crash.
"""

from __future__ import annotations

import typing as _typing

# _early_signals first, before the slow imports: a `resume --watch` worker notes an
# early SIGTERM instead of dying of it (nothing happens in any other process).
from idempotently import _early_signals, profiles  # noqa: F401
from idempotently._budget import RetryBudget
from idempotently._codec import Codec, FernetCodec
from idempotently._exceptions import (
    AnswerNotReadError,
    AttemptsCapError,
    CodecError,
    CredentialsMismatchError,
    GroupStoppedError,
    IdempotentlyError,
    InvalidKeyError,
    JournalCorruptError,
    JournalError,
    JournalMissingError,
    JournalMovedError,
    JournalVersionError,
    JournalWriteError,
    KeyReuseError,
    NeedsReconcileError,
    NoStoredAnswerError,
    OperationAbandonedError,
    OperationInProgressError,
    OperationPendingError,
    OperatorActionError,
    RequestNotSentError,
    RetryBudgetError,
    RetryLaterError,
    StoredProfileError,
)
from idempotently._flow._operation import Receipt, ResumeResult, Settlement
from idempotently._journal import (
    Attempt,
    Journal,
    Operation,
    OriginPause,
)
from idempotently._policy import RetryPolicy
from idempotently._profiles import ServerProfile
from idempotently._session import AsyncSession, Session

if _typing.TYPE_CHECKING:
    from idempotently._breaker import Breaker
    from idempotently._events import (
        AttemptFinished,
        BreakerChanged,
        Event,
        OperationFinished,
        OperationStarted,
        RetryRefused,
        RetryScheduled,
    )
    from idempotently._group import AsyncGroup, Group
    from idempotently._lookup import Lookup
    from idempotently._rows_audit import AuditEntry, JournalStats
    from idempotently._transport import AsyncTransport, Transport
    from idempotently._watch import WatchBatch, WatchSummary

__version__ = "0.1.0.dev0"

# Loaded on first use, so that `import idempotently` costs what a Session needs: the
# transports bring httpx2's classes (when installed), the lookup its reconciler, the
# events their classes (a call makes none unless a hook or the logger listens), the
# audits their rows.
_LAZY = {
    "AsyncGroup": "idempotently._group",
    "Group": "idempotently._group",
    "AuditEntry": "idempotently._rows_audit",
    "JournalStats": "idempotently._rows_audit",
    "AttemptFinished": "idempotently._events",
    "Breaker": "idempotently._breaker",
    "BreakerChanged": "idempotently._events",
    "Event": "idempotently._events",
    "OperationFinished": "idempotently._events",
    "OperationStarted": "idempotently._events",
    "RetryRefused": "idempotently._events",
    "RetryScheduled": "idempotently._events",
    "AsyncTransport": "idempotently._transport",
    "Transport": "idempotently._transport",
    "Lookup": "idempotently._lookup",
    "WatchBatch": "idempotently._watch",
    "WatchSummary": "idempotently._watch",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'idempotently' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AnswerNotReadError",
    "AsyncGroup",
    "AsyncSession",
    "AsyncTransport",
    "Attempt",
    "AttemptFinished",
    "AttemptsCapError",
    "AuditEntry",
    "Breaker",
    "BreakerChanged",
    "Codec",
    "CodecError",
    "CredentialsMismatchError",
    "Event",
    "FernetCodec",
    "Group",
    "GroupStoppedError",
    "IdempotentlyError",
    "InvalidKeyError",
    "Journal",
    "JournalCorruptError",
    "JournalError",
    "JournalMissingError",
    "JournalMovedError",
    "JournalStats",
    "JournalVersionError",
    "JournalWriteError",
    "KeyReuseError",
    "Lookup",
    "NeedsReconcileError",
    "NoStoredAnswerError",
    "Operation",
    "OperationAbandonedError",
    "OperationFinished",
    "OperationInProgressError",
    "OperationPendingError",
    "OperationStarted",
    "OperatorActionError",
    "OriginPause",
    "Receipt",
    "RequestNotSentError",
    "ResumeResult",
    "RetryBudget",
    "RetryBudgetError",
    "RetryLaterError",
    "RetryPolicy",
    "RetryRefused",
    "RetryScheduled",
    "ServerProfile",
    "Session",
    "Settlement",
    "StoredProfileError",
    "Transport",
    "WatchBatch",
    "WatchSummary",
    "profiles",
]
