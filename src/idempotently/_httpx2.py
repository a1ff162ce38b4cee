"""Adapters between httpx and httpx2 (Pydantic's maintained fork of httpx).

The operation flow speaks httpx. A client built on httpx2 (``openai`` 3.x is)
hands the transports httpx2 requests and expects httpx2 responses back; these
functions convert at the boundary, and only there: the request and response
bytes, headers and status are carried over unchanged, so the journal holds
what it holds for httpx. httpx2 is optional: nothing here imports it until a
request of its kind arrives (its classes are recognised by their module).
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

import httpx

# The body of a converted response is already decoded; its Content-Encoding
# would make the other library decode it a second time.
_DROPPED_RESPONSE_HEADERS = frozenset({b"content-encoding"})


def is_httpx2(obj: object) -> bool:
    """Whether ``obj`` (a request, response, client or transport) comes from httpx2."""
    return type(obj).__module__.partition(".")[0] == "httpx2" or any(
        cls.__module__.partition(".")[0] == "httpx2" for cls in type(obj).__mro__
    )


def httpx2_module() -> ModuleType:
    """The httpx2 module; a clear error when it is missing."""
    try:
        return importlib.import_module("httpx2")
    except ImportError as error:  # pragma: no cover - only without the extra
        raise ImportError(
            "this needs httpx2: pip install 'idempotently[httpx2]'", name="httpx2"
        ) from error


def to_httpx_request(request: Any) -> httpx.Request:
    """An httpx copy of an httpx2 request whose body has been read."""
    return httpx.Request(
        request.method,
        str(request.url),
        headers=list(request.headers.raw),
        content=request.content,
        extensions=dict(request.extensions),
    )


def to_httpx2_request(request: httpx.Request) -> Any:
    """An httpx2 copy of an httpx request whose body has been read."""
    httpx2 = httpx2_module()
    return httpx2.Request(
        request.method,
        str(request.url),
        headers=list(request.headers.raw),
        content=request.content,
        extensions=dict(request.extensions),
    )


def _kept_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value in raw if name.lower() not in _DROPPED_RESPONSE_HEADERS]


def to_httpx_response(response: Any, request: httpx.Request | None = None) -> httpx.Response:
    """An httpx copy of an httpx2 response whose body has been read (decoded)."""
    converted = httpx.Response(
        response.status_code,
        headers=_kept_headers(list(response.headers.raw)),
        content=response.content,
        extensions=dict(response.extensions),
        request=request,
    )
    return converted


class _Httpx2Body(httpx.SyncByteStream):
    """The body of an httpx2 answer, unread until an httpx response reads it."""

    def __init__(self, answer: Any) -> None:
        self._answer = answer

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._answer.iter_raw()
        except Exception as error:
            # As httpx's own, so the flow classifies it (a broken connection is retried).
            raise to_httpx_error(error) from error

    def close(self) -> None:
        self._answer.close()


class _AsyncHttpx2Body(httpx.AsyncByteStream):
    """The body of an async httpx2 answer, unread until an httpx response reads it."""

    def __init__(self, answer: Any) -> None:
        self._answer = answer

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._answer.aiter_raw():
                yield chunk
        except Exception as error:
            raise to_httpx_error(error) from error

    async def aclose(self) -> None:
        await self._answer.aclose()


def unread_response(
    answer: Any, request: httpx.Request, *, asynchronous: bool = False
) -> httpx.Response:
    """An httpx response standing for an httpx2 answer whose body is not read yet (its
    headers as they came: the body is decoded when it is read), so that the flow reads
    of it no more than it decides to. An answer already read (an in-process transport's)
    is converted read, as `to_httpx_response` does."""
    if getattr(answer, "is_stream_consumed", False):
        return to_httpx_response(answer, request)
    body: httpx.SyncByteStream | httpx.AsyncByteStream = (
        _AsyncHttpx2Body(answer) if asynchronous else _Httpx2Body(answer)
    )
    return httpx.Response(
        answer.status_code,
        headers=list(answer.headers.raw),
        stream=body,
        extensions=dict(answer.extensions),
        request=request,
    )


def to_httpx2_response(response: httpx.Response, request: Any) -> Any:
    """An httpx2 copy of an httpx response whose body has been read (decoded)."""
    httpx2 = httpx2_module()
    return httpx2.Response(
        response.status_code,
        headers=_kept_headers(list(response.headers.raw)),
        content=response.content,
        extensions=dict(response.extensions),
        request=request,
    )


def to_httpx_error(error: Exception) -> Exception:
    """The httpx exception of the same name as an httpx2 one (so the flow can classify it).

    httpx2 keeps httpx's exception hierarchy under the same names; anything
    without a counterpart is returned as it is (the flow treats an unknown
    error as one that came after the server may have acted).
    """
    if not is_httpx2(error):
        return error
    for cls in type(error).__mro__:
        counterpart = getattr(httpx, cls.__name__, None)
        if isinstance(counterpart, type) and issubclass(counterpart, httpx.RequestError):
            converted = counterpart(str(error))
            converted.__cause__ = error
            return converted
    return error


def in_library_of(request: object, error: Exception) -> Exception:
    """``error`` as an httpx2 caller should see it: converted httpx errors are undone.

    A network error the flow re-raises becomes the httpx2 error it came from,
    and one our own error names as its cause is put back as that cause.
    """
    if not is_httpx2(request):
        return error
    if _was_converted(error):
        return error.__cause__  # type: ignore[return-value]
    cause = error.__cause__
    if cause is not None and _was_converted(cause):
        error.__cause__ = cause.__cause__
    return error


def _was_converted(error: BaseException) -> bool:
    cause = error.__cause__
    return isinstance(error, httpx.HTTPError) and cause is not None and is_httpx2(cause)
