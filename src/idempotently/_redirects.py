"""Following redirects with every redirect's body read within bounds.

httpx's own client loop reads each redirect answer whole before it follows it, decoded
by httpx: a 302 whose body is a kilobyte of gzip-of-gzip inflates to gigabytes, and one
that trickles a byte a second is read for ever. So where the library sends through a
client that follows redirects (a Session's attempts and reads, a lookup's pages), it
sends each hop with ``follow_redirects=False`` and follows them here, as the client
would: the next request is the client's own (``_build_redirect_request``: 301/302/303
become a GET as httpx decides, ``Authorization`` is dropped on the way to another
origin, cookies from the client's jar), with the client's event hooks on every hop and
its ``max_redirects``. Only the reading differs: a redirect's body is read through
`_answers.read_answer`, no further than `REDIRECT_BODY_BYTES` and for no longer than
one read timeout, then closed. Nothing in a redirect's body decides where it leads.

Under a `Transport`, the client above follows the redirects; the transport reads a
redirect answer to a read the same way (`read_redirect`) before handing it up, so the
client's own read of it finds it already read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import httpx

from idempotently import _httpx2
from idempotently._answers import AnswerBody, aread_answer, read_answer

REDIRECT_BODY_BYTES = 64 * 1024
"""The most read of a redirect's body (decoded): ample for its "moved to" note."""

View = Callable[[Any], httpx.Response]
"""The httpx response that reads an answer of the client's library (httpx2's too)."""


def _same(response: Any) -> httpx.Response:
    return response  # type: ignore[no-any-return]


def _until(request: Any, clock: Callable[[], float], until: float | None) -> float | None:
    """When reading a redirect's body must be over: one read timeout from now (the flow
    caps a request's timeouts by its deadline), and never past ``until``."""
    timeouts = request.extensions.get("timeout")
    read = timeouts.get("read") if isinstance(timeouts, dict) else None
    if read is None:
        return until
    soon = clock() + float(read)
    return soon if until is None else min(soon, until)


def read_redirect(
    response: httpx.Response,
    request: httpx.Request,
    clock: Callable[[], float],
    until: float | None = None,
) -> None:
    """Read a redirect's body to `REDIRECT_BODY_BYTES`, within one read timeout; what
    was read is its content, the rest is never read (the response closed)."""
    body = AnswerBody(response)
    read_answer(body, REDIRECT_BODY_BYTES, _until(request, clock, until), clock)
    if not body.complete:
        body.close()


async def aread_redirect(
    response: httpx.Response,
    request: httpx.Request,
    clock: Callable[[], float],
    until: float | None = None,
) -> None:
    """`read_redirect`, async (asyncio or trio)."""
    body = AnswerBody(response)
    await aread_answer(body, REDIRECT_BODY_BYTES, _until(request, clock, until), clock)
    if not body.complete:
        await body.aclose()


def _library(client: Any) -> Any:
    """The module of the client's library: httpx, or httpx2 for an httpx2 client."""
    return _httpx2.httpx2_module() if _httpx2.is_httpx2(client) else httpx


def _next(client: Any, request: Any, response: Any, history: list[Any]) -> Any:
    """The client's next request after ``response``, or TooManyRedirects as it raises
    it: past ``max_redirects`` hops, before sending another."""
    following = client._build_redirect_request(request, response)
    history.append(response)
    if len(history) > client.max_redirects:
        raise _library(client).TooManyRedirects(
            "Exceeded maximum allowed redirects.", request=following
        )
    return following


def _hop_failed(client: Any, error: Exception, response: Any) -> Exception:
    """An error sending a later hop of a chain, as the attempt's: the request that was
    redirected reached the server (a 303 after a POST says it acted), so a transport error
    that would read as "nothing was sent" (a refused connection, a scheme httpx cannot
    send) must not read so; it becomes one that may have been delivered. The Location is
    not quoted (it may carry userinfo or a secret)."""
    library = _library(client)
    if not isinstance(error, library.TransportError):
        return error  # a hook's own error, or the gate refusing the hop: as they are
    followed: Exception = library.RemoteProtocolError(
        f"following the server's {response.status_code} redirect failed "
        f"({type(error).__name__}: {error}); the request it redirected reached the server",
        request=error.request if _has_request(error) else None,
    )
    return followed


def _has_request(error: Any) -> bool:
    try:
        error.request  # noqa: B018 (httpx raises when it was never set)
    except RuntimeError:
        return False
    return True


def _no_auth(client: Any) -> Any:
    """An auth that adds nothing: the client's auth applies to the first request only,
    as in httpx's loop; a later hop carries what its redirect rules kept of the headers
    (``Authorization`` is dropped on the way to another origin)."""
    return _library(client).Auth()


def send(
    client: Any,
    request: Any,
    clock: Callable[[], float],
    *,
    until: float | None = None,
    view: View = _same,
    within: Callable[[Any], bool] | None = None,
) -> Any:
    """``client.send(request, stream=True)``, its redirects followed as the client
    would follow them, each redirect's body read within bounds; the last answer's body
    is unread. ``view`` gives the httpx response reading an answer of the client's
    library; ``until`` caps the time of every redirect's read; ``within(url)`` says
    whether a redirect may be followed there (no: the redirect is the answer)."""
    follows = bool(client.follow_redirects)
    response = client.send(request, stream=True, follow_redirects=False)
    history: list[Any] = []
    while follows and response.has_redirect_location:
        try:
            following = _next(client, request, response, history)
            if within is not None and not within(following.url):
                history.pop()
                break
            read_redirect(view(response), request, clock, until)
        except BaseException:
            response.close()
            raise
        request = following
        try:
            response = client.send(
                request, stream=True, follow_redirects=False, auth=_no_auth(client)
            )
        except Exception as error:
            failed = _hop_failed(client, error, history[-1])
            if failed is error:
                raise
            raise failed from error
        response.history = list(history)
    return response


async def asend(
    client: Any,
    request: Any,
    clock: Callable[[], float],
    *,
    until: float | None = None,
    view: View = _same,
    within: Callable[[Any], bool] | None = None,
) -> Any:
    """`send`, with an async client (asyncio or trio)."""
    follows = bool(client.follow_redirects)
    response = await client.send(request, stream=True, follow_redirects=False)
    history: list[Any] = []
    while follows and response.has_redirect_location:
        try:
            following = _next(client, request, response, history)
            if within is not None and not within(following.url):
                history.pop()
                break
            await aread_redirect(view(response), request, clock, until)
        except BaseException:
            with anyio.CancelScope(shield=True):  # closed even in a cancelled call
                await response.aclose()
            raise
        request = following
        try:
            response = await client.send(
                request, stream=True, follow_redirects=False, auth=_no_auth(client)
            )
        except Exception as error:
            failed = _hop_failed(client, error, history[-1])
            if failed is error:
                raise
            raise failed from error
        response.history = list(history)
    return response
