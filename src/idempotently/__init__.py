"""Retry non-repeatable HTTP calls safely.

One idempotency key per logical operation, committed to a local SQLite journal
before the first byte is sent, reused on every attempt and after a crash.
"""

from __future__ import annotations

__version__ = "0.1.0.dev0"

__all__: list[str] = []
