"""Errors the API answers with, as RFC 9457 problem details (`application/problem+json`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

PROBLEM_MEDIA_TYPE = "application/problem+json"
_TYPE_BASE = "https://idempotently.invalid/problems/"


class Problem(Exception):
    """A request the API refuses; carries the status and the problem document."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        *,
        slug: str,
        headers: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{status} {title}: {detail}")
        self.status = status
        self.title = title
        self.detail = detail
        self.slug = slug
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def document(self) -> dict[str, Any]:
        return {
            "type": _TYPE_BASE + self.slug,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            **self.extra,
        }

    def body(self) -> str:
        return json.dumps(self.document(), separators=(",", ":"))


def bad_request(detail: str, *, slug: str = "invalid-request", **extra: Any) -> Problem:
    return Problem(400, "Bad Request", detail, slug=slug, extra=extra)
