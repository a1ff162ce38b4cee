"""The faces' argument checks: a wrong type or value is an error before anything is
journaled or sent.
"""

from __future__ import annotations

import httpx

from idempotently._numbers import as_float
from idempotently._vocabulary import DELIVERIES

MAX_OPERATION_ID_LENGTH = 255


MAX_HOST_ID_LENGTH = 128


def check_host_id(host_id: object) -> str:
    """A valid host identity (what lease owners start with), or a ValueError saying why not."""
    if not isinstance(host_id, str):
        raise TypeError(f"host_id must be a str (e.g. 'worker-3'), not {type(host_id).__name__}")
    if not host_id or len(host_id) > MAX_HOST_ID_LENGTH:
        raise ValueError(
            f"host_id must be 1 to {MAX_HOST_ID_LENGTH} characters, not {len(host_id)}"
        )
    if ":" in host_id or not host_id.isprintable() or host_id != host_id.strip():
        raise ValueError(
            f"host_id {host_id[:60]!r} must be printable, without ':' or surrounding spaces "
            "(e.g. the pod or machine name)"
        )
    return host_id


def check_call_arguments(
    *,
    operation_id: object,
    idempotency_key: object,
    delivery: object,
    deadline_at: object,
) -> None:
    """The boundary: a wrong type or value is an error before anything is journaled or sent."""
    if operation_id is not None:
        if not isinstance(operation_id, str):
            raise TypeError(
                f"operation_id must be a str (e.g. 'order-42:charge'), not "
                f"{type(operation_id).__name__}"
            )
        if not operation_id or len(operation_id) > MAX_OPERATION_ID_LENGTH:
            raise ValueError(
                f"operation_id must be 1 to {MAX_OPERATION_ID_LENGTH} characters, not "
                f"{len(operation_id)}; leave it out to have one generated"
            )
        if not operation_id.isprintable():
            raise ValueError(
                f"operation_id {operation_id[:60]!r} holds control characters; use "
                "printable characters only"
            )
    if idempotency_key is not None and not isinstance(idempotency_key, str):
        raise TypeError(f"idempotency_key must be a str, not {type(idempotency_key).__name__}")
    if delivery not in DELIVERIES:
        raise ValueError(f"delivery must be 'exactly_once' or 'at_most_once', not {delivery!r}")
    if deadline_at is not None:
        if isinstance(deadline_at, bool) or not isinstance(deadline_at, (int, float)):
            raise TypeError(
                "deadline_at must be seconds since the epoch (a number, e.g. "
                f"time.time() + 3600), not {type(deadline_at).__name__}"
            )
        if not (0 < deadline_at < 1e11):  # 1e11 s is the year 5138: a unit mistake
            raise ValueError(
                f"deadline_at must be seconds since the epoch (e.g. time.time() + 3600), "
                f"not {deadline_at!r}"
            )


_INFINITY = float("inf")


def check_timeouts(request: httpx.Request) -> None:
    """The request's timeouts (from ``timeout=``) are seconds or None, before anything is
    journaled: httpx would only fail on them at the socket."""
    timeouts = request.extensions.get("timeout") or {}
    if not isinstance(timeouts, dict):
        # httpx reads it with .get at the socket: anything else fails there, unexplained.
        raise TypeError(
            'request.extensions["timeout"] must be a dict of seconds per phase, as httpx '
            f"builds it from timeout= (httpx.Timeout(...).as_dict()), not a "
            f"{type(timeouts).__name__}: pass timeout= instead"
        )
    for phase, value in timeouts.items():
        if value is None:
            continue
        if type(value) is not float and (  # a float (the usual case) needs no more looks
            isinstance(value, bool) or not isinstance(value, (int, float))
        ):
            raise TypeError(
                f"timeout must be seconds (a number), None or an httpx.Timeout; its {phase} "
                f"timeout is a {type(value).__name__}"
            )
        # As a float first: an int past a float's range (10**400) passes any comparison
        # and would overflow only at the socket, after the operation is journaled.
        seconds = as_float(value, f"timeout ({phase})")
        if not (0 < seconds < _INFINITY):
            raise ValueError(
                f"timeout must be a finite number of seconds > 0, not {value!r} (its {phase} "
                "timeout); None waits without a limit"
            )
