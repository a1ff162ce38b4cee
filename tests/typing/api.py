"""The public API as mypy sees it: checked by ``mypy`` (``[tool.mypy] files``), never run.

Each ``# type: ignore[code]`` marks a call that must be a type error: mypy runs with
``--strict`` (``warn_unused_ignores``), so an ignore that stops being needed (the
API got looser, e.g. ``delivery`` became a plain ``str``) fails the check.
"""

from __future__ import annotations

import threading
import time

import anyio
import httpx
from typing_extensions import assert_type

import idempotently
from idempotently import profiles

URL = "https://api.example.com/v1/charges"


def session_calls(session: idempotently.Session) -> None:
    assert_type(session.post(URL, json={"amount": 1}, operation_id="order-42"), httpx.Response)
    assert_type(session.request("PATCH", URL, idempotency_key="k-1"), httpx.Response)
    assert_type(session.resume(dry_run=True), list[idempotently.ResumeResult])
    session.post(URL, delivery="at_most_once")
    session.post(URL, delivery="exactly_once")
    session.post(URL, delivery="twice")  # type: ignore[arg-type]
    session.post(URL, operation_id=42)  # type: ignore[arg-type]
    session.post(URL, deadline_at="tomorrow")  # type: ignore[arg-type]
    queued = session.enqueue("POST", URL, json={"amount": 1}, operation_id="order-43")
    assert_type(queued, idempotently.Operation)
    session.enqueue("POST", URL, json={"amount": 1})  # type: ignore[call-arg]


async def async_session_calls(session: idempotently.AsyncSession) -> None:
    assert_type(await session.post(URL, json={"amount": 1}), httpx.Response)
    assert_type(await session.resume(), list[idempotently.ResumeResult])
    await session.post(URL, delivery="twice")  # type: ignore[arg-type]
    queued = await session.enqueue("POST", URL, json={"amount": 1}, operation_id="order-43")
    assert_type(queued, idempotently.Operation)


def constructors() -> None:
    with idempotently.Session("ops.db", base_url="https://api.example.com") as session:
        assert_type(session, idempotently.Session)
    idempotently.Session(
        idempotently.Journal("ops.db", busy_timeout=5),
        client=httpx.Client(),
        policy=idempotently.RetryPolicy(max_attempts=3, deadline=10),
        profile=profiles.STRIPE,
        lease_duration=30,
    )
    idempotently.Session("ops.db", profile="stripe")  # type: ignore[arg-type]
    idempotently.Session("ops.db", policy=idempotently.RetryPolicy)  # type: ignore[arg-type]
    idempotently.Session(42)  # type: ignore[arg-type]
    idempotently.Session("ops.db", client=httpx.AsyncClient())  # type: ignore[arg-type]
    idempotently.AsyncSession("ops.db", client=httpx.Client())  # type: ignore[arg-type]
    idempotently.AsyncSession("ops.db", sleep=time.sleep)  # type: ignore[arg-type]
    idempotently.AsyncSession("ops.db", sleep=anyio.sleep)
    idempotently.RetryPolicy(max_attempts="3")  # type: ignore[arg-type]
    idempotently.Session("ops.db", profile_rule="forced", redacted_params={"api_key": "sk"})
    idempotently.AsyncSession("ops.db", profile_rule="stored_only", key_expiry_margin=600)
    idempotently.Session("ops.db", profile_rule="force")  # type: ignore[arg-type]
    idempotently.Session("ops.db", redacted_params=["api_key"])  # type: ignore[arg-type]


def watch_worker(session: idempotently.Session, async_session: idempotently.AsyncSession) -> None:
    stop = threading.Event()
    summary = session.watch(stop, interval=1.0, on_batch=lambda batch: batch.results)
    assert_type(summary, idempotently.WatchSummary)
    session.watch(stop, interval="5s")  # type: ignore[arg-type]
    session.watch(interval=1.0)  # type: ignore[call-arg]
    async_session.watch(stop)  # type: ignore[attr-defined]
    operation = session.journal.operation("op")
    if operation is not None:
        assert_type(session.profile_for(operation), idempotently.ServerProfile)
    assert_type(session.journal.schema_version, int)


def transports() -> None:
    httpx.Client(transport=idempotently.Transport("ops.db", delivery="at_most_once"))
    httpx.AsyncClient(transport=idempotently.AsyncTransport("ops.db"))
    httpx.Client(transport=idempotently.AsyncTransport("ops.db"))  # type: ignore[arg-type]
    idempotently.Transport("ops.db", delivery="twice")  # type: ignore[arg-type]
    idempotently.Transport("ops.db", polcy=None)  # type: ignore[call-arg]
    idempotently.Transport("ops.db", transport=httpx.AsyncHTTPTransport())  # type: ignore[arg-type]


def results(result: idempotently.ResumeResult, receipt: idempotently.Receipt) -> None:
    # ResumeResult.action is the ResumeAction Literal: comparing it with a word that is
    # not in it is a non-overlapping comparison under --strict.
    assert result.action in ("succeeded", "would_send")
    assert result.action != "sent"  # type: ignore[comparison-overlap]
    assert result.status != "done"  # type: ignore[comparison-overlap]
    assert_type(result.status_code, int | None)
    assert_type(receipt.replayed_locally, bool)
    assert_type(receipt.attempts, int)
    idempotently.Settlement(status="succeeded", note="found ch_1")
    idempotently.Settlement(status="maybe", note="?")  # type: ignore[arg-type]


def journal(journal: idempotently.Journal) -> None:
    operation = journal.operation("order-42")
    assert_type(operation, idempotently.Operation | None)
    if operation is not None:
        assert operation.status != "done"  # type: ignore[comparison-overlap]
        assert operation.delivery != "twice"  # type: ignore[comparison-overlap]
        assert_type(operation.attempts, tuple[idempotently.Attempt, ...])
    journal.operations(status="pending")
    journal.operations(status="done")  # type: ignore[arg-type]


def errors(error: idempotently.IdempotentlyError) -> None:
    assert_type(error.operation_id, str | None)
    assert_type(error.key, str | None)
    assert_type(error.response, httpx.Response | None)
    if isinstance(error, idempotently.RetryLaterError):
        assert_type(error.not_before, float)
    reuse: ValueError = idempotently.KeyReuseError("other payload")
    missing: FileNotFoundError = idempotently.JournalMissingError("no journal")
    pending: idempotently.OperationPendingError = idempotently.RetryLaterError(
        "later", not_before=1.0
    )
    idempotently.RetryLaterError("later")  # type: ignore[call-arg]
    del reuse, missing, pending


def reconcilers(session: idempotently.Session, async_session: idempotently.AsyncSession) -> None:
    def settle(
        operation: idempotently.Operation, client: httpx.Client
    ) -> idempotently.Settlement | None:
        return None

    async def settle_async(
        operation: idempotently.Operation, client: httpx.AsyncClient
    ) -> idempotently.Settlement | None:
        return None

    session.resume(reconciler=settle)
    session.resume(reconciler=settle_async)  # type: ignore[arg-type]
    anyio.run(lambda: async_session.resume(reconciler=settle_async))


def httpx2_clients(journal: str) -> None:
    """httpx2 clients take the transports and are taken by the sessions (openai 3.x's library)."""
    import httpx2

    httpx2.Client(transport=idempotently.Transport(journal))
    httpx2.AsyncClient(transport=idempotently.AsyncTransport(journal))
    idempotently.Session(journal, client=httpx2.Client())
    idempotently.AsyncSession(journal, client=httpx2.AsyncClient())


def hooks() -> None:
    def hook(event: idempotently.Event) -> None:
        if isinstance(event, idempotently.RetryScheduled):
            assert_type(event.wait, float)
        print(event.wait)  # type: ignore[union-attr]  # only a RetryScheduled has a wait

    async def async_hook(event: idempotently.Event) -> None:
        assert_type(event.operation_id, str)

    idempotently.Session("ops.db", hooks=[hook])
    idempotently.AsyncSession("ops.db", hooks=[hook, async_hook])
    idempotently.Transport("ops.db", hooks=(hook,))
    idempotently.AsyncTransport("ops.db", hooks=[async_hook])
    idempotently.Session("ops.db", hooks=hook)  # type: ignore[arg-type]


def retry_control(session: idempotently.Session, journal: idempotently.Journal) -> None:
    """The retry budget, origin pauses, per-call overrides, classifiers and reads."""
    policy = idempotently.RetryPolicy(budget=idempotently.RetryBudget(ratio=0.2))
    idempotently.RetryPolicy(budget=None)
    session.post("/v1/charges", json={}, policy=policy, profile=profiles.STRIPE, timeout=5.0)
    session.post("/v1/charges", policy="fast")  # type: ignore[arg-type]
    idempotently.Transport("ops.db", retry_idempotent_methods=True)
    for pause in journal.origin_pauses():
        assert_type(pause.until, float)
    assert_type(journal.unpause("https://api.example.com"), list[idempotently.OriginPause])

    def classify(status: int, headers: httpx.Headers, body: bytes) -> str | None:
        return "retry" if status == 200 and b"again" in body else None

    idempotently.ServerProfile(name="says-again", classify=classify)

    def refused(event: idempotently.Event) -> None:
        if isinstance(event, idempotently.RetryRefused):
            assert_type(event.origin, str)

    idempotently.Session("ops.db", hooks=[refused])
    try:
        session.post("/v1/charges")
    except idempotently.RetryBudgetError as error:
        assert_type(error.origin, str)


class ReversingCodec:
    """A user's own codec: any class with a name and bytes in, bytes out."""

    name = "reversed"

    def encode(self, data: bytes) -> bytes:
        return data[::-1]

    def decode(self, data: bytes) -> bytes:
        return data[::-1]


def data_at_rest(key: bytes) -> None:
    fernet: idempotently.Codec = idempotently.FernetCodec(key)
    own: idempotently.Codec = ReversingCodec()
    idempotently.Journal("ops.db", codec=fernet, redact_query=["session_key"])
    idempotently.Journal("ops.db", codec=own)
    idempotently.Journal("ops.db", codec="fernet")  # type: ignore[arg-type]
    idempotently.FernetCodec([key, key], name="fernet-2026")
    profile = profiles.GENERIC
    assert_type(profile.key_bound_to_credentials, bool)
    operation = idempotently.Journal("ops.db").operation("op")
    if operation is not None:
        assert_type(operation.unreadable, str | None)
