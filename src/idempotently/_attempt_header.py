"""Attempt metadata on the wire: ``ServerProfile(attempt_header=...)``.

Each send of a journaled operation carries its attempt's number, counted from the
journal (the operation's journaled attempts that reached the server + 1, across
processes and resumes: those `max_total_attempts` counts, so ``n`` never exceeds ``M``), and
``; max=M`` only when a cross-process maximum applies. Loaded by the flow only when a
profile names the header: nothing is paid when it is off.
"""

from __future__ import annotations

import httpx

from idempotently._policy import RetryPolicy


def attempt_maximum(policy: RetryPolicy) -> int | None:
    """The most attempts the journal lets the operation make across every process, the
    ``M`` of ``n; max=M``; None when none applies.

    The only such maximum is ``RetryPolicy.max_total_attempts`` (resume applies the
    stricter of the journaled and the given one before the policy reaches here);
    ``max_attempts`` bounds one call, not the operation, so it is no ``M``.
    """
    return policy.max_total_attempts


def attempt_value(attempt: int, maximum: int | None) -> str:
    """The header's value: ``3``, or ``3; max=5``."""
    return str(attempt) if maximum is None else f"{attempt}; max={maximum}"


def mark_attempt(request: httpx.Request, header: str, attempt: int, policy: RetryPolicy) -> None:
    """Set ``header`` on the request about to leave as attempt number ``attempt``."""
    request.headers[header] = attempt_value(attempt, attempt_maximum(policy))
