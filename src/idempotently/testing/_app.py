"""The mock payments API: an ASGI app implementing Leach's idempotency keys.

Starlette gives routing, request parsing and `Response` objects with exact
bodies and headers while staying a plain ASGI app (so `httpx.ASGITransport`
and uvicorn both run it); dropping a connection on purpose still needs the
raw ASGI `send`, which a Starlette `Response` subclass has.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from idempotently.testing._charge_request import (
    MAX_BODY_BYTES,
    BodyFormat,
    ChargeRequest,
    body_too_large,
    check_content_type,
    declared_too_large,
    parse_charge,
    parse_key,
    request_hash,
)
from idempotently.testing._clock import Clock, SystemClock, VirtualClock
from idempotently.testing._config import MockServerConfig
from idempotently.testing._database import Database
from idempotently.testing._faults import Fault, Faults, ScheduledFault
from idempotently.testing._log import LoggedRequest, RequestLog
from idempotently.testing._problems import PROBLEM_MEDIA_TYPE, Problem, bad_request
from idempotently.testing._provider import FakeProvider, Ledger, provider_key_for
from idempotently.testing._states import is_stale, next_step
from idempotently.testing._stats import Stats, Tally
from idempotently.testing._store import KeyStore, StoredCharge

REPLAY_HEADER = "Idempotent-Replayed"
_SEARCH_CLAUSE = re.compile(r"metadata\['([^'\\]+)'\]:'((?:[^'\\]|\\.)*)'")
"""One clause of a search query: ``metadata['name']:'value'`` (``\\'`` escapes a quote)."""

# How often a request in "wait" mode looks at the key it waits for. Real time:
# the request it waits for makes progress in real time, whatever the clock says.
_WAIT_POLL_SECONDS = 0.01
# Claim, read, and re-decide at most this often: a key swept or released between
# our failed claim and our read sends us round again, but never forever.
_MAX_ROUNDS = 4


class ConnectionDropped(httpx.RemoteProtocolError):
    """Raised by the app to drop the connection after the response headers.

    It subclasses httpx's error so that a client driving the app in-process
    (`httpx.ASGITransport`) sees the same exception class as one on a real
    socket, where uvicorn closes the connection mid-response.
    """


class _DroppedResponse(Response):
    """Sends the headers of `original` (with its Content-Length), then drops the connection."""

    def __init__(self, original: Response, reason: str) -> None:
        self.status_code = original.status_code
        self.raw_headers = list(original.raw_headers)
        self.body = original.body
        self.background = None
        self.reason = reason

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        raise ConnectionDropped(f"the mock server dropped the connection ({self.reason})")


def _problem_response(problem: Problem) -> Response:
    return Response(
        problem.body(),
        status_code=problem.status,
        headers=problem.headers,
        media_type=PROBLEM_MEDIA_TYPE,
    )


def _json(document: Any) -> str:
    return json.dumps(document, separators=(",", ":"))


# RFC 6750's b64token: the token becomes the user id, so keep it plain.
_BEARER_TOKEN = re.compile("[A-Za-z0-9._~+/-]+=*")
_MAX_TOKEN_LENGTH = 255


def _authenticate(request: Request) -> str:
    """The user id is the bearer token: any well-formed token is a user, none is a 401."""
    values = request.headers.getlist("authorization")
    scheme, _, token = (values[0] if len(values) == 1 else "").partition(" ")
    token = token.strip(" \t")
    if (
        scheme.lower() != "bearer"
        or not _BEARER_TOKEN.fullmatch(token)
        or len(token) > _MAX_TOKEN_LENGTH
    ):
        raise Problem(
            401,
            "Unauthorized",
            "send one Authorization: Bearer <token> header; the token is the user id:"
            f" up to {_MAX_TOKEN_LENGTH} letters, digits and -._~+/ (RFC 6750)",
            slug="unauthorized",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return token


def _idempotency_key(request: Request, config: MockServerConfig) -> str:
    values = request.headers.getlist("idempotency-key")
    if len(values) > 1:
        raise bad_request(
            f"the request has {len(values)} Idempotency-Key headers; send exactly one",
            slug="invalid-idempotency-key",
        )
    return parse_key(
        values[0] if values else None,
        key_format=config.key_format,
        max_length=config.max_key_length,
    )


async def _read_body(request: Request) -> tuple[bytes, BodyFormat]:
    """The body if declared as JSON or a form (else 415), refused (413) past 1 MiB."""
    body_format = check_content_type(
        request.headers.get("content-type"), request.headers.get("content-encoding")
    )
    if declared_too_large(request.headers.get("content-length")):
        raise body_too_large()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise body_too_large()
        chunks.append(chunk)
    return b"".join(chunks), body_format


class MockApp:
    """The ASGI app of the mock server, with its ledger, faults, clock and stats.

    ```python
    app = MockApp(MockServerConfig(provider_latency=0.1), clock=VirtualClock())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://mock") as client:
        ...
    assert app.ledger.duplicates() == {}
    ```
    """

    def __init__(
        self,
        config: MockServerConfig | None = None,
        *,
        clock: Clock | None = None,
        db: str | os.PathLike[str] = ":memory:",
    ) -> None:
        self.config = config if config is not None else MockServerConfig()
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.database = Database(db)
        self.keys = KeyStore(self.database)
        self.provider = FakeProvider(self.database)
        self.ledger = Ledger(self.database)
        self.faults = Faults()
        self._tally = Tally()
        self._log = RequestLog()
        self._starlette = Starlette(
            routes=[
                Route("/v1/charges", self._create_charge, methods=["POST"]),
                Route("/v1/charges", self._list_charges, methods=["GET"]),
                Route("/v1/charges/search", self._search_charges, methods=["GET"]),
                Route("/v1/_stats", self._stats, methods=["GET"]),
                Route("/v1/_faults", self._faults_endpoint, methods=["GET", "POST", "DELETE"]),
                Route("/v1/_clock", self._clock_endpoint, methods=["GET", "POST"]),
                Route("/v1/_sweep", self._sweep_endpoint, methods=["POST"]),
                Route("/v1/_ledger", self._ledger_endpoint, methods=["GET"]),
                Route("/v1/_keys", self._keys_endpoint, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_exception},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._starlette(scope, receive, send)

    # -- what a test reads -------------------------------------------------

    def stats(self) -> Stats:
        counts = self._tally.snapshot()
        return Stats(
            requests=counts["requests"],
            created=counts["created"],
            replays=counts["replays"],
            conflicts=counts["conflicts"],
            mismatches=counts["mismatches"],
            rejected=counts["rejected"],
            faults=counts["faults"],
            charges=len(self.ledger),
            keys=self.keys.count_by_status(),
            stuck=self.keys.count_stuck(now=self.clock.now(), stale_after=self.config.stale_after),
            swept=counts["swept"],
        )

    @property
    def requests(self) -> list[LoggedRequest]:
        """Every `POST /v1/charges` that reached the app, in the order they were answered."""
        return self._log.entries()

    def sweep(self) -> int:
        """Delete expired keys (`DELETE … WHERE expires_at < now`); returns how many."""
        now = self.clock.now()
        deleted = self.keys.sweep(now=now)
        self.provider.sweep(now=now)
        self._tally.count("swept", deleted)
        return deleted

    # -- POST /v1/charges --------------------------------------------------

    async def _create_charge(self, request: Request) -> Response:
        seen: dict[str, Any] = {}
        response = await self._handle_charge(request, seen)
        self._log.append(
            LoggedRequest(
                method=request.method,
                path=request.url.path,
                user=seen.get("user"),
                key=seen.get("key"),
                body=seen.get("body", b""),
                document=seen.get("document"),
                status=response.status_code,
                replayed=dict(response.headers).get(REPLAY_HEADER.lower()) == "true",
                fault=seen.get("fault"),
            )
        )
        return response

    async def _handle_charge(self, request: Request, seen: dict[str, Any]) -> Response:
        self._tally.count("requests")
        try:
            seen["user"] = user = _authenticate(request)
            seen["key"] = key = _idempotency_key(request, self.config)
            body, body_format = await _read_body(request)
            seen["body"] = body
            charge, document = parse_charge(body, body_format)
            seen["document"] = document
        except Problem as problem:
            self._tally.count("rejected")
            return _problem_response(problem)
        fingerprint = request_hash(
            request.method, request.url.path, request.query_params.multi_items(), document
        )
        # The sweeper runs on the write path so an expired key is gone before
        # this request looks for it: a reused key after the TTL is a new request.
        self.sweep()
        fault = self.faults.take(user=user, key=key, order_id=charge.order_id, doing_work=False)
        if fault is not None:
            seen["fault"] = fault.kind
            self._tally.count("faults")
            if fault.kind == "unavailable":
                return _problem_response(_unavailable(fault))
            if fault.kind == "rate_limited":
                return _problem_response(_rate_limited(fault))
            if fault.kind == "delay":
                await anyio.sleep(fault.seconds or 0)
        # Once the key may be claimed, a client that hangs up must not abandon
        # it halfway: the request finishes (or fails) as if it were still there.
        with anyio.CancelScope(shield=True):
            try:
                response = await self._answer(user, key, fingerprint, charge, fault, seen)
            except Problem as problem:
                response = _problem_response(problem)
        if fault is not None and fault.kind == "lose_response":
            return _DroppedResponse(response, "injected fault: lose_response")
        return response

    async def _answer(
        self,
        user: str,
        key: str,
        fingerprint: str,
        charge: ChargeRequest,
        fault: Fault | None,
        seen: dict[str, Any],
    ) -> Response:
        waited = False
        for _ in range(_MAX_ROUNDS):
            locked_at = await self._claim(user, key, fingerprint)
            if locked_at is not None:
                return await self._execute(user, key, charge, fault, seen, locked_at=locked_at)
            record = self.keys.get(user, key)
            if record is None:
                continue  # swept or released since our claim failed: claim again
            now = self.clock.now()
            step = next_step(record, fingerprint, now=now, stale_after=self.config.stale_after)
            if step == "mismatch":
                self._tally.count("mismatches")
                return self._mismatch()
            if step == "replay":
                self._tally.count("replays")
                return _replay(record.response_code, record.response_body)
            if step == "take_over":
                if self.keys.take_over(record, now=now):
                    return await self._execute(user, key, charge, fault, seen, locked_at=now)
                return self._in_progress()
            if self.config.in_progress == "wait" and not waited:
                waited = True
                await self._wait_while_in_progress(user, key)
                continue
            return self._in_progress()
        return self._in_progress()

    async def _claim(self, user: str, key: str, fingerprint: str) -> float | None:
        """Claim the key; the lock time if this request now owns it, else None."""
        now = self.clock.now()
        ttl = self.config.key_ttl
        if self.config.claim == "atomic":
            claimed = self.keys.claim(user, key, fingerprint, now=now, ttl=ttl)
            return now if claimed else None
        # The naive way, kept to prove the concurrency test can fail: between
        # the SELECT and the INSERT every concurrent first request sees no row.
        if self.keys.get(user, key) is not None:
            return None
        await anyio.sleep(self.config.naive_gap)
        try:
            self.keys.insert_naively(user, key, fingerprint, now=now, ttl=ttl)
        except sqlite3.IntegrityError as error:
            raise Problem(
                500,
                "Internal Server Error",
                f"naive claim lost the race: {error}",
                slug="unique-violation",
            ) from None
        return now

    async def _execute(
        self,
        user: str,
        key: str,
        request: ChargeRequest,
        fault: Fault | None,
        seen: dict[str, Any],
        *,
        locked_at: float,
    ) -> Response:
        """Do the work as the key's owner: provider call, then commit the result."""
        if fault is None:
            fault = self.faults.take(user=user, key=key, order_id=request.order_id, doing_work=True)
            if fault is not None:
                seen["fault"] = fault.kind
                self._tally.count("faults")
        if self.config.provider_latency:
            await anyio.sleep(self.config.provider_latency)
        charge = self.provider.charge(
            account=user,
            provider_key=provider_key_for(key),
            amount=request.amount,
            currency=request.currency,
            customer=request.customer,
            metadata=request.metadata,
            now=self.clock.now(),
            ttl=self.config.key_ttl,
        )
        if fault is not None and fault.kind == "crash":
            # Nothing more is written: the key stays in_progress with its lock,
            # as if the process died here, and the client loses the connection.
            return _DroppedResponse(
                _problem_response(_crashed(charge.id)), "injected fault: crash before commit"
            )
        if fault is not None and fault.kind == "server_error":
            problem = _server_error(charge.id)
            if self.config.store_server_errors:
                self.keys.complete(
                    user,
                    key,
                    locked_at=locked_at,
                    response_code=problem.status,
                    response_body=problem.body(),
                    charge=None,
                    now=self.clock.now(),
                )
            else:
                self.keys.fail(
                    user,
                    key,
                    locked_at=locked_at,
                    response_code=problem.status,
                    response_body=problem.body(),
                )
            return _problem_response(problem)
        body = _json(charge.to_json())
        # If our lock was taken over meanwhile, the new owner commits the same
        # provider charge; the answer is still true, so send it either way.
        self.keys.complete(
            user,
            key,
            locked_at=locked_at,
            response_code=201,
            response_body=body,
            charge=StoredCharge(
                id=charge.id,
                amount=charge.amount,
                currency=charge.currency,
                customer=charge.customer,
                metadata=charge.metadata,
                created=charge.created,
            ),
            now=self.clock.now(),
        )
        self._tally.count("created")
        return Response(body, status_code=201, media_type="application/json")

    async def _wait_while_in_progress(self, user: str, key: str) -> None:
        with anyio.move_on_after(self.config.in_progress_wait):
            while True:
                await anyio.sleep(_WAIT_POLL_SECONDS)
                record = self.keys.get(user, key)
                if record is None or record.status != "in_progress":
                    return
                if is_stale(
                    record.locked_at, now=self.clock.now(), stale_after=self.config.stale_after
                ):
                    return

    def _in_progress(self) -> Response:
        self._tally.count("conflicts")
        detail = "a request with this Idempotency-Key is still in progress; retry it later"
        if self.config.in_progress == "423":
            retry_after = str(self.config.in_progress_retry_after)
            return _problem_response(
                Problem(
                    423, "Locked", detail, slug="in-progress", headers={"Retry-After": retry_after}
                )
            )
        return _problem_response(Problem(409, "Conflict", detail, slug="in-progress"))

    def _mismatch(self) -> Response:
        if self.config.mismatch == "stripe":
            return JSONResponse(
                {
                    "error": {
                        "type": "idempotency_error",
                        "message": "Keys for idempotent requests can only be used with the same"
                        " parameters they were first used with. Try using a key other than"
                        " the one used in the original request (different payload).",
                    }
                },
                status_code=400,
            )
        return _problem_response(
            Problem(
                422,
                "Unprocessable Content",
                "Idempotency-Key reused with a different payload (mismatch): the stored"
                " response belongs to another request; use a new key for a new request",
                slug="payload-mismatch",
            )
        )

    # -- GET /v1/charges ---------------------------------------------------

    async def _list_charges(self, request: Request) -> Response:
        try:
            user = _authenticate(request)
        except Problem as problem:
            return _problem_response(problem)
        wanted = {
            name[len("metadata[") : -1]: value
            for name, value in request.query_params.multi_items()
            if name.startswith("metadata[") and name.endswith("]")
        }
        charges = [
            charge.to_json()
            for charge in self.ledger.charges(user)
            if all(charge.metadata.get(name) == value for name, value in wanted.items())
        ]
        # Stripe's list envelope: the whole filtered list in one page, which says so.
        return JSONResponse(
            {"object": "list", "data": charges, "has_more": False, "url": "/v1/charges"}
        )

    # -- search, as Stripe's search API spells it (for lookup reconcilers) -------

    async def _search_charges(self, request: Request) -> Response:
        """``GET /v1/charges/search?query=metadata['name']:'value'`` (clauses joined by
        `` AND ``): the user's charges whose metadata match, as Stripe's search answers."""
        try:
            user = _authenticate(request)
        except Problem as problem:
            return _problem_response(problem)
        query = request.query_params.get("query", "")
        clauses = [clause.strip() for clause in query.split(" AND ")] if query.strip() else []
        wanted: dict[str, str] = {}
        for clause in clauses:
            found = _SEARCH_CLAUSE.fullmatch(clause)
            if found is None:
                return _problem_response(
                    bad_request(
                        f"cannot parse the search clause {clause[:80]!r}: this mock searches "
                        "metadata['name']:'value' clauses joined by AND",
                        slug="invalid-search-query",
                    )
                )
            wanted[found.group(1)] = re.sub(r"\\(.)", r"\1", found.group(2))
        charges = [
            charge.to_json()
            for charge in self.ledger.charges(user)
            if all(charge.metadata.get(name) == value for name, value in wanted.items())
        ]
        return JSONResponse(
            {"object": "search_result", "data": charges, "has_more": False, "next_page": None}
        )

    # -- admin endpoints (loopback tooling; no authentication) ---------------

    async def _stats(self, request: Request) -> Response:
        return JSONResponse(self.stats().to_json())

    async def _faults_endpoint(self, request: Request) -> Response:
        if request.method == "DELETE":
            self.faults.clear()
        elif request.method == "POST":
            try:
                self.faults.schedule(*_scheduled_from_json(await request.body()))
            except Problem as problem:
                return _problem_response(problem)
        return JSONResponse(
            {
                "pending": [scheduled.to_json() for scheduled in self.faults.pending],
                "applied": [scheduled.to_json() for scheduled in self.faults.applied],
            }
        )

    async def _clock_endpoint(self, request: Request) -> Response:
        if request.method == "POST":
            if not isinstance(self.clock, VirtualClock):
                return _problem_response(
                    Problem(
                        409,
                        "Conflict",
                        "this server runs on the wall clock; start it with a virtual clock"
                        " (--virtual-clock) to move time",
                        slug="not-a-virtual-clock",
                    )
                )
            try:
                document = json.loads(await request.body())
                seconds = document["advance"]
                if isinstance(seconds, bool) or not isinstance(seconds, int | float):
                    raise TypeError(seconds)
                self.clock.advance(seconds)
            except (ValueError, KeyError, TypeError):
                return _problem_response(bad_request('send {"advance": <seconds>}, seconds >= 0'))
        return JSONResponse(
            {"now": self.clock.now(), "virtual": isinstance(self.clock, VirtualClock)}
        )

    async def _sweep_endpoint(self, request: Request) -> Response:
        return JSONResponse({"deleted": self.sweep()})

    async def _ledger_endpoint(self, request: Request) -> Response:
        charges = [
            {**charge.to_json(), "user": charge.user, "idempotency_key": charge.key}
            for charge in self.ledger.charges()
        ]
        # Stripe's list envelope: the whole filtered list in one page, which says so.
        return JSONResponse(
            {"object": "list", "data": charges, "has_more": False, "url": "/v1/charges"}
        )

    async def _keys_endpoint(self, request: Request) -> Response:
        records = [
            {
                "user_id": record.user_id,
                "key": record.key,
                "status": record.status,
                "response_code": record.response_code,
                "locked_at": record.locked_at,
                "expires_at": record.expires_at,
            }
            for record in self.keys.records()
        ]
        return JSONResponse({"object": "list", "data": records})

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        title = {404: "Not Found", 405: "Method Not Allowed"}.get(exc.status_code, "Error")
        return _problem_response(
            Problem(
                exc.status_code,
                title,
                f"{request.method} {request.url.path}: {exc.detail}",
                slug="routing",
                headers=exc.headers,
            )
        )


def create_app(
    config: MockServerConfig | None = None,
    *,
    clock: Clock | None = None,
    db: str | os.PathLike[str] = ":memory:",
) -> MockApp:
    """A fresh mock server app (nothing listens: mount it with `httpx.ASGITransport` or uvicorn).

    Args:
        config: How the server behaves (`MockServerConfig()`: Leach's server).
        clock: Its clock (`SystemClock()`; a `VirtualClock` stands still until advanced).
        db: The SQLite file for its keys, charges and ledger (`":memory:"`: none).
    """
    return MockApp(config, clock=clock, db=db)


def _replay(status: int | None, body: str | None) -> Response:
    status = status if status is not None else 500
    media_type = "application/json" if status < 400 else PROBLEM_MEDIA_TYPE
    return Response(
        body or "", status_code=status, media_type=media_type, headers={REPLAY_HEADER: "true"}
    )


def _unavailable(fault: Fault) -> Problem:
    headers = {} if fault.seconds is None else {"Retry-After": _seconds(fault.seconds)}
    return Problem(
        503,
        "Service Unavailable",
        "injected fault: unavailable before any work; nothing was stored or charged",
        slug="unavailable",
        headers=headers,
    )


def _rate_limited(fault: Fault) -> Problem:
    return Problem(
        429,
        "Too Many Requests",
        "injected fault: rate limited before any work; nothing was stored or charged",
        slug="rate-limited",
        headers={"Retry-After": _seconds(fault.seconds or 0)},
    )


def _server_error(charge_id: str) -> Problem:
    return Problem(
        500,
        "Internal Server Error",
        f"injected fault: failed after the provider made charge {charge_id}",
        slug="server-error",
    )


def _crashed(charge_id: str) -> Problem:
    return Problem(
        500,
        "Internal Server Error",
        f"injected fault: crashed after the provider made charge {charge_id}, before the commit",
        slug="crash",
    )


def _seconds(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else str(seconds)


def _scheduled_from_json(body: bytes) -> list[ScheduledFault]:
    """Read `{"faults": [...], "key": ..., "user": ..., "order_id": ...}` (targets optional)."""
    try:
        document = json.loads(body)
        if not isinstance(document, dict) or not isinstance(document.get("faults"), list):
            raise ValueError('send {"faults": [{"kind": ...}, ...]}')
        targets = {name: document.get(name) for name in ("key", "user", "order_id")}
        for name, value in targets.items():
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string")
        return [ScheduledFault(Fault.from_json(item), **targets) for item in document["faults"]]
    except ValueError as error:
        raise bad_request(f"invalid fault script: {error}", slug="invalid-fault") from None
