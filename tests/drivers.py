"""One call, run on every driver of the operation flow.

``Driver.post`` sends one POST through a ``Session``, an ``AsyncSession`` (on
asyncio or trio), a ``Transport`` or an ``AsyncTransport`` (on asyncio or
trio), all over the same journal, the same fake clock and sleep, and the same
scripted in-process server (an ``httpx.MockTransport`` handler). A contract
test written once against ``Driver`` runs on all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import anyio
import attrs
import httpx

import idempotently
from idempotently import profiles
from idempotently._transport import OPERATION_ID_HEADER
from idempotently._vocabulary import Delivery
from tests.support import URL, FakeTime

Step = Callable[[httpx.Request], httpx.Response]
"""One scripted answer of the server: a response, or a transport error raised."""

DRIVERS: Final = (
    "session",
    "async_session-asyncio",
    "async_session-trio",
    "transport",
    "async_transport-asyncio",
    "async_transport-trio",
)


def answer(status: int, *, headers: dict[str, str] | None = None, json: Any = None) -> Step:
    """A step answering ``status`` (a fresh response each time the script runs)."""

    def step(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers=headers, json=json)

    return step


def fail(error: type[httpx.TransportError]) -> Step:
    """A step raising ``error`` for the request, as a broken network would."""

    def step(request: httpx.Request) -> httpx.Response:
        raise error(f"scripted {error.__name__}", request=request)

    return step


@attrs.define
class Script:
    """The server: answers in order, and remembers every request it was sent."""

    steps: list[Step]
    sent: list[httpx.Request] = attrs.field(factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        if not self.steps:
            raise AssertionError(f"unscripted send #{len(self.sent)}: {request!r}")
        return self.steps.pop(0)(request)


@attrs.define
class Driver:
    """Runs one call on one driver; every call gets a fresh client over the same journal."""

    kind: str
    journal: idempotently.Journal
    script: Script
    time: FakeTime
    policy: idempotently.RetryPolicy = attrs.field(factory=idempotently.RetryPolicy)
    profile: idempotently.ServerProfile = profiles.GENERIC
    delivery: Delivery = "exactly_once"

    @property
    def backend(self) -> str:
        """The event loop of an async driver: ``asyncio`` or ``trio``."""
        return self.kind.partition("-")[2]

    def post(
        self,
        *,
        json: Any,
        operation_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """POST ``json`` to the scripted server as operation ``operation_id``."""
        headers = dict(headers or {})
        name = self.kind.partition("-")[0]
        if name in ("transport", "async_transport") and operation_id is not None:
            headers[OPERATION_ID_HEADER] = operation_id
        if name == "session":
            return self._session(json, operation_id, headers)
        if name == "transport":
            return self._transport(json, headers)
        go = self._async_session if name == "async_session" else self._async_transport
        return anyio.run(go, json, operation_id, headers, backend=self.backend)

    def _session(
        self, json: Any, operation_id: str | None, headers: dict[str, str]
    ) -> httpx.Response:
        with idempotently.Session(
            self.journal,
            transport=httpx.MockTransport(self.script),
            policy=self.policy,
            profile=self.profile,
            clock=self.time.clock,
            sleep=self.time.sleep,
        ) as session:
            return session.post(
                URL, json=json, headers=headers, operation_id=operation_id, delivery=self.delivery
            )

    async def _async_session(
        self, json: Any, operation_id: str | None, headers: dict[str, str]
    ) -> httpx.Response:
        async with idempotently.AsyncSession(
            self.journal,
            transport=httpx.MockTransport(self.script),
            policy=self.policy,
            profile=self.profile,
            clock=self.time.clock,
            sleep=self.time.async_sleep,
        ) as session:
            return await session.post(
                URL, json=json, headers=headers, operation_id=operation_id, delivery=self.delivery
            )

    def _transport(self, json: Any, headers: dict[str, str]) -> httpx.Response:
        transport = idempotently.Transport(
            self.journal,
            transport=httpx.MockTransport(self.script),
            policy=self.policy,
            profile=self.profile,
            delivery=self.delivery,
            clock=self.time.clock,
            sleep=self.time.sleep,
        )
        with httpx.Client(transport=transport) as client:
            return client.post(URL, json=json, headers=headers)

    async def _async_transport(
        self, json: Any, operation_id: str | None, headers: dict[str, str]
    ) -> httpx.Response:
        transport = idempotently.AsyncTransport(
            self.journal,
            transport=httpx.MockTransport(self.script),
            policy=self.policy,
            profile=self.profile,
            delivery=self.delivery,
            clock=self.time.clock,
            sleep=self.time.async_sleep,
        )
        async with httpx.AsyncClient(transport=transport) as client:
            return await client.post(URL, json=json, headers=headers)
