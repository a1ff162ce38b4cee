"""Text made safe to store, the same on every store (pure).

Error text comes from other people's servers and the caller's hooks: an
exception message may hold lone surrogates (``"\\udcff"``, how Python keeps
bytes it could not decode) that no UTF-8 encoder takes, and NUL characters
that SQLite stores but PostgreSQL refuses in text. Both are replaced with
visible stand-ins before anything is journaled or logged, so a journal row
reads the same on SQLite and PostgreSQL and a hostile message cannot turn a
journal write into an exception.
"""

from __future__ import annotations

import re

REPLACEMENT = "\ufffd"
"""What a lone surrogate becomes: U+FFFD REPLACEMENT CHARACTER, as a decoder would write."""
NUL_SYMBOL = "\u2400"
"""What a NUL becomes: U+2400 SYMBOL FOR NULL, visible where NUL would vanish or be refused."""
_SURROGATES = "[\ud800-\udfff]"
"""Compiled on the first text that is not ASCII (by `re`'s own cache), not at import: its
character set is the costliest pattern the package has."""


def storable_text(text: str) -> str:
    """``text`` with lone surrogates as U+FFFD and NUL as U+2400; anything else unchanged."""
    if text.isascii():
        return text.replace("\x00", NUL_SYMBOL) if "\x00" in text else text
    return re.sub(_SURROGATES, REPLACEMENT, text).replace("\x00", NUL_SYMBOL)


def storable(text: str | None) -> str | None:
    """`storable_text`, passing None through."""
    return None if text is None else storable_text(text)
