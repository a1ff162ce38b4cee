"""How a given API spells the idempotency-key contract."""

from __future__ import annotations

import json
import re
from typing import Literal

import attrs
import httpx

from idempotently._exceptions import InvalidKeyError

KeyFormat = Literal["token", "sf-string"]

DEFAULT_KEY_HEADER = "Idempotency-Key"
DEFAULT_KEY_LIFETIME = 24 * 60 * 60.0
DEFAULT_MAX_KEY_LENGTH = 255
REPLAY_MARKER_HEADERS = (
    "Idempotent-Replayed",
    "Idempotency-Replayed",
    "X-Idempotent-Replayed",
    "X-Idempotency-Replayed",
)
# Words a 409 (or 400) body uses when the key was reused with another payload,
# as opposed to "in progress" (Brandur's server answers 409 for both).
MISMATCH_BODY_MARKERS = (
    "mismatch",
    "different payload",
    "different parameters",
    "idempotency_error",
)

# Visible ASCII without the characters a quoted sf-string would need escaped:
# a key that is the same bytes in both formats is a key every server accepts.
_TRUE_VALUES = frozenset({b"true", b"?1", b"1"})

_KEY_CHARACTERS = re.compile(r"[!#-\[\]-~]+")


@attrs.frozen
class ServerProfile:
    """The server side of the contract, as one API implements it.

    Built-ins live in :mod:`idempotently.profiles`; adapt one with
    ``attrs.evolve(profiles.GENERIC, in_progress_statuses=frozenset({409, 423}))``.
    """

    name: str
    key_header: str = DEFAULT_KEY_HEADER
    key_format: KeyFormat = "token"
    max_key_length: int = DEFAULT_MAX_KEY_LENGTH
    key_lifetime: float = DEFAULT_KEY_LIFETIME
    """Seconds the server remembers a key; resume never resends an older one."""
    in_progress_statuses: frozenset[int] = frozenset({409})
    mismatch_statuses: frozenset[int] = frozenset({422})
    mismatch_error_types: frozenset[str] = frozenset()
    """Error ``type`` values in a JSON body that mean "key reused" (Stripe's 400)."""
    replay_headers: tuple[str, ...] = REPLAY_MARKER_HEADERS
    _replay_markers: frozenset[bytes] = attrs.field(init=False, repr=False, eq=False)

    @_replay_markers.default
    def _lowercase_replay_markers(self) -> frozenset[bytes]:
        return frozenset(name.lower().encode("latin-1") for name in self.replay_headers)

    def render_key(self, key: str) -> str:
        """The header value for ``key``, exactly as sent on every attempt."""
        if self.key_format == "sf-string":
            return f'"{key}"'
        return key

    def validate_key(self, key: str) -> None:
        if not key or len(key) > self.max_key_length:
            raise InvalidKeyError(
                f"idempotency key must be 1 to {self.max_key_length} characters for the "
                f"{self.name!r} profile; got {len(key)}",
                key=key,
            )
        if not _KEY_CHARACTERS.fullmatch(key):
            raise InvalidKeyError(
                "idempotency key may hold only visible ASCII characters, without quotes "
                "or backslashes; use a UUID or your own ASCII id",
                key=key,
            )

    def is_replay(self, response: httpx.Response) -> bool:
        """Whether the server says this response is a stored one."""
        markers = self._replay_markers
        return any(
            name.lower() in markers and value.strip().lower() in _TRUE_VALUES
            for name, value in response.headers.raw
        )

    def is_payload_mismatch(self, response: httpx.Response) -> bool:
        """Whether the server says the key was used before with another payload."""
        status = response.status_code
        if status in self.mismatch_statuses:
            return True
        if status not in {400, 409}:
            return False
        body = _body_text(response).lower()
        if status == 400:
            return _error_type(body) in self.mismatch_error_types
        return any(marker in body for marker in MISMATCH_BODY_MARKERS)

    def is_in_progress(self, response: httpx.Response) -> bool:
        return response.status_code in self.in_progress_statuses and not self.is_payload_mismatch(
            response
        )


def _body_text(response: httpx.Response) -> str:
    try:
        return response.content[:4096].decode("utf-8", "replace")
    except httpx.ResponseNotRead:
        return ""


def _error_type(body: str) -> str | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        kind = parsed["error"].get("type")
        return kind if isinstance(kind, str) else None
    return None


GENERIC = ServerProfile(name="generic")
"""``Idempotency-Key`` as a bare token, 24 h lifetime, 409 in progress, 422 mismatch."""

STRIPE = ServerProfile(
    name="stripe",
    mismatch_statuses=frozenset(),
    mismatch_error_types=frozenset({"idempotency_error"}),
)
"""Stripe: mismatch is ``400 {"error": {"type": "idempotency_error"}}``."""

IETF = ServerProfile(name="ietf", key_format="sf-string")
"""draft-ietf-httpapi-idempotency-key-header: the key is an RFC 8941 quoted string."""

BUILTIN_PROFILES = {profile.name: profile for profile in (GENERIC, STRIPE, IETF)}
