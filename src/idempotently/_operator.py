"""Operator actions on one operation: settle, abandon, retry, fork (pure planning).

An operator paged at night acts on one operation (``Journal.settle``, ``abandon``,
``retry_now``, ``fork``; the CLI's ``settle``, ``abandon``, ``retry``, ``fork``).
This module decides, from the operation as read, whether the action makes sense
now and which one write (`idempotently._commands_rare.Act`) carries it out,
audit entries included. The journal hands that write to its one writer, where it
is a compare-and-swap on the row read: if anyone changed the operation meanwhile
(another operator, a live call taking its lease), nothing is written and the
action is planned again from the new row, or refused.
"""

from __future__ import annotations

import getpass
import json
import re
import socket
import uuid
from collections.abc import Iterable
from typing import Literal

import attrs

from idempotently._commands_rare import Act, AuditNote
from idempotently._exceptions import (
    ErrorContext,
    OperationInProgressError,
    OperatorActionError,
    StoredProfileError,
)
from idempotently._keys import derived_key
from idempotently._policy import key_expiry_margin as expiry_margin_of
from idempotently._policy import key_past_margin, never_sent
from idempotently._profiles import GENERIC, ServerProfile, stored_profile
from idempotently._rows import AuditEntry, NewOperation, Operation
from idempotently._text import storable_text
from idempotently._vocabulary import Status

ActionName = Literal["settle", "abandon", "retry", "fork"]

MAX_NOTE_LENGTH = 2000
MAX_ACTOR_LENGTH = 200
MAX_OPERATION_ID_LENGTH = 255
FORK_MARK = "~fork"
_FORK_ID = re.compile(r"(.+)~fork([0-9]+)")

SETTLEABLE: tuple[Status, ...] = ("pending", "needs_reconcile", "abandoned")
ABANDONABLE: tuple[Status, ...] = ("pending", "needs_reconcile")
FORKABLE: tuple[Status, ...] = ("failed", "abandoned", "needs_reconcile")


def default_actor() -> str:
    """``user@host``: the OS user name and this machine's name."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in the environment nor the password database
        user = "unknown"
    host = socket.gethostname() or "localhost"
    return f"{user}@{host}"[:MAX_ACTOR_LENGTH]


def check_actor(actor: object) -> str:
    if actor is None:
        return default_actor()
    if not isinstance(actor, str):
        raise TypeError(f"actor must be a str (e.g. 'alice@ops'), not {type(actor).__name__}")
    if not actor.strip() or len(actor) > MAX_ACTOR_LENGTH or not actor.isprintable():
        raise ValueError(
            f"actor must be 1 to {MAX_ACTOR_LENGTH} printable characters, not {actor[:60]!r}"
        )
    return storable_text(actor)


def check_note(note: object, *, required: bool) -> str | None:
    if note is None:
        if required:
            raise ValueError(
                "note is required: say why (what you checked, e.g. 'no charge in the "
                "dashboard'), it is kept in the operation's audit trail"
            )
        return None
    if not isinstance(note, str):
        raise TypeError(f"note must be a str, not {type(note).__name__}")
    if required and not note.strip():
        raise ValueError("note must say why; it is kept in the operation's audit trail")
    if len(note) > MAX_NOTE_LENGTH:
        raise ValueError(f"note must be at most {MAX_NOTE_LENGTH} characters, not {len(note)}")
    return storable_text(note)


def fork_root(operation: Operation) -> str:
    """The id its chain of forks is numbered under: a fork's root (``op-1`` for
    ``op-1~fork2``), else its own."""
    found = _FORK_ID.fullmatch(operation.operation_id)
    if operation.forked_from is not None and found is not None:
        return found.group(1)
    return operation.operation_id


def recorded_forks(entries: Iterable[AuditEntry]) -> tuple[str, ...]:
    """The ids of the forks an audit trail says its operation made, oldest first."""
    forks = []
    for entry in entries:
        if entry.action != "fork" or entry.detail is None:
            continue
        try:
            detail = json.loads(entry.detail)
        except ValueError:
            continue
        fork = detail.get("fork") if isinstance(detail, dict) else None
        if isinstance(fork, str):
            forks.append(fork)
    return tuple(forks)


def fork_id_of(operation: Operation, taken: Iterable[str] = ()) -> str:
    """The id of the fork of ``operation``: ``<id>~fork1``; a fork's own fork counts on
    (``<id>~fork2``), so the chain keeps its root's id.

    Never a number any fork in ``taken`` had (the forks of the chain its audit trails
    record): a fork pruned from the journal may still be remembered by the server under
    its derived key, so its number is never given again."""
    root, number = fork_root(operation), 1
    found = _FORK_ID.fullmatch(operation.operation_id)
    if root != operation.operation_id and found is not None:
        number = int(found.group(2)) + 1
    for fork in taken:
        used = _FORK_ID.fullmatch(fork)
        if used is not None and used.group(1) == root:
            number = max(number, int(used.group(2)) + 1)
    return f"{root}{FORK_MARK}{number}"


def fork_operation(
    operation: Operation, namespace: uuid.UUID, now: float, taken: Iterable[str] = ()
) -> NewOperation:
    """The new pending operation a fork makes: the same request bytes under a new id and
    so a new derived key (the key header rewritten), its key's lifetime from now."""
    new_id = fork_id_of(operation, taken)
    ids: ErrorContext = {"operation_id": operation.operation_id, "key": operation.key}
    if len(new_id) > MAX_OPERATION_ID_LENGTH:
        raise OperatorActionError(
            f"cannot fork: the fork's id would be {len(new_id)} characters, over the "
            f"{MAX_OPERATION_ID_LENGTH} an operation id may have; send it again under a "
            "new, shorter operation_id instead",
            **ids,
        )
    try:
        profile = stored_profile(
            operation.profile,
            GENERIC,
            "stored",
            operation_id=operation.operation_id,
            key=operation.key,
        )
    except StoredProfileError as error:
        raise OperatorActionError(
            f"cannot fork: {error.message}; nothing was written", **ids
        ) from None
    key = derived_key(namespace, new_id)
    rendered = profile.render_key(key)
    header = operation.key_header.lower()
    headers = [
        (name, rendered if name.lower() == header else value)
        for name, value in operation.request_headers
    ]
    return NewOperation(
        operation_id=new_id,
        key=key,
        delivery=operation.delivery,
        method=operation.method,
        url=operation.url,
        request_headers=headers,
        request_body=operation.request_body,
        fingerprint=operation.fingerprint,
        profile=operation.profile,
        key_header=operation.key_header,
        created_at=now,
        key_expires_at=now + profile.key_lifetime,
        # The operator's word overrides the old deadline (which has often passed).
        deadline_at=None,
        # Journaled as not yet sent: never "maybe delivered" before its first send, and
        # its key's lifetime starts with that send.
        enqueued_at=now,
    )


@attrs.frozen
class Plan:
    """What an action does to an operation: the one write, and what it leads to."""

    action: ActionName
    operation: Operation
    write: Act
    after: Operation
    """The operation as it will be (for a fork: the new operation)."""
    summary: str
    """What it does, in the imperative (``settle op-1 failed (it is needs_reconcile)``)."""


def live_lease(operation: Operation, now: float, alive: bool) -> bool:
    """Whether a caller is sending the operation now (``alive``: its owner is not
    provably gone, see ``_flow._leases.lease_owner_alive``)."""
    return operation.lease_owner is not None and operation.lease_until > now and alive


def plan(
    action: ActionName,
    operation: Operation,
    *,
    actor: str,
    note: str | None,
    now: float,
    lease_alive: bool,
    namespace: uuid.UUID | None = None,
    status: Status | None = None,
    key_expiry_margin: float | None = None,
    forks_taken: Iterable[str] = (),
) -> Plan:
    """The write that carries out ``action`` on ``operation`` (as read), or the error
    that says why it makes no sense now (`OperatorActionError`, or
    `OperationInProgressError` while a live lease is held). ``forks_taken``: the forks
    of its chain the journal records, whose numbers a fork never takes again."""
    ids: ErrorContext = {"operation_id": operation.operation_id, "key": operation.key}
    current = operation.status
    if live_lease(operation, now, lease_alive):
        raise OperationInProgressError(
            f"refused: {operation.lease_owner} holds this operation's lease until "
            f"{_when(operation.lease_until)} (a caller sending it, or a resume worker holding "
            "it back); nothing was written. Let it finish, or try again once the lease has "
            "run out",
            **ids,
        )

    def refuse(why: str) -> OperatorActionError:
        return OperatorActionError(f"cannot {action}: {why}; nothing was written", **ids)

    def act(
        new_status: Status, reason: str | None, detail: dict[str, object], **more: object
    ) -> Act:
        notes = [
            AuditNote(
                operation.operation_id,
                actor,
                action,
                note,
                json.dumps({"from": current, "to": new_status, **detail}, sort_keys=True),
            )
        ]
        fork = more.get("fork")
        if isinstance(fork, NewOperation):
            notes.append(
                AuditNote(
                    fork.operation_id,
                    actor,
                    "forked",
                    note,
                    json.dumps({"forked_from": operation.operation_id}, sort_keys=True),
                )
            )
        return Act(
            operation_id=operation.operation_id,
            expect_status=current,
            expect_lease_owner=operation.lease_owner,
            expect_lease_until=operation.lease_until,
            expect_updated_at=operation.updated_at,
            status=new_status,
            reason=None if reason is None else storable_text(reason),
            now=now,
            audit=tuple(notes),
            **more,  # type: ignore[arg-type]
        )

    said = f": {note}" if note else ""
    if action == "settle":
        if status not in ("succeeded", "failed"):
            raise ValueError(f"status must be 'succeeded' or 'failed', not {status!r}")
        if current not in SETTLEABLE:
            raise refuse(
                f"it is already {current} ({operation.reason or 'settled'}); a completed "
                "operation is never settled again (to send it once more, fork a failed one)"
            )
        if status == "succeeded" and never_sent(operation):
            raise refuse(
                "the journal proves it was never sent (it was enqueued and no send of it "
                "began), so it cannot have succeeded; let resume send it, or abandon it, or "
                "settle it failed"
            )
        reason = f"settled {status} by {actor}{said}"
        # The answer that left it undecided (a replayed 500) is not the answer of what
        # the operator settled: a call again must not return it as a success's.
        write = act(status, reason, {}, sets_answer=True)
        return Plan(
            action,
            operation,
            write,
            _after(operation, status, reason, now),
            f"settle {operation.operation_id} {status} (it is {current})",
        )
    if action == "abandon":
        if current not in ABANDONABLE:
            raise refuse(
                f"it is already {current}; only a pending or needs_reconcile operation can "
                "be abandoned"
            )
        reason = f"abandoned by {actor}{said}"
        write = act("abandoned", reason, {})
        return Plan(
            action,
            operation,
            write,
            _after(operation, "abandoned", reason, now),
            f"abandon {operation.operation_id} (it is {current}): it is never sent again",
        )
    if action == "retry":
        if current != "pending":
            raise refuse(
                f"it is {current}, and retry makes a pending operation due now (fork a "
                "failed, abandoned or needs_reconcile one to send it under a new key)"
            )
        # An enqueued operation never sent has a key no server has seen (its lifetime
        # starts at its first send), the rule resume applies.
        try:
            profile: ServerProfile | None = stored_profile(
                operation.profile,
                GENERIC,
                "stored",
                operation_id=operation.operation_id,
                key=operation.key,
            )
        except StoredProfileError:
            profile = None
        margin = expiry_margin_of(operation, profile, key_expiry_margin)
        if key_past_margin(operation, now, margin):
            raise refuse(
                f"its key expires at {_when(operation.key_expires_at)} (with resume's "
                f"{margin:g} s margin) and the server may have forgotten it, so "
                "a resend could act twice; look the object up, then settle it, or fork it"
            )
        write = act("pending", operation.reason, {}, due_now=True)
        return Plan(
            action,
            operation,
            write,
            attrs.evolve(
                operation, not_before=None, lookup_after=None, updated_at=now, attempts=()
            ),
            f"make {operation.operation_id} due now: the next resume sends it with its key",
        )
    # fork
    if current not in FORKABLE:
        if current == "pending":
            raise refuse(
                "it is pending: it is still sent with its own key (resume it, or `retry` "
                "it to make it due now); fork only a failed, abandoned or needs_reconcile "
                "operation"
            )
        raise refuse(
            f"it {current}: forking would do it a second time (for a new one, send it "
            "under a new operation_id)"
        )
    if namespace is None:
        raise refuse("the journal has no key namespace (open it once without readonly=True)")
    fork = fork_operation(operation, namespace, now, forks_taken)
    settles = current != "failed"
    kept = (
        f"settled failed by {actor} when forking it as {fork.operation_id}{said}"
        if settles
        else operation.reason
    )
    write = act("failed", kept, {"fork": fork.operation_id}, fork=fork, sets_answer=settles)
    summary = (
        f"fork {operation.operation_id} as {fork.operation_id} (new key {fork.key}, the same "
        "request bytes, pending)"
    )
    if settles:
        summary += f", and settle {operation.operation_id} failed (it is {current})"
    after = attrs.evolve(
        _fork_row(fork, operation.operation_id, now),
        codec=operation.codec,
        secret_params=operation.secret_params,
        credentials_digest=operation.credentials_digest,
        overrides=operation.overrides,
        body_digest=operation.body_digest,
    )
    return Plan(action, operation, write, after, summary)


def _after(operation: Operation, status: Status, reason: str | None, now: float) -> Operation:
    cleared = (
        {"response_status": None, "response_headers": None, "response_body": None}
        if status in ("succeeded", "failed")
        else {}
    )
    return attrs.evolve(
        operation,
        **cleared,  # type: ignore[arg-type]
        status=status,
        reason=reason,
        updated_at=now,
        lease_owner=None,
        lease_until=0.0,
        attempts=(),
    )


def _fork_row(fork: NewOperation, parent: str, now: float) -> Operation:
    """The fork as the journal holds it once written: enqueued now, never sent, linked."""
    return attrs.evolve(
        attrs.evolve(fork, enqueued_at=now).as_row(), updated_at=now, forked_from=parent
    )


def _when(timestamp: float) -> str:
    import datetime

    try:
        moment = datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc)
    except (OverflowError, OSError, ValueError):
        return f"{timestamp:g}"
    return moment.isoformat(timespec="seconds")
