"""A call's own policy and timeouts, as the journal keeps them for resume.

``Session.post(..., policy=, timeout=)`` overrides the session's for one
operation; the journal's ``operations.overrides`` column holds them as JSON so
that a resume (library or CLI) sends the operation as its caller asked. (The
call's ``profile=`` needs no entry here: every operation journals the profile
it was made under.) Nothing here does I/O.
"""

from __future__ import annotations

import json
import math
from typing import Any

from idempotently._budget import RetryBudget
from idempotently._policy import RetryPolicy

_POLICY_FIELDS = (
    "max_attempts",
    "deadline",
    "initial_backoff",
    "max_backoff",
    "max_retry_after",
    "in_progress_retries",
)
_TIMEOUT_PHASES = ("connect", "read", "write", "pool")

Timeouts = dict[str, float | None]


def check_call_policy(policy: object) -> None:
    """A per-call policy that can be journaled, or a TypeError/ValueError saying why not."""
    if not isinstance(policy, RetryPolicy):
        raise TypeError(f"policy must be an idempotently.RetryPolicy, not {type(policy).__name__}")
    if policy.wait is not None or policy.stop is not None:
        raise ValueError(
            "a per-call policy is journaled with its operation so that resume uses it, and a "
            "custom wait= or stop= strategy cannot be journaled: give this call's limits as "
            "max_attempts, deadline, initial_backoff, max_backoff and max_retry_after, or "
            "set the strategy on the Session's policy"
        )


def overrides_json(policy: RetryPolicy | None, timeouts: Timeouts | None) -> str | None:
    """The ``overrides`` column for a call's own policy and timeouts (None: neither)."""
    if policy is None and timeouts is None:
        return None
    document: dict[str, Any] = {}
    if policy is not None:
        fields: dict[str, Any] = {name: getattr(policy, name) for name in _POLICY_FIELDS}
        budget = policy.budget
        fields["budget"] = (
            None
            if budget is None
            else {"ratio": budget.ratio, "min_per_second": budget.min_per_second}
        )
        if policy.max_total_attempts is not None:
            # Only when set: an entry without it reads the same in an older version.
            fields["max_total_attempts"] = policy.max_total_attempts
        document["policy"] = fields
    if timeouts is not None:
        document["timeout"] = {phase: timeouts.get(phase) for phase in _TIMEOUT_PHASES}
    return json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)


def read_overrides(text: str) -> tuple[RetryPolicy | None, Timeouts | None]:
    """The policy and timeouts `overrides_json` wrote; ValueError saying what is
    wrong with a damaged (or newer) entry, never a guess."""
    try:
        document = json.loads(text)
    except ValueError as error:
        raise ValueError(f"its journaled overrides are not JSON ({error})") from None
    if not isinstance(document, dict) or set(document) - {"policy", "timeout"}:
        raise ValueError(
            "its journaled overrides hold entries this version does not know (written by a "
            "newer idempotently?)"
        )
    policy = None
    if "policy" in document:
        fields = document["policy"]
        if not isinstance(fields, dict) or set(fields) - {
            *_POLICY_FIELDS,
            "budget",
            "max_total_attempts",
        }:
            raise ValueError("its journaled policy holds fields this version does not know")
        budget = fields.pop("budget", None)
        try:
            policy = RetryPolicy(**fields, budget=None if budget is None else RetryBudget(**budget))
        except (TypeError, ValueError) as error:
            raise ValueError(f"its journaled policy is not valid ({error})") from None
    timeouts = None
    if "timeout" in document:
        phases = document["timeout"]
        if not isinstance(phases, dict) or not all(
            phase in _TIMEOUT_PHASES and (value is None or _seconds(value) is not None)
            for phase, value in phases.items()
        ):
            raise ValueError(f"its journaled timeouts are not seconds per phase ({_shown(phases)})")
        timeouts = {
            phase: None if phases.get(phase) is None else _seconds(phases[phase])
            for phase in _TIMEOUT_PHASES
        }
    return policy, timeouts


def _seconds(value: object) -> float | None:
    """A journaled timeout as a float, or None if it is none: 1e999 and NaN are what
    JSON reads as inf and nan, and an int past a float's range overflows at the socket."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    return seconds if 0 <= seconds < math.inf else None


def _shown(document: object) -> str:
    """A journaled document as it may be quoted in one line (an int of 400 digits is not)."""
    text = json.dumps(document, default=str)
    return text if len(text) <= 120 else text[:117] + "..."
