"""`Group` and `AsyncGroup`: the steps of one multi-step operation (``Session.group``).

The rule lives in ``_flow/_groups.py``; these are its thin faces, built on the session's
own call and enqueue (one mechanism: a step is a named operation with one more column).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import httpx

from idempotently._exceptions import KeyReuseError
from idempotently._flow._groups import check_group_id, check_step

if TYPE_CHECKING:
    from types import TracebackType

    from idempotently._rows import Operation

_CALL_ARGUMENTS = frozenset(
    {
        "content",
        "data",
        "files",
        "json",
        "params",
        "headers",
        "cookies",
        "timeout",
        "extensions",
        "idempotency_key",
        "delivery",
        "deadline_at",
        "policy",
        "profile",
    }
)
_ENQUEUE_ARGUMENTS = frozenset(
    {"content", "data", "files", "json", "params", "headers", "cookies"}
    | {"idempotency_key", "deadline_at", "connection"}
)


class _Order:
    """The order this run calls the group's steps in, held against the journaled one:
    a rerun that names a journaled step after one journaled later (or after a new step)
    is refused before anything is sent, so that a changed program never sends its
    steps in another order than the first run did."""

    __slots__ = ("places", "reached")

    def __init__(self, steps: list[Operation]) -> None:
        # A forked step keeps its place under its own id too: the application calls it so.
        self.places = {step.operation_id: float(step.step or 0) for step in steps}
        self.reached = 0.0

    def check(self, group_id: str, operation_id: str, key: str) -> None:
        place = self.places.get(operation_id, math.inf)  # a new step goes last
        if place < self.reached:
            raise KeyReuseError(
                f"step {operation_id.removeprefix(group_id + '/')!r} of group {group_id!r} "
                "was first journaled before a step this run has already called: steps must "
                "be called in the order they were first called in (see `idempotently show "
                f"{group_id}`); nothing was sent. Give a new group id for a new order",
                operation_id=operation_id,
                key=key,
            )
        self.reached = max(self.reached, place)


class _GroupBase:
    __slots__ = ("_order", "_session", "group_id")

    def __init__(self, session: Any, group_id: str) -> None:
        # ``session``: the Session or AsyncSession that made the group (Session.group):
        # typed loosely so that this room names nothing above it.
        self.group_id = check_group_id(group_id)
        self._session = session
        self._order: _Order | None = None

    def _step(self, step: object, arguments: dict[str, Any], allowed: frozenset[str]) -> str:
        operation_id = check_step(self.group_id, step)
        unknown = sorted(set(arguments) - allowed)
        if unknown:
            hint = (
                " (a step's operation id is its group's and step's: group/step)"
                if "operation_id" in unknown
                else ""
            )
            raise TypeError(f"a group step takes no {', '.join(unknown)} argument{hint}")
        return operation_id

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.group_id!r})"


class Group(_GroupBase):
    """The steps of one multi-step operation (`Session.group`): each step is the named
    operation ``f"{group_id}/{step}"``, sent only once every earlier step of the group
    has succeeded. A context manager too (entering and leaving change nothing)."""

    __slots__ = ()

    def __enter__(self) -> Group:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None

    def steps(self) -> list[Operation]:
        """The group's journaled steps, in their order (`Journal.group`)."""
        return cast("list[Operation]", self._session.journal.group(self.group_id))

    def request(
        self, method: str, url: httpx.URL | str, *, step: str, **kwargs: Any
    ) -> httpx.Response:
        """Send step ``step`` (a `Session.request` with the step's operation id): its
        stored answer if it has settled; else sent once every earlier step succeeded,
        or `OperationPendingError` (an earlier step pending or in flight) or
        `GroupStoppedError` (an earlier step failed or was abandoned) without sending."""
        operation_id = self._step(step, kwargs, _CALL_ARGUMENTS)
        session = self._session
        if self._order is None:
            self._order = _Order(self.steps())
        self._order.check(self.group_id, operation_id, session._engine.key_for(operation_id))
        ids: dict[str, Any] = {
            "operation_id": operation_id,
            "idempotency_key": kwargs.pop("idempotency_key", None),
            "delivery": kwargs.pop("delivery", "exactly_once"),
            "deadline_at": kwargs.pop("deadline_at", None),
            "policy": kwargs.pop("policy", None),
            "profile": kwargs.pop("profile", None),
        }
        timeout = kwargs.pop("timeout", httpx.USE_CLIENT_DEFAULT)
        request = session._built(method, url, **ids, timeout=session._timeout(timeout), **kwargs)
        return cast(httpx.Response, session._operate(request, timeout, ids, self.group_id))

    def post(self, url: httpx.URL | str, *, step: str, **kwargs: Any) -> httpx.Response:
        """POST step ``step``; see `request`."""
        return self.request("POST", url, step=step, **kwargs)

    def put(self, url: httpx.URL | str, *, step: str, **kwargs: Any) -> httpx.Response:
        """PUT step ``step``; see `request`."""
        return self.request("PUT", url, step=step, **kwargs)

    def patch(self, url: httpx.URL | str, *, step: str, **kwargs: Any) -> httpx.Response:
        """PATCH step ``step``; see `request`."""
        return self.request("PATCH", url, step=step, **kwargs)

    def delete(self, url: httpx.URL | str, *, step: str, **kwargs: Any) -> httpx.Response:
        """DELETE step ``step``; see `request`."""
        return self.request("DELETE", url, step=step, **kwargs)

    def enqueue(self, method: str, url: httpx.URL | str, *, step: str, **kwargs: Any) -> Operation:
        """Journal step ``step`` to be sent later (`Session.enqueue`, ``connection=``
        included): it takes the group's next place, and resume or a watch worker sends
        it once every earlier step has succeeded."""
        operation_id = self._step(step, kwargs, _ENQUEUE_ARGUMENTS)
        session = self._session
        connection = kwargs.pop("connection", None)
        deadline_at = kwargs.pop("deadline_at", None)
        idempotency_key = kwargs.pop("idempotency_key", None)
        request = session._enqueue_request(
            method,
            url,
            operation_id=operation_id,
            idempotency_key=idempotency_key,
            deadline_at=deadline_at,
            **kwargs,
        )
        operation = session._enqueued(
            request, operation_id, idempotency_key, deadline_at, connection, self.group_id
        )
        return cast("Operation", operation)


class AsyncGroup(_GroupBase):
    """`Group` for an `AsyncSession` (asyncio and trio)."""

    __slots__ = ()

    async def __aenter__(self) -> AsyncGroup:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        return None

    async def steps(self) -> list[Operation]:
        """The group's journaled steps, in their order (`Journal.group`), read off the
        event loop."""
        import anyio.to_thread

        steps = await anyio.to_thread.run_sync(self._session.journal.group, self.group_id)
        return cast("list[Operation]", steps)

    async def request(
        self, method: str, url: httpx.URL | str, *, step: str, **kwargs: Any
    ) -> httpx.Response:
        """Send step ``step``; see `Group.request`."""
        operation_id = self._step(step, kwargs, _CALL_ARGUMENTS)
        session = self._session
        if self._order is None:
            self._order = _Order(await self.steps())
        self._order.check(self.group_id, operation_id, session._engine.key_for(operation_id))
        ids: dict[str, Any] = {
            "operation_id": operation_id,
            "idempotency_key": kwargs.pop("idempotency_key", None),
            "delivery": kwargs.pop("delivery", "exactly_once"),
            "deadline_at": kwargs.pop("deadline_at", None),
            "policy": kwargs.pop("policy", None),
            "profile": kwargs.pop("profile", None),
        }
        timeout = kwargs.pop("timeout", httpx.USE_CLIENT_DEFAULT)
        request = session._built(method, url, **ids, timeout=session._timeout(timeout), **kwargs)
        response = await session._operate(request, timeout, ids, self.group_id)
        return cast(httpx.Response, response)

    async def post(self, url: httpx.URL | str, *, step: str, **kwargs: Any) -> httpx.Response:
        """POST step ``step``; see `Group.request`."""
        return await self.request("POST", url, step=step, **kwargs)

    async def put(self, url: httpx.URL | str, *, step: str, **kwargs: Any) -> httpx.Response:
        """PUT step ``step``; see `Group.request`."""
        return await self.request("PUT", url, step=step, **kwargs)

    async def patch(self, url: httpx.URL | str, *, step: str, **kwargs: Any) -> httpx.Response:
        """PATCH step ``step``; see `Group.request`."""
        return await self.request("PATCH", url, step=step, **kwargs)

    async def delete(self, url: httpx.URL | str, *, step: str, **kwargs: Any) -> httpx.Response:
        """DELETE step ``step``; see `Group.request`."""
        return await self.request("DELETE", url, step=step, **kwargs)

    async def enqueue(
        self, method: str, url: httpx.URL | str, *, step: str, **kwargs: Any
    ) -> Operation:
        """Journal step ``step`` to be sent later; see `Group.enqueue`."""
        operation_id = self._step(step, kwargs, _ENQUEUE_ARGUMENTS)
        session = self._session
        connection = kwargs.pop("connection", None)
        deadline_at = kwargs.pop("deadline_at", None)
        idempotency_key = kwargs.pop("idempotency_key", None)
        request = session._enqueue_request(
            method,
            url,
            operation_id=operation_id,
            idempotency_key=idempotency_key,
            deadline_at=deadline_at,
            **kwargs,
        )
        operation = await session._enqueued(
            request, operation_id, idempotency_key, deadline_at, connection, self.group_id
        )
        return cast("Operation", operation)
