"""What every flow of one Session or Transport shares: its configuration."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import attrs

from idempotently._answers import DEFAULT_MAX_RESPONSE_BYTES
from idempotently._budget import BUDGETS, RetryBudgets
from idempotently._codec import Codec
from idempotently._commands import Lease
from idempotently._flow._leases import _HOST, new_lease_owner
from idempotently._hooks import AsyncHook
from idempotently._keys import redaction_set
from idempotently._pauses import PauseBoard
from idempotently._policy import RetryPolicy
from idempotently._profiles import (
    GENERIC,
    MAX_DEFAULT_KEY_EXPIRY_MARGIN,
    ProfileRule,
    ServerProfile,
)
from idempotently._secret_params import (
    LiveValues,
    secret_param_names,
)

DEFAULT_LEASE_DURATION = 60.0
DEFAULT_WATCH_INTERVAL = 5.0
"""Seconds a worker waits when nothing is due (``resume --watch --interval``)."""


DEFAULT_KEY_EXPIRY_MARGIN = MAX_DEFAULT_KEY_EXPIRY_MARGIN
"""The margin of keys living 10 h or more (``_profiles.default_key_expiry_margin``): what
``stats --expiring-within`` counts by default."""


@attrs.define
class Config:
    """What every flow of one Session or Transport shares: its configuration."""

    policy: RetryPolicy = attrs.field(factory=RetryPolicy)
    profile: ServerProfile = GENERIC
    profile_rule: ProfileRule = "stored"
    """How operations' journaled profiles are read (``_profiles.ProfileRule``)."""
    clock: Callable[[], float] = time.time
    rand: Callable[[], float] = random.random
    redact_headers: frozenset[str] = attrs.field(factory=redaction_set)
    fingerprint_headers: tuple[str, ...] = ()
    lease_duration: float = DEFAULT_LEASE_DURATION
    key_expiry_margin: float | None = None
    """A margin given to this engine (a resume's ``--key-expiry-margin``): applied where it
    is larger than the one journaled with an operation's profile. None: the journaled one."""
    namespace: uuid.UUID | None = None
    """The journal's own namespace: a named operation's key is derived from it."""
    host_id: str = _HOST
    """This host's identity: lease owners are ``host_id:pid:token``; the pid of an owner
    is checked only when its host id is this one."""
    # Data at rest: the journal's codec and secret query parameters, and where a resume
    # finds the values of redacted parameters (the session's client params, --param-env).
    codec: Codec | None = None
    secret_params: frozenset[str] = attrs.field(factory=secret_param_names)
    param_values: LiveValues | None = None
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    """The largest final answer read and journaled (decoded bytes); a larger one is
    journaled with its status and headers only (`AnswerNotReadError`)."""
    hooks: tuple[AsyncHook, ...] = ()
    """Called with every event (``_events.py``), through the driver."""
    budgets: RetryBudgets = BUDGETS
    """The retry ledgers per origin the policy's budget is spent from: the process's."""
    pauses: PauseBoard = attrs.Factory(PauseBoard)
    """What this engine last read of its journal's origin pauses."""
    quiet_client: Callable[[], bool] | None = None
    """Asked before each call's attempts: True when nothing between the journal and the
    wire can change a request (a Session's client with no request hook but the library's
    and no ``auth``; a Transport, which journals after the client's hooks and auth flow
    ran), so an attempt whose key is bound to no credentials needs no `Gate`. None: every
    attempt is gated."""

    _resuming: Any = attrs.field(default=None, init=False, repr=False, eq=False)
    """This engine as a resume sends with (`Engine.resuming`), once made; not copied by
    `attrs.evolve`, so an engine with another policy makes its own."""

    def new_owner(self) -> str:
        """A new lease owner of this engine's host."""
        return new_lease_owner(self.host_id)

    def lease(self, operation_id: str, owner: str) -> Lease:
        """What a heartbeat needs to keep ``owner``'s lease on the operation alive."""
        return Lease(operation_id, owner, self.lease_duration, self.clock)
