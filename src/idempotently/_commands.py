"""The commands the operation flow yields: journal reads and writes, sends, sleeps.

The flow (``_flow/``) never touches a socket, a clock-driven sleep or the
journal: it yields one of these values and receives the result. A journal
command is a plain value: `Journal._execute` runs a read against the
store and hands a write to the journal's one writer (``_journal/_writer.py``),
which commits it with whatever other writes are waiting; the async driver
hands it over without ever running SQLite on its event loop.

A new command joins its union (`Write`, `Read`, `Command`); every place that decides by
a command's type is a ``match`` over that union ending in ``case _: assert_never(...)``,
so mypy names each one that does not handle it yet. A write's traits (`JournalWrite`)
are set by its own class, never kept in a tuple of types elsewhere.

The commands a call never yields (operator actions, lookups and reconciling, resume's
queue, audit reads, unpausing) and the unions are defined in ``_commands_rare.py``, which
builds on this module, and a ``match`` on a call's path names them last through
``_commands_lazy.py``, which loads them when one is first named: each class costs attrs
about 2.5 M instructions to make, which ``import idempotently`` would pay for every
process.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import attrs
import httpx

from idempotently._vocabulary import Status

if TYPE_CHECKING:
    from idempotently._answers import AnswerBody
    from idempotently._events import Event
    from idempotently._hooks import AsyncHook
    from idempotently._rows import AttemptRecord, NewOperation, Operation

if sys.version_info >= (3, 11):
    from typing import assert_never
else:

    def assert_never(value: NoReturn, /) -> NoReturn:
        """`typing.assert_never` (3.11+): mypy proves the line unreachable, so a `match`
        that ends in it handles every member of the union it matches."""
        raise AssertionError(f"Expected code to be unreachable, but got: {value!r}")


# -- journal commands ---------------------------------------------------------------------


class Journaled:
    """A command the journal runs (a `Read` or a `Write`): a driver hands every one of
    them to the journal with one class pattern, ``case Journaled():``."""

    __slots__ = ()


class JournalWrite(Journaled):
    """A command the journal's one writer commits (a `Write`), and its traits: each write
    class sets every one of them itself (tests/test_commands_dispatch.py checks it)."""

    __slots__ = ()

    durable: ClassVar[bool]
    """Flushed before its caller goes on when the journal's durability is "fsync": a new
    key, or the credentials it is bound to, must outlive a crash of the send it precedes."""
    starts_send: ClassVar[bool]
    """Its caller may send after it (or a relay will): refused on a journal whose file
    moved, for nobody would resume what it wrote there (`SqliteStore.commit`)."""
    one_statement: ClassVar[bool]
    """One SQLite statement: alone in a batch it commits by itself, with no ``BEGIN``."""
    synchronous: ClassVar[bool]
    """On PostgreSQL, committed with ``synchronous_commit = on`` whatever the journal's
    durability: a lease, a status or a pause another host acts on must not be lost by a
    server that restarts. False for a new key and an attempt, whose flush the journal's
    durability decides."""


@attrs.frozen
class Find(Journaled):
    """The operation with this id (else this key), with its attempts; or None."""

    operation_id: str | None
    key: str | None
    connection: object | None = attrs.field(default=None, eq=False, repr=False)
    """Read on the application's own connection (and so inside its transaction), not
    the journal's: what an `Enqueue` on that connection finds taken."""


@attrs.frozen
class Insert(JournalWrite):
    """Make the new operation's key durable (before its first byte is sent); False if taken."""

    durable: ClassVar[bool] = True
    starts_send: ClassVar[bool] = True
    one_statement: ClassVar[bool] = True
    synchronous: ClassVar[bool] = False

    new: NewOperation
    owner: str
    lease_until: float


@attrs.frozen
class Enqueue(JournalWrite):
    """Journal a new operation as pending, not yet sent and unleased; False if its id or
    key is taken.

    With ``connection`` (the application's own, inside its own transaction) the row is
    written there and commits or rolls back with the application's writes: the one
    write that does not pass through the journal's writer. Without, it is a write like
    an `Insert`, durable before it returns."""

    durable: ClassVar[bool] = True
    starts_send: ClassVar[bool] = True
    one_statement: ClassVar[bool] = True
    synchronous: ClassVar[bool] = False

    new: NewOperation
    connection: object | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class TakeLease(JournalWrite):
    """Compare-and-swap the lease read in ``operation``; True for the one winner. It
    fails on a row written since ``operation`` was read (its lease, updated_at or
    attempt_count moved): the lease is only ever taken on the row decided on."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = True
    one_statement: ClassVar[bool] = True
    synchronous: ClassVar[bool] = True

    operation: Operation
    owner: str
    lease_until: float
    now: float


@attrs.frozen
class Record(JournalWrite):
    """One attempt and the operation's state after it, in one transaction."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = False
    one_statement: ClassVar[bool] = False
    synchronous: ClassVar[bool] = False

    operation_id: str
    record: AttemptRecord
    now: float
    owner: str | None = None
    """The lease holder writing it: its new state applies only while it holds the lease."""
    key: str | None = None
    """The operation's key, for the error a failed write raises (never written)."""


@attrs.frozen
class SetStatus(JournalWrite):
    """Move a pending operation to ``status`` without an attempt (releases any lease)."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = False
    one_statement: ClassVar[bool] = False  # and the counts' change, in one transaction
    synchronous: ClassVar[bool] = True

    operation_id: str
    status: Status
    reason: str | None
    now: float
    expect: Status = "pending"
    """The status it moves from: nothing changes unless the operation has it."""
    cap_reason: str | None = None
    """Set when the move is for the policy's ``max_total_attempts``: written with it."""
    stopped_at: str | None = None
    """Set by a group's stop (``_flow/_groups.py``): the step it stopped at. The move is
    made only if the operation was never sent and that step still stops the group (a
    stop settling what it read earlier must not abandon a step sent since a fork of
    that step took its place)."""


@attrs.frozen
class Release(JournalWrite):
    """Give up a lease this caller holds (a call cancelled or crashed mid-flight)."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = False
    one_statement: ClassVar[bool] = True
    synchronous: ClassVar[bool] = True

    operation_id: str
    owner: str


@attrs.frozen
class RenewLease(JournalWrite):
    """Compare-and-swap right before a send whose lease may have run out: set the
    lease to ``lease_until`` only if ``owner`` still holds it (nobody took it over,
    expired or not) and the operation is pending; False means another caller may be
    sending it, and nothing may be sent. ``now`` (the clock ``lease_until`` is counted
    on) becomes the row's ``updated_at``: the lease's write time (`RebaseOperation`)."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = True
    one_statement: ClassVar[bool] = True
    synchronous: ClassVar[bool] = True

    operation_id: str
    owner: str
    lease_until: float
    now: float


@attrs.frozen
class BindCredentials(JournalWrite):
    """Journal the credentials a key is bound to (a `credentials_record`), right before
    the first request of the operation leaves with them: only while ``owner`` holds the
    lease of the pending operation and it is bound to none yet; False otherwise (nothing
    may be sent). Durable like an `Insert`: the binding must outlive a crash of the send
    it precedes."""

    durable: ClassVar[bool] = True
    starts_send: ClassVar[bool] = True
    one_statement: ClassVar[bool] = True
    synchronous: ClassVar[bool] = True

    operation_id: str
    owner: str
    record: str = attrs.field(repr=False)
    key: str | None = None
    """The operation's key, for the error a failed write raises (never written)."""


@attrs.frozen
class ExtendLeases(JournalWrite):
    """Heartbeat: push each (operation_id, owner) still pending and leased by that
    owner to at least ``lease_until``, stamping ``updated_at = now`` (the lease's write
    time, `RebaseOperation`); replies how many rows were extended."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = False
    one_statement: ClassVar[bool] = False
    synchronous: ClassVar[bool] = True

    leases: tuple[tuple[str, str], ...]
    lease_until: float
    now: float


@attrs.frozen
class ClaimDue(JournalWrite):
    """Lease up to ``limit`` due pending operations to ``owner``, oldest first.

    Due: status 'pending', lease expired (``lease_until <= now``) and its
    ``not_before`` passed; replies them with their attempts. N workers never
    claim one operation twice."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = True
    one_statement: ClassVar[bool] = False
    synchronous: ClassVar[bool] = True

    owner: str
    now: float
    lease_until: float
    limit: int
    made: float = attrs.field(factory=time.monotonic, eq=False, repr=False)
    """When the claim was made (monotonic): a row written after ``now`` was read and
    before the claim runs (behind another worker's write lock) is not from a clock ahead."""

    def written_ahead(self) -> float:
        """The write time past which a pending row was written by a clock ahead of ours:
        ``now`` plus how long the claim waited to run. A row another worker claimed while
        this one waited is its live lease, never rebased (its owner's compare-and-swap on
        ``lease_until`` would fail, and the row stay held for a whole lease)."""
        return self.now + max(0.0, time.monotonic() - self.made)


@attrs.frozen
class Pauses(Journaled):
    """The origin pauses still running at ``now`` (a list of ``OriginPause``)."""

    now: float
    operation_id: str | None = None
    """The operation about to be sent, for the error a failed read raises."""


@attrs.frozen
class PauseOrigin(JournalWrite):
    """Pause an origin for some credentials until ``until`` (a later pause wins)."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = False
    one_statement: ClassVar[bool] = False
    synchronous: ClassVar[bool] = True

    origin: str
    credentials: str
    until: float
    reason: str
    set_at: float


@attrs.frozen
class RebasePause(JournalWrite):
    """Count a pause written by a clock ahead of ``now`` from ``now``: if its ``set_at``
    is in the future, (set_at, until) become (now, now + its length), so it only ever
    gets shorter. Replies the pause as it stands after (None: it was lifted)."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = False
    one_statement: ClassVar[bool] = False
    synchronous: ClassVar[bool] = True

    origin: str
    credentials: str
    now: float


@attrs.frozen
class RebaseOperation(JournalWrite):
    """Count a pending operation written by a clock ahead of ``now`` (its ``updated_at``,
    the last write's time, is in the future) from ``now``: its ``not_before`` and its
    lease's ``lease_until`` each become now + (time - updated_at), and updated_at now,
    so they only ever come sooner, and never sooner than their length after the write;
    a compare-and-swap on the ``updated_at`` read. Replies the new (not_before,
    lease_until), or None if the row changed."""

    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = False
    one_statement: ClassVar[bool] = False
    synchronous: ClassVar[bool] = True

    operation_id: str
    updated_at: float
    now: float


# -- commands for the driver ------------------------------------------------------------------


@attrs.frozen
class Lease:
    """A lease a sender holds, and how to renew it: until ``clock() + duration``."""

    operation_id: str
    owner: str
    duration: float
    clock: Callable[[], float] = attrs.field(eq=False, repr=False)


@attrs.frozen
class Send:
    """Send one attempt; the reply is the response or the error that ended it.

    With ``read`` (a call's attempt), the driver reads the answer's body at once, still
    under the heartbeat, as far as ``read(response)`` says: its (body, byte limit, time
    limit, clock) for `_answers.read_answer`; an error while reading is the reply.
    Without (a read's attempt), the answer comes back unread, to be returned or
    `Discard`ed."""

    request: httpx.Request
    lease: Lease | None = None
    """The lease held while it is in flight: the driver's heartbeat keeps it alive."""
    read: (
        Callable[[httpx.Response], tuple[AnswerBody, int, float | None, Callable[[], float]]] | None
    ) = attrs.field(default=None, eq=False, repr=False)
    # A `_gate.Gate`, typed Any: the gate yields this module's commands, so naming its
    # class here would tie the two modules in a circle.
    gate: Any = attrs.field(default=None, eq=False, repr=False)
    """What the request must still be as it leaves (after the client's request hooks and
    auth flow), a `_gate.Gate` checked there by the driver's `_gate.Passage`; None for a
    read."""


@attrs.frozen
class Sleep:
    """Wait this many seconds before the next step."""

    seconds: float


@attrs.frozen
class ReadAnswer:
    """Read on in an answer's body (one its `Send` read an excerpt of) until it ends,
    more than ``limit`` bytes are read, or ``clock()`` passes ``until``
    (`_answers.read_answer`): a server can make a body endless, or trickle it. Reply:
    None (``body`` says how far it got), or the error the read raised (the response is
    then closed)."""

    body: AnswerBody = attrs.field(eq=False, repr=False)
    limit: int
    until: float | None
    clock: Callable[[], float] = attrs.field(eq=False, repr=False)
    lease: Lease | None = None
    """The lease held while the body arrives: the driver's heartbeat keeps it alive."""


@attrs.frozen
class Discard:
    """Close an answer the flow will not use (one it is about to retry, or one it read
    no further than an excerpt of) without reading more of its body: a server can make
    that body endless. Reply: None."""

    response: httpx.Response = attrs.field(eq=False, repr=False)
    body: AnswerBody | None = attrs.field(default=None, eq=False, repr=False)
    """What was read of it, if anything (its reading is ended too)."""


@attrs.frozen
class Emit:
    """Call the session's hooks with this event (yielded only when it has hooks); reply:
    None. A hook that raises is logged, never ends the call."""

    event: Event
    hooks: tuple[AsyncHook, ...]


@attrs.frozen
class DigestCredentials:
    """Compute a credentials digest this process has not computed yet (scrypt, slow by
    design: the async driver runs it off its event loop); reply: the digest."""

    key: tuple[bytes, tuple[str, ...], tuple[bytes, ...]] = attrs.field(repr=False)
    """(salt, names, values): the values are credentials, never shown."""


GateCommand = DigestCredentials | BindCredentials
"""What a request's gate (`_gate.Gate`) yields as the request leaves."""
