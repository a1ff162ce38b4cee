"""Durations as people type them on the command line: ``30s``, ``15m``, ``12h``, ``7d``."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import click

UNITS: dict[str, float] = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
MAX_DURATION = 100 * 366 * 86400.0
"""A century: anything longer is a typo, not a retention window."""
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
ACCEPTED = (
    "a number with a unit, like 0s, 30s, 15m, 12h or 7d "
    "(w for weeks; combinations like 1h30m work; a bare number is seconds)"
)


def parse_duration(text: str) -> float:
    """Seconds in ``text``; ValueError saying the accepted forms otherwise."""
    cleaned = re.sub(r"\s+", "", text).lower()
    try:
        seconds = float(cleaned)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds) and seconds >= 0:
            return _bounded(text, seconds)
        raise ValueError(f"{text!r} is not a duration; use {ACCEPTED}")
    parts = _PART.findall(cleaned)
    if not parts or "".join(number + unit for number, unit in parts) != cleaned:
        raise ValueError(f"{text!r} is not a duration; use {ACCEPTED}")
    return _bounded(text, sum(float(number) * UNITS[unit] for number, unit in parts))


def _bounded(text: str, seconds: float) -> float:
    if not seconds <= MAX_DURATION:  # also catches inf and nan
        raise ValueError(f"{text[:40]!r} is longer than a century; use {ACCEPTED}")
    return seconds


def format_duration(seconds: float) -> str:
    """A compact duration for people, two units at most: ``45s``, ``3m20s``, ``1h30m``, ``2d3h``."""
    if not math.isfinite(seconds):  # a damaged row's time: shown, never a traceback
        return str(abs(seconds))
    whole = round(abs(seconds))
    if whole < 60:
        return f"{whole}s"
    steps = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
    for index, (unit, size) in enumerate(steps[:-1]):
        if whole >= size:
            big, rest = divmod(whole, size)
            small_unit, small_size = steps[index + 1]
            small = rest // small_size
            return f"{big}{unit}{small}{small_unit}" if small else f"{big}{unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_age(timestamp: float, now: float) -> str:
    """``3m ago`` for the past, ``in 5h`` for the future, ``just now`` within a second.

    One unit, rounded down: an age is for scanning a column, not for arithmetic.
    """
    delta = now - timestamp
    if abs(delta) < 1:
        return "just now"
    whole = int(abs(delta))
    unit, size = next(
        (u, s) for u, s in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)) if whole >= s
    )
    rough = f"{whole // size}{unit}"
    return f"{rough} ago" if delta > 0 else f"in {rough}"


if TYPE_CHECKING:  # click 8.2+ types ParamType by value; older releases are not generic
    _ParamType = click.ParamType[float, Any]
else:
    _ParamType = click.ParamType


class Duration(_ParamType):
    """A click option type: a duration string in, seconds (float) out."""

    name = "duration"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return parse_duration(str(value))
        except ValueError as error:
            self.fail(str(error), param, ctx)


DURATION = Duration()


class Seconds(_ParamType):
    """A click option type: plain seconds, finite, from 0 to a century.

    ``click.FloatRange(min=0)`` lets ``nan``, ``inf`` and ``1e400`` through.
    """

    name = "seconds"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            seconds = float(value)  # type: ignore[arg-type]  # str or a float default
        except (TypeError, ValueError):
            self.fail(f"{str(value)[:40]!r} is not a number of seconds", param, ctx)
        if not 0 <= seconds <= MAX_DURATION:  # also catches nan and inf
            self.fail(
                f"{str(value)[:40]!r} is not a number of seconds from 0 to "
                f"{MAX_DURATION:.0f} (a century)",
                param,
                ctx,
            )
        return seconds


SECONDS = Seconds()
