"""A lookup on a paginated list never takes a page it did not read for absence.

Against a real loopback server whose list endpoint ignores its filter and pages newest
ten first, with the charge on page 2: the lookup follows the pagination it understands
(``has_more`` + a cursor, a ``next`` link, ``Link: rel="next"``) on its own origin only,
up to ``max_pages``; absence settles anything only when the whole list was read (its
last page says so, an empty answer that says nothing of pages, or ``unpaged=True``).
On SQLite and PostgreSQL; sync, asyncio and trio.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import idempotently
from idempotently import Lookup, profiles
from idempotently._lookup import UNMARKED, next_page
from idempotently.cli import cli
from tests.scripted_server import serve

CARRYING = attrs.evolve(profiles.GENERIC, operation_id_field="metadata.operation_id")
TOKEN = "Bearer sk_test_lookup"
PAGE = 10
LATER = lambda: time.time() + 7200  # noqa: E731 (past absent_after)


@attrs.define
class Listing:
    """A charges API: ``POST /v1/charges`` makes the charge and answers a replayed 500
    (the journal cannot use it: needs_reconcile); ``GET /v1/charges`` ignores every
    filter and pages the charges newest first, ten a page, in the configured style."""

    style: str = "has_more"
    lists_it: bool = True
    """Whether the charge the POST made is listed at all (False: it never happened)."""
    next_origin: str | None = None
    """``cross``: the origin page 1's next link points to."""
    charges: list[dict[str, Any]] = attrs.Factory(list)
    arrivals: list[tuple[str, str, str | None]] = attrs.Factory(list)
    """(method, path?query, Authorization) of every request."""

    def reset(self, style: str, *, lists_it: bool = True) -> None:
        self.style, self.lists_it = style, lists_it
        self.charges.clear()
        self.arrivals.clear()

    async def create(self, request: Request) -> Response:
        self._arrived(request)
        body = json.loads(await request.body())
        newer = [{"id": f"ch_new{n:02d}", "object": "charge", "metadata": {}} for n in range(12)]
        older = [{"id": f"ch_old{n:02d}", "object": "charge", "metadata": {}} for n in range(3)]
        made = {"id": "ch_target", "object": "charge", "metadata": body.get("metadata", {})}
        # Newest first: twelve charges made after it put it on page 2 (of 2).
        self.charges[:] = [*newer, *([made] if self.lists_it else []), *older]
        return JSONResponse(
            {"error": "boom"}, status_code=500, headers={"Idempotent-Replayed": "true"}
        )

    async def list(self, request: Request) -> Response:
        self._arrived(request)
        query = request.query_params
        start = 0
        if "starting_after" in query:
            ids = [charge["id"] for charge in self.charges]
            start = ids.index(query["starting_after"]) + 1
        elif "cursor" in query:
            start = int(query["cursor"])
        page = self.charges[start : start + PAGE]
        after = start + PAGE
        more = after < len(self.charges)
        style = self.style
        if style == "has_more":
            return JSONResponse({"object": "list", "data": page, "has_more": more})
        if style == "next":
            following = f"/v1/charges?cursor={after}" if more else None
            return JSONResponse({"data": page, "next": following})
        if style == "link":
            base = str(request.base_url).rstrip("/")
            rel = f'<{base}/v1/charges?cursor={after}>; rel="next"' if more else ""
            first = f'<{base}/v1/charges?cursor=0>; rel="first"'
            return JSONResponse(page, headers={"Link": ", ".join(filter(None, [rel, first]))})
        if style == "loop":
            # Page 2 points to itself: a cursor seen before.
            return JSONResponse({"data": page, "next": f"/v1/charges?cursor={min(after, PAGE)}"})
        if style == "cross":
            return JSONResponse(
                {"data": page, "next": f"{self.next_origin}/v1/charges?cursor={after}"}
            )
        if style == "redirect":
            # Page 2 is moved to another origin (which lists nothing: "the end").
            if start:
                return Response(
                    status_code=302,
                    headers={"Location": f"{self.next_origin}/v1/charges?cursor={start}"},
                )
            return JSONResponse({"data": page, "next": f"/v1/charges?cursor={after}"})
        if style == "has_more_text":
            # A has_more this library does not understand (a string), on an empty page.
            return JSONResponse({"data": page, "has_more": "true" if more else "false"})
        return JSONResponse({"object": "list", "data": page})  # "unmarked"

    def _arrived(self, request: Request) -> None:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        self.arrivals.append((request.method, target, request.headers.get("authorization")))

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/charges", self.create, methods=["POST"]),
                Route("/v1/charges", self.list, methods=["GET"]),
            ]
        )


@pytest.fixture(scope="module")
def _servers() -> Iterator[tuple[Listing, str, Listing, str]]:
    listing, elsewhere = Listing(), Listing()
    with serve(listing.app()) as url, serve(elsewhere.app()) as other:
        listing.next_origin = other
        yield listing, url, elsewhere, other


@pytest.fixture
def servers(
    _servers: tuple[Listing, str, Listing, str],
) -> Iterator[tuple[Listing, str, Listing, str]]:
    yield _servers
    for listing in _servers[0], _servers[2]:
        listing.reset("has_more")


LOOKUP = "/v1/charges"
PARAMS = {"metadata[operation_id]": "{operation_id}"}


def charged_unsettled(journal: str, url: str, name: str = "order-1") -> None:
    """The charge is made; its answer (a replayed 500) leaves it needs_reconcile."""
    with (
        idempotently.Session(
            journal, base_url=url, headers={"Authorization": TOKEN}, profile=CARRYING
        ) as session,
        pytest.raises(idempotently.NeedsReconcileError),
    ):
        session.post("/v1/charges", json={"amount": 1000}, operation_id=name)


def reconcile(journal: str, url: str, lookup: Lookup) -> tuple[str, str, list[str]]:
    """Reconcile two hours later; (action, status after, every operation id journaled)."""
    with idempotently.Session(
        journal, base_url=url, headers={"Authorization": TOKEN}, profile=CARRYING, clock=LATER
    ) as session:
        (result,) = session.reconcile(lookup)
        operation = session.journal.operation("order-1")
        assert operation is not None
        everything = [listed.operation_id for listed in session.journal.operations()]
    return result.action, operation.status, sorted(everything)


def stored(journal: str) -> idempotently.Operation:
    with idempotently.Journal(journal) as opened:
        operation = opened.operation("order-1")
    assert operation is not None
    return operation


def lookups(listing: Listing) -> list[str]:
    return [target for method, target, _ in listing.arrivals if method == "GET"]


@pytest.mark.parametrize("absent", ["failed", "resend"])
@pytest.mark.parametrize("style", ["has_more", "next", "link"])
def test_a_charge_on_page_2_settles_it_succeeded_never_failed_or_forked(
    journal_target: str, servers: tuple[Listing, str, Listing, str], style: str, absent: Any
) -> None:
    """absent="failed" or "resend" on a list that pages, the charge on page 2: the lookup
    reads page 2 and settles the operation succeeded with that charge, nothing forked
    (before: absent from page 1, settled failed although it was charged, or forked and
    charged again by the next resume)."""
    listing, url, _, _ = servers
    listing.reset(style)
    charged_unsettled(journal_target, url)
    action, status, everything = reconcile(
        journal_target, url, Lookup(LOOKUP, params=PARAMS, absent=absent)
    )
    assert ("reconciled", "succeeded", ["order-1"]) == (action, status, everything)
    assert "ch_target" == json.loads(stored(journal_target).response_body or b"")["id"]
    assert 2 == len(lookups(listing))


def test_a_list_that_says_nothing_of_pages_never_forks_a_charge_it_may_hold(
    journal_target: str, servers: tuple[Listing, str, Listing, str]
) -> None:
    """absent="resend" on an answer of ten charges that says nothing of pages (the charge
    is on page 2, which the answer does not offer): nothing is concluded, nothing forked,
    and the server was charged once."""
    listing, url, _, _ = servers
    listing.reset("unmarked")
    charged_unsettled(journal_target, url)
    action, status, everything = reconcile(
        journal_target, url, Lookup(LOOKUP, params=PARAMS, absent="resend")
    )
    assert ("needs_reconcile", "needs_reconcile") == (action, status)
    assert ["order-1"] == everything
    assert 1 == sum(method == "POST" for method, _, _ in listing.arrivals)
    with idempotently.Journal(journal_target) as opened:
        (entry,) = opened.audit("order-1")
    assert "says nothing of pages" in (entry.note or "")


def test_a_charge_past_max_pages_is_not_taken_for_absent(
    servers: tuple[Listing, str, Listing, str], tmp_path: Any
) -> None:
    """max_pages=1 on a list whose charge is on page 2: the page limit proves nothing, the
    operation stays, noted why."""
    listing, url, _, _ = servers
    journal = str(tmp_path / "j.db")
    charged_unsettled(journal, url)
    action, status, _ = reconcile(
        journal, url, Lookup(LOOKUP, params=PARAMS, absent="failed", max_pages=1)
    )
    assert ("needs_reconcile", "needs_reconcile") == (action, status)
    assert 1 == len(lookups(listing))
    with idempotently.Journal(journal) as opened:
        (entry,) = opened.audit("order-1")
    assert "max_pages=1" in (entry.note or "")


def test_a_next_link_to_another_origin_is_never_followed(
    servers: tuple[Listing, str, Listing, str], tmp_path: Any
) -> None:
    """Page 1 points to its next page on another origin: it is not followed (that origin
    receives no request, so no credentials), and absence from page 1 proves nothing."""
    listing, url, elsewhere, _ = servers
    listing.reset("cross", lists_it=False)
    journal = str(tmp_path / "j.db")
    charged_unsettled(journal, url)
    action, status, everything = reconcile(
        journal, url, Lookup(LOOKUP, params=PARAMS, absent="resend")
    )
    assert ("needs_reconcile", "needs_reconcile", ["order-1"]) == (action, status, everything)
    assert [] == elsewhere.arrivals
    with idempotently.Journal(journal) as opened:
        (entry,) = opened.audit("order-1")
    assert "another origin" in (entry.note or "")


def test_a_cursor_seen_before_proves_nothing(
    servers: tuple[Listing, str, Listing, str], tmp_path: Any
) -> None:
    """A list whose page 2 points back to itself: the loop is read once and proves
    nothing; the operation stays."""
    listing, url, _, _ = servers
    listing.reset("loop", lists_it=False)
    journal = str(tmp_path / "j.db")
    charged_unsettled(journal, url)
    action, status, _ = reconcile(journal, url, Lookup(LOOKUP, params=PARAMS, absent="failed"))
    assert ("needs_reconcile", "needs_reconcile") == (action, status)
    assert 2 == len(lookups(listing))
    with idempotently.Journal(journal) as opened:
        (entry,) = opened.audit("order-1")
    assert "cursor loop" in (entry.note or "")


@pytest.mark.parametrize("absent", ["failed", "resend"])
def test_a_page_redirected_to_another_origin_is_never_read_nor_taken_for_the_end(
    journal_target: str, servers: tuple[Listing, str, Listing, str], absent: Any
) -> None:
    """A client that follows redirects, and page 2 answers 302 to another origin (whose
    list is empty and says it is the last): the lookup never sends the session's
    credentials there (that origin receives nothing), and absence proves nothing: the
    operation stays, no fork (before: the other origin's empty page settled a charge
    made on page 2 failed, or forked it to be charged again)."""
    listing, url, elsewhere, _ = servers
    listing.reset("redirect")
    charged_unsettled(journal_target, url)
    with idempotently.Session(
        journal_target,
        base_url=url,
        headers={"Authorization": TOKEN, "X-Api-Key": "sk_test_elsewhere"},
        profile=CARRYING,
        clock=LATER,
        follow_redirects=True,
    ) as session:
        (result,) = session.reconcile(Lookup(LOOKUP, params=PARAMS, absent=absent))
        everything = sorted(op.operation_id for op in session.journal.operations())
        operation = session.journal.operation("order-1")
    assert operation is not None
    assert ("needs_reconcile", "needs_reconcile", ["order-1"]) == (
        result.action,
        operation.status,
        everything,
    )
    assert [] == elsewhere.arrivals


def test_an_empty_page_whose_has_more_is_not_a_boolean_proves_nothing(
    servers: tuple[Listing, str, Listing, str], tmp_path: Any
) -> None:
    """A list whose ``has_more`` is a string ("true"), its charge made but listed empty:
    a pagination field the lookup cannot read is never taken for "no more" (before: the
    empty answer counted as a filtered one and settled the charge failed)."""
    listing, url, _, _ = servers
    listing.reset("has_more_text")
    journal = str(tmp_path / "j.db")
    charged_unsettled(journal, url)
    listing.charges.clear()  # the list lags: the charge is not listed yet, nor anything
    action, status, _ = reconcile(journal, url, Lookup(LOOKUP, params=PARAMS, absent="failed"))
    assert ("needs_reconcile", "needs_reconcile") == (action, status)


@pytest.mark.parametrize("style", ["has_more", "next", "link"])
def test_absence_from_the_whole_list_settles_it(
    servers: tuple[Listing, str, Listing, str], tmp_path: Any, style: str
) -> None:
    """The charge never happened and every page was read to the one that says it is the
    last: absence is proven, absent="failed" settles it failed."""
    listing, url, _, _ = servers
    listing.reset(style, lists_it=False)
    journal = str(tmp_path / "j.db")
    charged_unsettled(journal, url)
    action, status, _ = reconcile(journal, url, Lookup(LOOKUP, params=PARAMS, absent="failed"))
    assert ("reconciled", "failed") == (action, status)


def test_unpaged_says_an_unmarked_list_is_the_whole_list(
    servers: tuple[Listing, str, Listing, str], tmp_path: Any
) -> None:
    """Lookup(unpaged=True): the endpoint never pages, so an answer that says nothing of
    pages and does not hold the charge proves it absent."""
    listing, url, _, _ = servers
    listing.reset("unmarked", lists_it=False)
    journal = str(tmp_path / "j.db")
    charged_unsettled(journal, url)
    action, status, _ = reconcile(
        journal, url, Lookup(LOOKUP, params=PARAMS, absent="failed", unpaged=True)
    )
    assert ("reconciled", "failed") == (action, status)


@pytest.mark.anyio
async def test_an_async_lookup_reads_page_2_too(
    journal_target: str, servers: tuple[Listing, str, Listing, str], anyio_backend: str
) -> None:
    """AsyncSession.reconcile walks the pages as Session does: the charge on page 2
    settles the operation succeeded, absent="resend" forks nothing."""
    listing, url, _, _ = servers
    listing.reset("has_more")
    charged_unsettled(journal_target, url)
    async with idempotently.AsyncSession(
        journal_target,
        base_url=url,
        headers={"Authorization": TOKEN},
        profile=CARRYING,
        clock=LATER,
    ) as session:
        (result,) = await session.reconcile(Lookup(LOOKUP, params=PARAMS, absent="resend"))
    assert ("reconciled", "succeeded") == (result.action, result.status)
    assert "ch_target" == json.loads(stored(journal_target).response_body or b"")["id"]


@pytest.mark.anyio
async def test_an_async_lookup_never_follows_a_redirect_to_another_origin(
    tmp_path: Any, servers: tuple[Listing, str, Listing, str], anyio_backend: str
) -> None:
    """AsyncSession.reconcile with a client that follows redirects: page 2's 302 to
    another origin is not followed (nothing arrives there) and proves nothing."""
    listing, url, elsewhere, _ = servers
    listing.reset("redirect")
    journal = str(tmp_path / "j.db")
    charged_unsettled(journal, url)
    async with idempotently.AsyncSession(
        journal,
        base_url=url,
        headers={"Authorization": TOKEN},
        profile=CARRYING,
        clock=LATER,
        follow_redirects=True,
    ) as session:
        (result,) = await session.reconcile(Lookup(LOOKUP, params=PARAMS, absent="resend"))
    assert ("needs_reconcile", "needs_reconcile") == (result.action, result.status)
    assert [] == elsewhere.arrivals


@pytest.mark.parametrize(
    ("options", "expected"), [((), "needs_reconcile"), (("--unpaged",), "failed")]
)
def test_reconcile_on_the_command_line_takes_unpaged(
    servers: tuple[Listing, str, Listing, str],
    tmp_path: Any,
    options: tuple[str, ...],
    expected: str,
) -> None:
    """`idempotently reconcile --absent failed` on an answer that says nothing of pages
    and lacks the charge: it stays, unless --unpaged says the endpoint never pages."""
    listing, url, _, _ = servers
    listing.reset("unmarked", lists_it=False)
    journal = str(tmp_path / "j.db")
    charged_unsettled(journal, url)
    command = ["--journal", journal, "reconcile", "--lookup", LOOKUP, "--absent", "failed"]
    result = CliRunner().invoke(cli, [*command, "--absent-after", "0s", *options])
    assert expected == stored(journal).status, result.output


HERE = "https://api.example.test/v1/charges?limit=10"


@pytest.mark.parametrize(
    ("headers", "document", "expected"),
    [
        ({}, {"data": [], "has_more": False}, "last"),
        ({}, {"data": [{"id": "ch_9"}], "has_more": True}, f"{HERE}&starting_after=ch_9"),
        ({}, {"data": [{"id": "ch_9"}], "has_more": True, "next_page": "tok"}, f"{HERE}&page=tok"),
        ({}, {"data": [{"x": 1}], "has_more": True}, "no cursor"),
        ({}, {"data": [], "next": None}, "last"),
        (
            {},
            {"data": [], "next": "/v1/charges?cursor=2"},
            "https://api.example.test/v1/charges?cursor=2",
        ),
        (
            {},
            {"data": [], "links": {"next": "?cursor=3"}},
            "https://api.example.test/v1/charges?cursor=3",
        ),
        ({}, {"data": [], "links": {"next": None}}, "last"),
        ({}, {"data": [], "next": 2}, "not understood"),
        ({}, {"data": [], "has_more": "true"}, "not understood"),
        ({}, {"data": [], "has_more": 1}, "not understood"),
        ({}, {"data": [], "has_more": None}, "not understood"),
        ({"link": '<https://api.example.test/p2>; rel="next"'}, [], "https://api.example.test/p2"),
        ({"link": '<https://api.example.test/p1>; rel="first"'}, [], "last"),
        ({"link": '<https://api.example.test/d>; rel="describedby"'}, [], "unmarked"),
        (
            {},
            {"data": [], "has_more": False, "next": "/v1/charges?cursor=2"},
            "https://api.example.test/v1/charges?cursor=2",
        ),
        ({}, {"object": "list", "data": [{"id": "ch_1"}]}, "unmarked"),
        ({}, [{"id": "ch_1"}], "unmarked"),
    ],
)
def test_the_pagination_a_page_carries(
    headers: dict[str, str], document: Any, expected: str
) -> None:
    """What each pagination a lookup understands says of the next page; any sign of more
    wins over a sign of the end; a sign it cannot follow is never taken for the end."""
    response = httpx.Response(
        200, headers=headers, json=document, request=httpx.Request("GET", HERE)
    )
    listed = document.get("data") if isinstance(document, dict) else document
    following = next_page(response, document, listed)
    said = (
        "last"
        if following.last
        else str(following.url)
        if following.url is not None
        else "unmarked"
        if following.why == UNMARKED
        else "no cursor"
        if "cursor" in following.why
        else "not understood"
    )
    assert expected == said
