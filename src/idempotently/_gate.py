"""The last look at a journaled request, as it leaves: after every request hook and auth flow.

A client's request hooks and its ``auth=`` flow run inside ``client.send``, after
the journal has seen the request (a token-refresh hook sets ``Authorization``, an
SDK signs its body). What they change is either journaled as sent or refused
before the first byte:

- a key bound to credentials (``ServerProfile(key_bound_to_credentials=True)``) is
  bound to the credentials the request carries as it leaves, journaled durably
  before its first byte; a later attempt, a call again or a resume whose request
  leaves with other credentials sends nothing (`CredentialsMismatchError`);
- a request that leaves with another method, URL, body or idempotency key header
  than the journal holds (or another value of a fingerprinted header) sends nothing:
  the journal could not vouch for what the server got under its key.

Other headers (trace ids, a user agent, a signature over the journaled bytes) are
outside the operation's identity, as they are outside its fingerprint: a hook may set
them on every attempt.

The check is one sans-I/O generator (`Gate.leaving`), driven where the request
leaves the library's hands: by the last request hook of a `Session`'s client (the
drivers keep it last), and by a `Transport` right before its wrapped transport.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import Any

import httpx

from idempotently import _httpx2
from idempotently._commands import BindCredentials, DigestCredentials, GateCommand
from idempotently._credentials import (
    cached_digest,
    credential_names,
    credentials_record,
    described,
    digest_key,
    read_record,
    same_digest,
)
from idempotently._exceptions import (
    CredentialsMismatchError,
    ErrorContext,
    IdempotentlyError,
    OperationInProgressError,
    OperationPendingError,
    RequestNotSentError,
    after_send_began,
    without_nothing_sent,
)
from idempotently._secret_params import redacted_url
from idempotently._vocabulary import Outcome

GATE_EXTENSION = "idempotently.gate"
"""The request extension a journaled attempt carries while it is being sent: its `Passage`."""

CREDENTIALS_DIFFER = "credentials differ from those it was made with"


class GateRefusal(Exception):
    """The request was not let out as it stood: nothing of it left (``not_sent``), or an
    earlier request of the same attempt did (an auth flow's or a redirect's follow-up:
    ``maybe_delivered``). Raised inside ``client.send``; the flow journals the attempt
    and raises `error` for the caller."""

    def __init__(
        self, reason: str, *, outcome: Outcome, kind: type[IdempotentlyError] | None = None
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.outcome: Outcome = outcome
        self.kind = kind

    def error(self, ids: ErrorContext) -> IdempotentlyError:
        """What the caller gets: the operation stays pending with its key; when an earlier
        request of the attempt may have been delivered, the one rule says so."""
        if self.kind is not None:
            kind = self.kind
        elif self.outcome == "not_sent":
            kind = RequestNotSentError
        else:
            kind = OperationPendingError
        error = kind(self.reason, **ids)
        if self.outcome == "not_sent":
            return error
        return after_send_began(error, ids.get("operation_id") or "", ids.get("key") or "", "")

    def delivered(self, why: str) -> None:
        """Make this refusal the attempt's after ``why`` (an earlier request of it, or this
        one, may have reached the server): journaled ``maybe_delivered``, and its reason no
        longer says nothing was sent."""
        self.outcome = "maybe_delivered"
        self.reason = f"{why}: {without_nothing_sent(self.reason)}"


def binding_differs(
    record: str, request: httpx.Request, salt: bytes
) -> Generator[GateCommand, Any, str | None]:
    """None when ``request`` carries the credentials of ``record`` (its digest agrees),
    else why it must not be sent. The one comparison: a gate's, and a lookup's."""
    try:
        names, digest = read_record(record)
    except ValueError as error:
        return (
            f"its key is bound to its credentials and their digest cannot be checked "
            f"({error}); nothing was sent and it stays pending"
        )
    if not names:
        return (
            "its key is bound to no credentials (journaled by an earlier version, before a "
            "request hook or auth flow added them), so no resend can be shown to carry the "
            "credentials it was made with; nothing was sent and it stays pending: look the "
            "object up on the server and settle it (`idempotently settle`)"
        )
    key = digest_key(salt, request, names)
    live = cached_digest(key)
    if live is None:
        live = yield DigestCredentials(key)
    if same_digest(live, digest):
        return None
    return (
        f"{CREDENTIALS_DIFFER} ({described(names)}, compared by digest, as the request "
        "left its last request hook and auth flow): its profile says the server binds the "
        "key to them, so a resend would be a new request there. Nothing was sent and it "
        "stays pending: send it again with the original credentials"
    )


class Gate:
    """What one operation's attempts must still be as they leave, made by the flow before
    its first send (from the request as the journal holds it); the binding it journals
    on the first pass of an unbound key is kept here for the attempts after."""

    __slots__ = (
        "_body",
        "_fingerprinted",
        "_key_name",
        "_key_values",
        "_left",
        "_method",
        "_stream",
        "_url",
        "bind",
        "binding",
        "fingerprint_headers",
        "key",
        "key_header",
        "operation_id",
        "owner",
        "passes",
        "redact_headers",
        "salt",
        "secret_params",
    )

    def __init__(
        self,
        request: httpx.Request,
        *,
        operation_id: str,
        key: str,
        key_header: str,
        bind: bool,
        binding: str | None,
        owner: str | None,
        salt: bytes,
        redact_headers: frozenset[str],
        secret_params: frozenset[str],
        fingerprint_headers: Sequence[str],
    ) -> None:
        self.operation_id = operation_id
        self.key = key
        self.key_header = key_header
        self.bind = bind
        self.binding = binding
        self.owner = owner
        self.salt = salt
        self.redact_headers = redact_headers
        self.secret_params = secret_params
        self.fingerprint_headers = fingerprint_headers
        self.passes = 0
        """Requests let out during the current send (the flow resets it before each)."""
        self._left: tuple[Any, ...] = ()
        """The last request let out, as it was then: whether it was the attempt's first,
        the request, its method, URL, body stream and raw headers."""
        self._method = request.method
        self._url = request.url
        self._body = request.content
        self._stream = request.stream
        self._key_name = key_header.lower().encode("latin-1")
        self._key_values = _values(request.headers, self._key_name)
        self._fingerprinted = [request.headers.get_list(name) for name in fingerprint_headers]

    def leaving(self, request: httpx.Request) -> Generator[GateCommand, Any, None]:
        """Let ``request`` out (the attempt's first, or a follow-up within the same send),
        binding the key to its credentials first if it is bound to none; raise
        `GateRefusal` if it must not leave."""
        follow_up = self.passes > 0
        outcome: Outcome = "maybe_delivered" if follow_up else "not_sent"
        changed = self._changed(request, follow_up)
        if changed is not None:
            raise GateRefusal(self._refusal(changed, follow_up), outcome=outcome)
        if self.bind:
            if self.binding is None:
                yield from self._bind(request)
            else:
                differ = yield from binding_differs(self.binding, request, self.salt)
                if differ is not None:
                    refusal = GateRefusal(differ, outcome=outcome, kind=CredentialsMismatchError)
                    if follow_up:
                        refusal.delivered(
                            "a follow-up request of this attempt (its auth flow's, or a "
                            "redirect's: httpx drops Authorization on a redirect to another "
                            "origin) was not sent, an earlier one may have been delivered"
                        )
                    raise refusal
        self._left = (
            not follow_up,
            request,
            request.method,
            request.url,
            request.stream,
            request.headers.raw,
        )
        self.passes += 1

    def changed_since(self, request: httpx.Request) -> bool:
        """Whether ``request``, the one that left, is the last one let out with something
        changed after its check (a request hook that ran after the Session's last one:
        appended while the send was running), so it must be checked again."""
        if not self._left or request is not self._left[1]:
            return False
        _first, _request, method, url, stream, raw = self._left
        return (
            request.method != method
            or request.url is not url
            or request.stream is not stream
            or request.headers.raw != raw
        )

    def again(self, request: httpx.Request) -> Generator[GateCommand, Any, None]:
        """`leaving` for the last request let out, once more, as it left."""
        if self._left[0]:
            self.passes = 0
        yield from self.leaving(request)

    def _bind(self, request: httpx.Request) -> Generator[GateCommand, Any, None]:
        """Journal, durably and before any byte of it leaves, the credentials this key is
        sent with: the first request of the operation to leave."""
        names = credential_names(request, self.redact_headers, self.secret_params)
        if not names:
            raise GateRefusal(
                "its profile binds the key to the credentials it is sent with, and the request "
                "leaves with none (no Authorization, Proxy-Authorization or X-Api-Key header, "
                "no header in redact_headers, no secret query parameter): it would be bound to "
                "nothing. Nothing was sent and it stays pending: give the credentials (headers=, "
                "a request hook or auth=), then call again or resume",
                outcome="not_sent",
                kind=CredentialsMismatchError,
            )
        key = digest_key(self.salt, request, names)
        digest = cached_digest(key)
        if digest is None:
            digest = yield DigestCredentials(key)
        record = credentials_record(names, digest)
        if self.owner is None or not (
            yield BindCredentials(self.operation_id, self.owner, record, self.key)
        ):
            raise GateRefusal(
                "its lease was taken over (or it was settled) before its credentials could be "
                "journaled: another caller may be sending it, so this one sent nothing. Call "
                "again with the same operation_id for its outcome",
                outcome="not_sent",
                kind=OperationInProgressError,
            )
        self.binding = record

    def _changed(self, request: httpx.Request, follow_up: bool) -> str | None:
        """What differs from the journaled request in what decides the server's answer to
        the key, if anything (a follow-up is checked for its key header only: a redirect
        may change the method, URL and body)."""
        if _values(request.headers, self._key_name) != self._key_values:
            return f"its {self.key_header} header"
        if follow_up:
            return None
        if request.method != self._method:
            return "its method"
        # httpx's URL equality parses the other side again: identity first (a hook that
        # leaves the URL alone leaves the same object), then the text.
        url = request.url
        if (
            url is not self._url
            and str(url) != str(self._url)
            and (
                redacted_url(url, self.secret_params)[0]
                != redacted_url(self._url, self.secret_params)[0]
            )
        ):
            return "its URL"
        if request.stream is not self._stream:
            stream = request.stream
            if not isinstance(stream, httpx.ByteStream) or b"".join(stream) != self._body:
                return "its body"
        else:
            try:
                if request.content != self._body:
                    return "its body"
            except httpx.RequestNotRead:
                return "its body"
        for name, values in zip(self.fingerprint_headers, self._fingerprinted, strict=True):
            if request.headers.get_list(name) != values:
                return f"its {name} header (a fingerprinted header)"
        return None

    def _refusal(self, changed: str, follow_up: bool) -> str:
        when = (
            "a follow-up request of this attempt (its auth flow's or a redirect's) changed"
            if follow_up
            else "a request hook or auth flow changed"
        )
        after = (
            "this one was not sent, an earlier request of this attempt may have been delivered"
            if follow_up
            else "nothing was sent and it stays pending with its key"
        )
        return (
            f"{when} {changed} after the journal recorded the request, so the server would get "
            f"under key {self.key!r} a request the journal cannot vouch for: {after}. Set it "
            "before the call (headers=, content=), not in a hook"
        )


class Passage:
    """A gate with the I/O its checks need (a digest, a durable journal write), as the
    driver of the attempt provides it: what a request carries in `GATE_EXTENSION`
    while it is being sent."""

    __slots__ = ("gate", "perform")

    def __init__(self, gate: Gate, perform: Callable[[GateCommand], Any]) -> None:
        self.gate = gate
        self.perform = perform

    def carries_key(self, request: Any) -> bool:
        return _values(request.headers, self.gate._key_name) == self.gate._key_values

    def through(self, request: Any) -> None:
        """Check ``request`` (an httpx or httpx2 request) as it leaves, with blocking I/O."""
        steps = self.gate.leaving(_as_httpx(request))
        reply: Any = None
        while True:
            try:
                command = steps.send(reply)
            except StopIteration:
                return
            reply = self.perform(command)

    async def athrough(self, request: Any) -> None:
        """`through`, on an event loop (``perform`` returns awaitables)."""
        steps = self.gate.leaving(_as_httpx(request))
        reply: Any = None
        while True:
            try:
                command = steps.send(reply)
            except StopIteration:
                return
            waited: Awaitable[Any] = self.perform(command)
            reply = await waited


def _values(headers: Any, name: bytes) -> list[bytes]:
    """The raw values of the header ``name`` (lowercase), as they go out."""
    return [value for raw_name, value in headers.raw if raw_name.lower() == name]


def _as_httpx(request: Any) -> httpx.Request:
    if type(request) is httpx.Request:
        return request
    return _httpx2.to_httpx_request(request) if _httpx2.is_httpx2(request) else request


LEAVING: contextvars.ContextVar[Passage | None] = contextvars.ContextVar(
    "idempotently_leaving", default=None
)
"""The passage of the attempt this thread or task is sending: for a request an auth
flow rebuilt without the original's extensions, recognised by its key header."""


def _passage_of(request: Any) -> Passage | None:
    passage = request.extensions.get(GATE_EXTENSION)
    if isinstance(passage, Passage):
        return passage
    leaving = LEAVING.get()
    if leaving is not None and leaving.carries_key(request):
        return leaving
    return None


def last_hook(request: Any) -> None:
    """The request hook every Session keeps last on its client: a journaled attempt's
    gate (anything else passes untouched)."""
    passage = _passage_of(request)
    if passage is not None:
        passage.through(request)


async def alast_hook(request: Any) -> None:
    """`last_hook`, for an async client."""
    passage = _passage_of(request)
    if passage is not None:
        await passage.athrough(request)


_KEEPING_LAST = threading.Lock()


def keep_last(client: Any, hook: Callable[[Any], Any]) -> None:
    """Make ``hook`` the client's last request hook (a hook added after it moves it);
    threads sending through one client move it once."""
    hooks = client.event_hooks["request"]
    if hooks and hooks[-1] is hook:
        return
    with _KEEPING_LAST:
        hooks = client.event_hooks["request"]
        while hook in hooks:
            hooks.remove(hook)
        hooks.append(hook)
