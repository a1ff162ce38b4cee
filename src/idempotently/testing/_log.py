"""The request log: what reached the mock server, for a test to assert on."""

from __future__ import annotations

import json
import threading
from typing import Any

import attrs


@attrs.frozen
class LoggedRequest:
    """One `POST /v1/charges` as the server saw and answered it.

    `user` and `key` are None when the request was refused before they were
    read; `document` is the charge (JSON or form, decoded the same way) when
    the body was valid; `replayed` says the answer carried
    `Idempotent-Replayed: true`; `fault` names the scripted fault it met.
    A `lose_response` or `crash` fault shows the status the server would
    have sent: the client saw a dropped connection instead.
    """

    method: str
    """The request's HTTP method."""
    path: str
    """The request's path."""
    user: str | None
    """The user its bearer token named, or None when refused before it was read."""
    key: str | None
    """Its `Idempotency-Key`, or None when refused before it was read."""
    body: bytes
    """The request body's bytes."""
    document: dict[str, Any] | None
    """The charge it carried (JSON or form, decoded the same way), or None when invalid."""
    status: int
    """The status the server answered (or would have, for `lose_response` and `crash`)."""
    replayed: bool
    """The answer carried `Idempotent-Replayed: true`."""
    fault: str | None = None
    """The scripted fault it met, or None."""

    def json(self) -> Any:
        """The body decoded as JSON (raises ValueError for a form or malformed body)."""
        return json.loads(self.body)


class RequestLog:
    """Thread-safe, append-only; read with `entries()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[LoggedRequest] = []

    def append(self, entry: LoggedRequest) -> None:
        with self._lock:
            self._entries.append(entry)

    def entries(self) -> list[LoggedRequest]:
        with self._lock:
            return list(self._entries)
