"""Reading an answer's body within bounds: so many bytes, and no later than a time.

A server decides how long its answer's body is and how fast it comes: a hostile or
broken one can stream a 503's body without end, answer a POST with 10 GB, or send
one byte a second for ever (httpx's read timeout is per chunk, so each byte resets
it). The flow (``_flow/``) says how much of an answer to read and until when
(`ReadAnswer`); the drivers read it here, the sync one with `read_answer`, the async
one with `aread_answer`, and `AnswerBody` keeps what was read, so a read stopped at an
excerpt can go on later from where it stopped.

Sizes count decoded bytes (what is held in memory). The raw body is decoded here, not
by httpx: httpx inflates a raw chunk through every ``Content-Encoding`` layer before
anything can count it, so 755 bytes of gzip-of-gzip become 750 MiB at once. Here each
layer yields at most `DECODE_STEP` bytes per step (zlib's ``max_length``), so at most one
step past the limit is ever held; an answer with more than `MAX_ENCODINGS` layers, or
an encoding that cannot be decoded within bounds, is refused unread (``refused``).
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
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


MAX_ENCODINGS = 2
"""The most ``Content-Encoding`` layers an answer is decoded through (``gzip, gzip``
is two); an answer with more is refused unread, as one over ``max_response_bytes``."""

DECODE_STEP = 64 * 1024
"""The most one decoding step of one layer produces, whatever a raw chunk inflates to."""


class _Inflate:
    """One gzip or deflate layer, decoded a bounded step at a time."""

    __slots__ = ("decompressor", "retry_raw")

    def __init__(self, wbits: int) -> None:
        self.decompressor = zlib.decompressobj(wbits)
        # "deflate" is meant to be zlib-wrapped, yet some servers send it raw (httpx
        # tries both too): a first chunk that is not zlib is read as raw deflate.
        self.retry_raw = wbits == zlib.MAX_WBITS

    def feed(self, data: bytes) -> Iterator[bytes]:
        while True:
            try:
                out = self.decompressor.decompress(data, DECODE_STEP)
            except zlib.error as error:
                if self.retry_raw:
                    self.retry_raw = False
                    self.decompressor = zlib.decompressobj(-zlib.MAX_WBITS)
                    continue
                raise httpx.DecodingError(str(error)) from error
            if data:
                self.retry_raw = False
            data = self.decompressor.unconsumed_tail
            if out:
                yield out
            # A full step may leave output inside zlib, with no input left: ask again.
            if not data and len(out) < DECODE_STEP:
                return

    def end(self) -> Iterator[bytes]:
        yield from self.feed(b"")
        try:
            rest = self.decompressor.flush(DECODE_STEP)
        except zlib.error as error:
            raise httpx.DecodingError(str(error)) from error
        if rest:
            yield rest


_LAYERS: dict[str, Callable[[], _Inflate]] = {
    "gzip": lambda: _Inflate(zlib.MAX_WBITS | 16),
    "x-gzip": lambda: _Inflate(zlib.MAX_WBITS | 16),
    "deflate": lambda: _Inflate(zlib.MAX_WBITS),
}


def decoding(headers: httpx.Headers) -> list[_Inflate] | str:
    """The layers that decode an answer with these headers, the last applied first, or
    why its body is not read: too many layers, or one not decoded within bounds."""
    names = [
        value.strip().lower()
        for value in headers.get_list("content-encoding", split_commas=True)
        if value.strip().lower() not in ("", "identity")
    ]
    if len(names) > MAX_ENCODINGS:
        return (
            f"its body is encoded {len(names)} times (Content-Encoding: {', '.join(names)}), "
            f"more than the {MAX_ENCODINGS} layers read, so only its status and headers "
            "are journaled"
        )
    unknown = [name for name in names if name not in _LAYERS]
    if unknown:
        return (
            f"its body is encoded as {unknown[0][:40]!r}, which is not decoded within a "
            "bound on decoded bytes (gzip and deflate are), so only its status and headers "
            "are journaled"
        )
    return [_LAYERS[name]() for name in reversed(names)]


def _through(layers: Sequence[_Inflate], index: int, data: bytes) -> Iterator[bytes]:
    """``data`` decoded by ``layers[index:]``, a step of each at a time."""
    if index == len(layers):
        yield data
        return
    for piece in layers[index].feed(data):
        yield from _through(layers, index + 1, piece)


def _ended(layers: Sequence[_Inflate], index: int = 0) -> Iterator[bytes]:
    """What the layers still hold once the raw body has ended."""
    if index == len(layers):
        return
    for piece in layers[index].end():
        yield from _through(layers, index + 1, piece)
    yield from _ended(layers, index + 1)


def _raw(body: AnswerBody) -> tuple[bytes | None, Sequence[_Inflate]]:
    """The content already read (decoded) of an answer, else None and the layers that
    decode its raw bytes; a refused encoding is noted on ``body`` and read as nothing."""
    response = body.response
    if hasattr(response, "_content"):  # an in-process transport's answer, read whole
        return response.content, ()
    layers = decoding(response.headers)
    if isinstance(layers, str):
        body.refused = layers
        return b"", ()
    return None, layers


def _decoded(
    read: bytes | None, layers: Sequence[_Inflate], raw: Callable[[], Iterator[bytes]]
) -> Iterator[bytes]:
    if read is not None:
        yield read
        return
    for chunk in raw():
        produced = False
        for piece in _through(layers, 0, chunk):
            produced = True
            yield piece
        if not produced:
            # Compressed bytes trickled in that decode to nothing yet: an empty piece
            # still lets the reader look at its clock, so the time bound holds.
            yield b""
    yield from _ended(layers)


async def _adecoded(
    read: bytes | None, layers: Sequence[_Inflate], raw: Callable[[], AsyncIterator[bytes]]
) -> AsyncIterator[bytes]:
    if read is not None:
        yield read
        return
    async for chunk in raw():
        produced = False
        for piece in _through(layers, 0, chunk):
            produced = True
            yield piece
        if not produced:
            yield b""  # as in _decoded: the reader's clock is looked at
    for piece in _ended(layers):
        yield piece


class AnswerBody:
    """What has been read of one answer's body (decoded), and why the reading stopped."""

    __slots__ = (
        "chunks",
        "complete",
        "iterator",
        "over",
        "refused",
        "response",
        "size",
        "timed_out",
    )

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
        self.refused: str | None = None
        """Why the body is not read at all (its encoding), or None."""
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
    if body.refused is not None:
        return False
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
        iterator = body.iterator = _decoded(*_raw(body), body.response.iter_raw)
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
        iterator = body.iterator = _adecoded(*_raw(body), body.response.aiter_raw)
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
