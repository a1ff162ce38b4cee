"""An in-memory journal store: the ``Store`` interface as dicts, for the contract suite and
the writer's own tests. Each batch is all or nothing per write, as a savepoint makes it."""

from __future__ import annotations

import copy
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import attrs

from idempotently._commands import (
    BindCredentials,
    ClaimDue,
    Enqueue,
    ExtendLeases,
    Find,
    Insert,
    PauseOrigin,
    Pauses,
    RebaseOperation,
    RebasePause,
    Record,
    Release,
    RenewLease,
    SetStatus,
    TakeLease,
)
from idempotently._commands_rare import Act, LookUpLater, Queue, SwapPause, Unpause, Write
from idempotently._rows import (
    Attempt,
    AuditEntry,
    Durability,
    Failed,
    JournalStats,
    Operation,
    OriginPause,
)
from idempotently._vocabulary import FINISHED_STATUSES, STATUSES, Status


class MemoryStore:
    """Operations in a dict, in insertion order; ``commits`` records each batch."""

    def __init__(self, durability: Durability = "fsync") -> None:
        self.path = ":memory-store:"
        self.durability: Durability = durability
        self.readonly = False
        self.rows: dict[str, Operation] = {}
        self.audit_entries: list[AuditEntry] = []
        self.commits: list[tuple[int, bool]] = []
        self._lock = threading.Lock()
        self._namespace = uuid.uuid4()
        self.pauses: dict[tuple[str, str], OriginPause] = {}

    @property
    def namespace(self) -> uuid.UUID:
        return self._namespace

    @property
    def schema_version(self) -> int:
        return 0

    def check_identity(self) -> None:
        pass

    def after_fork(self) -> None:
        self._lock = threading.Lock()

    def close(self) -> None:
        pass

    # -- writes ----------------------------------------------------------------------

    def commit(self, writes: Sequence[Write], durable: bool) -> list[Any]:
        with self._lock:
            self.commits.append((len(writes), durable))
            results: list[Any] = []
            for write in writes:
                saved, audited = dict(self.rows), list(self.audit_entries)
                try:
                    results.append(self._apply(write))
                except Exception as error:
                    # The write's savepoint, rolled back.
                    self.rows, self.audit_entries = saved, audited
                    results.append(Failed(error))
            return results

    def _apply(self, write: Write) -> Any:
        if isinstance(write, PauseOrigin):
            known = self.pauses.get((write.origin, write.credentials))
            if known is None or write.until > known.until:
                self.pauses[(write.origin, write.credentials)] = OriginPause(
                    write.origin, write.credentials, write.until, write.reason, write.set_at
                )
            return None
        if isinstance(write, RebaseOperation):
            row = self.rows.get(write.operation_id)
            if (
                row is None
                or row.status != "pending"
                or row.updated_at != write.updated_at
                or not row.updated_at > write.now
            ):
                return None
            row = self._rebase(row, write.now)
            return (row.not_before, row.lease_until)
        if isinstance(write, RebasePause):
            known = self.pauses.get((write.origin, write.credentials))
            if known is not None and known.set_at > write.now:
                known = OriginPause(
                    known.origin,
                    known.credentials,
                    write.now + (known.until - known.set_at),
                    known.reason,
                    write.now,
                )
                self.pauses[(write.origin, write.credentials)] = known
            return known
        if isinstance(write, SwapPause):
            scope = (write.origin, write.credentials)
            known = self.pauses.get(scope)
            if (
                known is not None
                and known.reason == write.expect
                and (write.ended_by is None or known.until <= write.ended_by)
            ):
                if write.new is None:
                    del self.pauses[scope]
                else:
                    self.pauses[scope] = write.new
            return self.pauses.get(scope)
        if isinstance(write, Unpause):
            lifted = [pause for pause in self.pauses.values() if pause.origin == write.origin]
            for pause in lifted:
                del self.pauses[(pause.origin, pause.credentials)]
            return lifted
        if isinstance(write, Enqueue):
            # Enqueued: unleased, its first send not begun.
            return self._apply(Insert(write.new, None, 0.0))  # type: ignore[arg-type]
        if isinstance(write, Insert):
            new = write.new
            if new.operation_id in self.rows or any(
                row.key == new.key for row in self.rows.values()
            ):
                return False
            self.rows[new.operation_id] = new.as_row(write.owner, write.lease_until)
            return True
        if isinstance(write, Record):
            return self._record(write)
        if isinstance(write, TakeLease):
            row = self.rows.get(write.operation.operation_id)
            read = write.operation
            if (
                row is None
                or row.status != "pending"
                or (row.lease_until, row.lease_owner, row.updated_at, row.attempt_count)
                != (read.lease_until, read.lease_owner, read.updated_at, read.attempt_count)
            ):
                return False
            self._set(row, lease_owner=write.owner, lease_until=write.lease_until)
            self._set(self.rows[row.operation_id], updated_at=write.now)
            if row.enqueued_at is not None and row.first_send_at is None:
                # The first send of an enqueued operation begins with this lease.
                self._set(
                    self.rows[row.operation_id],
                    first_send_at=write.now,
                    key_expires_at=write.now + (row.key_expires_at - row.created_at),
                )
            return True
        if isinstance(write, BindCredentials):
            row = self.rows.get(write.operation_id)
            if (
                row is None
                or row.status != "pending"
                or row.lease_owner != write.owner
                or row.credentials_digest is not None
            ):
                return False
            self._set(row, credentials_digest=write.record)
            return True
        if isinstance(write, RenewLease):
            row = self.rows.get(write.operation_id)
            if row is None or row.status != "pending" or row.lease_owner != write.owner:
                return False
            self._set(row, lease_until=write.lease_until, updated_at=write.now)
            return True
        if isinstance(write, SetStatus):
            row = self.rows.get(write.operation_id)
            if row is None or row.status != write.expect:
                return False
            self._set(
                row,
                status=write.status,
                reason=write.reason,
                updated_at=write.now,
                lease_owner=None,
                lease_until=0.0,
            )
            return True
        if isinstance(write, Release):
            row = self.rows.get(write.operation_id)
            if row is not None and row.lease_owner == write.owner:
                self._set(row, lease_owner=None, lease_until=0.0)
            return None
        if isinstance(write, ExtendLeases):
            extended = 0
            for operation_id, owner in write.leases:
                row = self.rows.get(operation_id)
                if row is not None and row.lease_owner == owner and row.status == "pending":
                    self._set(
                        row,
                        lease_until=max(row.lease_until, write.lease_until),
                        updated_at=write.now,
                    )
                    extended += 1
            return extended
        if isinstance(write, ClaimDue):
            for row in list(self.rows.values()):
                if row.status == "pending" and row.updated_at > write.written_ahead():
                    self._rebase(row, write.now)
            due = sorted(
                (
                    row
                    for row in self.rows.values()
                    if row.status == "pending"
                    and row.lease_until <= write.now
                    and (row.not_before or 0) <= write.now
                ),
                key=lambda row: (row.created_at, row.operation_id),
            )[: write.limit]
            for row in due:
                self._set(
                    row,
                    lease_owner=write.owner,
                    lease_until=write.lease_until,
                    updated_at=write.now,
                )
            return [self.rows[row.operation_id] for row in due]
        if isinstance(write, Act):
            return self._act(write)
        if isinstance(write, LookUpLater):
            row = self.rows.get(write.operation_id)
            if row is None or row.status != "needs_reconcile":
                return False
            self._set(row, lookup_after=write.lookup_after)
            self._audit(write.audit, write.now)
            return True
        raise TypeError(f"not a journal write: {write!r}")

    # -- the operator's journal --------------------------------------------------------

    def _act(self, write: Act) -> bool:
        row = self.rows.get(write.operation_id)
        fork = write.fork
        if (
            row is None
            or (row.status, row.lease_owner, row.lease_until, row.updated_at)
            != (
                write.expect_status,
                write.expect_lease_owner,
                write.expect_lease_until,
                write.expect_updated_at,
            )
            or (
                fork is not None
                and (
                    fork.operation_id in self.rows
                    or any(other.key == fork.key for other in self.rows.values())
                )
            )
        ):
            return False
        changes: dict[str, Any] = {
            "status": write.status,
            "reason": write.reason,
            "updated_at": write.now,
            "lease_owner": None,
            "lease_until": 0.0,
        }
        if write.due_now:
            changes.update(not_before=None, lookup_after=None)
        if write.sets_answer:
            changes.update(
                response_status=write.response_status,
                response_headers=None
                if write.response_headers is None
                else tuple(write.response_headers),
                response_body=write.response_body,
            )
        self._set(row, **changes)
        if fork is not None:
            self.rows[fork.operation_id] = attrs.evolve(
                attrs.evolve(fork, enqueued_at=write.now).as_row(),
                forked_from=write.operation_id,
                codec=row.codec,
                secret_params=row.secret_params,
                credentials_digest=row.credentials_digest,
                overrides=row.overrides,
                body_digest=row.body_digest,
            )
        for note in write.audit:
            self._audit(note, write.now)
        return True

    def _audit(self, note: Any, now: float) -> None:
        self.audit_entries.append(
            AuditEntry(
                seq=len(self.audit_entries) + 1,
                operation_id=note.operation_id,
                at=now,
                actor=note.actor,
                action=note.action,
                note=note.note,
                detail=note.detail,
            )
        )

    def audit(self, operation_id: str) -> list[AuditEntry]:
        with self._lock:
            return [entry for entry in self.audit_entries if entry.operation_id == operation_id]

    def _set(self, row: Operation, **changes: Any) -> None:
        self.rows[row.operation_id] = attrs.evolve(row, **changes)

    def _rebase(self, row: Operation, now: float) -> Operation:
        """A row written by a clock ahead of ``now``: every time moved to our clock."""
        shift = now - row.updated_at
        self._set(
            row,
            not_before=None if row.not_before is None else row.not_before + shift,
            lease_until=row.lease_until + shift if row.lease_until > 0 else row.lease_until,
            updated_at=now,
        )
        return self.rows[row.operation_id]

    def _record(self, write: Record) -> None:
        row = self.rows.get(write.operation_id)
        if row is None:
            return
        record = write.record
        attempt = Attempt(
            number=row.attempt_count + 1,
            started_at=record.started_at,
            elapsed=record.elapsed,
            outcome=record.outcome,
            status_code=record.status_code,
            replayed=record.replayed,
            error=record.error,
            wait=record.wait,
        )
        counted = {"attempt_count": row.attempt_count + 1, "attempts": (*row.attempts, attempt)}
        holds = write.owner is None or (row.status == "pending" and row.lease_owner == write.owner)
        if not holds:
            self._set(row, **counted)  # the holder's updated_at stays: its clock's
            return
        self._set(
            row,
            **counted,
            updated_at=write.now,
            status=record.status,
            reason=record.reason,
            not_before=record.not_before,
            last_status_code=record.status_code
            if record.status_code is not None
            else row.last_status_code,
            response_status=record.response_status,
            response_headers=None
            if record.response_headers is None
            else tuple(record.response_headers),
            response_body=record.response_body,
            lease_until=record.lease_until,
            lease_owner=row.lease_owner if record.lease_until > 0 else None,
        )

    def origin_pauses(self, *, now: float) -> list[OriginPause]:
        with self._lock:
            running = [
                pause
                for pause in self.pauses.values()
                if pause.until > now or (pause.reason or "").startswith("circuit breaker")
            ]
        return sorted(running, key=lambda pause: pause.until)

    def _execute(self, command: Any) -> Any:
        """What ``Journal._execute`` does: a read here, a write as a batch of one."""
        if isinstance(command, Find):
            return self.find(command.operation_id, command.key)
        if isinstance(command, Queue):
            return self.queue(command.statuses)
        if isinstance(command, Pauses):
            return self.origin_pauses(now=command.now)
        (outcome,) = self.commit([command], False)
        if isinstance(outcome, Failed):
            raise outcome.error
        return outcome

    # -- reads -----------------------------------------------------------------------

    def find(self, operation_id: str | None, key: str | None) -> Operation | None:
        with self._lock:
            if operation_id is not None and operation_id in self.rows:
                return copy.copy(self.rows[operation_id])
            if key is not None:
                return next((row for row in self.rows.values() if row.key == key), None)
            return None

    def operation(self, operation_id_or_key: str, *, damaged: bool = False) -> Operation | None:
        return self.find(operation_id_or_key, operation_id_or_key)

    def group(self, group_id: str) -> list[Operation]:
        with self._lock:
            steps = [copy.copy(row) for row in self.rows.values() if row.group_id == group_id]
        return sorted(steps, key=lambda row: (row.step or 0, row.created_at, row.operation_id))

    def queue(self, statuses: Sequence[Status]) -> list[Operation]:
        with self._lock:
            return [copy.copy(row) for row in self.rows.values() if row.status in statuses]

    def operations(
        self,
        *,
        status: Status | Sequence[Status] | None = None,
        since: float | None = None,
        limit: int | None = None,
        newest_first: bool = True,
    ) -> list[Operation]:
        wanted = None if status is None else {status} if isinstance(status, str) else set(status)
        with self._lock:
            found = [
                attrs.evolve(row, attempts=())
                for row in self.rows.values()
                if (wanted is None or row.status in wanted)
                and (since is None or row.created_at >= since)
            ]
        if newest_first:
            found.reverse()
        return found if limit is None else found[:limit]

    def recount(self) -> None:
        """Nothing to recount: counts() counts the rows at each read."""

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        with self._lock:
            for row in self.rows.values():
                counts[row.status] += 1
        return counts

    def stats(
        self, *, now: float, stuck_after: float = 60.0, expiring_within: float | None = None
    ) -> JournalStats:
        with self._lock:
            rows = list(self.rows.values())
        attempts = [attempt for row in rows for attempt in row.attempts]
        pending = [row for row in rows if row.status == "pending"]
        return JournalStats(
            counts=self.counts(),
            operations=len(rows),
            attempts=len(attempts),
            answered_attempts=sum(a.status_code is not None for a in attempts),
            replayed_attempts=sum(a.replayed for a in attempts),
            in_progress_attempts=sum(a.status_code in (409, 423) for a in attempts),
            oldest_pending_created_at=min((row.created_at for row in pending), default=None),
            stuck=sum(
                row.lease_until < now
                and row.updated_at < now - stuck_after
                and (row.not_before or 0) <= now
                for row in pending
            ),
            now=now,
            expiring=None
            if expiring_within is None
            else sum(row.key_expires_at <= now + expiring_within for row in pending),
            expiring_within=expiring_within,
        )

    def prune(self, *, older_than: float, now: float, dry_run: bool = False) -> int:
        with self._lock:
            linked = {row.forked_from for row in self.rows.values() if row.forked_from}
            doomed = [
                row.operation_id
                for row in self.rows.values()
                if row.status in FINISHED_STATUSES
                and row.updated_at < now - older_than
                and row.operation_id not in linked  # a fork links to it: kept
            ]
            if not dry_run:
                for operation_id in doomed:
                    del self.rows[operation_id]
                gone = set(doomed)
                self.audit_entries = [
                    entry for entry in self.audit_entries if entry.operation_id not in gone
                ]
        return len(doomed)
