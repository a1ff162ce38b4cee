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

import attrs

from idempotently._commands import PauseOrigin, SwapPause
from idempotently._numbers import as_float
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


def _breaker_seconds(name: str, value: object) -> float:
    """A Breaker's number as a float above 0, or a clear error naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Breaker {name} must be a number, not {type(value).__name__} ({value!r})")
    number = as_float(value, f"Breaker {name}")
    if not (0 < number < math.inf):
        raise ValueError(f"Breaker {name} must be a finite number above 0, not {value!r}")
    return number


MAX_FAILURES = 1_000_000
"""More failures in a row than any window sees: a larger count is a mistake."""


def _failures(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"Breaker failures must be a whole number, not {type(value).__name__} ({value!r})"
        )
    if not 1 <= value <= MAX_FAILURES:
        shown = value if value < 10**20 else f"an integer of {value.bit_length()} bits"
        raise ValueError(f"Breaker failures must be from 1 to {MAX_FAILURES:,}, not {shown}")
    return value


def _window(value: object) -> float:
    return _breaker_seconds("window", value)


def _min_open(value: object) -> float:
    return _breaker_seconds("min_open", value)


def _max_open(value: object) -> float:
    return _breaker_seconds("max_open", value)


@attrs.frozen
class Breaker:
    """A circuit breaker per origin and credentials, journaled as an origin pause.

    ``failures`` network errors or 5xx answers without Retry-After in a row from one
    origin (for one set of credentials), all within ``window`` seconds, open it: the
    origin is paused for ``min_open`` seconds for every thread, process and resume
    sharing the journal. When that ends, one caller across them all takes the probe
    (a compare-and-swap on the pause's row) while the others keep waiting: answered,
    the breaker closes; failed, it opens again for twice as long, up to ``max_open``
    and never longer than the policy's ``max_retry_after``. ``idempotently unpause
    ORIGIN`` closes it at once.
    """

    failures: int = attrs.field(default=5, converter=_failures)
    """Failures in a row that open it."""
    window: float = attrs.field(default=30.0, converter=_window)
    """Seconds those failures must fall within."""
    min_open: float = attrs.field(default=5.0, converter=_min_open)
    """Seconds it stays open the first time."""
    max_open: float = attrs.field(default=300.0, converter=_max_open)
    """Seconds it stays open at most, however many probes failed."""

    def __attrs_post_init__(self) -> None:
        if self.min_open > self.max_open:
            raise ValueError(
                f"Breaker min_open ({self.min_open:g}s) must not exceed max_open "
                f"({self.max_open:g}s)"
            )


def is_breaker(pause: OriginPause) -> bool:
    """Whether ``pause`` is a circuit breaker's (kept until closed), not a server's."""
    return pause.reason is not None and pause.reason.startswith(BREAKER)


def opened_reason(length: float, why: str) -> str:
    return f"{BREAKER} open {length:g}s: {why}"


@attrs.frozen
class BreakerStep:
    """What an attempt's outcome does to its origin's breaker: the journal write (None:
    none) and the pause that now holds the origin back (None: nothing refuses a retry)."""

    write: SwapPause | PauseOrigin | None
    pause: OriginPause | None


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
        return BreakerStep(SwapPause(origin, credentials, probe.reason or "", None, None), None)
    if probe is not None:
        # The probe failed: open again, twice as long (never beyond the caps).
        ceiling = min(breaker.max_open, max_retry_after) if breaker else max_retry_after
        length = max(0.0, min(2 * open_length(probe), ceiling))
        reopened = OriginPause(
            origin, credentials, now + length, opened_reason(length, f"its probe {failure}"), now
        )
        board.add(reopened)
        return BreakerStep(
            SwapPause(origin, credentials, probe.reason or "", None, reopened), reopened
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
        PauseOrigin(origin, credentials, opened.until, opened.reason or "", now), opened
    )


_LENGTH = re.compile(r"circuit breaker (?:open|half-open) ([0-9.e+]+)s:")


def open_length(pause: OriginPause) -> float:
    """How long a breaker's pause was open (its reason says; else its row's length)."""
    found = _LENGTH.match(pause.reason or "")
    length = float(found.group(1)) if found else pause.until - pause.set_at
    return length if 0 <= length < math.inf else 0.0


def probe_claim(pause: OriginPause, now: float, hold: float) -> SwapPause:
    """The compare-and-swap that makes this caller the one probe of an ended breaker:
    the row, as read, becomes a pause for as long as it was open or the probe may take
    (``hold``), whichever is longer, so the others keep waiting and a claim whose holder
    died ends then; its reason keeps the open length and marks the probe as its own."""
    length = open_length(pause)
    claimed = OriginPause(
        pause.origin,
        pause.credentials,
        now + max(length, hold),
        f"{BREAKER} half-open {length:g}s: one probe in flight ({uuid.uuid4().hex[:12]})",
        now,
    )
    return SwapPause(pause.origin, pause.credentials, pause.reason or "", now, claimed)
