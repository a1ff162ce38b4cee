"""The switches that make the mock server imitate one real server or another."""

from __future__ import annotations

from typing import Literal

import attrs

DEFAULT_STALE_AFTER = 90.0
"""Seconds after which an `in_progress` key is presumed abandoned (Leach's STALE_AFTER)."""

DEFAULT_KEY_TTL = 24 * 60 * 60.0
"""Seconds a key is remembered, as Stripe does: after that a reused key is a new request."""

DEFAULT_MAX_KEY_LENGTH = 255

DEFAULT_IN_PROGRESS_RETRY_AFTER = 1
"""Seconds announced in `Retry-After` when in-progress is answered with 423."""

DEFAULT_IN_PROGRESS_WAIT = 10.0
"""Longest a request waits for an in-flight twin in "wait" mode before answering 409."""

DEFAULT_NAIVE_GAP = 0.05
"""Seconds between the naive SELECT and INSERT: the window in which the race is lost."""

InProgressStyle = Literal["409", "423", "wait"]
MismatchStyle = Literal["422", "stripe"]
KeyFormat = Literal["bare", "quoted"]
ClaimStyle = Literal["atomic", "naive"]


@attrs.frozen(kw_only=True)
class MockServerConfig:
    """How the mock server behaves; the defaults are the server of
    Leach's "Implementing Stripe-like Idempotency Keys in Postgres".
    """

    stale_after: float = DEFAULT_STALE_AFTER
    """Age of an `in_progress` lock after which one retry may take it over."""
    key_ttl: float = DEFAULT_KEY_TTL
    """How long a key is remembered before the sweeper deletes it."""
    provider_latency: float = 0.0
    """Seconds every call to the fake provider takes, so concurrent retries overlap with the
    request doing the work."""
    in_progress: InProgressStyle = "409"
    """Answer a key in progress with `"409"` (as Leach's article does), `"423"` plus
    `Retry-After` (some API gateways), or `"wait"`: hold the request until the first one
    finishes and replay its response."""
    in_progress_retry_after: int = DEFAULT_IN_PROGRESS_RETRY_AFTER
    """The Retry-After, in seconds, of a 423 answer (with `in_progress="423"`)."""
    in_progress_wait: float = DEFAULT_IN_PROGRESS_WAIT
    """With `in_progress="wait"`: the longest a request waits, in seconds, for the one doing the
    work."""
    mismatch: MismatchStyle = "422"
    """Answer a reused key with a different payload with `"422"` (problem+json) or `"stripe"`
    (400 with an `idempotency_error` body)."""
    store_server_errors: bool = True
    """Replay a 500 that happened after the side effect (Stripe's rule, the default) or mark the
    key `failed` so a retry runs again."""
    key_format: KeyFormat = "bare"
    """Take the `Idempotency-Key` header verbatim (`"bare"`) or require an RFC 8941 sf-string
    (`"quoted"`, the IETF draft)."""
    max_key_length: int = DEFAULT_MAX_KEY_LENGTH
    """The longest `Idempotency-Key` accepted; a longer one is a 400."""
    claim: ClaimStyle = "atomic"
    """The race-free `INSERT … ON CONFLICT DO NOTHING RETURNING` (`"atomic"`), or `"naive"`
    (SELECT, await `naive_gap`, INSERT), which exists only so a test can show that the
    concurrency test can fail."""
    naive_gap: float = DEFAULT_NAIVE_GAP
    """With `claim="naive"`: seconds between the SELECT and the INSERT, the window a race needs."""

    def __attrs_post_init__(self) -> None:
        _choose("in_progress", self.in_progress, ("409", "423", "wait"))
        _choose("mismatch", self.mismatch, ("422", "stripe"))
        _choose("key_format", self.key_format, ("bare", "quoted"))
        _choose("claim", self.claim, ("atomic", "naive"))
        for name in ("stale_after", "key_ttl", "provider_latency", "in_progress_wait", "naive_gap"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)!r}")
        if self.max_key_length < 1:
            raise ValueError(f"max_key_length must be positive, got {self.max_key_length!r}")


def _choose(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
