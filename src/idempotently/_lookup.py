"""The built-in lookup reconciler: settle a needs_reconcile operation by looking it up.

``Lookup(url, params=...)`` is a reconciler (``Session.resume(reconciler=...)``,
``AsyncSession`` too, ``idempotently reconcile --lookup``). For each operation it
sends one GET through the session's client (its credentials, nothing journaled),
and reads the answer: one object carrying the operation's id settles it
``succeeded`` with that object as its answer; several leave it (ambiguous,
never guessed); none is absence, which proves the operation never happened only
if its request carried the id where the lookup looks and the server has had
``absent_after`` seconds to list it. What the lookup concluded is a
`Verdict`; the flow journals it (``_flow._reconcile.apply_verdict``).

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
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

import attrs
import httpx

from idempotently import _redirects
from idempotently._answers import AnswerBody, aread_answer, read_answer
from idempotently._commands_rare import ReconcilePlan
from idempotently._differences import shown_url
from idempotently._exceptions import StoredProfileError
from idempotently._keys import stored_header
from idempotently._operator import MAX_ACTOR_LENGTH
from idempotently._policy import (
    DEFAULT_DEADLINE,
    capped_timeouts,
    may_have_been_delivered,
    maybe_acted,
)
from idempotently._profiles import GENERIC, check_operation_id_field, stored_profile
from idempotently._retry_after import server_wait
from idempotently._rows import AuditEntry, Operation
from idempotently._secret_params import redacted_url, secret_param_names
from idempotently._text import storable_text
from idempotently._vocabulary import LOOKUP_ACTOR

if TYPE_CHECKING:
    from idempotently._policy import RetryPolicy

Absent = Literal["keep", "failed", "resend"]
ABSENT_CHOICES: tuple[Absent, ...] = ("keep", "failed", "resend")
DEFAULT_MATCH = "metadata.operation_id"
DEFAULT_ABSENT_AFTER = 300.0
DEFAULT_BACKOFF = 60.0
DEFAULT_MAX_BACKOFF = 3600.0
"""The cap of the lookup backoff (an hour), unless ``backoff`` itself is longer."""
LOOKUP_VERDICT = "lookup"
"""The action of the audit entry a lookup that settled nothing writes."""
LOOKUP_DEFERRED = "lookup_deferred"
"""The action of the audit entry written when a paused origin defers a lookup."""
MAX_LOOKUP_BYTES = 10 * 1024 * 1024
"""The most a lookup reads (10 MiB, decoded), over all the pages it walks: a list
endpoint's pages, not a dump."""
DEFAULT_MAX_PAGES = 10
"""The most pages a lookup walks before it concludes that it cannot read the whole list."""

_ENCODING_HEADERS = frozenset({"content-encoding", "content-length", "transfer-encoding"})

Found = Callable[[httpx.Response], Any]
"""``found(response)``: the object the answer holds for the operation, or None."""


class SessionBounds(Protocol):
    """What a lookup takes from the engine of the session that runs it (`_flow._engine.Engine`,
    not imported here: the flow imports this module)."""

    @property
    def clock(self) -> Callable[[], float]: ...
    @property
    def policy(self) -> RetryPolicy: ...
    @property
    def max_response_bytes(self) -> int: ...
    @property
    def secret_params(self) -> frozenset[str]: ...


@attrs.frozen
class LookupBounds:
    """What bounds one lookup, from the session that runs it: its clock (the one that also
    times the lookup's backoff and ``absent_after``), its time limit when the `Lookup`
    sets none (the policy's ``deadline``), the most bytes it reads (the session's
    ``max_response_bytes``, at most `MAX_LOOKUP_BYTES`), the query parameters a stored
    URL never shows, and whether its worker is stopping (a stopped lookup reads no more)."""

    clock: Callable[[], float] = time.time
    deadline: float = DEFAULT_DEADLINE
    max_bytes: int = MAX_LOOKUP_BYTES
    secret_params: frozenset[str] = attrs.field(factory=secret_param_names)
    stopped: Callable[[], bool] = attrs.field(default=lambda: False, repr=False)


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
    answer_status: int = 200
    """``found``: the status of the page that held the object (what a call again returns
    with it: the lookup's status, not the create's)."""
    answer_from: str | None = None
    """``found``: the URL of the page that held the object, secret query values redacted
    (stored as the answer's ``Content-Location``)."""
    request: httpx.Request | None = attrs.field(default=None, eq=False, repr=False)
    """The lookup's GET: whose credentials asked (a key bound to other credentials is
    looked up in another account, where absence proves nothing)."""

    def answer_headers(self) -> tuple[tuple[str, str], ...]:
        """``found``: the headers stored with the object: JSON, and where it was found."""
        stored = [("content-type", "application/json")]
        if self.answer_from is not None:
            stored.append(("content-location", self.answer_from))
        return tuple(stored)


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
    so an endpoint that ignores its filter settles nothing. Exactly one, across
    every page: ``succeeded``, the object stored as the answer (with the status of
    the page that held it and its URL as ``Content-Location``: a call again
    returns the lookup's answer, not the create's, and its receipt says
    ``answered_by="lookup"``); several: ambiguous, it stays.

    The default ``found`` follows the pagination it understands, on the lookup
    URL's own origin only (a relative link is resolved against it; a link or a
    redirect to another origin is never followed, so the credentials never leave), up to
    ``max_pages`` pages: an RFC 8288 ``Link: <...>; rel="next"`` header, a
    ``next`` link in the body (top level or ``links.next``), or ``has_more:
    true`` with a cursor (``starting_after=<the last object's id>``, or
    ``page=<next_page>`` for a Stripe search). Only a whole list proves
    anything: its last page says there is no more (``has_more: false``, a null
    ``next``, a ``Link`` without ``rel="next"``), or it carries no pagination
    field and is empty (the endpoint filtered), or ``unpaged=True`` says the
    endpoint never pages. A non-empty list that says nothing of pages, a cursor
    seen before, a link to another origin or the page limit prove nothing: the
    operation stays, noted why, and a match found on such a list is not taken as
    the only one. Your own ``found`` reads the first page only: its None proves
    nothing on a page that says there are more.

    None found in the whole list: ``absent`` says what that means. ``"keep"``: it
    stays needs_reconcile. ``"failed"``: settled failed. ``"resend"``: settled failed
    and forked (the same bytes under a new key, sent by the next resume).
    ``failed`` and ``resend`` apply only when the journaled request carries the id
    at ``match`` and its last attempt that may have been delivered is more than
    ``absent_after`` seconds old (the server's consistency window); otherwise it
    stays, noted why. A lookup that fails (network, non-2xx, an answer not read
    whole) changes nothing.

    Every lookup is read within one time limit and one byte bound over all its
    pages: ``timeout`` seconds (default the session policy's ``deadline``) and
    the session's ``max_response_bytes`` (at most 10 MiB); an answer that trickles
    past either is given up, and the operation stays, noted why. Its times
    (``absent_after``, the backoff) follow the session's clock.

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
    max_pages: int = attrs.field(default=DEFAULT_MAX_PAGES, kw_only=True)
    """The most pages one lookup walks; a list longer than that is not read whole, so
    absence from it proves nothing."""
    unpaged: bool = attrs.field(default=False, kw_only=True)
    """True: the endpoint never pages, so an answer that says nothing of pages is the
    whole list even when it holds other objects (pagination it does carry is followed)."""
    timeout: float | None = attrs.field(default=None, kw_only=True)
    """Seconds the whole lookup may take, every page read included; None: the session
    policy's ``deadline``."""

    def __attrs_post_init__(self) -> None:
        if not self.url:
            raise ValueError("url must be the lookup's URL, e.g. '/v1/charges'")
        if self.params is not None and not all(
            isinstance(name, str) and isinstance(value, str) for name, value in self.params.items()
        ):
            raise TypeError("params must map str names to str templates")
        if self.found is not None and not callable(self.found):
            raise TypeError(f"found must be callable, not {type(self.found).__name__}")
        for name in ("absent_after", "backoff", "max_backoff", "timeout"):
            value = getattr(self, name)
            if value is None and name in ("max_backoff", "timeout"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
            if not 0 <= value <= 366 * 86400:
                raise ValueError(f"{name} must be seconds from 0 to a year, not {value!r}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout must be more than 0 seconds, not {self.timeout!r}")
        if isinstance(self.max_pages, bool) or not isinstance(self.max_pages, int):
            raise TypeError(f"max_pages must be an int, not {type(self.max_pages).__name__}")
        if not 1 <= self.max_pages <= 1000:
            raise ValueError(f"max_pages must be from 1 to 1000, not {self.max_pages!r}")
        if not isinstance(self.unpaged, bool):
            raise TypeError(f"unpaged must be True or False, not {type(self.unpaged).__name__}")
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

    def time_limit(self, bounds: LookupBounds) -> float:
        """The seconds the whole lookup (every page) may take: ``timeout``, else the
        session policy's ``deadline``."""
        return float(self.timeout) if self.timeout is not None else bounds.deadline

    def _look_up(
        self,
        operation: Operation,
        client: httpx.Client | httpx.AsyncClient,
        request: httpx.Request | None,
        bounds: LookupBounds | None = None,
    ) -> Verdict | Awaitable[Verdict]:
        """Send ``request`` (the GET `request` built, None: build it now), walk the pages
        its answer points to, and judge what they hold: a `Verdict` (awaitable with an
        async client). The whole walk is read within one time limit and one byte bound."""
        bounds = bounds or LookupBounds()
        if isinstance(client, httpx.AsyncClient):
            return self._alook_up(operation, client, request, bounds)
        try:
            if request is None:
                request = self.request(operation, client)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as error:
            return self._failed(error)
        reading = _Reading(bounds, bounds.clock() + self.time_limit(bounds), request)
        walk = self._walk(operation, client, request, bounds)
        page: Page | None = None
        try:
            while True:
                sent = walk.send(page)  # type: ignore[arg-type]  # None starts it
                page = _fetch(client, sent, reading)
        except StopIteration as end:
            verdict: Verdict = end.value
        return attrs.evolve(verdict, request=request)

    async def _alook_up(
        self,
        operation: Operation,
        client: httpx.AsyncClient,
        request: httpx.Request | None,
        bounds: LookupBounds,
    ) -> Verdict:
        try:
            if request is None:
                request = self.request(operation, client)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as error:
            return self._failed(error)
        reading = _Reading(bounds, bounds.clock() + self.time_limit(bounds), request)
        walk = self._walk(operation, client, request, bounds)
        page: Page | None = None
        try:
            while True:
                sent = walk.send(page)  # type: ignore[arg-type]  # None starts it
                page = await _afetch(client, sent, reading)
        except StopIteration as end:
            verdict: Verdict = end.value
        return attrs.evolve(verdict, request=request)

    def _failed(self, error: BaseException, where: str = "") -> Verdict:
        # The error's class only: its text may quote a URL's query or a header.
        return self._stay(
            f"the lookup failed{where} ({type(error).__name__}); nothing changed", failed=True
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

    def _walk(
        self,
        operation: Operation,
        client: httpx.Client | httpx.AsyncClient,
        first: httpx.Request,
        bounds: LookupBounds,
    ) -> Generator[httpx.Request, Page, Verdict]:
        """The lookup's decision, I/O-free: yields each page's GET, receives the `Page`
        read for it, returns the `Verdict`. Follows the pagination it understands on the
        first GET's origin only, up to ``max_pages``, and says whether the pages read are
        the whole list: only a whole list proves absence, or that a match is the only one."""
        match = self.match_for(operation)
        origin = _origin(first.url)
        seen = {str(first.url)}
        request = first
        matches: list[tuple[object, int, Page]] = []
        number = 0
        while True:
            number += 1
            page = yield request
            where = "" if number == 1 else f" on page {number}"
            if page.error is not None:
                return self._failed(page.error, where)
            if page.cut is not None:
                return self._stay(
                    f"the lookup's answer{where} was not read whole ({page.cut}); nothing changed",
                    failed=True,
                )
            response = page.response
            assert response is not None
            if not 200 <= response.status_code < 300:
                status = response.status_code
                waits = server_wait(response.headers, now=bounds.clock()) if status >= 400 else None
                asked = "" if waits is None else f" with Retry-After {waits:g}s"
                if response.has_redirect_location:
                    asked = (
                        " (a redirect the lookup did not follow: to another origin, or by a "
                        "client that does not follow redirects)"
                    )
                return self._stay(
                    f"the lookup answered {status}{asked}{where}; nothing changed",
                    failed=True,
                    status_code=status,
                    waits=waits,
                )
            if self.found is not None:
                return self._found_by_user(operation, match, page, bounds)
            try:
                document = json.loads(page.body)
            except (ValueError, RecursionError):  # a hostile answer nested too deep, too
                return self._stay(
                    f"the lookup's answer{where} is not JSON (or is nested too deep to read); "
                    "nothing changed",
                    failed=True,
                )
            listed = document.get("data") if isinstance(document, dict) else document
            if not isinstance(listed, list):
                return self._stay(
                    f"the lookup's answer{where} holds no list (a 'data' list or a top-level "
                    "list); nothing changed",
                    failed=True,
                )
            matches += [
                (item, number, page)
                for item in listed
                if _at(item, match) == operation.operation_id
            ]
            following = next_page(response, document, listed)
            if following.last:
                unread = None
            elif following.url is None:
                unread = following.why
                if following.why == UNMARKED:
                    unread = (
                        None  # a filtered answer (empty), or one that never pages
                        if self.unpaged or not listed
                        else "the answer says nothing of pages (no has_more, next or Link) "
                        "and holds other objects, so it may be one page of many; "
                        "Lookup(unpaged=True), or --unpaged, if the endpoint never pages"
                    )
            elif _origin(following.url) != origin:
                unread = (
                    f"page {number} points to its next page on another origin "
                    f"({_origin_text(following.url)}), which a lookup never follows"
                )
            elif str(following.url) in seen:
                unread = f"page {number} points back to a page read already (a cursor loop)"
            elif number >= self.max_pages:
                unread = f"it has more than max_pages={self.max_pages} pages"
            else:
                seen.add(str(following.url))
                try:
                    request = client.build_request("GET", following.url)
                except (httpx.InvalidURL, ValueError, TypeError) as error:
                    return self._failed(error, f" building page {number + 1}'s GET")
                continue
            return self._judged(
                operation,
                match,
                matches,
                number,
                unread,
                bounds,
                more=not following.last and following.why != UNMARKED,
            )

    def _found_by_user(
        self, operation: Operation, match: str, page: Page, bounds: LookupBounds
    ) -> Verdict:
        """The verdict of your own ``found`` on the first page: it reads that page only,
        so its None proves nothing when the page says there are more."""
        response = page.response
        assert response is not None
        answered = httpx.Response(
            response.status_code,
            # The body is decoded already: its encoding headers no longer describe it.
            headers=[
                (name, value)
                for name, value in response.headers.multi_items()
                if name.lower() not in _ENCODING_HEADERS
            ],
            content=page.body,
            request=response.request,
        )
        try:
            found = self.found(answered)  # type: ignore[misc]  # checked: not None
        except Exception as error:  # the user's function, whatever it raises
            return self._stay(
                f"found() raised {type(error).__name__}; nothing changed", failed=True
            )
        if found is not None:
            return self._judged(operation, match, [(found, 1, page)], 1, None, bounds)
        try:
            document = json.loads(page.body)
        except (ValueError, RecursionError):
            document = None
        following = next_page(response, document, None)
        unread = None
        if following.url is not None:
            unread = "found() reads the first page only, and it says there are more"
        elif not following.last and following.why != UNMARKED:
            unread = following.why
        return self._judged(operation, match, [], 1, unread, bounds, more=unread is not None)

    def _judged(
        self,
        operation: Operation,
        match: str,
        matches: list[tuple[object, int, Page]],
        pages: int,
        unread: str | None,
        bounds: LookupBounds,
        *,
        more: bool = False,
    ) -> Verdict:
        """What the objects found across ``pages`` mean; ``unread`` says why the list was
        not read to its end (None: it was, so it is the whole list), ``more`` whether its
        last page read said there are more: then a match is not known to be the only one.
        A match in an answer that says nothing of pages is taken as the only one."""
        read = f"{pages} page" if pages == 1 else f"{pages} pages"
        if len(matches) > 1:
            return self._stay(
                f"ambiguous: {len(matches)} objects carry its id at {match} (in {read}); it is "
                "never guessed: settle it by hand (`idempotently settle`)"
            )
        if matches:
            item, number, page = matches[0]
            if unread is not None and more:
                return self._stay(
                    f"found on page {number}, but the list was not read to its end ({unread}),"
                    " so another object may carry its id: it is never guessed; settle it by "
                    "hand (`idempotently settle`)"
                )
            try:
                answer = json.dumps(item, ensure_ascii=False).encode("utf-8")
            except (TypeError, ValueError):
                answer = json.dumps(str(item)).encode("utf-8")
            except RecursionError:
                return self._stay(
                    "the object found is nested too deep to store; nothing changed", failed=True
                )
            response = page.response
            assert response is not None
            source, _ = redacted_url(response.request.url, bounds.secret_params)
            return Verdict(
                "found",
                storable_text(
                    f"found by lookup on page {number} (GET {shown_url(source)} answered "
                    f"{response.status_code}; carries its id at {match})"
                ),
                answer,
                answer_status=response.status_code,
                answer_from=source,
            )
        if unread is not None:
            return self._stay(
                f"absent from the {read} read, but that proves nothing: {unread}; it stays "
                "needs_reconcile"
            )
        if self.absent == "keep":
            return self._stay("absent from the lookup; absent='keep' leaves it to you")
        if not _carries(operation, match):
            return self._stay(
                f"absent from the lookup, but its journaled request does not carry its id at "
                f"{match}, so absence proves nothing"
            )
        last = last_delivery(operation)
        now = bounds.clock()
        if last is not None and now - last <= self.absent_after:
            return self._stay(
                f"absent from the lookup, but its last attempt that may have been delivered "
                f"was {max(0.0, now - last):.0f} s ago, within absent_after={self.absent_after:g}"
                " s: the server may not list it yet"
            )
        said = f"absent from the whole list ({read}) at {match}, after {self.absent_after:g} s"
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
    bounds: LookupBounds = attrs.field(factory=LookupBounds, repr=False)
    """A `Lookup`'s clock and bounds: the session's."""

    @classmethod
    def of(
        cls,
        reconciler: Callable[..., Any],
        client: httpx.Client | httpx.AsyncClient,
        engine: SessionBounds,
        stopped: Callable[[], bool] | None = None,
    ) -> BoundReconciler:
        """``reconciler`` bound to ``client`` and to the bounds of ``engine`` (its clock,
        policy deadline, ``max_response_bytes``, secret query parameters); ``stopped``:
        whether the worker running it is stopping."""
        bounds = LookupBounds(
            clock=engine.clock,
            deadline=engine.policy.deadline,
            max_bytes=min(MAX_LOOKUP_BYTES, engine.max_response_bytes),
            secret_params=engine.secret_params,
            stopped=stopped or (lambda: False),
        )
        return cls(reconciler, client, bounds)

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
            return self.reconciler._look_up(operation, self.client, request, self.bounds)
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


UNMARKED = "unmarked"
"""`NextPage.why` of an answer that says nothing of pages."""


@attrs.frozen
class NextPage:
    """What one page says of the next: ``last`` (it says there is none), or the ``url``
    to ask for it, or neither (``why``: it says nothing of pages, `UNMARKED`, or says
    there are more without a way to ask for them)."""

    last: bool = False
    url: httpx.URL | None = None
    why: str = UNMARKED


_PAGE_RELS = frozenset({"next", "prev", "previous", "first", "last"})


def next_page(response: httpx.Response, document: object, listed: list[Any] | None) -> NextPage:
    """The pagination a page carries, as this library understands it: an RFC 8288
    ``Link`` header (``rel="next"``; a Link with other page relations and no next marks
    the last page), a ``next`` link in the body (top level, or JSON:API's
    ``links.next``; null on the last page), and ``has_more`` with a cursor (Stripe's:
    ``starting_after=<the last object's id>``, or ``page=<next_page>`` for a search).
    Relative links are resolved against the page's own URL. Any sign of more wins over
    a sign of the end: a list is never cut short on a contradiction."""
    here = response.request.url
    links: list[str] = []
    ends = False
    for link in response.links.values():
        rels = set(str(link.get("rel", "")).lower().split())
        if "next" in rels and link.get("url"):
            links.append(str(link["url"]))
        elif rels & _PAGE_RELS:
            ends = True
    if isinstance(document, dict):
        holders = [document]
        if isinstance(document.get("links"), dict):
            holders.append(document["links"])
        for holder in holders:
            if "next" not in holder:
                continue
            value = holder["next"]
            if isinstance(value, str) and value:
                links.append(value)
            elif value is None or value == "":
                ends = True
            else:
                return NextPage(why="the answer's next is neither a link nor null")
        more = document.get("has_more")
        if "has_more" in document and not isinstance(more, bool):
            return NextPage(why="the answer's has_more is neither true nor false")
        if more is False:
            ends = True
        elif more is True and not links:
            cursor = document.get("next_page")
            if isinstance(cursor, str) and cursor:
                return NextPage(url=_with_param(here, "page", cursor))
            last = listed[-1] if listed else None
            ident = last.get("id") if isinstance(last, dict) else None
            if isinstance(ident, (str, int)) and not isinstance(ident, bool) and str(ident):
                return NextPage(url=_with_param(here, "starting_after", str(ident)))
            return NextPage(
                why="the answer says has_more but gives no cursor (no next_page, and its last "
                "object has no id) to ask for the rest"
            )
    for target in links:
        try:
            return NextPage(url=here.join(target))
        except (httpx.InvalidURL, ValueError, TypeError):
            return NextPage(why="the answer's next link is not a URL")
    return NextPage(last=True) if ends else NextPage()


def _with_param(url: httpx.URL, name: str, value: str) -> httpx.URL:
    return url.copy_set_param(name, value)


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    default = {"http": 80, "https": 443}.get(url.scheme)
    return url.scheme, url.host, url.port or default


def _origin_text(url: httpx.URL) -> str:
    scheme, host, port = _origin(url)
    return f"{scheme}://{host}:{port}"


@attrs.frozen
class Page:
    """One page as the driver read it: the answer and its body, or why it has none."""

    response: httpx.Response | None = None
    body: bytes = b""
    error: BaseException | None = None
    cut: str | None = None
    """Why the body was not read whole: more than the byte bound, or past the time."""


class _Reading:
    """The bounds of one walk, shared by its pages: one time limit, one byte bound."""

    __slots__ = ("bounds", "origin", "until", "used")

    def __init__(self, bounds: LookupBounds, until: float, first: httpx.Request) -> None:
        self.bounds = bounds
        self.until = until
        self.used = 0
        self.origin = _origin(first.url)

    def within(self, url: httpx.URL) -> bool:
        """Whether a redirect may be followed to ``url``: on the first GET's origin only,
        as a next link (the session's credentials never leave it)."""
        return _origin(url) == self.origin

    def clock(self) -> float:
        # A stopping worker's lookup is over: its read ends at the next chunk.
        return _INFINITY if self.bounds.stopped() else self.bounds.clock()

    def room(self) -> int:
        return self.bounds.max_bytes - self.used

    def before(self, request: httpx.Request) -> str | None:
        """Why the page cannot be asked for (None: it can), its timeouts capped by the
        time left."""
        if self.bounds.stopped():
            return "the worker is stopping"
        left = self.until - self.clock()
        if left <= 0:
            return "the lookup ran out of time"

        request.extensions["timeout"] = capped_timeouts(request.extensions.get("timeout"), left)
        return None

    def after(self, body: AnswerBody) -> Page:
        """The page read (its body closed by the caller if not read whole)."""
        self.used += body.size
        if body.complete:
            return Page(body.response, b"".join(body.chunks))
        if body.over:
            return Page(cut=f"larger than {self.bounds.max_bytes} bytes over all its pages")
        return Page(cut="it took longer than the lookup's time limit, or the worker stopped")


_INFINITY = float("inf")
_READ_ERRORS = (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, ValueError)


def _fetch(client: httpx.Client, request: httpx.Request, reading: _Reading) -> Page:
    """One page, sent and read within the walk's bounds (`_answers.read_answer`)."""
    cut = reading.before(request)
    if cut is not None:
        return Page(cut=cut)
    try:
        # Redirects are followed as the client would, each one's body read within bounds.
        body = AnswerBody(
            _redirects.send(
                client, request, reading.clock, until=reading.until, within=reading.within
            )
        )
        read_answer(body, reading.room(), reading.until, reading.clock)
    except _READ_ERRORS as error:
        return Page(error=error)
    if not body.complete:
        body.close()
    return reading.after(body)


async def _afetch(client: httpx.AsyncClient, request: httpx.Request, reading: _Reading) -> Page:
    """`_fetch` with an async client (asyncio or trio)."""
    cut = reading.before(request)
    if cut is not None:
        return Page(cut=cut)
    try:
        body = AnswerBody(
            await _redirects.asend(
                client, request, reading.clock, until=reading.until, within=reading.within
            )
        )
        await aread_answer(body, reading.room(), reading.until, reading.clock)
    except _READ_ERRORS as error:
        return Page(error=error)
    if not body.complete:
        await body.aclose()
    return reading.after(body)
