"""Numbers from callers and from the journal, read as floats before anything is kept.

Python compares an int with a float exactly, so ``10**400 < math.inf`` holds and such an
int passes every range check; it fails only later, as a raw ``OverflowError``, when
something converts it (a timeout handed to a socket, a deadline added to a clock), by
which time the operation is journaled. Every numeric argument and journaled number is
converted here first, so that one out of a float's range is a ``ValueError`` naming it.
"""

from __future__ import annotations


def as_float(value: object, name: str) -> float:
    """``float(value)``; a ValueError naming ``name`` for an int no float holds."""
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:
        raise ValueError(
            f"{name} must be a finite number, not an integer too large for a float "
            f"({_digits(value)} digits)"
        ) from None


def _digits(value: object) -> str:
    if isinstance(value, int):
        # str() of an int past 4,300 digits raises: its bit length tells the size.
        return f"about {int(value.bit_length() * 0.30103) + 1}"
    return "too many"
