"""Scripted faults: what goes wrong, and for which request.

A fault is a frozen value (`Fault.crash()`); `Faults` is the script, a queue
the server consumes one fault per request, in order. Faults that only make
sense for the request doing the work (`server_error`, `crash`) wait for that
request: a concurrent retry that is answered 409 does not consume them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

FaultKind = Literal[
    "unavailable", "rate_limited", "delay", "server_error", "lose_response", "crash"
]

FAULT_KINDS: tuple[FaultKind, ...] = (
    "unavailable",
    "rate_limited",
    "delay",
    "server_error",
    "lose_response",
    "crash",
)

# Kinds that happen to whichever request meets them; the others need the request
# that claimed the key and called the provider.
_ANY_REQUEST_KINDS = frozenset({"unavailable", "rate_limited", "delay", "lose_response"})


@attrs.frozen
class Fault:
    """One thing that goes wrong with one request.

    Build them with the class methods; `kind` names the fault on the wire
    (`POST /v1/_faults`) and `seconds` is its Retry-After or delay.
    """

    kind: FaultKind
    """Which fault: `unavailable`, `rate_limited`, `delay`, `error_after_work`, `lose_response`
    or `crash` (the names `POST /v1/_faults` takes)."""
    seconds: float | None = None
    """The Retry-After of `rate_limited`, or how long `delay` waits; None otherwise."""

    @classmethod
    def unavailable(cls, retry_after: float | None = None) -> Fault:
        """503 before any work: nothing is claimed or charged (with `Retry-After` if given)."""
        return cls("unavailable", retry_after)

    @classmethod
    def rate_limited(cls, retry_after: float = 1) -> Fault:
        """429 with `Retry-After: retry_after` before any work: nothing is claimed or charged."""
        return cls("rate_limited", retry_after)

    @classmethod
    def delay(cls, seconds: float) -> Fault:
        """Hold the request `seconds` (real time) before handling it normally."""
        return cls("delay", seconds)

    @classmethod
    def server_error(cls) -> Fault:
        """500 after the provider charged: stored and replayed, unless 5xx are not stored."""
        return cls("server_error")

    @classmethod
    def lose_response(cls) -> Fault:
        """Commit as usual, then drop the connection: the charge happened, the answer is lost."""
        return cls("lose_response")

    @classmethod
    def crash(cls) -> Fault:
        """Die between the provider call and the commit: charged, key left `in_progress`."""
        return cls("crash")

    @property
    def needs_work(self) -> bool:
        """Whether only the request that claimed the key can meet this fault."""
        return self.kind not in _ANY_REQUEST_KINDS

    def __attrs_post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; known: {', '.join(FAULT_KINDS)}")
        if self.kind in ("delay", "rate_limited") and self.seconds is None:
            raise ValueError(f"a {self.kind} fault needs seconds")
        if self.seconds is not None and self.seconds < 0:
            raise ValueError(f"seconds must not be negative, got {self.seconds!r}")

    def to_json(self) -> dict[str, Any]:
        if self.seconds is None:
            return {"kind": self.kind}
        return {"kind": self.kind, "seconds": self.seconds}

    @classmethod
    def from_json(cls, value: object) -> Fault:
        """Read `{"kind": ..., "seconds": ...}` (`retry_after` is accepted for `seconds`)."""
        if not isinstance(value, Mapping):
            raise ValueError(f"a fault is a JSON object, got {value!r}")
        kind = value.get("kind")
        seconds = value.get("seconds", value.get("retry_after"))
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, int | float)
        ):
            raise ValueError(f"seconds must be a number, got {seconds!r}")
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
        return cls(kind, None if seconds is None else float(seconds))


@attrs.frozen
class ScheduledFault:
    """A fault waiting for a request; `None` targets match any request."""

    fault: Fault
    """What goes wrong."""
    key: str | None = None
    """Only a request with this `Idempotency-Key` meets it (None: any)."""
    user: str | None = None
    """Only a request from this user (bearer token) meets it (None: any)."""
    order_id: str | None = None
    """Only a request whose `metadata.order_id` is this meets it (None: any)."""

    def matches(self, *, user: str, key: str, order_id: str | None) -> bool:
        return (
            (self.key is None or self.key == key)
            and (self.user is None or self.user == user)
            and (self.order_id is None or self.order_id == order_id)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            **self.fault.to_json(),
            "key": self.key,
            "user": self.user,
            "order_id": self.order_id,
        }


class Faults:
    """The fault script of one mock server. Thread-safe.

    ```python
    server.faults.push(Fault.unavailable(), Fault.lose_response())  # the next two requests
    server.faults.for_key("k-1", Fault.crash())  # the next request with that key
    server.faults.for_order("order-42", Fault.rate_limited(2))  # ... with that order_id
    ```

    Faults apply in the order they were scheduled, one per request; only
    requests that reach the idempotency layer (authenticated, with a key and
    a valid body) meet them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[ScheduledFault] = []
        self._applied: list[ScheduledFault] = []

    def push(self, *faults: Fault) -> None:
        """Apply `faults` to the next requests, whatever their key."""
        self._schedule(ScheduledFault(fault) for fault in faults)

    def for_key(self, key: str, *faults: Fault, user: str | None = None) -> None:
        """Apply `faults` to the next requests that carry `key` (and come from `user`, if given)."""
        self._schedule(ScheduledFault(fault, key=key, user=user) for fault in faults)

    def for_order(self, order_id: str, *faults: Fault) -> None:
        """Apply `faults` to the next requests whose `metadata.order_id` is `order_id`."""
        self._schedule(ScheduledFault(fault, order_id=order_id) for fault in faults)

    def schedule(self, *scheduled: ScheduledFault) -> None:
        self._schedule(scheduled)

    def clear(self) -> None:
        """Forget every fault not yet applied."""
        with self._lock:
            self._queue.clear()

    @property
    def pending(self) -> list[ScheduledFault]:
        """Faults still waiting for a request, in order."""
        with self._lock:
            return list(self._queue)

    @property
    def applied(self) -> list[ScheduledFault]:
        """Faults that met a request, in the order they did."""
        with self._lock:
            return list(self._applied)

    def take(self, *, user: str, key: str, order_id: str | None, doing_work: bool) -> Fault | None:
        """The next fault for this request, removed from the script.

        Before the claim (`doing_work=False`) a fault that needs the work is
        left for the request that will do it, and it blocks the faults queued
        behind it for the same target, so the script keeps its order.
        """
        with self._lock:
            for index, scheduled in enumerate(self._queue):
                if not scheduled.matches(user=user, key=key, order_id=order_id):
                    continue
                if scheduled.fault.needs_work and not doing_work:
                    return None
                del self._queue[index]
                self._applied.append(scheduled)
                return scheduled.fault
            return None

    def _schedule(self, scheduled: Iterable[ScheduledFault]) -> None:
        items = list(scheduled)
        with self._lock:
            self._queue.extend(items)
