"""Origin pauses: a server's "leave me alone until then", shared through the journal.

A 429 or 503 with Retry-After pauses its origin (scheme, host, port) for the
credentials it was answered to, in the journal's ``origin_pauses`` table, so
every thread, process and resume worker sharing the journal waits instead of
sending. Each engine keeps what it last read of that table and reads it again
at most once every `REFRESH` seconds: a pause written by another process
is seen within that long, and a call pays no journal statement for it the rest
of the time. Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import uuid
from collections.abc import Iterable, Sequence

import attrs

from idempotently._rows import OriginPause

REFRESH = 1.0
"""Seconds an engine trusts its last read of the journal's pauses."""
PAUSE_STATUS_CODES = frozenset({429, 503})
"""Answers whose Retry-After pauses the whole origin."""


def credentials_digest(namespace: uuid.UUID | None, secrets: Sequence[str]) -> str:
    """A keyed digest of the credentials a request carries ('' without any): the scope of
    a pause, so one tenant's 429 does not pause another's. Keyed with the journal's own
    namespace (every process sharing the journal agrees); never the values themselves."""
    if not secrets:
        return ""
    key = b"idempotently-pause" if namespace is None else namespace.bytes
    message = b"\0".join(sorted(secret.encode("utf-8", "surrogatepass") for secret in set(secrets)))
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:32]


@attrs.define
class PauseBoard:
    """What one engine last read of its journal's origin pauses, by origin."""

    by_origin: dict[str, tuple[OriginPause, ...]] = attrs.Factory(dict)
    read_at: float = float("-inf")

    def stale(self, now: float) -> bool:
        return not (self.read_at <= now < self.read_at + REFRESH)

    def replace(self, pauses: Iterable[OriginPause], now: float) -> None:
        by_origin: dict[str, tuple[OriginPause, ...]] = {}
        for pause in pauses:
            by_origin[pause.origin] = (*by_origin.get(pause.origin, ()), pause)
        self.by_origin, self.read_at = by_origin, now  # one swap: threads read either

    def add(self, pause: OriginPause) -> None:
        """A pause this engine just journaled: known at once, without a read."""
        known = tuple(
            each
            for each in self.by_origin.get(pause.origin, ())
            if each.credentials != pause.credentials
        )
        self.by_origin = {**self.by_origin, pause.origin: (*known, pause)}

    def remove_pause(self, pause: OriginPause) -> None:
        """A pause found lifted meanwhile: forget it until the next read."""
        known = tuple(
            each
            for each in self.by_origin.get(pause.origin, ())
            if each.credentials != pause.credentials
        )
        self.by_origin = {
            **{name: pauses for name, pauses in self.by_origin.items() if name != pause.origin},
            **({pause.origin: known} if known else {}),
        }

    def remove(self, origin: str) -> None:
        self.by_origin = {name: pauses for name, pauses in self.by_origin.items() if name != origin}

    def has(self, origin: str) -> bool:
        return origin in self.by_origin

    def find(self, origin: str, credentials: str, now: float) -> OriginPause | None:
        """The pause of ``origin`` for these credentials still running at ``now``."""
        for pause in self.by_origin.get(origin, ()):
            if pause.credentials == credentials and pause.until > now:
                return pause
        return None
