"""Codecs for the bodies the journal stores: encryption at rest.

A codec is any object with a ``name`` and two functions of bytes, as
Temporal's PayloadCodec: ``encode(data) -> bytes`` before a body is written,
``decode(data) -> bytes`` after it is read. The journal applies it to the
request body and the answer body of every operation it makes, and names it in
the operation's row; everything else (the URL, non-secret headers, statuses,
ids and keys) stays in clear, so the journal can still be audited without it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from idempotently._exceptions import CodecError

MAX_CODEC_NAME_LENGTH = 64
_PROBE = b"idempotently codec check \x00\xff"


@runtime_checkable
class Codec(Protocol):
    """What ``Journal(codec=...)`` takes: a name, and bytes in, bytes out both ways.

    ``decode(encode(data)) == data`` for all bytes. ``name`` is journaled with
    every operation it encodes; a journal opened with a codec of another name (or
    none) reads those bodies as unreadable, and never sends them.

    With each request body the journal stores its SHA-256, encoded by the codec too,
    and resends a body only if its decoded digest matches: a codec that does not
    authenticate (a keystream, XOR, compression with a dictionary), given the wrong key,
    decodes to other bytes, which are never sent under the operation's key. A codec
    whose ``decode`` raises for a wrong key or damaged data may say so with
    ``authenticates = True``: rows journaled before the digest existed (schema
    version 5) are then resent as before; without it they are not.
    """

    name: str

    def encode(self, data: bytes) -> bytes: ...

    def decode(self, data: bytes) -> bytes: ...


def check_codec(codec: object) -> Codec:
    """``codec`` if it is one, or a TypeError/ValueError saying what it lacks; it must
    decode what it encodes (tried once, on a probe)."""
    name = getattr(codec, "name", None)
    if not callable(getattr(codec, "encode", None)) or not callable(getattr(codec, "decode", None)):
        raise TypeError(
            "codec must have encode(data: bytes) -> bytes and decode(data: bytes) -> bytes "
            f"methods (e.g. idempotently.FernetCodec(key)), not {type(codec).__name__}"
        )
    if (
        not isinstance(name, str)
        or not name
        or len(name) > MAX_CODEC_NAME_LENGTH
        or not name.isprintable()
        or name != name.strip()
    ):
        raise ValueError(
            f"a codec's name must be 1 to {MAX_CODEC_NAME_LENGTH} printable characters "
            f"without surrounding spaces (it is journaled with each operation), not {name!r:.80}"
        )
    checked: Codec = codec  # type: ignore[assignment]  # checked above, structurally
    try:
        back = checked.decode(checked.encode(_PROBE))
    except Exception as error:
        raise ValueError(
            f"codec {name!r} cannot decode what it encodes ({type(error).__name__}); "
            "nothing was journaled"
        ) from None
    if back != _PROBE:
        raise ValueError(
            f"codec {name!r} does not give back what it encoded; nothing was journaled"
        )
    return checked


def encoded(codec: Codec, data: bytes) -> bytes:
    """``codec.encode(data)``, or a CodecError (never the data in its message).

    The message says only what the codec did: whether anything was sent is for the
    caller to say (before the first send, nothing was; after it, the one rule of
    `idempotently._exceptions.after_send_began` says what may have been)."""
    try:
        result = codec.encode(data)
    except Exception as error:
        raise CodecError(
            f"codec {codec.name!r} failed to encode a body ({type(error).__name__})"
        ) from None
    if not isinstance(result, bytes):
        raise CodecError(
            f"codec {codec.name!r} encoded a body as {type(result).__name__}, not bytes"
        )
    return result


def body_digest(codec: Codec, body: bytes) -> bytes:
    """What the journal stores beside a request body encoded by ``codec``: the SHA-256 of
    the clear body, encoded by the same codec (never in clear)."""
    return encoded(codec, hashlib.sha256(body).digest())


def unverified(codec: Codec, body: bytes, digest: bytes | None) -> str | None:
    """Why ``body``, decoded by ``codec``, cannot be proven to be the body first journaled
    (a message, never the data); None when its digest matches.

    ``digest`` is the row's stored ``body_digest``; None for a row journaled before there
    was one, which only a codec that says it authenticates may resend."""
    if digest is None:
        if getattr(codec, "authenticates", False) is True:
            return None
        return (
            f"it was journaled before the journal kept a digest of each request body "
            f"(schema version 5), and codec {codec.name!r} does not say that it "
            "authenticates (a codec whose decode raises for a wrong key sets "
            "authenticates = True), so the decoded body cannot be proven to be the one "
            "first sent; check it (`idempotently show`) and settle or fork it by hand"
        )
    clear = decoded(codec, codec.name, digest)
    if isinstance(clear, str) or not hmac.compare_digest(clear, hashlib.sha256(body).digest()):
        return (
            f"its request body, decoded with codec {codec.name!r}, does not match the "
            "digest journaled with it: the codec's key is not the one it was written with "
            "(a codec that does not authenticate decodes a wrong key to other bytes), or "
            "the row is damaged; open the journal with the codec and key it was written with"
        )
    return None


def decoded(codec: Codec | None, stored: str, data: bytes) -> bytes | str:
    """The clear body, or why it cannot be had here (a message, never the data)."""
    if codec is None:
        return (
            f"its bodies are stored encoded with codec {stored!r} and the journal was opened "
            "without a codec (Journal(..., codec=...), or --codec module:NAME)"
        )
    if codec.name != stored:
        return (
            f"its bodies are stored encoded with codec {stored!r} and the journal was opened "
            f"with codec {codec.name!r}"
        )
    try:
        result = codec.decode(data)
    except Exception as error:
        return (
            f"its bodies could not be decoded with codec {stored!r} ({type(error).__name__}: "
            "the wrong key, or a damaged row)"
        )
    if not isinstance(result, bytes):
        return f"codec {stored!r} decoded a body as {type(result).__name__}, not bytes"
    return result


class FernetCodec:
    """Encrypts stored bodies with Fernet (AES-128-CBC and HMAC-SHA256, from the
    ``cryptography`` package: ``pip install 'idempotently[fernet]'``).

    ``FernetCodec(key)`` takes a key from ``cryptography.fernet.Fernet.generate_key()``
    (keep it out of the journal's directory, e.g. in a secret manager). To rotate,
    give several: ``FernetCodec([new_key, old_key])`` encodes with the first and
    decodes with any of them. Each encoding has a random IV, so the same body is
    stored differently each time; the journal compares requests by their clear bytes.
    """

    def __init__(self, keys: bytes | str | Sequence[bytes | str], *, name: str = "fernet") -> None:
        try:
            from cryptography.fernet import Fernet, MultiFernet
        except ImportError:
            raise ImportError(
                "FernetCodec needs the cryptography package: pip install 'idempotently[fernet]'"
            ) from None
        listed = [keys] if isinstance(keys, (bytes, str)) else list(keys)
        if not listed:
            raise ValueError("FernetCodec needs at least one key")
        try:
            fernets = [Fernet(key) for key in listed]
        except (ValueError, TypeError):
            raise ValueError(
                "a Fernet key is 32 url-safe base64-encoded bytes (make one with "
                "cryptography.fernet.Fernet.generate_key()); the key given is not one"
            ) from None
        self.name = name
        self._fernet = MultiFernet(fernets)

    authenticates = True
    """Fernet's HMAC makes a wrong key or a damaged row fail to decode (see `Codec`)."""

    def encode(self, data: bytes) -> bytes:
        return self._fernet.encrypt(data)

    def decode(self, data: bytes) -> bytes:
        return self._fernet.decrypt(data)

    def __repr__(self) -> str:
        return f"FernetCodec(name={self.name!r})"  # never the keys
