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
import math
import re
import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import attrs

from idempotently._commands import PauseOrigin
from idempotently._rows import OriginPause

if TYPE_CHECKING:
    from idempotently._breaker import Breaker
    from idempotently._commands_rare import SwapPause

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
    # The circuit breaker's in-memory half (`after_attempt`): failures in a row per
    # (origin, credentials) seen by this journal's engines in this process, and the
    # probes they hold (the claimed row). Empty on the happy path: one truth test each.
    failing: dict[tuple[str, str], list[float]] = attrs.Factory(dict)
    probes: dict[tuple[str, str], OriginPause] = attrs.Factory(dict)
    lock: threading.Lock = attrs.Factory(threading.Lock)

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
        """The pause of ``origin`` for these credentials still running at ``now``, or a
        circuit breaker's that ended (half-open: its probe is yet to be claimed)."""
        for pause in self.by_origin.get(origin, ()):
            if pause.credentials == credentials and (pause.until > now or is_breaker(pause)):
                return pause
        return None


# -- the circuit breaker: a pause the origin's failures set ---------------------------

BREAKER = "circuit breaker"
"""How a breaker's pause row begins its reason: the mark that tells it from a server's
Retry-After pause (which the store keeps only while it runs, and a breaker's until it is
closed)."""


def is_breaker(pause: OriginPause) -> bool:
    """Whether ``pause`` is a circuit breaker's (kept until closed), not a server's."""
    return pause.reason is not None and pause.reason.startswith(BREAKER)


def is_probing(pause: OriginPause) -> bool:
    """Whether ``pause`` is a half-open breaker's, its one probe in flight."""
    return pause.reason is not None and pause.reason.startswith(f"{BREAKER} half-open")


def opened_reason(length: float, why: str) -> str:
    return f"{BREAKER} open {length:g}s: {why}"


class BreakerStep:
    """What an attempt's outcome does to its origin's breaker: the journal write (None:
    none) and the pause that now holds the origin back (None: nothing refuses a retry)."""

    # A plain class: made only on a failure's path, it costs `import idempotently`
    # nothing (an attrs class compiles its methods at import).
    __slots__ = ("change", "pause", "write")

    def __init__(
        self,
        write: SwapPause | PauseOrigin | None,
        pause: OriginPause | None,
        change: Literal["opened", "reopened", "closed"] | None = None,
    ) -> None:
        self.write, self.pause = write, pause
        self.change = change
        """What the write does to the breaker, for the `BreakerChanged` event."""


def _scope(origin: str, credentials: str) -> tuple[str, str]:
    return (origin, credentials)


def after_attempt(
    board: PauseBoard,
    breaker: Breaker | None,
    origin: str,
    credentials: str,
    failure: str | None,
    now: float,
    max_retry_after: float,
) -> BreakerStep | None:
    """What one attempt's outcome (``failure``: why it failed, None: answered) does to
    the breaker of its origin and credentials; None: nothing."""
    from idempotently._commands_rare import SwapPause

    scope = _scope(origin, credentials)
    probe = board.probes.pop(scope, None) if board.probes else None
    if failure is None:
        if board.failing:
            with board.lock:
                board.failing.pop(scope, None)
        if probe is None:
            return None
        # The probe was answered: the origin is back, the breaker closes.
        board.remove_pause(probe)
        return BreakerStep(
            SwapPause(origin, credentials, probe.reason or "", None, None), None, "closed"
        )
    if probe is not None:
        # The probe failed: open again, twice as long (never beyond the caps).
        ceiling = min(breaker.max_open, max_retry_after) if breaker else max_retry_after
        floor = breaker.min_open if breaker else 0.0  # a damaged row's 0 s still grows
        length = max(0.0, min(max(2 * open_length(probe), floor), ceiling))
        reopened = OriginPause(
            origin, credentials, now + length, opened_reason(length, f"its probe {failure}"), now
        )
        board.add(reopened)
        return BreakerStep(
            SwapPause(origin, credentials, probe.reason or "", None, reopened), reopened, "reopened"
        )
    if breaker is None:
        return None
    running = board.find(origin, credentials, now)
    if running is not None and running.until > now:
        return BreakerStep(None, running)  # opened meanwhile: no retry while it is
    with board.lock:
        times = [at for at in board.failing.get(scope, ()) if at > now - breaker.window]
        times.append(now)
        if len(times) < breaker.failures:
            board.failing[scope] = times
            return None
        board.failing.pop(scope, None)
    length = min(breaker.min_open, breaker.max_open, max_retry_after)
    opened = OriginPause(
        origin,
        credentials,
        now + length,
        opened_reason(
            length,
            f"{breaker.failures} failures in a row within {breaker.window:g}s, the last {failure}",
        ),
        now,
    )
    board.add(opened)
    return BreakerStep(
        PauseOrigin(origin, credentials, opened.until, opened.reason or "", now), opened, "opened"
    )


_LENGTH = r"circuit breaker (?:open|half-open) ([0-9.e+]+)s:"
"""Compiled on first use (re's cache), not at import."""


def open_length(pause: OriginPause) -> float:
    """How long a breaker's pause was open (its reason says; else its row's length)."""
    found = re.match(_LENGTH, pause.reason or "")
    try:
        length = float(found.group(1)) if found else pause.until - pause.set_at
    except ValueError:  # a damaged reason ("1.2.3s"): the row's own length
        length = pause.until - pause.set_at
    return length if 0 <= length < math.inf else 0.0


def probe_claim(
    pause: OriginPause, now: float, hold: float, longest: float = math.inf
) -> SwapPause:
    """The compare-and-swap that makes this caller the one probe of an ended breaker:
    the row, as read, becomes a pause for as long as it was open or the probe may take
    (``hold``), whichever is longer, so the others keep waiting and a claim whose holder
    died ends then; its reason keeps the open length and marks the probe as its own.
    Never longer than ``longest`` (the claimer's max_retry_after): a damaged row, or one
    another policy opened for longer, must not let a dead holder wedge the origin."""
    from idempotently._commands_rare import SwapPause

    length = min(open_length(pause), longest)
    claimed = OriginPause(
        pause.origin,
        pause.credentials,
        now + max(length, hold),
        f"{BREAKER} half-open {length:g}s: one probe in flight ({uuid.uuid4().hex[:12]})",
        now,
    )
    return SwapPause(pause.origin, pause.credentials, pause.reason or "", now, claimed)
