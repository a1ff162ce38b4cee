"""Every read a lookup makes has a byte bound and a time bound, over the whole walk.

A search endpoint that trickles a byte every 0.4 s never hangs `Session.reconcile`
(sync, asyncio, trio): the lookup is given up at its time limit (``Lookup(timeout=)``,
else the session policy's ``deadline``) and the operation stays, noted why. The bounds
cover every page of a walk together, not each page. A `resume --watch
--reconcile-lookup` worker (a real process) sends a claimed charge while its lookup
trickles, and a SIGTERM stops it whatever the lookup is doing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import idempotently
from idempotently import Lookup, profiles
from tests.scripted_server import serve

REPO = Path(__file__).resolve().parents[1]
CARRYING = attrs.evolve(profiles.GENERIC, operation_id_field="metadata.operation_id")
GENEROUS = 60.0
"""The longest a test waits for what must happen long before (a loaded machine)."""
WORKER_WAIT = 30.0
"""The longest the watch test waits for the charge, and for the worker to stop: half the
worker's lookup limit (the policy's 60 s deadline), so a lookup that held them back
would be seen doing so."""


@attrs.define
class Slow:
    """``POST /v1/charges``: the charge of ``stuck`` answers a replayed 500 (it needs
    reconciling), any other is made (201). ``GET /v1/charges``: as ``style`` says —
    ``trickle`` one byte every 0.4 s for ever, ``big`` pages of 40 KB that never end
    (``has_more``), ``slow`` pages each answered after 0.5 s that never end."""

    style: str = "trickle"
    charges: list[str] = attrs.Factory(list)
    lookups: int = 0

    async def create(self, request: Request) -> Response:
        name = json.loads(await request.body())["metadata"]["operation_id"]
        if name == "stuck":
            return JSONResponse({}, status_code=500, headers={"Idempotent-Replayed": "true"})
        self.charges.append(name)
        return JSONResponse({"id": f"ch_{name}", "object": "charge"}, status_code=201)

    async def list(self, request: Request) -> Response:
        self.lookups += 1
        after = int(request.query_params.get("starting_after", "ch_0")[3:])
        page = [{"id": f"ch_{after + n + 1}", "pad": "x" * 4000} for n in range(10)]
        if self.style == "big":
            return JSONResponse({"data": page, "has_more": True})
        if self.style == "slow":
            await asyncio.sleep(0.5)
            return JSONResponse({"data": page[:1], "has_more": True})

        async def trickle() -> AsyncIterator[bytes]:
            for _ in range(1_000_000):
                yield b" "
                await asyncio.sleep(0.4)

        return StreamingResponse(trickle(), media_type="application/json")

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/charges", self.create, methods=["POST"]),
                Route("/v1/charges", self.list, methods=["GET"]),
            ]
        )


@pytest.fixture(scope="module")
def _slow() -> Iterator[tuple[Slow, str]]:
    app = Slow()
    with serve(app.app()) as url:
        yield app, url


@pytest.fixture
def slow(_slow: tuple[Slow, str]) -> Iterator[tuple[Slow, str]]:
    app, url = _slow
    app.style, app.lookups = "trickle", 0
    app.charges.clear()
    yield app, url


def stuck(journal: str, url: str) -> None:
    """An operation the server answered with a replayed 500: needs_reconcile."""
    with (
        idempotently.Session(journal, base_url=url, profile=CARRYING) as session,
        pytest.raises(idempotently.NeedsReconcileError),
    ):
        session.post("/v1/charges", json={"amount": 1}, operation_id="stuck")


def reconciled_in_a_thread(journal: str, url: str, lookup: Lookup, **options: Any) -> Any:
    """``Session.reconcile(lookup)`` on a thread; its one result, once it has ended (it
    must end within `GENEROUS` seconds)."""
    results: list[idempotently.ResumeResult] = []

    def run() -> None:
        with idempotently.Session(journal, base_url=url, profile=CARRYING, **options) as s:
            results.extend(s.reconcile(lookup))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GENEROUS)
    assert not thread.is_alive(), "reconcile hung on the lookup"
    (result,) = results
    return result


def test_a_trickling_lookup_is_given_up_at_its_timeout(
    journal_target: str, slow: tuple[Slow, str]
) -> None:
    """A search answer trickling a byte every 0.4 s: Session.reconcile ends (the lookup
    given up at Lookup(timeout=1)), the operation stays needs_reconcile, noted why."""
    _, url = slow
    stuck(journal_target, url)
    result = reconciled_in_a_thread(journal_target, url, Lookup("/v1/charges", timeout=1))
    assert "needs_reconcile" == result.status
    assert "not read whole" in result.detail


def test_without_a_timeout_the_policy_deadline_bounds_a_lookup(
    tmp_path: Path, slow: tuple[Slow, str]
) -> None:
    """With no Lookup(timeout=), the session policy's deadline is the lookup's limit."""
    _, url = slow
    journal = str(tmp_path / "j.db")
    stuck(journal, url)
    policy = idempotently.RetryPolicy(deadline=1)
    result = reconciled_in_a_thread(journal, url, Lookup("/v1/charges"), policy=policy)
    assert ("needs_reconcile", True) == (result.status, "not read whole" in result.detail)


@pytest.mark.anyio
async def test_an_async_trickling_lookup_is_given_up_at_its_timeout(
    tmp_path: Path, slow: tuple[Slow, str], anyio_backend: str
) -> None:
    """AsyncSession.reconcile (asyncio and trio) ends too, the operation unchanged."""
    _, url = slow
    journal = str(tmp_path / "j.db")
    stuck(journal, url)
    with anyio.fail_after(GENEROUS):
        async with idempotently.AsyncSession(journal, base_url=url, profile=CARRYING) as s:
            (result,) = await s.reconcile(Lookup("/v1/charges", timeout=1))
    assert ("needs_reconcile", True) == (result.status, "not read whole" in result.detail)


def test_one_byte_bound_covers_every_page_of_a_walk(tmp_path: Path, slow: tuple[Slow, str]) -> None:
    """Pages of 40 KB under max_response_bytes=100 KB: each page fits, the walk does not;
    it stops at the bound, before max_pages, and proves nothing."""
    app, url = slow
    app.style = "big"
    journal = str(tmp_path / "j.db")
    stuck(journal, url)
    result = reconciled_in_a_thread(
        journal, url, Lookup("/v1/charges", absent="failed"), max_response_bytes=100_000
    )
    assert ("needs_reconcile", True) == (result.status, "bytes over all its pages" in result.detail)
    assert 3 == app.lookups


def test_one_time_limit_covers_every_page_of_a_walk(tmp_path: Path, slow: tuple[Slow, str]) -> None:
    """Pages answered after 0.5 s each, Lookup(timeout=1.2): each page fits the limit,
    the walk of ten does not; it stops before max_pages, and proves nothing."""
    app, url = slow
    app.style = "slow"
    journal = str(tmp_path / "j.db")
    stuck(journal, url)
    result = reconciled_in_a_thread(
        journal, url, Lookup("/v1/charges", absent="failed", timeout=1.2)
    )
    assert "needs_reconcile" == result.status
    assert app.lookups < 10


# -- a watch worker, a real process ---------------------------------------------------


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_watch_workers_trickling_lookup_holds_back_no_send_and_no_sigterm(
    tmp_path: Path, slow: tuple[Slow, str]
) -> None:
    """`resume --watch --reconcile-lookup` whose lookup trickles: a charge enqueued while
    it trickles is sent, and a SIGTERM stops the worker (exit 0) with the lookup still
    trickling, its operation unchanged."""
    app, url = slow
    journal = str(tmp_path / "j.db")
    stuck(journal, url)
    with (tmp_path / "out").open("w") as out, (tmp_path / "err").open("w") as err:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "idempotently",
                "--journal",
                journal,
                "resume",
                "--watch",
                "--json",
                "--interval",
                "0.1s",
                "--reconcile-lookup",
                "/v1/charges",
            ],
            stdout=out,
            stderr=err,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    try:
        wait_for(lambda: app.lookups > 0, worker)
        with idempotently.Session(journal, base_url=url, profile=CARRYING) as session:
            session.enqueue("POST", "/v1/charges", json={"amount": 2}, operation_id="order-2")
        wait_for(lambda: app.charges == ["order-2"], worker)
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(WORKER_WAIT)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    with idempotently.Journal(journal) as opened:
        left = opened.operation("stuck")
        sent = opened.operation("order-2")
    assert left is not None and sent is not None
    assert (0, "needs_reconcile", "succeeded") == (code, left.status, sent.status), (
        tmp_path / "err"
    ).read_text()


def wait_for(condition: Any, worker: subprocess.Popen[bytes]) -> None:
    ends = time.monotonic() + WORKER_WAIT
    while not condition():
        assert worker.poll() is None, "the worker ended early"
        assert time.monotonic() < ends, "it never happened"
        time.sleep(0.05)
