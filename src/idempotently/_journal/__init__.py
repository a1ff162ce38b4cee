"""The journal: a facade over one store (SQLite or PostgreSQL) and its one writer.

``Journal(path)`` opens a SQLite file; ``Journal("postgresql://...")`` a
PostgreSQL database. Both stores implement `Store`
(``_journal/_store.py``) side by side; neither knows the other. Every write,
whoever makes it (a call, a resume, the heartbeat, a watch worker), goes
through the journal's `Writer`: one queue, batched commits, durability
decided once per batch.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import attrs
import httpx

from idempotently import _commands_lazy, _rows
from idempotently._budget import origin_of
from idempotently._codec import Codec, check_codec, decoded, unverified
from idempotently._commands import (
    BindCredentials,
    ClaimDue,
    Enqueue,
    ExtendLeases,
    Find,
    Insert,
    JournalWrite,
    PauseOrigin,
    Pauses,
    RebaseOperation,
    RebasePause,
    Record,
    Release,
    RenewLease,
    SetStatus,
    TakeLease,
    assert_never,
)
from idempotently._exceptions import (
    IdempotentlyError,
    JournalError,
    JournalMissingError,
    OperatorActionError,
)
from idempotently._journal._sqlite import SqliteStore
from idempotently._journal._store import Store
from idempotently._journal._writer import Writer
from idempotently._keys import derived_key
from idempotently._pauses import PauseBoard
from idempotently._rows import (
    DEFAULT_EXPIRING_WITHIN,
    DURABILITIES,
    MAX_LIMIT,
    MAX_TIMESTAMP,
    MAX_WINDOW,
    Attempt,
    AttemptRecord,
    Durability,
    NewOperation,
    Operation,
    OriginPause,
)
from idempotently._secret_params import check_param_names, secret_param_names
from idempotently._vocabulary import Status

if TYPE_CHECKING:
    from idempotently._commands_rare import JournalCommand
    from idempotently._operator import ActionName
    from idempotently._rows_audit import AuditEntry as AuditEntry
    from idempotently._rows_audit import JournalStats as JournalStats

__all__ = [
    "DEFAULT_EXPIRING_WITHIN",
    "DURABILITIES",
    "MAX_LIMIT",
    "MAX_TIMESTAMP",
    "MAX_WINDOW",
    "Attempt",
    "AttemptRecord",
    "AuditEntry",
    "Durability",
    "Journal",
    "JournalStats",
    "NewOperation",
    "Operation",
    "OriginPause",
    "Store",
]

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
"""A journal path starting with one of these is a PostgreSQL URL."""

_ACT_ROUNDS = 5
"""How often an operator action is planned again when the row changed under it."""

_OPEN: weakref.WeakSet[Journal] = weakref.WeakSet()
"""Every Journal of this process: a forked child marks each one as its parent's."""


class Journal:
    """The local record of every operation, its key and its attempts.

    Safe to share between threads and tasks; several processes may open the
    same file. A ``postgresql://`` (or ``postgres://``) URL opens a journal in
    that PostgreSQL database instead (``pip install 'idempotently[postgres]'``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        readonly: bool = False,
        busy_timeout: float = 30.0,
        durability: Durability = "fsync",
        codec: Codec | None = None,
        redact_query: Iterable[str] = (),
        adopt: bool = False,
    ) -> None:
        """Open (or create, mode 0600) the journal at ``path``.

        ``create=False`` neither creates the file nor initialises an empty
        one. ``readonly=True`` implies it, and opens the file read-only (SQLite
        ``mode=ro``): nothing is ever written, not even the switch to WAL mode
        or the upgrade of an older journal's schema.

        ``durability`` is what "journaled before the first byte is sent" means
        for the row naming a key. ``"fsync"`` (the default, the contract): the
        row is committed and fsync'd. ``"os"``: committed, never fsync'd; it
        survives the process being killed (SIGKILL, OOM) but not a power cut or
        an OS crash before the OS writes it back, and roughly halves the
        journal's cost per call (the performance page of the docs).

        ``codec`` (e.g. `FernetCodec`) encodes the request and
        answer bodies of every operation this journal makes (encryption at rest);
        each row names its codec, and a row whose codec is not this one is read with
        its bodies left out (``Operation.unreadable`` says why) and never sent.
        ``redact_query`` names query parameters journaled redacted, besides the
        built-in list (``api_key``, ``token``, ``password``, ``signature``, ...).

        A SQLite file that already holds other tables (an application's database, for
        the outbox) and none named like the journal's is refused unless ``adopt=True``
        (what `idempotently migrate` passes): then the journal's tables are created in
        it, and its version and identity kept in its own ``journal_meta`` table, never
        in the file's ``PRAGMA user_version`` or ``application_id``, which stay the
        application's. A file whose ``application_id`` is another program's is refused.

        Args:
            path: The SQLite file, or a `postgresql://` URL.
            create: Create the file (and its tables) if missing.
            readonly: Open it read-only; nothing is ever written.
            busy_timeout: Seconds to wait for another process's lock before a clear error.
            durability: `"fsync"` or `"os"`, as above.
            codec: Encodes stored bodies at rest (None: stored in clear).
            redact_query: More query parameters to journal redacted.
            adopt: Create the journal's tables in an application's SQLite database.
        """
        # Data at rest: checked before anything is opened.
        self._codec = None if codec is None else check_codec(codec)
        self._pause_board = PauseBoard()
        """What the sessions and transports on this Journal last read of its origin
        pauses, shared, so that `unpause` here lifts a pause for all of them at once."""
        self._secret_params = secret_param_names(check_param_names(redact_query))
        store: Store
        if isinstance(path, str) and path.startswith(POSTGRES_SCHEMES):
            from idempotently._journal._postgres import PostgresStore

            store = PostgresStore(
                path,
                create=create,
                readonly=readonly,
                busy_timeout=busy_timeout,
                durability=durability,
            )
        else:
            store = SqliteStore(
                path,
                create=create,
                readonly=readonly,
                busy_timeout=busy_timeout,
                durability=durability,
                adopt=adopt,
            )
        self._store: Store = store
        self._fsync_keys = store.durability == "fsync"
        self._writer = Writer(store.commit, self._durable, self._refusal)
        self._heartbeat = self._writer.heartbeat
        """The leases this journal keeps alive (its writer's thread extends them)."""
        self._closed = False
        self._opened_in = os.getpid()
        self._forked_from: int | None = None
        """The process that opened this journal, once this one is a fork of it."""
        _OPEN.add(self)

    # -- what the journal is -----------------------------------------------------

    @property
    def path(self) -> str:
        """The file's path; for PostgreSQL, the URL with its password as ``***``."""
        return self._store.path

    @property
    def durability(self) -> Durability:
        return self._store.durability

    @property
    def readonly(self) -> bool:
        return self._store.readonly

    @property
    def codec(self) -> Codec | None:
        """The codec this journal encodes stored bodies with (None: stored in clear)."""
        return self._codec

    @property
    def redact_query(self) -> frozenset[str]:
        """The query parameters (lowercase) whose values are journaled redacted: the
        built-in list and ``redact_query=``."""
        return self._secret_params

    @property
    def namespace(self) -> uuid.UUID:
        """The journal's own random namespace: made with the journal, never changed.

        A named operation's key is ``uuid5(namespace, operation_id)``, so a
        re-run after a lost write sends the same key. A version-1 journal opened
        read-only has none yet (JournalVersionError): opening it to write
        upgrades it and makes one.
        """
        return self._store.namespace

    @property
    def schema_version(self) -> int:
        """The version of the journal's tables, as `idempotently migrate` reports it
        (0: an application's SQLite file whose tables `migrate` has not created yet)."""
        return self._store.schema_version

    @property
    def _namespace(self) -> uuid.UUID | None:
        return cast(uuid.UUID | None, getattr(self._store, "_namespace", None))

    def __repr__(self) -> str:
        return f"Journal({self.path!r})"

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the file (or pool), once the writes queued are committed. Any later use
        raises `JournalError`; closing again is a no-op."""
        # From inside a commit observer it would wait for its own batch: refused before
        # anything is marked closed, so the journal is left whole.
        self._writer.refuse_reentry("close")
        self._closed = True
        if self._forked_from is None:
            self._writer.close()
            self._store.close()

    def observe_commits(
        self,
        *,
        before: Callable[[Sequence[Any], bool], object] | None = None,
        after: Callable[[Sequence[Any], Sequence[Any]], object] | None = None,
    ) -> Callable[[], None]:
        """Watch every batch of writes this journal commits; returns a function that
        stops watching.

        ``before(writes, durable)`` runs just before a batch is committed, in the thread
        that commits it (``durable``: it is fsync'd before anyone waiting for it goes
        on, `durability`); if it raises, the batch is not committed and every write in it
        fails with that error, as when the database refuses the transaction.
        ``after(writes, outcomes)`` runs once it is committed, before any caller whose
        write it holds goes on; each outcome is the write's result, or the exception it
        failed with alone. An exception ``after`` raises is logged: the batch stands.
        The writes are the journal's own command values (``idempotently._commands``:
        ``Insert`` makes a key durable, ``Record`` journals an attempt...); their
        fields are not a stable API. This is how the crash-point harness
        (`idempotently.testing.crash_points`) dies exactly around a commit, and how a
        test makes a write fail."""
        return self._writer.observe(before, after)

    # -- reading ------------------------------------------------------------------

    def operation(self, operation_id_or_key: str, *, damaged: bool = False) -> Operation | None:
        """One operation with all its attempts, by operation id or by key.

        A row this version cannot decode raises `JournalCorruptError` naming it; with
        ``damaged=True`` it is returned as `operations` lists it: what could be read,
        ``damaged`` saying what is wrong (what settle and abandon act on)."""
        self._check_usable()
        return self._opened(self._store.operation(operation_id_or_key, damaged=damaged))

    def operations(
        self,
        *,
        status: Status | Sequence[Status] | None = None,
        since: float | None = None,
        limit: int | None = None,
        newest_first: bool = True,
    ) -> list[Operation]:
        """Operations (without their attempts), filtered by status and age.

        ``since`` is seconds since the epoch: only operations created since then.
        """
        self._check_usable()
        return self._opened_all(
            self._store.operations(
                status=status, since=since, limit=limit, newest_first=newest_first
            )
        )

    def group(self, group_id: str) -> list[Operation]:
        """The steps of an operation group (`Session.group`), without their attempts, in
        their order (a forked step's successor right after it); empty for a name that is
        no group's. A row this version cannot decode is listed as its stand-in."""
        self._check_usable()
        if not isinstance(group_id, str):
            raise TypeError(f"group_id must be a str, not {type(group_id).__name__}")
        return self._opened_all(self._store.group(group_id))

    def stats(
        self,
        *,
        now: float,
        stuck_after: float = 60.0,
        expiring_within: float | None = None,
    ) -> JournalStats:
        """Counts, rates and the stuck count (pending, unleased, idle ``stuck_after`` s).

        With ``expiring_within`` (seconds), also how many pending operations have a
        key that expires by ``now + expiring_within``; with the key-expiry margin
        (`DEFAULT_EXPIRING_WITHIN`), exactly those ``resume`` no longer resends.
        """
        self._check_usable()
        return self._store.stats(now=now, stuck_after=stuck_after, expiring_within=expiring_within)

    # -- origin pauses (retry control) -------------------------------------------------

    def origin_pauses(self, *, now: float | None = None) -> list[OriginPause]:
        """The origins a server asked to leave alone (a 429 or 503 with Retry-After, or
        a request quota a profile's trusted rate-limit headers said was spent) whose
        pause still runs at ``now`` (default: the time now), and every circuit breaker
        not yet closed (open, or half-open: its reason says), soonest over first."""
        self._check_usable()
        return self._store.origin_pauses(now=time.time() if now is None else now)

    def unpause(self, origin: str, *, actor: str | None = None) -> list[OriginPause]:
        """Lift every pause of ``origin`` (a URL: its scheme, host and port count), for
        all credentials; returns the pauses lifted (none: it was not paused).

        Audited: a log record on the ``idempotently`` logger names the actor (default
        ``user@host``), the origin, and each pause lifted (until when, why, set when)."""
        if not isinstance(origin, str):
            raise TypeError(
                f"origin must be a str (scheme://host:port), not {type(origin).__name__}"
            )
        try:
            name = origin_of(httpx.URL(origin))
        except (httpx.InvalidURL, TypeError, ValueError) as error:
            raise ValueError(f"{origin!r} is not an origin URL ({error})") from None
        if not name.startswith(("http://", "https://")):
            raise ValueError(
                f"{origin!r} is not an origin: give scheme://host[:port], e.g. https://api.example.com"
            )
        lifted: list[OriginPause] = self._execute(_commands_lazy.Unpause(name))
        self._pause_board.remove(name)
        who = actor or default_actor()
        for pause in lifted:
            _logger.warning(
                "origin %s unpaused by %s: it was paused until %s (%s), set at %s",
                name,
                who,
                _iso(pause.until),
                pause.reason,
                _iso(pause.set_at),
                extra={
                    "idempotently": {"event": "origin_unpaused", "actor": who, **pause.to_json()}
                },
            )
        return lifted

    def counts(self) -> dict[str, int]:
        """Operations per status; every status is present, zero included."""
        self._check_usable()
        return self._store.counts()

    def prune(self, *, older_than: float, now: float, dry_run: bool = False) -> int:
        """Delete finished operations (and their attempts) idle for ``older_than`` seconds.

        Never touches ``pending`` or ``needs_reconcile``: those still need work.
        Returns how many operations were (or, with ``dry_run``, would be) deleted.
        """
        self._check_usable()
        return self._store.prune(older_than=older_than, now=now, dry_run=dry_run)

    # -- operator actions: one write each, audited ---------------------------------------

    def audit(self, operation_id: str) -> list[AuditEntry]:
        """The operation's audit trail, oldest first: every operator action on it and
        every lookup verdict, with actor, time and note (empty for a journal written
        before audit trails existed)."""
        self._check_usable()
        return self._store.audit(operation_id)

    def settle(
        self,
        operation_id: str,
        status: Literal["succeeded", "failed"],
        *,
        note: str,
        actor: str | None = None,
        dry_run: bool = False,
    ) -> Operation:
        """Record what really happened to a pending, needs_reconcile or abandoned
        operation: ``succeeded`` (it took effect) or ``failed`` (it provably did not).

        Journaled with an audit entry (``actor``, default ``user@host``; the time;
        ``note``). Refused (`OperatorActionError`) for a completed operation, and
        (`OperationInProgressError`) while a live caller holds its lease. With
        ``dry_run``, everything is checked and nothing written. Returns the operation
        as it is afterwards (as it would be, with ``dry_run``)."""
        return self._act("settle", operation_id, note, actor, dry_run, status=status)

    def abandon(
        self, operation_id: str, *, note: str, actor: str | None = None, dry_run: bool = False
    ) -> Operation:
        """Give up a pending or needs_reconcile operation: it is never sent again (its
        audit entry says who decided, when and why). See `settle`."""
        return self._act("abandon", operation_id, note, actor, dry_run)

    def retry_now(
        self,
        operation_id: str,
        *,
        note: str | None = None,
        actor: str | None = None,
        dry_run: bool = False,
    ) -> Operation:
        """Make a pending operation due now: its ``not_before`` and lookup backoff are
        cleared, so the next resume sends it with its key. Never revives a key past its
        lifetime (refused: fork it instead). See `settle`."""
        return self._act("retry", operation_id, note, actor, dry_run, required=False)

    def fork(
        self, operation_id: str, *, note: str, actor: str | None = None, dry_run: bool = False
    ) -> Operation:
        """Send a failed, abandoned or needs_reconcile operation once more, as a new
        pending operation ``<operation_id>~fork<n>``: the same request bytes under a
        new derived key, linked to this one (``forked_from``) in the journal. ``n``
        is never one an earlier fork had, even a fork pruned since (its audit entry on
        this operation stays): the server may still remember that fork's key, and never
        an id another operation holds (one the application named so itself). Refused
        while a fork of it is still in the journal (fork that one instead).

        Forking a needs_reconcile or abandoned operation settles it ``failed`` in the
        same transaction: the operator's recorded word that it did not happen. Returns
        the new operation (with ``dry_run``: as it would be, not journaled)."""
        return self._act("fork", operation_id, note, actor, dry_run)

    def _act(
        self,
        action: ActionName,
        operation_id: str,
        note: object,
        actor: object,
        dry_run: bool,
        *,
        status: Status | None = None,
        required: bool = True,
    ) -> Operation:
        # Operator actions load on first use: `import idempotently` stays light.
        from idempotently._flow._leases import lease_owner_alive
        from idempotently._operator import FORKABLE, check_actor, check_note, plan

        self._check_usable()
        if not isinstance(operation_id, str) or not operation_id:
            raise TypeError(f"operation_id must be a non-empty str, not {operation_id!r}")
        who = check_actor(actor)
        said = check_note(note, required=required)
        # A compare-and-swap on the row read: if it changed meanwhile, plan again from
        # the new row (the second operator is told what the first one did).
        for _ in range(_ACT_ROUNDS):
            # A row this version cannot decode can still be settled or abandoned: what
            # happened is the operator's word, and nothing of the row is sent or copied.
            operation = self._store.operation(operation_id, damaged=True)
            if operation is None or operation.operation_id != operation_id:
                raise OperatorActionError(
                    f"no operation {operation_id!r} in {self.path}; nothing was written "
                    "(`idempotently list` shows the operations)",
                    operation_id=operation_id,
                )
            if operation.damaged is not None and action not in ("settle", "abandon"):
                raise OperatorActionError(
                    f"cannot {action}: its journaled row cannot be read ({operation.damaged}); "
                    "nothing was written. Repair that row, or settle or abandon it",
                    operation_id=operation_id,
                    key=operation.key,
                )
            now = time.time()
            owner = operation.lease_owner
            forks_taken = (
                self._free_forks(operation, self._forks_taken(operation))
                if action == "fork" and operation.status in FORKABLE
                else ()
            )
            planned = plan(
                action,
                operation,
                actor=who,
                note=said,
                now=now,
                lease_alive=owner is not None and lease_owner_alive(owner),
                namespace=self._namespace,
                status=status,
                forks_taken=forks_taken,
            )
            # Read from the store as it is (a fork copies its parent's stored bytes, in
            # its codec); returned as every read is, decoded.
            if dry_run:
                return cast(Operation, self._opened(planned.after))
            if self._execute(planned.write):
                done = self._store.operation(planned.after.operation_id, damaged=True)
                return cast(Operation, self._opened(done if done is not None else planned.after))
        raise OperatorActionError(
            f"cannot {action}: the operation kept changing while this action was being "
            "written (a caller or another operator is working on it); nothing was written, "
            "look at it again (`idempotently show`)",
            operation_id=operation_id,
        )

    def _free_forks(self, operation: Operation, taken: tuple[str, ...]) -> tuple[str, ...]:
        """``taken`` and every id a fork of ``operation`` would be given that a row
        already holds, so the fork takes the next free one.

        An unrelated operation may already be called ``<id>~fork1`` (an application
        naming its own retries so): that id is passed over, never reported as this
        operation's fork. Only a row this operation really forked is refused."""
        from idempotently._operator import fork_id_of

        namespace = self._namespace
        while namespace is not None:  # without one, the plan refuses to fork
            candidate = fork_id_of(operation, taken)
            held = self._store.find(candidate, derived_key(namespace, candidate))
            if held is None:
                return taken
            if held.forked_from == operation.operation_id:
                raise OperatorActionError(
                    f"cannot fork: it was forked already, as {held.operation_id!r} "
                    f"({held.status}); fork that one if it failed; nothing was written",
                    operation_id=operation.operation_id,
                    key=operation.key,
                )
            taken = (*taken, candidate)
        return taken

    def _forks_taken(self, operation: Operation) -> tuple[str, ...]:
        """The forks of ``operation``'s chain its own audit trail and its root's record
        (kept while they live, even once a fork is pruned), so a fork never takes a
        number, and so a derived key, a server may still remember.

        Refused (`OperatorActionError`) while a fork it made is still in the journal:
        fork that one instead."""
        from idempotently._operator import fork_root, recorded_forks

        own = recorded_forks(self._store.audit(operation.operation_id))
        for fork_id in reversed(own):
            made = self._store.operation(fork_id)
            if made is not None:
                raise OperatorActionError(
                    f"cannot fork: it was forked already, as {made.operation_id!r} "
                    f"({made.status}); fork that one if it failed; nothing was written",
                    operation_id=operation.operation_id,
                    key=operation.key,
                )
        root = fork_root(operation)
        if root == operation.operation_id:
            return own
        return own + recorded_forks(self._store.audit(root))

    # -- commands: what the drivers, the heartbeat and the watch worker run -----------

    def _durable(self, write: Any) -> bool:
        """Whether a write must be flushed before its caller goes on: a new key, with
        durability "fsync"."""
        return self._fsync_keys and write.durable

    def _check_usable(self, command: Any = None) -> None:
        refusal = self._refusal(command)
        if refusal is not None:
            raise refusal

    def _refusal(self, command: Any = None) -> JournalError | None:
        """Why this journal takes no command here (a fork, a close), told for ``command``."""
        if self._forked_from is not None:
            return JournalError(
                f"the journal {self.path} was opened in process {self._forked_from}, and this "
                f"process ({os.getpid()}) is a fork of it: a database connection cannot cross "
                "a fork, so nothing was sent or written here. Open a new Journal (or Session) "
                "in the child process",
                operation_id=_ids_of(command)[0],
                key=_ids_of(command)[1],
            )
        if self._closed:
            operation_id, key = _ids_of(command)
            return JournalError(
                _closed_message(self.path, command), operation_id=operation_id, key=key
            )
        return None

    def _execute(self, command: JournalCommand) -> Any:
        """Run one journal command: a read against the store, a write through the writer."""
        try:
            self._check_usable(command)
            match command:
                case Find() | Enqueue() if command.connection is not None:
                    return self._on_connection(command)
                case Find():
                    return self._opened(self._store.find(command.operation_id, command.key))
                case Pauses():
                    return self._store.origin_pauses(now=command.now)
                case ClaimDue():
                    return self._opened_all(self._writer.write(command))
                case JournalWrite():  # every write goes to the one writer
                    return self._writer.write(command)
                # Last, and through the module: a call's commands never reach them, so the
                # commands of resume and the operator's journal load with their rooms.
                case _commands_lazy.Queue():
                    return self._opened_all(self._store.queue(command.statuses))
                case _commands_lazy.AuditTrail():
                    return self._store.audit(command.operation_id)
                case _commands_lazy.GroupSteps():
                    return self._opened_all(self._store.group(command.group_id))
                case _commands_lazy.ForksTaken():
                    try:
                        return self._free_forks(
                            command.operation, self._forks_taken(command.operation)
                        )
                    except OperatorActionError as refused:
                        return refused
                case _:
                    assert_never(command)
        except IdempotentlyError as error:
            raise _with_ids(error, command) from error.__cause__

    async def _aexecute(self, command: JournalCommand) -> Any:
        """`_execute` for an async caller, never blocking its event loop: a write is
        queued to the writer's thread, which wakes this loop once it is committed; a
        read runs in anyio's worker threads (a call's own commands are writes: a read
        is a resume's or a reconcile's, and shares nothing a batch would save). On the
        application's own async connection (the outbox), awaited on the loop itself."""
        try:
            self._check_usable(command)
            match command:
                case Find() | Enqueue() if command.connection is not None:
                    return await self._aon_connection(command)
                case ClaimDue():
                    return self._opened_all(await self._writer.awrite(command))
                case JournalWrite():  # every write goes to the one writer
                    return await self._writer.awrite(command)
                case (
                    Find()
                    | Pauses()
                    | _commands_lazy.Queue()  # last, as in `_execute`
                    | _commands_lazy.AuditTrail()
                    | _commands_lazy.ForksTaken()
                    | _commands_lazy.GroupSteps()
                ):
                    import anyio.to_thread  # loaded with the first async read (the package's)

                    return await anyio.to_thread.run_sync(self._execute, command)
                case _:
                    assert_never(command)
        except IdempotentlyError as error:
            raise _with_ids(error, command) from error.__cause__

    # -- the outbox: commands on the application's own connection ------------------------

    def _on_connection(self, command: Find | Enqueue) -> Any:
        """An `Enqueue` (or the `Find` after one) on the application's
        connection, in its transaction: the one write that bypasses the writer."""
        match command:
            case Enqueue():
                return self._store.enqueue_on(command.connection, command.new)
            case Find():
                return self._opened(
                    self._store.find_on(command.connection, command.operation_id, command.key)
                )
            case _:
                assert_never(command)

    async def _aon_connection(self, command: Find | Enqueue) -> Any:
        """`_on_connection` for an async session: awaited on the event loop for an
        async connection (psycopg's AsyncConnection); a sqlite3 connection is used where
        the application uses it, on the loop's thread."""
        match command:
            case Enqueue():
                return await self._store.aenqueue_on(command.connection, command.new)
            case Find():
                return self._opened(
                    await self._store.afind_on(
                        command.connection, command.operation_id, command.key
                    )
                )
            case _:
                assert_never(command)

    # -- data at rest: bodies decoded as they are read -----------------------------------

    def _opened(self, operation: Operation | None) -> Operation | None:
        """``operation`` with its bodies decoded by this journal's codec; with them left
        out and ``unreadable`` saying why, when they cannot be (never the encoded bytes)."""
        if operation is None or operation.codec is None:
            return operation
        request = decoded(self._codec, operation.codec, operation.request_body)
        if isinstance(request, bytes) and self._codec is not None:
            # Decoded is not proven: the same check for every read, so no resend (a
            # call again, resume, a watch worker) can send bytes other than the first.
            request = unverified(self._codec, request, operation.body_digest) or request
        response: bytes | str | None = None
        if isinstance(request, bytes) and operation.response_body is not None:
            response = decoded(self._codec, operation.codec, operation.response_body)
        if isinstance(request, str) or isinstance(response, str):
            problem = request if isinstance(request, str) else response
            return attrs.evolve(
                operation,
                request_body=b"",
                response_body=None if operation.response_body is None else b"",
                unreadable=cast(str, problem),
            )
        return attrs.evolve(operation, request_body=request, response_body=response)

    def _opened_all(self, operations: list[Operation]) -> list[Operation]:
        if not any(operation.codec is not None for operation in operations):
            return operations
        return [cast(Operation, self._opened(operation)) for operation in operations]

    @property
    def _conn(self) -> Any:
        """The SQLite store's connection (tests and benchmarks look at it)."""
        return getattr(self._store, "_conn", None)

    @property
    def db(self) -> Any:
        """The SQLite store's sqlite_utils Database."""
        return getattr(self._store, "db", None)


_logger = logging.getLogger("idempotently")


def default_actor() -> str:
    """``user@host``: who an operator action is recorded as, unless told."""
    import getpass

    try:
        user = getpass.getuser()
    except Exception:  # no user name in this environment (a container without one)
        user = "unknown"
    return f"{user}@{socket.gethostname() or 'localhost'}"


def _iso(timestamp: float) -> str:
    try:
        moment = datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return f"{timestamp:g}"
    return moment.isoformat(timespec="seconds")


def migration_sql(path: str | os.PathLike[str], from_version: int | None = None) -> str:
    """The statements that would create the journal at ``path`` (a file or a PostgreSQL
    URL) or bring it to this version, changing nothing: the journal is read, if there is
    one, only for its schema version; with ``from_version`` (0: no journal yet) it is not
    read at all, only the kind of store is taken from ``path``."""
    postgres = isinstance(path, str) and path.startswith(POSTGRES_SCHEMES)
    from idempotently._journal import _postgres, _sqlite

    script_from = _postgres.migration_sql if postgres else _sqlite.migration_sql
    if from_version is not None:
        latest = _postgres.SCHEMA_VERSION if postgres else _sqlite.SCHEMA_VERSION
        if not 0 <= from_version <= latest:
            raise ValueError(
                f"from_version must be 0 (no journal yet) to {latest} for a "
                f"{'PostgreSQL' if postgres else 'SQLite'} journal, not {from_version}"
            )
        return script_from(from_version)
    adopted = False
    try:
        with Journal(path, create=False, readonly=True, adopt=True) as journal:
            version = journal.schema_version
            adopted = bool(getattr(journal._store, "_adopted", False))
    except JournalMissingError:
        version = 0
    if adopted:
        return _sqlite.migration_sql(version, adopted=True)
    return script_from(version)


def _ids_of(command: Any) -> tuple[str | None, str | None]:
    """The operation id and key a command is for, for the error it raises."""
    operation = getattr(command, "operation", None) or getattr(command, "new", None)
    operation_id = getattr(command, "operation_id", None) or getattr(
        operation, "operation_id", None
    )
    key = getattr(command, "key", None) or getattr(operation, "key", None)
    return operation_id, key


def _with_ids(error: IdempotentlyError, command: Any) -> IdempotentlyError:
    """``error``, naming the operation and key the command was for where it did not."""
    operation_id, key = _ids_of(command)
    error.operation_id = error.operation_id or operation_id
    error.key = error.key or key
    return error


def _closed_message(path: str, command: JournalCommand | None) -> str:
    """What a closed journal means for the command that found it closed."""
    closed = (
        f"the journal {path} was closed (Journal.close(), or the end of the Session's `with` block)"
    )
    match command:
        case Record():
            # What this means for the operation is the drivers' one rule for an error
            # raised after a send began (`after_send_began`): it may have been delivered.
            return (
                f"{closed} while this operation was in flight, so its answer was not journaled; "
                "open the journal again to finish it"
            )
        case Release() | ExtendLeases() | RenewLease():
            return f"{closed}: the lease was left to expire; nothing else changed"
        case (
            Insert()
            | Find()
            | TakeLease()
            | BindCredentials()
            | ClaimDue()
            | Pauses()
            | _commands_lazy.Queue()
            | _commands_lazy.AuditTrail()
            | _commands_lazy.ForksTaken()
            | _commands_lazy.GroupSteps()
        ):
            return f"{closed}; nothing was sent. Open the journal again (a new Journal or Session)"
        case (
            Enqueue()
            | SetStatus()
            | PauseOrigin()
            | RebasePause()
            | RebaseOperation()
            | _commands_lazy.Act()
            | _commands_lazy.LookUpLater()
            | _commands_lazy.Unpause()
            | _commands_lazy.SwapPause()
            | None
        ):
            return f"{closed}; this write was not journaled. Open the journal again to retry it"
        case _:
            assert_never(command)


def _after_fork_in_child() -> None:
    """Every journal of the parent is the parent's: a child must open its own."""
    for journal in list(_OPEN):
        journal._forked_from = journal._opened_in
        journal._writer.after_fork()
        journal._store.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def __getattr__(name: str) -> Any:
    """`JournalStats` and `AuditEntry` (in ``__all__``), made when first named (`_rows`)."""
    if name not in ("JournalStats", "AuditEntry"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_rows, name)
