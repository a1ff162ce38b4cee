"""Built-in server profiles and the pieces to describe another server.

``GENERIC`` is the default; ``STRIPE``, ``IETF`` and a catalog of the server-side
libraries and payment APIs users meet most (``DJANGO_IDEMPOTENCY_KEY``,
``ASGI_IDEMPOTENCY_HEADER``, ``EXPRESS_IDEMPOTENCY``, ``ROCKET_RIDES``, ``ADYEN``,
``PAYPAL``, ``AWS_POWERTOOLS``, ``INCREASE``), each also in ``BUILTIN_PROFILES`` by
its name, the name ``--profile`` takes. ``body_mentions`` and ``error_type`` build a
payload-mismatch matcher, ``never`` matches nothing."""

from __future__ import annotations

from idempotently._profiles import (
    ADYEN,
    ASGI_IDEMPOTENCY_HEADER,
    AWS_POWERTOOLS,
    BUILTIN_PROFILES,
    DJANGO_IDEMPOTENCY_KEY,
    EXPRESS_IDEMPOTENCY,
    GENERIC,
    IETF,
    INCREASE,
    PAYPAL,
    ROCKET_RIDES,
    STRIPE,
    MismatchMatcher,
    ServerProfile,
    body_mentions,
    error_type,
    never,
)

__all__ = [
    "ADYEN",
    "ASGI_IDEMPOTENCY_HEADER",
    "AWS_POWERTOOLS",
    "BUILTIN_PROFILES",
    "DJANGO_IDEMPOTENCY_KEY",
    "EXPRESS_IDEMPOTENCY",
    "GENERIC",
    "IETF",
    "INCREASE",
    "PAYPAL",
    "ROCKET_RIDES",
    "STRIPE",
    "MismatchMatcher",
    "ServerProfile",
    "body_mentions",
    "error_type",
    "never",
]
