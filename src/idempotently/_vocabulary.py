"""One vocabulary from the decision to the journal to the screen.

Each word is a ``Literal``; each table below is the only place that maps one
word onto another, so the decision, the journal, ``resume`` and the CLI can
never disagree about what happened.
"""

from __future__ import annotations

import logging
from typing import Final, Literal

Delivery = Literal["exactly_once", "at_most_once"]
"""``exactly_once`` (the key makes resending safe) or ``at_most_once`` (never resent)."""

DELIVERIES: Final = ("exactly_once", "at_most_once")

Outcome = Literal["not_sent", "maybe_delivered", "answered"]
"""What the client can know about one attempt."""

Status = Literal["pending", "succeeded", "failed", "needs_reconcile", "abandoned"]
"""An operation's state in the journal."""

STATUSES: Final[tuple[Status, ...]] = (
    "pending",
    "succeeded",
    "failed",
    "needs_reconcile",
    "abandoned",
)
FINISHED_STATUSES: Final[tuple[Status, ...]] = ("succeeded", "failed", "abandoned")


def finished_level(status: Status) -> int:
    """The log level of an operation's end with ``status``: what the caller did not get
    (pending, needs reconciling, abandoned) is worth a line at INFO; a settled answer is
    the caller's to report."""
    return logging.DEBUG if status in ("succeeded", "failed") else logging.INFO


Action = Literal[
    "succeed",
    "fail",
    "retry",
    "pending",
    "unresolved",
    "unsent",
    "retry_later",
    "reconcile",
    "abandon",
]
"""What the decision says after one attempt.

- ``succeed``: a 2xx/3xx.
- ``fail``: provably nothing happened: a final 4xx that is the server's first and only
  word on this key (or its stored replay), or a request that could not be sent at all
  when no earlier attempt may have been delivered.
- ``retry``: sleep, then send the same bytes with the same key.
- ``pending``: the budget is spent and the outcome unknown.
- ``unresolved``: a final 4xx after an attempt that may have been delivered (a 401 from
  an expired token, a 404 from a proxy): it says nothing about that attempt.
- ``unsent``: this attempt could not be sent (bad URL, illegal header) but an earlier
  one may have been delivered, or a resume is sending: the state is kept.
- ``retry_later``: the server's wait is longer than allowed: pending until ``not_before``.
- ``reconcile``: resending cannot settle it: a human or a reconciler decides.
- ``abandon``: at-most-once and maybe delivered: never resent.
"""

STATUS_AFTER: Final[dict[Action, Status]] = {
    "succeed": "succeeded",
    "fail": "failed",
    "retry": "pending",
    "pending": "pending",
    "unresolved": "pending",
    "unsent": "pending",
    "retry_later": "pending",
    "reconcile": "needs_reconcile",
    "abandon": "abandoned",
}
"""The operation's status after each action: the only such table."""

Blocker = Literal["leased", "abandon", "expired", "deadline", "waiting"]
"""Why a pending operation cannot be sent now."""

ResumeAction = Literal[
    "succeeded",
    "failed",
    "still_pending",
    "unresolved",
    "not_sent",
    "waiting",
    "leased",
    "needs_reconcile",
    "abandoned",
    "reconciled",
    "skipped",
    "would_send",
    "would_wait",
    "would_skip_leased",
    "would_abandon",
    "would_need_reconcile",
    "would_reconcile",
]
"""What resume did (or, with ``dry_run``, would do) with one operation."""

RESUME_ACTION_OF: Final[dict[Action, ResumeAction]] = {
    "succeed": "succeeded",
    "fail": "failed",
    "pending": "still_pending",
    "unresolved": "unresolved",
    "unsent": "not_sent",
    "retry_later": "waiting",
    "reconcile": "needs_reconcile",
    "abandon": "abandoned",
}
"""The resume word for the action that ended an operation's attempts."""

RESUME_ACTION_OF_BLOCKER: Final[dict[Blocker, tuple[ResumeAction, ResumeAction]]] = {
    "leased": ("leased", "would_skip_leased"),
    "abandon": ("abandoned", "would_abandon"),
    "expired": ("needs_reconcile", "would_need_reconcile"),
    "deadline": ("needs_reconcile", "would_need_reconcile"),
    "waiting": ("waiting", "would_wait"),
}
"""The resume word (done, dry run) for an operation that is not sent, and why."""

RESUME_DONE: Final[frozenset[ResumeAction]] = frozenset({"succeeded", "skipped"})
"""Resume results that leave nothing for anyone to do; every other one makes
``idempotently resume`` exit 1 (a reconciled operation counts as done when the
reconciler settled it as succeeded)."""


LOOKUP_ACTOR = "lookup"
"""The actor of the lookup reconciler's audit entries."""

AnsweredBy = Literal["server", "lookup", "reconciler"]
"""Whose answer a stored response is (`idempotently.Receipt.answered_by`)."""
