"""The built-in lookup reconciler: settle a needs_reconcile operation by looking it up.

``Lookup(url, params=...)`` is a reconciler (``Session.resume(reconciler=...)``,
``AsyncSession`` too, ``idempotently reconcile --lookup``). For each operation it
sends one GET through the session's client (its credentials, nothing journaled),
and reads the answer: one object carrying the operation's id settles it
``succeeded`` with that object as its answer; several leave it (ambiguous,
never guessed); none is absence, which proves the operation never happened only
if its request carried the id where the lookup looks and the server has had
``absent_after`` seconds to list it. What the lookup concluded is a
`Verdict`; the flow journals it (``_flow.Engine.apply_verdict``).

A lookup is a request like any other to its origin: the flow asks for the GET
first (`BoundReconciler.plan`), and sends nothing while the origin is paused;
a lookup answered 429 or 503 with Retry-After pauses it. An operation a lookup
leaves unsettled waits an exponential backoff with full jitter before its next
lookup, counted from the lookup entries of its audit trail.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, overload

import attrs
import httpx

from idempotently._commands import ReconcilePlan
from idempotently._exceptions import StoredProfileError
from idempotently._keys import stored_header
from idempotently._operator import MAX_ACTOR_LENGTH
from idempotently._policy import may_have_been_delivered, maybe_acted
from idempotently._profiles import GENERIC, check_operation_id_field, stored_profile
from idempotently._retry_after import server_wait
from idempotently._rows import AuditEntry, Operation
from idempotently._text import storable_text

Absent = Literal["keep", "failed", "resend"]
ABSENT_CHOICES: tuple[Absent, ...] = ("keep", "failed", "resend")
DEFAULT_MATCH = "metadata.operation_id"
DEFAULT_ABSENT_AFTER = 300.0
DEFAULT_BACKOFF = 60.0
DEFAULT_MAX_BACKOFF = 3600.0
"""The cap of the lookup backoff (an hour), unless ``backoff`` itself is longer."""
LOOKUP_ACTOR = "lookup"
"""The actor of the lookup reconciler's audit entries."""
LOOKUP_VERDICT = "lookup"
"""The action of the audit entry a lookup that settled nothing writes."""
LOOKUP_DEFERRED = "lookup_deferred"
"""The action of the audit entry written when a paused origin defers a lookup."""
MAX_LOOKUP_BYTES = 10 * 1024 * 1024
"""The largest lookup answer read (10 MiB): a list endpoint's page, not a dump."""

_ENCODING_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})

Found = Callable[[httpx.Response], Any]
"""``found(response)``: the object the answer holds for the operation, or None."""


@attrs.frozen
class Verdict:
    """What one lookup concluded about one operation."""

    outcome: Literal["found", "failed", "resend", "stay"]
    note: str
    answer: bytes | None = None
    """``found``: the object, as the JSON the operation's answer stores."""
    lookup_failed: bool = False
    """``stay`` because the lookup itself failed (network, a non-2xx, not JSON)."""
    backoff: float = DEFAULT_BACKOFF
    """``stay``: the base of the backoff before the operation is looked up again (the
    first wait is up to this long, each further unsettled lookup doubles the ceiling)."""
    max_backoff: float = DEFAULT_MAX_BACKOFF
    """``stay``: the cap of that backoff, in seconds."""
    status_code: int | None = None
    """The status the lookup was answered with (None: it got no answer, or it settled)."""
    server_wait: float | None = None
    """Seconds the lookup's answer asked to wait (``Retry-After``, ``retry-after-ms``) on
    an error status; a 429 or 503 with it pauses the origin, as any answer does."""
    request: httpx.Request | None = attrs.field(default=None, eq=False, repr=False)
    """The lookup's GET: whose credentials asked (a key bound to other credentials is
    looked up in another account, where absence proves nothing)."""


@attrs.frozen
class Lookup:
    """A reconciler that looks each needs_reconcile operation up on the server.

    ``url`` (relative to the client's ``base_url``, or to the operation's own
    origin when the client has none) and the values of ``params`` may hold
    ``{operation_id}`` and ``{key}``, substituted URL-encoded. ``found(response)``
    returns the object the answer holds for the operation, or None; the default
    reads a JSON list (``data``, or the top level) and keeps only the objects
    carrying the operation id at ``match`` (a dotted path; default the
    operation's profile's ``operation_id_field``, else ``metadata.operation_id``),
    so an endpoint that ignores its filter settles nothing. Exactly one:
    ``succeeded``, the object stored as the answer; several: ambiguous, it stays.

    None found: ``absent`` says what that means. ``"keep"``: it stays
    needs_reconcile. ``"failed"``: settled failed. ``"resend"``: settled failed
    and forked (the same bytes under a new key, sent by the next resume).
    ``failed`` and ``resend`` apply only when the journaled request carries the id
    at ``match`` and its last attempt that may have been delivered is more than
    ``absent_after`` seconds old (the server's consistency window); otherwise it
    stays, noted why. A lookup that fails (network, non-2xx) changes nothing.

    An operation a lookup leaves needs_reconcile is not looked up again before a
    backoff, journaled (so a watcher does not hammer the endpoint): exponential with
    full jitter, a random wait up to ``backoff`` after its first unsettled lookup, up to
    twice that after the second in a row, and so on, capped at ``max_backoff``. While
    the lookup's origin is paused (a 429 or 503 with Retry-After, to a call or to a
    lookup), nothing is sent to it: the operation is looked up once the pause is over.
    """

    url: str = attrs.field(validator=attrs.validators.instance_of(str))
    """The lookup's URL, relative to the client's ``base_url`` (or the operation's own
    origin); ``{operation_id}`` and ``{key}`` are filled in URL-encoded."""
    params: Mapping[str, str] | None = attrs.field(default=None, kw_only=True)
    """Query parameters of the GET, each value a template like ``url``'s."""
    found: Found | None = attrs.field(default=None, kw_only=True)
    """``found(response)``: the object the answer holds for the operation, or None.
    None: a JSON list (``data`` or the top level) filtered by ``match``."""
    absent: Absent = attrs.field(
        default="keep", kw_only=True, validator=attrs.validators.in_(ABSENT_CHOICES)
    )
    """What nothing found means: ``"keep"`` (it stays), ``"failed"`` or ``"resend"``
    (settled failed and forked), the last two only once absence proves something."""
    absent_after: float = attrs.field(default=DEFAULT_ABSENT_AFTER, kw_only=True)
    """The server's consistency window, in seconds: absence proves nothing until the
    last attempt that may have been delivered is older than this."""
    match: str | None = attrs.field(default=None, kw_only=True)
    """The dotted path of the operation id in each object; None: the profile's
    ``operation_id_field``, else ``metadata.operation_id``."""
    backoff: float = attrs.field(default=DEFAULT_BACKOFF, kw_only=True)
    """The base of the backoff, in seconds, before an operation a lookup left
    needs_reconcile is looked up again: a random wait up to ``backoff * 2**(n-1)`` after
    its n-th unsettled lookup in a row, capped at ``max_backoff`` (journaled)."""
    max_backoff: float | None = attrs.field(default=None, kw_only=True)
    """The cap of that backoff, in seconds; None: an hour (or ``backoff``, if longer)."""
    clock: Callable[[], float] = attrs.field(default=time.time, kw_only=True, repr=False)
    """The time, in seconds since the epoch (inject one in tests)."""

    def __attrs_post_init__(self) -> None:
        if not self.url:
            raise ValueError("url must be the lookup's URL, e.g. '/v1/charges'")
        if self.params is not None and not all(
            isinstance(name, str) and isinstance(value, str) for name, value in self.params.items()
        ):
            raise TypeError("params must map str names to str templates")
        if self.found is not None and not callable(self.found):
            raise TypeError(f"found must be callable, not {type(self.found).__name__}")
        for name in ("absent_after", "backoff", "max_backoff"):
            value = getattr(self, name)
            if value is None and name == "max_backoff":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
            if not 0 <= value <= 366 * 86400:
                raise ValueError(f"{name} must be seconds from 0 to a year, not {value!r}")
        if self.max_backoff is not None and self.max_backoff < self.backoff:
            raise ValueError(
                f"max_backoff ({self.max_backoff:g} s) must be at least backoff "
                f"({self.backoff:g} s): it caps the backoff that starts there"
            )
        if self.match is not None:
            check_operation_id_field(self.match, "match")

    # -- the request ------------------------------------------------------------------

    def request(
        self, operation: Operation, client: httpx.Client | httpx.AsyncClient
    ) -> httpx.Request:
        """The GET for ``operation``: templates filled, relative to the client's base URL
        or, without one, to the operation's own origin."""
        url = _fill(self.url, operation, quote=True)
        if not client.base_url.host and url.startswith("/"):
            origin = httpx.URL(operation.url)
            url = str(origin.copy_with(raw_path=url.encode("ascii")))
        params = {
            name: _fill(value, operation, quote=False)
            for name, value in (self.params or {}).items()
        }
        return client.build_request("GET", url, params=params or None)

    # -- the reconciler ---------------------------------------------------------------

    @overload
    def __call__(self, operation: Operation, client: httpx.Client) -> Verdict: ...

    @overload
    def __call__(self, operation: Operation, client: httpx.AsyncClient) -> Awaitable[Verdict]: ...

    def __call__(
        self, operation: Operation, client: httpx.Client | httpx.AsyncClient
    ) -> Verdict | Awaitable[Verdict]:
        return self._look_up(operation, client, None)

    @property
    def backoff_cap(self) -> float:
        """The cap of the lookup backoff in force: ``max_backoff``, or an hour (or
        ``backoff`` if longer) without one."""
        if self.max_backoff is not None:
            return float(self.max_backoff)
        return max(float(self.backoff), DEFAULT_MAX_BACKOFF)

    def _look_up(
        self,
        operation: Operation,
        client: httpx.Client | httpx.AsyncClient,
        request: httpx.Request | None,
    ) -> Verdict | Awaitable[Verdict]:
        """Send ``request`` (the GET `request` built, None: build it now) and judge its
        answer: a `Verdict` (awaitable with an async client)."""
        if isinstance(client, httpx.AsyncClient):
            return self._acall(operation, client, request)
        try:
            if request is None:
                request = self.request(operation, client)
            response = client.send(request, stream=True)
            try:
                body = _read(response.iter_bytes())
            finally:
                response.close()
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as error:
            return self._failed(operation, error)
        return attrs.evolve(self.judge(operation, response, body), request=request)

    async def _acall(
        self, operation: Operation, client: httpx.AsyncClient, request: httpx.Request | None
    ) -> Verdict:
        try:
            if request is None:
                request = self.request(operation, client)
            response = await client.send(request, stream=True)
            try:
                chunks = [chunk async for chunk in _limited(response.aiter_bytes())]
                body = b"".join(chunks)
            finally:
                await response.aclose()
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as error:
            return self._failed(operation, error)
        return attrs.evolve(self.judge(operation, response, body), request=request)

    def _failed(self, operation: Operation, error: Exception) -> Verdict:
        # The error's class only: its text may quote a URL's query or a header.
        return self._stay(
            f"the lookup failed ({type(error).__name__}); nothing changed", failed=True
        )

    def _stay(
        self,
        note: str,
        *,
        failed: bool = False,
        status_code: int | None = None,
        waits: float | None = None,
    ) -> Verdict:
        return Verdict(
            "stay",
            storable_text(note),
            lookup_failed=failed,
            backoff=self.backoff,
            max_backoff=self.backoff_cap,
            status_code=status_code,
            server_wait=waits,
        )

    # -- the verdict (pure) -------------------------------------------------------------

    def match_for(self, operation: Operation) -> str:
        """Where the objects (and the journaled request) carry the operation's id."""
        if self.match is not None:
            return self.match
        try:
            profile = stored_profile(
                operation.profile,
                GENERIC,
                "stored",
                operation_id=operation.operation_id,
                key=operation.key,
            )
        except StoredProfileError:
            return DEFAULT_MATCH
        return getattr(profile, "operation_id_field", None) or DEFAULT_MATCH

    def judge(self, operation: Operation, response: httpx.Response, body: bytes) -> Verdict:
        """What the lookup's answer means for ``operation``."""
        if not 200 <= response.status_code < 300:
            status = response.status_code
            waits = server_wait(response.headers, now=self.clock()) if status >= 400 else None
            asked = "" if waits is None else f" with Retry-After {waits:g}s"
            return self._stay(
                f"the lookup answered {status}{asked}; nothing changed",
                failed=True,
                status_code=status,
                waits=waits,
            )
        match = self.match_for(operation)
        if self.found is not None:
            answered = httpx.Response(
                response.status_code,
                # The body is decoded already: its encoding headers no longer describe it.
                headers=[
                    (name, value)
                    for name, value in response.headers.multi_items()
                    if name.lower() not in _ENCODING_HEADERS
                ],
                content=body,
                request=response.request,
            )
            try:
                found = self.found(answered)
            except Exception as error:  # the user's function, whatever it raises
                return self._stay(
                    f"found() raised {type(error).__name__}; nothing changed", failed=True
                )
            objects = [] if found is None else [found]
        else:
            try:
                document = json.loads(body)
            except (ValueError, RecursionError):  # a hostile answer nested too deep, too
                return self._stay(
                    "the lookup's answer is not JSON (or is nested too deep to read); nothing "
                    "changed",
                    failed=True,
                )
            listed = document.get("data") if isinstance(document, dict) else document
            if not isinstance(listed, list):
                return self._stay(
                    "the lookup's answer holds no list (a 'data' list or a top-level list); "
                    "nothing changed",
                    failed=True,
                )
            objects = [item for item in listed if _at(item, match) == operation.operation_id]
        if len(objects) > 1:
            return self._stay(
                f"ambiguous: {len(objects)} objects carry its id at {match}; it is never "
                "guessed: settle it by hand (`idempotently settle`)"
            )
        if objects:
            try:
                answer = json.dumps(objects[0], ensure_ascii=False).encode("utf-8")
            except (TypeError, ValueError):
                answer = json.dumps(str(objects[0])).encode("utf-8")
            except RecursionError:
                return self._stay(
                    "the object found is nested too deep to store; nothing changed", failed=True
                )
            return Verdict("found", f"found by lookup (carries its id at {match})", answer)
        if self.absent == "keep":
            return self._stay("absent from the lookup; absent='keep' leaves it to you")
        if not _carries(operation, match):
            return self._stay(
                f"absent from the lookup, but its journaled request does not carry its id at "
                f"{match}, so absence proves nothing"
            )
        last = last_delivery(operation)
        now = self.clock()
        if last is not None and now - last <= self.absent_after:
            return self._stay(
                f"absent from the lookup, but its last attempt that may have been delivered "
                f"was {max(0.0, now - last):.0f} s ago, within absent_after={self.absent_after:g}"
                " s: the server may not list it yet"
            )
        said = f"absent from the lookup at {match}, after {self.absent_after:g} s"
        return Verdict(self.absent, said)


def unsettled_lookups(entries: Sequence[AuditEntry]) -> int:
    """How many lookups in a row, the latest last, left the operation unsettled: the
    lookup entries at the end of its audit trail (a deferral by a paused origin neither
    counts nor breaks the run; any other entry, an operator's, ends it)."""
    count = 0
    for entry in reversed(entries):
        if entry.actor != LOOKUP_ACTOR:
            break
        if entry.action == LOOKUP_VERDICT:
            count += 1
        elif entry.action != LOOKUP_DEFERRED:
            break
    return count


def reconciler_actor(reconciler: object) -> str:
    """The actor of a reconciler of your own's audit entries: ``reconciler:`` and its
    ``module.qualname`` (a callable object's class, without one)."""
    named = reconciler if hasattr(reconciler, "__qualname__") else type(reconciler)
    module = getattr(named, "__module__", None) or "?"
    qualname = getattr(named, "__qualname__", None) or type(reconciler).__name__
    return storable_text(f"reconciler:{module}.{qualname}")[:MAX_ACTOR_LENGTH]


@attrs.frozen
class BoundReconciler:
    """A reconciler with the client it looks operations up through: what a driver runs
    for the flow's `PlanReconcile` and `Reconcile` commands."""

    reconciler: Callable[..., Any]
    client: httpx.Client | httpx.AsyncClient = attrs.field(repr=False)

    def plan(self, operation: Operation) -> ReconcilePlan:
        """Who settles ``operation``, and the GET it will send for it: a `Lookup`'s
        (None if it cannot be built: the lookup says why when it runs); None for a
        reconciler of your own, whose requests the flow cannot see."""
        if not isinstance(self.reconciler, Lookup):
            return ReconcilePlan(reconciler_actor(self.reconciler), None)
        try:
            request = self.reconciler.request(operation, self.client)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError, TypeError):
            request = None
        return ReconcilePlan(LOOKUP_ACTOR, request)

    def __call__(self, operation: Operation, request: httpx.Request | None) -> Any:
        """The verdict on ``operation`` (awaitable with an async client): a `Lookup`
        sends the planned ``request``; a reconciler of your own is called as it is."""
        if isinstance(self.reconciler, Lookup):
            return self.reconciler._look_up(operation, self.client, request)
        return self.reconciler(operation, self.client)


def last_delivery(operation: Operation) -> float | None:
    """When the operation's last attempt that may have been delivered ended (or, with no
    attempt recorded, when its first send began); None if nothing may have been."""
    if not may_have_been_delivered(operation):
        return None
    moments = [
        attempt.started_at + attempt.elapsed
        for attempt in operation.attempts
        if maybe_acted(attempt.status_code, attempt.outcome)
    ]
    if operation.attempt_count == 0 or len(operation.attempts) < operation.attempt_count:
        moments.append(operation.first_send_at or operation.created_at)
    return max(moments) if moments else operation.updated_at


def _fill(template: str, operation: Operation, *, quote: bool) -> str:
    values = {"{operation_id}": operation.operation_id, "{key}": operation.key}
    for mark, value in values.items():
        template = template.replace(mark, urllib.parse.quote(value, safe="") if quote else value)
    return template


def _at(item: object, path: str) -> object:
    for part in path.split("."):
        if not isinstance(item, dict):
            return None
        item = item.get(part)
    return item


def _carries(operation: Operation, path: str) -> bool:
    """Whether the journaled request carries the operation's id at ``path``: in a JSON
    body (nested objects) or a form body (``metadata[operation_id]``)."""
    content_type = (stored_header(operation.request_headers, "content-type") or "").lower()
    body = operation.request_body
    if "x-www-form-urlencoded" in content_type:
        parts = path.split(".")
        name = parts[0] + "".join(f"[{part}]" for part in parts[1:])
        try:
            fields = urllib.parse.parse_qsl(body.decode("utf-8"), keep_blank_values=True)
        except (UnicodeDecodeError, ValueError):
            return False
        return (name, operation.operation_id) in fields
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return _at(document, path) == operation.operation_id


def _read(chunks: Any) -> bytes:
    read, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_LOOKUP_BYTES:
            raise ValueError("the lookup's answer is larger than 10 MiB")
        read.append(chunk)
    return b"".join(read)


async def _limited(chunks: Any) -> Any:
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > MAX_LOOKUP_BYTES:
            raise ValueError("the lookup's answer is larger than 10 MiB")
        yield chunk
