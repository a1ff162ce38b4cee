"""Reading an answer's body within bounds: so many bytes, and no later than a time.

A server decides how long its answer's body is and how fast it comes: a hostile or
broken one can stream a 503's body without end, answer a POST with 10 GB, or send
one byte a second for ever (httpx's read timeout is per chunk, so each byte resets
it). The flow (``_flow.py``) says how much of an answer to read and until when
(`ReadAnswer`); the drivers read it here, the sync one with `read_answer`, the async
one with `aread_answer`, and `AnswerBody` keeps what was read, so a read stopped at an
excerpt can go on later from where it stopped.

Sizes count decoded bytes (what is held in memory), as httpx's ``iter_bytes`` yields
them: at most one decoded chunk past the limit is ever held.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import suppress

import anyio
import httpx

RETRIED_ANSWER_BYTES = 64 * 1024
"""The most read of an answer the flow may retry (5xx, 408, 409, 425, 429, a profile's
in-progress statuses), before it decides: what a profile's classifier and matchers see
of it. Such an answer's body is never journaled; this is ample for an error document."""

DEFAULT_MAX_RESPONSE_BYTES = 100 * 1024 * 1024
"""The default ``max_response_bytes`` (100 MiB): the largest final answer a call reads
and journals. A larger one is journaled with its status and headers, without its body,
and the call raises `AnswerNotReadError`."""


class AnswerBody:
    """What has been read of one answer's body (decoded), and why the reading stopped."""

    __slots__ = ("chunks", "complete", "iterator", "over", "response", "size", "timed_out")

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.chunks: list[bytes] = []
        self.size = 0
        self.complete = False
        """The whole body is read (and the response closed)."""
        self.over = False
        """The reading stopped at the limit of bytes: more was coming."""
        self.timed_out = False
        """The reading stopped at its time limit: more was coming."""
        self.iterator: Iterator[bytes] | AsyncIterator[bytes] | None = None

    def close(self) -> None:
        """Stop reading: the rest is never read, the connection is closed. A failure to
        close ends the connection, never the call."""
        with suppress(Exception):
            close = getattr(self.iterator, "close", None)
            if close is not None:
                close()
        with suppress(Exception):
            self.response.close()

    async def aclose(self) -> None:
        """`close`, on an async response; finished even in a cancelled call."""
        with anyio.CancelScope(shield=True):
            with suppress(Exception):
                aclose = getattr(self.iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            with suppress(Exception):
                await self.response.aclose()


def _room(body: AnswerBody, limit: int) -> bool:
    """A new read begins: False (and ``over``) when more than ``limit`` is read already."""
    body.over = body.timed_out = False
    if body.size > limit:
        body.over = True
        return False
    return True


def _took(
    body: AnswerBody, chunk: bytes, limit: int, until: float | None, clock: Callable[[], float]
) -> bool:
    """Keep ``chunk``; False when the read stops here: past ``limit`` bytes (``over``), or
    past ``until`` once a second chunk has come (``timed_out``)."""
    body.chunks.append(chunk)
    body.size += len(chunk)
    if body.size > limit:
        body.over = True
        return False
    if until is not None and len(body.chunks) > 1 and clock() >= until:
        body.timed_out = True
        return False
    return True


def _keep(body: AnswerBody) -> None:
    # What was read is the response's content from now on: a classifier and the
    # profile's matchers read ``response.content``, as of an answer read whole.
    body.response._content = b"".join(body.chunks)


def read_answer(
    body: AnswerBody, limit: int, until: float | None, clock: Callable[[], float]
) -> None:
    """Read on, until the body ends, more than ``limit`` bytes are read, or ``clock()``
    passes ``until`` (checked once a second chunk has come: an answer in one chunk is
    bounded by the read timeout alone); what a read raises (a timeout, a broken
    connection, an undecodable body) comes through, the response closed."""
    iterator: Iterator[bytes] | None = body.iterator  # type: ignore[assignment]
    if iterator is None:
        iterator = body.iterator = body.response.iter_bytes()
    try:
        if not _room(body, limit):
            return
        for chunk in iterator:
            if not _took(body, chunk, limit, until, clock):
                return
        body.complete = True
    except BaseException:
        body.close()
        raise
    finally:
        _keep(body)


async def aread_answer(
    body: AnswerBody, limit: int, until: float | None, clock: Callable[[], float]
) -> None:
    """`read_answer` on an async response (asyncio or trio)."""
    iterator: AsyncIterator[bytes] | None = body.iterator  # type: ignore[assignment]
    if iterator is None:
        iterator = body.iterator = body.response.aiter_bytes()
    try:
        if not _room(body, limit):
            return
        async for chunk in iterator:
            if not _took(body, chunk, limit, until, clock):
                return
        body.complete = True
    except BaseException:
        await body.aclose()
        raise
    finally:
        _keep(body)
