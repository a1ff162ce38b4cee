"""The commands a call never yields, and the unions of every command (``_commands.py``).

Operator actions and the audit entries they write, a lookup's verdict and its audit
trail, the forks a new fork must pass over, reconciling, resume's queue and its
reports, unpausing an origin. They load when the room that yields one first names it
(through `_commands`' ``__getattr__``), not with ``import idempotently``: a call
answered on its first attempt never makes one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import httpx

from idempotently._commands import (
    BindCredentials,
    ClaimDue,
    DigestCredentials,
    Discard,
    Emit,
    Enqueue,
    ExtendLeases,
    Find,
    Insert,
    Journaled,
    JournalWrite,
    PauseOrigin,
    Pauses,
    ReadAnswer,
    RebaseOperation,
    RebasePause,
    Record,
    Release,
    RenewLease,
    Send,
    SetStatus,
    Sleep,
    TakeLease,
)
from idempotently._vocabulary import Status

if TYPE_CHECKING:
    from idempotently._rows import NewOperation, Operation, OriginPause

# -- journal commands ---------------------------------------------------------------------


@attrs.frozen
class Queue(Journaled):
    """Operations with these statuses, oldest first, each with its attempts (what resume
    works through, and sends from as read)."""

    statuses: tuple[Status, ...]


@attrs.frozen
class GroupSteps(Journaled):
    """The steps of an operation group in their order (`Store.group`)."""

    group_id: str


# -- the operator's journal: operator actions and lookup verdicts --------------------


@attrs.frozen
class AuditNote:
    """An audit entry written with the change it records (``_rows.AuditEntry``)."""

    operation_id: str
    actor: str
    action: str
    note: str | None
    detail: str | None


@attrs.frozen
class Act(JournalWrite):
    """An operator's action (or a lookup's verdict) on one operation, with its audit
    entries and, for a fork, the new operation, all in one transaction.

    A compare-and-swap on the row as read (status, lease, ``updated_at``): it applies
    only if nobody changed the operation since, so two operators, or an operator and a
    live call taking the lease, never both win. Replies True if applied; False, with
    nothing written, if the operation changed or the fork's id or key is taken."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = False
    one_statement: ClassVar[bool] = False
    synchronous: ClassVar[bool] = True

    operation_id: str
    expect_status: Status
    expect_lease_owner: str | None
    expect_lease_until: float
    expect_updated_at: float
    status: Status
    reason: str | None
    now: float
    audit: tuple[AuditNote, ...]
    due_now: bool = False
    """Retry: clear ``not_before`` and ``lookup_after``, so it is due at once."""
    sets_answer: bool = False
    """Replace the stored answer with ``response_*`` (all None: no answer stored). An
    operator's settle clears the answer that led to needs_reconcile (a replayed 500 is
    not the answer of a success); a lookup stores the object it found."""
    response_status: int | None = None
    response_headers: Sequence[tuple[str, str]] | None = None
    response_body: bytes | None = None
    fork: NewOperation | None = None
    """A new pending operation, unleased, ``forked_from`` this one."""


@attrs.frozen
class LookUpLater(JournalWrite):
    """A lookup that settled nothing: its note in the audit trail, and no lookup of the
    operation before ``lookup_after``; only while it is needs_reconcile."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = False
    one_statement: ClassVar[bool] = False
    synchronous: ClassVar[bool] = True

    operation_id: str
    lookup_after: float
    now: float
    audit: AuditNote


@attrs.frozen
class AuditTrail(Journaled):
    """The operation's audit entries, oldest first (a list of ``AuditEntry``): what a
    lookup's backoff counts its unsettled lookups in a row from."""

    operation_id: str


@attrs.frozen
class ForksTaken(Journaled):
    """The fork ids a new fork of ``operation`` must pass over (a tuple of str): its
    chain's earlier forks and any row already holding the next one
    (`Journal._free_forks`); or the `OperatorActionError` refusing a fork while one it
    made is still in the journal (returned, not raised, for the flow to report)."""

    operation: Operation


@attrs.frozen
class SwapPause(JournalWrite):
    """A compare-and-swap on a circuit breaker's pause row: if the row of (origin,
    credentials) still has the reason ``expect`` (and, with ``ended_by``, ended by then),
    it becomes ``new`` (None: deleted). Replies the row as it stands after (None: none)."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = False
    one_statement: ClassVar[bool] = False
    synchronous: ClassVar[bool] = True

    origin: str
    credentials: str
    expect: str
    ended_by: float | None
    new: OriginPause | None


@attrs.frozen
class Unpause(JournalWrite):
    """Lift every pause of ``origin``; replies the pauses it lifted."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = False
    one_statement: ClassVar[bool] = False
    synchronous: ClassVar[bool] = True

    origin: str


Write = (
    Insert
    | Enqueue
    | TakeLease
    | Record
    | SetStatus
    | Release
    | RenewLease
    | BindCredentials
    | ExtendLeases
    | ClaimDue
    | Act
    | LookUpLater
    | PauseOrigin
    | RebasePause
    | SwapPause
    | RebaseOperation
    | Unpause
)
"""What the journal's one writer commits (``_journal/_writer.py``): every `JournalWrite`
class, each once. A dispatch over it ends in ``case _: assert_never(write)``, so mypy
fails where a new write is not handled."""
Read = Find | Queue | Pauses | AuditTrail | ForksTaken | GroupSteps
"""What the journal reads without its writer."""
JournalCommand = Read | Write

# -- commands for the driver ------------------------------------------------------------------


@attrs.frozen
class PlanReconcile:
    """Ask who will reconcile a needs_reconcile operation, and which GET it will send
    (so the flow can hold it back while its origin is paused); reply: a `ReconcilePlan`,
    or None without a reconciler."""

    operation: Operation


@attrs.frozen
class ReconcilePlan:
    """The reply to `PlanReconcile`."""

    actor: str
    """Who settles it, as its audit entries name it: ``lookup``, or
    ``reconciler:module.qualname`` for a reconciler of your own."""
    request: httpx.Request | None = attrs.field(default=None, eq=False)
    """The lookup's GET, built but not sent; None for a reconciler of your own (its
    requests are its own business) or a lookup whose request cannot be built."""


@attrs.frozen
class Reconcile:
    """Ask the user's reconciler about a needs_reconcile operation; reply: its Settlement
    (or a lookup's Verdict), or None."""

    operation: Operation
    request: httpx.Request | None = attrs.field(default=None, eq=False)
    """The planned lookup GET to send (`ReconcilePlan.request`)."""


@attrs.frozen
class Report:
    """One operation's resume result, as soon as it is known; reply: None."""

    result: Any


Command = (
    JournalCommand
    | Send
    | ReadAnswer
    | Sleep
    | Discard
    | PlanReconcile
    | Reconcile
    | Report
    | Emit
    | DigestCredentials
)
"""Everything a flow yields; a driver's dispatch over it ends in ``assert_never``."""
