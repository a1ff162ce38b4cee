"""Built-in server profiles: ``GENERIC`` (the default), ``STRIPE`` and ``IETF``."""

from __future__ import annotations

from idempotently._profiles import BUILTIN_PROFILES, GENERIC, IETF, STRIPE, ServerProfile

__all__ = ["BUILTIN_PROFILES", "GENERIC", "IETF", "STRIPE", "ServerProfile"]
