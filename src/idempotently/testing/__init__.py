"""A companion mock server that implements the server side of idempotency keys.

It follows Brandur Leach's article "Implementing Stripe-like Idempotency Keys
in Postgres" (https://brandur.org/idempotency-keys): one race-free claim
(`INSERT … ON CONFLICT DO NOTHING RETURNING`) committed before the side
effect, a provider idempotent on `f"{key}:charge"`, replays marked
`Idempotent-Replayed: true`, 409 while in progress, 422 on a different
payload, stale locks taken over by compare-and-swap, keys swept after 24 h —
plus switches that imitate other servers and scripted faults.

The server needs the `[mock]` extra (starlette, uvicorn): `MockApp`,
`MockServer`, `create_app` and `serve` import it on first use, so that
`idempotently.testing.cli` and the pytest plugin load without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from idempotently.testing._clock import Clock, SystemClock, VirtualClock
from idempotently.testing._config import (
    DEFAULT_KEY_TTL,
    DEFAULT_STALE_AFTER,
    MockServerConfig,
)
from idempotently.testing._crash_points import (
    CRASH_STEPS,
    CrashHarnessError,
    CrashPointResult,
    CrashReport,
    CrashStep,
    crash_points,
)
from idempotently.testing._fake_time import FakeTime
from idempotently.testing._faults import Fault, Faults, ScheduledFault
from idempotently.testing._log import LoggedRequest
from idempotently.testing._provider import Charge, Ledger
from idempotently.testing._stats import Stats
from idempotently.testing._store import IdempotencyRecord

if TYPE_CHECKING:
    from idempotently.testing._app import REPLAY_HEADER, MockApp, create_app
    from idempotently.testing._server import MockServer, in_process, serve

__all__ = [
    "CRASH_STEPS",
    "DEFAULT_KEY_TTL",
    "DEFAULT_STALE_AFTER",
    "REPLAY_HEADER",
    "Charge",
    "Clock",
    "CrashHarnessError",
    "CrashPointResult",
    "CrashReport",
    "CrashStep",
    "FakeTime",
    "Fault",
    "Faults",
    "IdempotencyRecord",
    "Ledger",
    "LoggedRequest",
    "MockApp",
    "MockServer",
    "MockServerConfig",
    "ScheduledFault",
    "Stats",
    "SystemClock",
    "VirtualClock",
    "crash_points",
    "create_app",
    "in_process",
    "serve",
]

MOCK_EXTRA_MESSAGE = "the mock server needs the [mock] extra: pip install 'idempotently[mock]'"

# Names whose modules import starlette or uvicorn, loaded on first access.
_NEED_THE_EXTRA = {
    "REPLAY_HEADER": "idempotently.testing._app",
    "MockApp": "idempotently.testing._app",
    "create_app": "idempotently.testing._app",
    "MockServer": "idempotently.testing._server",
    "serve": "idempotently.testing._server",
    "in_process": "idempotently.testing._server",
}


def __getattr__(name: str) -> object:
    module_name = _NEED_THE_EXTRA.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        if (error.name or "").partition(".")[0] in ("starlette", "uvicorn"):
            raise ImportError(MOCK_EXTRA_MESSAGE, name=error.name) from error
        raise
    return getattr(module, name)
