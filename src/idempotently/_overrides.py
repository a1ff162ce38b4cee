"""A call's own policy and timeouts, as the journal keeps them for resume.

``Session.post(..., policy=, timeout=)`` overrides the session's for one
operation; the journal's ``operations.overrides`` column holds them as JSON so
that a resume (library or CLI) sends the operation as its caller asked. (The
call's ``profile=`` needs no entry here: every operation journals the profile
it was made under.) A request through a `Transport` says the same in its own
terms (`request_overrides`): httpx's ``extensions["timeout"]``,
``extensions["idempotently"]`` and the ``Idempotency-Policy`` header naming one of
the Transport's ``policies=``. Nothing here does I/O.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import attrs
import httpx

from idempotently._budget import RetryBudget
from idempotently._policy import RetryPolicy
from idempotently._profiles import ServerProfile, journaled_profile


class TransportSettings(Protocol):
    """What the overrides of a request read of the Transport's configuration (the
    flow's `Config` has it): the profile, and the headers it fingerprints and redacts."""

    @property
    def profile(self) -> ServerProfile: ...
    @property
    def redact_headers(self) -> frozenset[str]: ...
    @property
    def fingerprint_headers(self) -> tuple[str, ...]: ...


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
        breaker = policy.breaker
        if breaker is not None:
            # Only when set: an operation journaled without one reads as before.
            fields["breaker"] = attrs.asdict(breaker)
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
            "breaker",
            "max_total_attempts",
        }:
            raise ValueError("its journaled policy holds fields this version does not know")
        budget = fields.pop("budget", None)
        breaker = fields.pop("breaker", None)
        from idempotently._breaker import Breaker  # loaded with the first journaled one

        try:
            policy = RetryPolicy(
                **fields,
                budget=None if budget is None else RetryBudget(**budget),
                breaker=None if breaker is None else Breaker(**breaker),
            )
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


POLICY_HEADER = "Idempotency-Policy"
"""A request header naming one of a Transport's ``policies=`` for this request; it is
never sent on to the server nor journaled."""
EXTENSION_KEYS = ("policy", "profile")
"""What ``request.extensions["idempotently"]`` may hold."""
_POLICY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


def check_attempt_header(
    profile: ServerProfile, fingerprint_headers: Iterable[str], redact_headers: Iterable[str]
) -> None:
    """A ValueError if ``fingerprint_headers`` or ``redact_headers`` names the profile's
    attempt header: it differs on every attempt, so a fingerprint holding it would call
    each resend another request, and as a credential (what redacting makes a header) it
    would bind a key to attempt 1 and scope an origin pause to one attempt."""
    name = profile.attempt_header
    if name is None:
        return
    for option, headers, why in (
        (
            "fingerprint_headers",
            fingerprint_headers,
            "part of what makes two requests the same operation",
        ),
        ("redact_headers", redact_headers, "a credential (a resend would carry other credentials)"),
    ):
        if name.lower() in {header.lower() for header in headers}:
            raise ValueError(
                f"{option} names {name!r}, the attempt_header of profile {profile.name!r}: it "
                f"differs on every attempt, so it cannot be {why}; leave it out of {option}"
            )


def check_policies(policies: object) -> dict[str, RetryPolicy]:
    """A Transport's named ``policies=``: each name one an ``Idempotency-Policy`` header
    can carry, each policy one that can be journaled (`check_call_policy`)."""
    if policies is None:
        return {}
    if not isinstance(policies, Mapping):
        raise TypeError(
            "policies must be a mapping of names to idempotently.RetryPolicy (e.g. "
            f"{{'slow': RetryPolicy(deadline=600.0)}}), not {type(policies).__name__}"
        )
    checked: dict[str, RetryPolicy] = {}
    for name, policy in policies.items():
        if not isinstance(name, str) or not _POLICY_NAME.fullmatch(name):
            raise ValueError(
                "policies names must be 1 to 64 letters, digits, '_', '.', ':' or '-' (as an "
                f"{POLICY_HEADER} header carries them), not {str(name)[:70]!r}"
            )
        try:
            check_call_policy(policy)
        except (TypeError, ValueError) as error:
            raise type(error)(f"policies[{name!r}]: {error}") from None
        checked[name] = policy
    return checked


def request_overrides(
    request: httpx.Request,
    policies: Mapping[str, RetryPolicy],
    config: TransportSettings,
    *,
    journaled: bool,
) -> tuple[RetryPolicy | None, ServerProfile | None, str | None]:
    """The policy, the profile and the journaled ``overrides`` a request through a
    Transport asks for, its ``Idempotency-Policy`` header removed; a TypeError or
    ValueError, before anything is journaled or sent, for one that cannot be honoured.

    ``journaled``: the request is journaled as an operation, so its timeouts (httpx's
    ``extensions["timeout"]``, the client's or the request's own) are journaled with it
    and a resume applies them."""
    extensions = request.extensions
    given = extensions.get("idempotently")
    policy: RetryPolicy | None = None
    profile: ServerProfile | None = None
    if given is not None or POLICY_HEADER in request.headers:
        policy, profile = _asked(request, given, policies, config)
    if not journaled:
        return policy, profile, None
    timeouts = extensions.get("timeout")
    if not isinstance(timeouts, dict):
        return policy, profile, overrides_json(policy, None)
    if policy is None:
        get = timeouts.get
        return None, profile, _timeouts_json(get("connect"), get("read"), get("write"), get("pool"))
    return policy, profile, overrides_json(policy, timeouts)


def _asked(
    request: httpx.Request,
    given: object,
    policies: Mapping[str, RetryPolicy],
    config: TransportSettings,
) -> tuple[RetryPolicy | None, ServerProfile | None]:
    where = _where(request, config.profile.key_header)
    named = request.headers.get_list(POLICY_HEADER) or None
    policy: RetryPolicy | None = None
    profile: ServerProfile | None = None
    if given is not None:
        if not isinstance(given, Mapping):
            raise TypeError(
                'request.extensions["idempotently"] must be a dict with "policy" and/or '
                f'"profile", not {type(given).__name__}{where}; nothing was journaled or sent'
            )
        unknown = sorted(str(name)[:40] for name in given if name not in EXTENSION_KEYS)
        if unknown:
            raise ValueError(
                f'request.extensions["idempotently"] holds {", ".join(map(repr, unknown))}, '
                'which this version does not know (it knows "policy" and "profile")'
                f"{where}; nothing was journaled or sent"
            )
        try:
            if given.get("policy") is not None:
                check_call_policy(given["policy"])
                policy = given["policy"]
            if given.get("profile") is not None:
                profile = given["profile"]
                if not isinstance(profile, ServerProfile):
                    raise TypeError(
                        "profile must be an idempotently.ServerProfile (e.g. "
                        f"idempotently.profiles.STRIPE), not {type(profile).__name__}"
                    )
                journaled_profile(profile)
                check_attempt_header(profile, config.fingerprint_headers, config.redact_headers)
        except (TypeError, ValueError) as error:
            raise type(error)(
                f'request.extensions["idempotently"]: {error}{where}; nothing was journaled or sent'
            ) from None
    if named is not None:
        del request.headers[POLICY_HEADER]
        known = ", ".join(map(repr, sorted(policies))) or "none: pass Transport(policies=...)"
        if len(named) != 1 or named[0].strip(" \t") not in policies:
            raise ValueError(
                f"{POLICY_HEADER}: {', '.join(named)[:70]!r} names no policy of this "
                f"Transport (it knows {known}){where}; nothing was journaled or sent"
            )
        if policy is not None:
            raise ValueError(
                f'{POLICY_HEADER} and request.extensions["idempotently"]["policy"] both give '
                f"this request a policy{where}: give one; nothing was journaled or sent"
            )
        policy = policies[named[0].strip(" \t")]
    return policy, profile


def _where(request: httpx.Request, key_header: str) -> str:
    """`` (operation ID, key KEY)`` for the request's own operation id and key headers."""
    parts = [
        f"{label} {value[:100]!r}"
        for label, header in (("operation", "Idempotency-Operation-Id"), ("key", key_header))
        if (value := request.headers.get(header)) is not None
    ]
    return f" ({', '.join(parts)})" if parts else ""


@functools.lru_cache(maxsize=64)
def _timeouts_json(
    connect: float | None, read: float | None, write: float | None, pool: float | None
) -> str:
    """`overrides_json` of timeouts alone, once per distinct value: an httpx client puts
    the same timeouts on every request it sends."""
    timeouts = {"connect": connect, "read": read, "write": write, "pool": pool}
    return overrides_json(None, timeouts) or ""
