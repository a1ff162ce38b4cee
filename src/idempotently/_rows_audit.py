"""The rows the audits read, neither store's: a journal's figures (`JournalStats`) and
an operation's audit trail (`AuditEntry`).

Loaded when one is first named (through `_rows`' ``__getattr__``, where they are
still found), not by ``import idempotently``: no call reads them, and attrs makes
each class as it is defined (about 4 M instructions for these two).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import attrs


@attrs.frozen
class JournalStats:
    """What to watch, as Leach's article advises: replay rate, 409 rate, stuck keys."""

    counts: dict[str, int]
    """Operations per status; every status is present."""
    operations: int
    """Operations in the journal."""
    attempts: int
    """Attempts journaled (pruning removes some)."""
    answered_attempts: int
    """Attempts the server answered with a status."""
    replayed_attempts: int
    """Answers the server marked as a replay of its stored response."""
    in_progress_attempts: int
    """Answers with 409 or 423: the server was still working on the key."""
    oldest_pending_created_at: float | None
    """When the oldest pending operation was created, or None when nothing is pending."""
    stuck: int
    """Pending operations nobody is sending: lease expired, untouched for a while,
    and not waiting for a ``not_before`` the server asked for."""
    now: float
    """The time the figures were read at (seconds since the epoch)."""
    expiring: int | None = None
    """Pending operations whose key expires by ``now + expiring_within`` (or already has):
    with the key-expiry margin as the window, the ones ``resume`` would no longer resend.
    None when `Journal.stats` was not given ``expiring_within``."""
    expiring_within: float | None = None
    """The window `expiring` was counted with, in seconds, or None."""
    capped: int = 0
    """Operations that reached their policy's ``max_total_attempts`` (their ``cap_reason``
    set), whatever their status now; pruning removes some."""

    @property
    def replay_rate(self) -> float:
        return self.replayed_attempts / self.answered_attempts if self.answered_attempts else 0.0

    @property
    def in_progress_rate(self) -> float:
        return self.in_progress_attempts / self.answered_attempts if self.answered_attempts else 0.0

    @property
    def retries_per_operation(self) -> float:
        return (self.attempts - self.operations) / self.operations if self.operations else 0.0

    @property
    def oldest_pending_age(self) -> float | None:
        if self.oldest_pending_created_at is None:
            return None
        return max(0.0, self.now - self.oldest_pending_created_at)

    def to_json(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "operations": self.operations,
            "attempts": self.attempts,
            "replay_rate": round(self.replay_rate, 6),
            "in_progress_rate": round(self.in_progress_rate, 6),
            "retries_per_operation": round(self.retries_per_operation, 6),
            "oldest_pending_age": self.oldest_pending_age,
            "stuck": self.stuck,
            "needs_reconcile": self.counts["needs_reconcile"],
            "expiring": self.expiring,
            "expiring_within": self.expiring_within,
            "capped": self.capped,
        }


# -- the operator's journal: audit entries ----------------------------------------------


@attrs.frozen
class AuditEntry:
    """One entry of an operation's audit trail: who did what to it, when, and why.

    Written with the change it records, in the same transaction: an operator's
    settle, abandon, retry or fork, a lookup reconciler's verdict, a reconciler's
    settlement. Never holds a
    secret: ``note`` is the operator's own words, ``detail`` JSON of statuses and ids.
    """

    seq: int
    """Its place in the journal's audit trail (increasing)."""
    operation_id: str
    """The operation it is about."""
    at: float
    """When it was written (seconds since the epoch)."""
    actor: str
    """``user@host`` (an operator), ``lookup`` (the lookup reconciler), or
    ``reconciler:module.qualname`` (a reconciler of your own)."""
    action: str
    """``settle``, ``abandon``, ``retry``, ``fork``, ``forked`` (the new operation's
    entry), ``lookup`` (a lookup that settled nothing) or ``lookup_deferred`` (a lookup
    not sent: its origin was paused)."""
    note: str | None
    """The operator's own words (why they did it), or the lookup's finding."""
    detail: str | None
    """JSON: what changed (``{"from": ..., "to": ..., "fork": ...}``)."""

    def to_json(self) -> dict[str, Any]:
        detail: Any = self.detail
        if self.detail is not None:
            with contextlib.suppress(ValueError):  # else shown as the text it is
                detail = json.loads(self.detail)
        return {
            "seq": self.seq,
            "at": self.at,
            "actor": self.actor,
            "action": self.action,
            "note": self.note,
            "detail": detail,
        }
