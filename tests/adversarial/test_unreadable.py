"""Answers httpx cannot finish reading, and whatever else happens after the request left.

Every attempt whose request was sent is journaled, whatever happens while
reading the answer (an undecodable body, a redirect loop, a broken frame, a
user's response hook that raises); the caller gets an ``IdempotentlyError``
carrying the operation id and key, with the original error as its cause.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

import idempotently
from tests.adversarial.invariants import assert_sound, cli_run
from tests.adversarial.wire import DEFLATE_GARBAGE, GZIP_GARBAGE, OK, RESET, Wire, reply

ONE_TRY = idempotently.RetryPolicy(max_attempts=1)
CHARGE = {"amount": 1000}
LOOP = reply(307, [(b"Location", b"/v1/charges")], b"")
UNDECODABLE = {"gzip": GZIP_GARBAGE, "deflate": DEFLATE_GARBAGE}


def call_session(journal: Path, url: str, **options: Any) -> httpx.Response:
    options.setdefault("policy", ONE_TRY)
    with idempotently.Session(journal, **options) as session:
        return session.post(url, json=CHARGE, operation_id="op")


def call_transport(journal: Path, url: str, **options: Any) -> httpx.Response:
    client_options = {k: options.pop(k) for k in ("follow_redirects",) if k in options}
    transport = idempotently.Transport(journal, policy=ONE_TRY, **options)
    with httpx.Client(transport=transport, **client_options) as client:
        return client.post(url, json=CHARGE, headers={"Idempotency-Operation-Id": "op"})


async def call_async_session(journal: Path, url: str, **options: Any) -> httpx.Response:
    options.setdefault("policy", ONE_TRY)
    async with idempotently.AsyncSession(journal, **options) as session:
        return await session.post(url, json=CHARGE, operation_id="op")


async def call_async_transport(journal: Path, url: str, **options: Any) -> httpx.Response:
    client_options = {k: options.pop(k) for k in ("follow_redirects",) if k in options}
    transport = idempotently.AsyncTransport(journal, policy=ONE_TRY, **options)
    async with httpx.AsyncClient(transport=transport, **client_options) as client:
        return await client.post(url, json=CHARGE, headers={"Idempotency-Operation-Id": "op"})


SYNC: dict[str, Callable[..., httpx.Response]] = {
    "Session": call_session,
    "Transport": call_transport,
}
ASYNC: dict[str, Callable[..., Awaitable[httpx.Response]]] = {
    "AsyncSession": call_async_session,
    "AsyncTransport": call_async_transport,
}


def assert_journaled_once(
    journal: Path, error: BaseException, cause: type[BaseException], wire: Wire
) -> None:
    """One send, one journaled attempt naming the error; the caller's error names the
    operation and its key, with the httpx error as its cause."""
    assert isinstance(error, idempotently.IdempotentlyError), repr(error)
    assert isinstance(error.__cause__, cause), repr(error.__cause__)
    with idempotently.Journal(journal, create=False) as opened:
        operation = opened.operation("op")
    assert operation is not None
    assert ("op", operation.key) == (error.operation_id, error.key)
    assert ["maybe_delivered"] == [attempt.outcome for attempt in operation.attempts]
    assert cause.__name__ in (operation.attempts[0].error or "")
    assert "pending" == operation.status
    assert [operation.key.encode()] == wire.keys()
    assert_sound(journal, operations=["op"])


# -- undecodable bodies ------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", UNDECODABLE)
@pytest.mark.parametrize("driver", SYNC)
def test_an_undecodable_answer_is_journaled_and_raised_with_its_ids(
    journal: Path, wire: Wire, driver: str, encoding: str
) -> None:
    """A body httpx cannot decode is an attempt journaled as maybe delivered, and an
    IdempotentlyError with the operation id, key and the DecodingError as cause."""
    wire.answer(UNDECODABLE[encoding])
    with pytest.raises(idempotently.IdempotentlyError) as caught:
        SYNC[driver](journal, f"{wire.url}/v1/charges")
    assert_journaled_once(journal, caught.value, httpx.DecodingError, wire)


@pytest.mark.anyio
@pytest.mark.parametrize("encoding", UNDECODABLE)
@pytest.mark.parametrize("driver", ASYNC)
async def test_an_undecodable_answer_is_journaled_by_async_drivers_too(
    journal: Path, wire: Wire, driver: str, encoding: str, anyio_backend: str
) -> None:
    """The async drivers journal an undecodable answer the same way, on asyncio and trio."""
    wire.answer(UNDECODABLE[encoding])
    with pytest.raises(idempotently.IdempotentlyError) as caught:
        await ASYNC[driver](journal, f"{wire.url}/v1/charges")
    assert_journaled_once(journal, caught.value, httpx.DecodingError, wire)


@pytest.mark.parametrize("encoding", UNDECODABLE)
def test_an_undecodable_answer_is_not_asked_again_within_the_call(
    journal: Path, wire: Wire, encoding: str
) -> None:
    """Resending would meet the same unreadable answer: the call stops after one send and
    leaves the operation pending, whatever retries the policy allows."""
    wire.default = UNDECODABLE[encoding]
    policy = idempotently.RetryPolicy(max_attempts=4, initial_backoff=0, max_backoff=0)
    with pytest.raises(idempotently.OperationPendingError):
        call_session(journal, f"{wire.url}/v1/charges", policy=policy)
    assert 1 == len(wire.arrivals)
    assert_sound(journal, operations=["op"])


# -- redirect loops ----------------------------------------------------------------------------


def test_a_redirect_loop_is_journaled_and_raised_with_its_ids(journal: Path, wire: Wire) -> None:
    """With follow_redirects=True, a 307 loop ends as a journaled attempt and an
    IdempotentlyError whose cause is TooManyRedirects; every hop carried the same key
    and body."""
    wire.default = LOOP
    with pytest.raises(idempotently.IdempotentlyError) as caught:
        call_session(journal, f"{wire.url}/v1/charges", follow_redirects=True)
    error = caught.value
    assert isinstance(error.__cause__, httpx.TooManyRedirects)
    assert 1 == len({(arrival.key, arrival.body) for arrival in wire.arrivals})
    with idempotently.Journal(journal, create=False) as opened:
        operation = opened.operation("op")
    assert operation is not None and ("op", operation.key) == (error.operation_id, error.key)
    assert ["maybe_delivered"] == [attempt.outcome for attempt in operation.attempts]
    assert_sound(journal, operations=["op"])


@pytest.mark.anyio
async def test_a_redirect_loop_is_journaled_by_async_session(
    journal: Path, wire: Wire, anyio_backend: str
) -> None:
    """AsyncSession journals a redirect loop as Session does, on asyncio and trio."""
    wire.default = LOOP
    with pytest.raises(idempotently.IdempotentlyError) as caught:
        await call_async_session(journal, f"{wire.url}/v1/charges", follow_redirects=True)
    assert isinstance(caught.value.__cause__, httpx.TooManyRedirects)
    assert_sound(journal, operations=["op"])


def test_a_redirect_loop_above_a_transport_sends_once_and_journals_it(
    journal: Path, wire: Wire
) -> None:
    """Behind a Transport, the client follows the loop above the journal: the write is
    sent once and journaled; each hop after it is answered from the journal."""
    wire.default = LOOP
    with pytest.raises(httpx.TooManyRedirects):
        call_transport(journal, f"{wire.url}/v1/charges", follow_redirects=True)
    assert 1 == len(wire.arrivals)
    operations = assert_sound(journal, operations=["op"])
    assert 1 == operations[0].attempt_count


# -- broken frames: sent, then the answer cannot be parsed -------------------------------------

BROKEN = {
    "body-shorter-than-length": reply(
        200, [(b"Content-Length", b"100"), (b"Connection", b"close")], b"short"
    ),
    "bad-chunk-size": reply(
        200, [(b"Transfer-Encoding", b"chunked")], b"zz\r\nabc\r\n0\r\n\r\n", content_length=False
    ),
    "garbage-status-line": b"HTTP/1.1 abc OK\r\n\r\n",
    "not-http": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "header-without-colon": b"HTTP/1.1 201 Created\r\nno colon here\r\nContent-Length: 0\r\n\r\n",
    "huge-header": reply(201, [(b"X-Pad", b"a" * 200_000)]),
}


@pytest.mark.parametrize("answer", BROKEN)
@pytest.mark.parametrize("driver", SYNC)
def test_a_broken_answer_is_journaled_and_retried_with_the_same_key(
    journal: Path, wire: Wire, driver: str, answer: str
) -> None:
    """An answer that breaks HTTP framing after the request was sent is a maybe-delivered
    attempt: journaled, then retried with the same key and bytes until a real answer."""
    wire.answer(BROKEN[answer], OK)
    policy = idempotently.RetryPolicy(max_attempts=2, initial_backoff=0, max_backoff=0)
    if driver == "Session":
        with idempotently.Session(journal, policy=policy) as session:
            response = session.post(f"{wire.url}/v1/charges", json=CHARGE, operation_id="op")
    else:
        transport = idempotently.Transport(journal, policy=policy)
        with httpx.Client(transport=transport) as client:
            response = client.post(
                f"{wire.url}/v1/charges", json=CHARGE, headers={"Idempotency-Operation-Id": "op"}
            )
    assert 201 == response.status_code
    assert 2 == len(wire.arrivals)
    assert 1 == len({arrival.identity for arrival in wire.arrivals})
    operations = assert_sound(journal, operations=["op"])
    with idempotently.Journal(journal, create=False) as opened:
        operation = opened.operation(operations[0].operation_id)
    assert operation is not None
    assert ["maybe_delivered", "answered"] == [attempt.outcome for attempt in operation.attempts]


# -- a user's response hook --------------------------------------------------------------------


def exploding_hook(response: httpx.Response) -> None:
    raise RuntimeError("the response hook failed")


def test_a_raising_response_hook_still_journals_the_attempt(journal: Path, wire: Wire) -> None:
    """A response hook raising after the send leaves a journaled attempt and an
    IdempotentlyError with the operation id and key, the hook's error as cause."""
    with pytest.raises(idempotently.IdempotentlyError) as caught:
        call_session(journal, f"{wire.url}/v1/charges", event_hooks={"response": [exploding_hook]})
    assert_journaled_once(journal, caught.value, RuntimeError, wire)


@pytest.mark.anyio
async def test_a_raising_async_response_hook_still_journals_the_attempt(
    journal: Path, wire: Wire, anyio_backend: str
) -> None:
    """AsyncSession journals the attempt when an async response hook raises."""

    async def hook(response: httpx.Response) -> None:
        raise RuntimeError("the response hook failed")

    with pytest.raises(idempotently.IdempotentlyError) as caught:
        await call_async_session(
            journal, f"{wire.url}/v1/charges", event_hooks={"response": [hook]}
        )
    assert_journaled_once(journal, caught.value, RuntimeError, wire)


def test_raise_for_status_in_a_hook_never_retries_a_final_4xx(journal: Path, wire: Wire) -> None:
    """A hook that raises for a 422 does not make the 422 retryable: one send only."""
    wire.default = reply(422, body=b'{"error": "amount must be positive"}')

    def raise_for_status(response: httpx.Response) -> None:
        response.raise_for_status()

    with pytest.raises((idempotently.IdempotentlyError, httpx.HTTPStatusError)):
        call_session(
            journal,
            f"{wire.url}/v1/charges",
            event_hooks={"response": [raise_for_status]},
            policy=idempotently.RetryPolicy(max_attempts=2, initial_backoff=0, max_backoff=0),
        )
    assert 1 == len(wire.arrivals)
    assert_sound(journal, operations=["op"])


def test_a_raising_response_hook_does_not_stop_resume_for_the_others(
    journal: Path, wire: Wire
) -> None:
    """resume journals the failed operation's attempt and goes on with the next ones."""
    wire.answer(RESET, RESET)
    with idempotently.Session(journal, policy=ONE_TRY) as session:
        for operation_id in ("first", "second"):
            with pytest.raises(idempotently.OperationPendingError):
                session.post(f"{wire.url}/v1/charges", json=CHARGE, operation_id=operation_id)
    calls = iter([True, False])

    def hook_failing_once(response: httpx.Response) -> None:
        if next(calls):
            raise RuntimeError("the response hook failed")

    with idempotently.Session(journal, event_hooks={"response": [hook_failing_once]}) as session:
        results = session.resume()
    assert ["first", "second"] == [result.operation_id for result in results]
    assert "succeeded" == results[1].status
    operations = {o.operation_id: o for o in assert_sound(journal, operations=["first", "second"])}
    assert 2 == operations["first"].attempt_count


# -- poisoned rows: one never stops a resume or a watch worker ---------------------------------

HUGE = "1" + "0" * 400
"""10**400 as JSON: an int no float holds (what an unchecked timeout=10**400 journaled)."""
PHASES = ("connect", "pool", "read", "write")


def every_phase(value: str) -> str:
    """Journaled overrides whose every timeout phase is ``value``."""
    return '{"timeout":{' + ",".join(f'"{phase}":{value}' for phase in PHASES) + "}}"


POISONS = {
    "timeout-1e999": ("overrides", every_phase("1e999")),
    "timeout-10**400": ("overrides", every_phase(HUGE)),
    "timeout-nan": ("overrides", every_phase("NaN")),
    "deadline-10**400": ("overrides", '{"policy":{"deadline":' + HUGE + "}}"),
    "backoff-nan": ("overrides", '{"policy":{"initial_backoff":NaN}}'),
    "overrides-not-json": ("overrides", '{"policy": {'),
    "profile-not-json": ("profile", '{"name": "custom", '),
    "credentials-digest-garbage": ("credentials_digest", "not a digest"),
    "url-unparseable": ("url", "http://[::1"),
    "method-empty": ("method", ""),
}
"""What a damaged row, another version or an unchecked argument left: (column, text)."""
UNDECODABLE_ROWS = {
    "request-headers-not-json": ("request_headers", "not json"),
    "request-headers-not-pairs": ("request_headers", '{"Accept": "*/*"}'),
    "secret-params-not-json": ("secret_params", "not json"),
    "secret-params-not-a-list": ("secret_params", '{"api_key": 1}'),
}
"""Values the store itself refuses to decode when it reads the row (what a read of that
one operation raises as `JournalCorruptError`): a listing reads it as damaged instead."""
EVERY_POISON = POISONS | UNDECODABLE_ROWS


def poison(target: str, operation_id: str, column: str, text: str) -> None:
    """Write ``text`` into one column of one row, past every check of the library."""
    if target.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(target) as pg:
            pg.execute(
                f"UPDATE idempotently.operations SET {column} = %s WHERE operation_id = %s",
                (text, operation_id),
            )
        return
    conn = sqlite3.connect(target)
    with conn:
        conn.execute(
            f"UPDATE operations SET {column} = ? WHERE operation_id = ?", (text, operation_id)
        )
    conn.close()


def poisoned_journal(target: str, wire: Wire, case: str) -> None:
    """Three pending operations (their answers lost), the middle one poisoned."""
    wire.answer(RESET, RESET, RESET)
    with idempotently.Session(target, policy=ONE_TRY) as session:
        for operation_id in ("first", "poisoned", "last"):
            with pytest.raises(idempotently.OperationPendingError):
                session.post(f"{wire.url}/v1/charges", json=CHARGE, operation_id=operation_id)
    poison(target, "poisoned", *EVERY_POISON[case])


def assert_the_others_went_on(target: str, wire: Wire, results: list[Any]) -> None:
    """first and last succeeded with their keys; poisoned was not sent, stays pending and
    is reported with its id, its key and what is wrong."""
    by_id = {result.operation_id: result for result in results}
    assert ("succeeded", "succeeded") == (by_id["first"].status, by_id["last"].status)
    bad = by_id["poisoned"]
    assert ("pending", "not_sent") == (bad.status, bad.action)
    assert "nothing was sent" in bad.detail or "cannot be sent" in bad.detail
    with idempotently.Journal(target, create=False) as opened:
        operations = {o.operation_id: o for o in opened.operations()}
    assert bad.key == operations["poisoned"].key
    assert "pending" == operations["poisoned"].status
    sent_keys = wire.keys()[3:]
    assert sorted([operations["first"].key.encode(), operations["last"].key.encode()]) == sorted(
        key for key in sent_keys if key is not None
    )


@pytest.mark.parametrize("case", EVERY_POISON)
@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_poisoned_row_never_stops_session_resume(
    journal_target: str, wire: Wire, case: str
) -> None:
    """Session.resume reports the poisoned operation (not sent, pending, what is wrong)
    and sends the ones after it. SQLite and PostgreSQL."""
    poisoned_journal(journal_target, wire, case)
    with idempotently.Session(journal_target) as session:
        results = session.resume()
    assert_the_others_went_on(journal_target, wire, results)


@pytest.mark.parametrize("case", POISONS)
def test_a_poisoned_row_never_stops_an_audit(journal: Path, wire: Wire, case: str) -> None:
    """list, show, stats and the Journal's reads go through a journal holding a poisoned
    row, before and after a resume, and name every operation."""
    poisoned_journal(str(journal), wire, case)
    assert_sound(journal, operations=["first", "poisoned", "last"])
    with idempotently.Session(journal) as session:
        session.resume()
    assert_sound(journal, operations=["first", "poisoned", "last"])


@pytest.mark.parametrize("case", EVERY_POISON)
def test_a_poisoned_row_never_stops_a_concurrent_resume(
    journal: Path, wire: Wire, case: str
) -> None:
    """With concurrency, each operation in its own flow: the same."""
    poisoned_journal(str(journal), wire, case)
    with idempotently.Session(journal) as session:
        results = session.resume(concurrency=3)
    assert_the_others_went_on(str(journal), wire, results)


@pytest.mark.anyio
@pytest.mark.parametrize("case", ["timeout-10**400", "deadline-10**400", "url-unparseable"])
@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_a_poisoned_row_never_stops_async_session_resume(
    journal_target: str, wire: Wire, case: str, anyio_backend: str
) -> None:
    """AsyncSession.resume, on asyncio and trio, SQLite and PostgreSQL: the same."""
    poisoned_journal(journal_target, wire, case)
    async with idempotently.AsyncSession(journal_target) as session:
        results = await session.resume()
    assert_the_others_went_on(journal_target, wire, results)


@pytest.mark.parametrize("case", EVERY_POISON)
@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_poisoned_row_never_stops_the_resume_command(
    journal_target: str, wire: Wire, case: str
) -> None:
    """`idempotently resume --json` sends the others, reports the poisoned one and exits 1."""
    poisoned_journal(journal_target, wire, case)
    code, output = cli_run(journal_target, "resume", "--json")  # type: ignore[arg-type]
    assert 1 == code
    printed = json.loads(output[: output.rindex("]") + 1])
    assert_the_others_went_on(
        journal_target, wire, [idempotently.ResumeResult(**row) for row in printed]
    )


@pytest.mark.parametrize("case", ["timeout-10**400", "url-unparseable", "request-headers-not-json"])
@pytest.mark.parametrize("store", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_poisoned_row_never_stops_a_watch_worker(
    tmp_path: Path, journal_target: str, wire: Wire, case: str
) -> None:
    """`resume --watch`, a real process: the poisoned operation enqueued first is
    reported (not sent, what is wrong), the good one enqueued after it is sent, and the
    worker stays up until it is stopped."""
    from tests.test_fleet import WatchWorker

    with idempotently.Session(journal_target) as session:
        for operation_id in ("poisoned", "good"):
            session.enqueue(
                "POST", f"{wire.url}/v1/charges", json=CHARGE, operation_id=operation_id
            )
    poison(journal_target, "poisoned", *EVERY_POISON[case])
    worker = WatchWorker(tmp_path, journal_target, "host-a")
    try:
        seen: dict[str, dict[str, Any]] = {}

        def both_reported(event: dict[str, Any]) -> bool:
            if event.get("event") == "operation":
                seen.setdefault(event["operation_id"], event)
            return {"poisoned", "good"} <= set(seen)

        worker.wait_for(both_reported)
        assert None is worker.proc.poll(), worker.diagnosis()
        assert ("succeeded", "pending", "not_sent") == (
            seen["good"]["status"],
            seen["poisoned"]["status"],
            seen["poisoned"]["action"],
        )
        assert "nothing was sent" in seen["poisoned"]["detail"]
        with idempotently.Journal(journal_target, create=False) as opened:
            good = opened.operation("good")
        assert good is not None and [good.key.encode()] == wire.keys()
        assert 0 == worker.stop(), worker.diagnosis()
    finally:
        worker.close()


# -- rows the store itself cannot decode: listed as damaged, never a stop -------------------

STORES = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def audit_commands(target: str) -> dict[tuple[str, ...], tuple[int, str]]:
    """Exit code and output of the read-only commands, `show` of each operation included."""
    commands = [("list",), ("list", "--json"), ("stats",), ("stats", "--json")]
    commands += [("show", operation_id) for operation_id in ("first", "poisoned", "last")]
    return {args: cli_run(target, *args) for args in commands}  # type: ignore[arg-type]


@pytest.mark.parametrize("case", UNDECODABLE_ROWS)
@pytest.mark.parametrize("store", STORES)
def test_a_row_the_store_cannot_decode_never_stops_an_audit(
    journal_target: str, wire: Wire, case: str
) -> None:
    """list, stats and `show` of the other operations work on a journal holding a row the
    store cannot decode; list names that row (id, key, what is wrong) and `show` of it
    says what is wrong, exit 1. SQLite and PostgreSQL."""
    poisoned_journal(journal_target, wire, case)
    with idempotently.Journal(journal_target, create=False) as opened:
        listed = {o.operation_id: o for o in opened.operations()}
        poisoned = listed["poisoned"]
    column = UNDECODABLE_ROWS[case][0]
    assert (None, None) == (listed["first"].damaged, listed["last"].damaged)
    assert poisoned.damaged is not None and column in poisoned.damaged
    outputs = audit_commands(journal_target)
    expected = {args: 0 for args in outputs} | {("show", "poisoned"): 1}
    assert expected == {args: code for args, (code, _) in outputs.items()}
    for args in (("list",), ("list", "--json"), ("show", "poisoned")):
        assert column in outputs[args][1], (args, outputs[args][1])
    assert f"'poisoned' (key {poisoned.key!r}) cannot be read" in outputs[("list",)][1]
    listed_json = outputs[("list", "--json")][1]  # stdout, then the note on stderr
    assert {"first", "poisoned", "last"} == {
        row["operation_id"] for row in json.loads(listed_json[: listed_json.index("\n]") + 2])
    }


@pytest.mark.anyio
@pytest.mark.parametrize("case", ["request-headers-not-json", "secret-params-not-a-list"])
@pytest.mark.parametrize("store", STORES)
async def test_a_row_the_store_cannot_decode_never_stops_async_session_resume(
    journal_target: str, wire: Wire, case: str, anyio_backend: str
) -> None:
    """AsyncSession.resume, on asyncio and trio, SQLite and PostgreSQL: the row the store
    cannot decode is reported (not sent, pending, its key), the others are sent."""
    poisoned_journal(journal_target, wire, case)
    async with idempotently.AsyncSession(journal_target) as session:
        results = await session.resume()
    assert_the_others_went_on(journal_target, wire, results)
    by_id = {result.operation_id: result for result in results}
    assert "idempotently show poisoned" in by_id["poisoned"].detail


@pytest.mark.parametrize("case", ["request-headers-not-json", "secret-params-not-a-list"])
@pytest.mark.parametrize("store", STORES)
def test_a_row_the_store_cannot_decode_is_reported_by_a_dry_run(
    journal_target: str, wire: Wire, case: str
) -> None:
    """`resume --dry-run` plans the others and reports the damaged row; nothing is sent."""
    poisoned_journal(journal_target, wire, case)
    code, output = cli_run(journal_target, "resume", "--dry-run", "--json")  # type: ignore[arg-type]
    planned = {row["operation_id"]: row for row in json.loads(output[: output.rindex("]") + 1])}
    assert "not_sent" == planned["poisoned"]["action"], code
    assert ("would_send", "would_send") == (planned["first"]["action"], planned["last"]["action"])
    assert 3 == len(wire.arrivals)


@pytest.mark.parametrize("case", ["request-headers-not-json", "secret-params-not-a-list"])
@pytest.mark.parametrize("store", STORES)
def test_a_row_the_store_cannot_decode_can_be_settled_or_abandoned(
    journal_target: str, wire: Wire, case: str
) -> None:
    """What a resume's report says to do works on the damaged row: `idempotently abandon`
    (or settle) records it, and the next resume no longer reports it; a fork or retry of
    it is refused, nothing written (its request cannot be read)."""
    poisoned_journal(journal_target, wire, case)
    with idempotently.Journal(journal_target, create=False) as opened:
        with pytest.raises(idempotently.OperatorActionError, match="cannot be read") as refused:
            opened.retry_now("poisoned", note="try again")
        assert ("poisoned", "pending") == (
            refused.value.operation_id,
            opened.operation("poisoned", damaged=True).status,  # type: ignore[union-attr]
        )
    code, output = cli_run(journal_target, "abandon", "poisoned", "--note", "checked")  # type: ignore[arg-type]
    assert (0, "poisoned: pending -> abandoned") == (code, output.strip())
    code, output = cli_run(journal_target, "resume", "--json")  # type: ignore[arg-type]
    printed = json.loads(output[: output.index("\n]") + 2])
    assert (0, ["first", "last"]) == (code, sorted(row["operation_id"] for row in printed))
    with idempotently.Journal(journal_target, create=False) as opened:
        abandoned = opened.operation("poisoned", damaged=True)
        assert abandoned is not None and "abandoned" == abandoned.status
        assert "checked" == opened.audit("poisoned")[-1].note
    assert 5 == len(wire.arrivals)


@pytest.mark.parametrize("store", STORES)
def test_a_watch_worker_reports_a_row_it_cannot_decode_once(
    tmp_path: Path, journal_target: str, wire: Wire
) -> None:
    """`resume --watch`, a real process: a row the store cannot decode is reported once,
    not each time the worker claims it again (its lease ran out); an operation enqueued
    after that is sent, and SIGTERM stops the worker with exit 0."""
    from tests.test_fleet import WatchWorker

    with idempotently.Session(journal_target) as session:
        session.enqueue("POST", f"{wire.url}/v1/charges", json=CHARGE, operation_id="poisoned")
    poison(journal_target, "poisoned", *UNDECODABLE_ROWS["request-headers-not-json"])
    worker = WatchWorker(tmp_path, journal_target, "host-a", lease="1s")
    try:
        reports: list[dict[str, Any]] = []

        def reported(operation_id: str) -> Callable[[dict[str, Any]], bool]:
            def test(event: dict[str, Any]) -> bool:
                if event.get("event") == "operation":
                    reports.append(event)
                return any(report["operation_id"] == operation_id for report in reports)

            return test

        worker.wait_for(reported("poisoned"))
        first_lease = lease_of(journal_target, "poisoned")
        claimed_again = wait_until(lambda: lease_of(journal_target, "poisoned") > first_lease)
        assert claimed_again, worker.diagnosis()
        with idempotently.Session(journal_target) as session:
            session.enqueue("POST", f"{wire.url}/v1/charges", json=CHARGE, operation_id="later")
        worker.wait_for(reported("later"))
        assert None is worker.proc.poll(), worker.diagnosis()
        assert ["poisoned", "later"] == [report["operation_id"] for report in reports]
        assert "succeeded" == reports[1]["status"]
        assert 0 == worker.stop(), worker.diagnosis()
    finally:
        worker.close()


def lease_of(target: str, operation_id: str) -> float:
    """The lease on an operation as a listing reads it (a damaged row's too)."""
    with idempotently.Journal(target, create=False) as opened:
        (operation,) = [o for o in opened.operations() if o.operation_id == operation_id]
    return operation.lease_until


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


# -- a codec failing on one server's answer during a resume: that operation only ----------


class FailsOnMarkedAnswers:
    """Encodes every body but an answer holding ``unencodable`` (a codec bug on one answer)."""

    name = "fails-on-marked-answers"

    def encode(self, data: bytes) -> bytes:
        if b"unencodable" in data:
            raise RuntimeError("cannot encode this answer")
        return data[::-1]

    def decode(self, data: bytes) -> bytes:
        return data[::-1]


CODEC = FailsOnMarkedAnswers()
UNENCODABLE = reply(body=b'{"id": "ch_2", "unencodable": true}')


def pending_through_the_codec(target: str, wire: Wire) -> None:
    """first, middle and last pending (answers lost), journaled through `CODEC`; the resume
    that follows gets OK, an answer the codec fails on, OK."""
    wire.answer(RESET, RESET, RESET)
    with idempotently.Session(idempotently.Journal(target, codec=CODEC), policy=ONE_TRY) as session:
        for operation_id in ("first", "middle", "last"):
            with pytest.raises(idempotently.OperationPendingError):
                session.post(f"{wire.url}/v1/charges", json=CHARGE, operation_id=operation_id)
    wire.answer(OK, UNENCODABLE, OK)


def assert_only_the_middle_one_stays(target: str, wire: Wire, results: list[Any]) -> None:
    """first and last succeeded; middle was sent with its key and stays pending, its
    attempt maybe delivered, reported as such with its key: never a stopped resume."""
    by_id = {result.operation_id: result for result in results}
    assert ["first", "middle", "last"] == [result.operation_id for result in results]
    assert ("succeeded", "succeeded") == (by_id["first"].status, by_id["last"].status)
    middle = by_id["middle"]
    assert ("pending", "still_pending") == (middle.status, middle.action)
    assert "may have been delivered" in middle.detail and "CodecError" in middle.detail
    with idempotently.Journal(target, create=False, codec=CODEC) as opened:
        stored = opened.operation("middle")
    assert stored is not None and middle.key == stored.key
    assert "pending" == stored.status
    assert "maybe_delivered" == stored.attempts[-1].outcome
    assert 2 == wire.keys().count(stored.key.encode())
    assert 6 == len(wire.arrivals)


@pytest.mark.parametrize("store", STORES)
def test_a_codec_failing_on_one_answer_never_stops_session_resume(
    journal_target: str, wire: Wire
) -> None:
    """Session.resume reports the operation whose answer the codec failed on (sent, may
    have been delivered, pending with its key) and resumes the others. SQLite and
    PostgreSQL."""
    pending_through_the_codec(journal_target, wire)
    with idempotently.Session(idempotently.Journal(journal_target, codec=CODEC)) as session:
        results = session.resume()
    assert_only_the_middle_one_stays(journal_target, wire, results)


@pytest.mark.parametrize("store", STORES)
def test_a_codec_failing_on_one_answer_never_stops_the_resume_command(
    journal_target: str, wire: Wire
) -> None:
    """`idempotently resume --codec`: the same, and exit 1."""
    pending_through_the_codec(journal_target, wire)
    code, output = cli_run(
        journal_target,  # type: ignore[arg-type]
        "resume",
        "--json",
        "--codec",
        "tests.adversarial.test_unreadable:CODEC",
    )
    assert 1 == code, output
    printed = json.loads(output[: output.index("\n]") + 2])
    assert_only_the_middle_one_stays(
        journal_target, wire, [idempotently.ResumeResult(**row) for row in printed]
    )
