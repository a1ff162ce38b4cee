"""Built-in server profiles (``GENERIC``, the default, ``STRIPE`` and ``IETF``) and the
pieces to describe another server: ``body_mentions`` and ``error_type`` build a
payload-mismatch matcher, ``never`` matches nothing."""

from __future__ import annotations

from idempotently._profiles import (
    BUILTIN_PROFILES,
    GENERIC,
    IETF,
    STRIPE,
    MismatchMatcher,
    ServerProfile,
    body_mentions,
    error_type,
    never,
)

__all__ = [
    "BUILTIN_PROFILES",
    "GENERIC",
    "IETF",
    "STRIPE",
    "MismatchMatcher",
    "ServerProfile",
    "body_mentions",
    "error_type",
    "never",
]
