"""The child process of `crash_points`: runs the scenario, and dies where it is told.

Run as ``python -m idempotently.testing._crash_child INSTRUCTIONS`` (JSON). It
writes one JSON line per event to the file descriptor the instructions name,
never to stdout or stderr (those are the scenario's, and go to a log file).

The seams are installed in this process only, around two places every journaled
call passes: the session's journal's commit of each batch of writes (its public
observer, `Journal.observe_commits`: SQLite and PostgreSQL alike) and the HTTP
transports' send (httpx, and httpx2 when installed).
Operations are numbered in the order their keys are first written, so that a
scenario whose ids are made fresh each run is still aimed at by position.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from idempotently._commands import Enqueue, Insert, Record
from idempotently.testing._crash_points import CRASH_STEPS

# The steps, in the order an operation meets them (`CRASH_STEPS`).
(
    BEFORE_KEY_COMMIT,
    AFTER_KEY_COMMIT,
    AFTER_REQUEST_SENT,
    AFTER_ANSWER_ARRIVED,
    BEFORE_ANSWER_RECORDED,
) = CRASH_STEPS

DEFAULT_TOKEN = "user_1"
PARENT_CHECK = 0.2
"""Seconds between two looks at whether the harness's process is still there."""
THREAD_GRACE = 2.0
"""Seconds the threads still running when the scenario returned are given to end."""
# The name a scenario defined in a script (its ``__main__``) is loaded under.
SCRIPT_MODULE = "_idempotently_crash_scenario"


class Events:
    """One JSON line per event on the parent's pipe; safe from any thread."""

    def __init__(self, fd: int) -> None:
        self._file = os.fdopen(fd, "w", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()
        self._pid = os.getpid()
        # A process the scenario forks must not hold the parent's pipe open (the
        # parent would wait for its end) nor speak on it.
        os.register_at_fork(after_in_child=self._let_go)

    def _let_go(self) -> None:
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._file.fileno())
            os.close(devnull)

    def emit(self, event: str, **fields: Any) -> None:
        if os.getpid() != self._pid:
            return
        line = json.dumps({"event": event, **fields}, default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()


class Tracker:
    """Which operation is which, which steps each has met, and where to die."""

    def __init__(self, events: Events, kill: dict[str, Any] | None) -> None:
        self._events = events
        self._kill = (int(kill["operation"]), str(kill["step"])) if kill else None
        # Aimed at by id when the clean run's id recurs (threads, a task group, a
        # query without ORDER BY may journal them in another order); by position
        # when this run's ids are new ones (made fresh each run).
        self._aimed_id = str(kill["operation_id"]) if kill and "operation_id" in kill else None
        self._clean_ids = frozenset(map(str, kill.get("operations", ()))) if kill else frozenset()
        self._target: int | None = None
        self._lock = threading.RLock()
        self._index_by_id: dict[str, int] = {}
        self._id_by_index: dict[int, str] = {}
        self._index_by_key: dict[str, int] = {}
        self._key_headers: set[str] = set()
        self._meetings: collections.Counter[tuple[int, str]] = collections.Counter()
        # Which meeting of the step to die at: the clean run's last (a retry's, when the
        # first attempt was answered 503 and the second charged).
        self._meeting = int(kill.get("meeting", 1)) if kill else 1

    def new_key(self, operation_id: str, key: str, key_header: str) -> int:
        with self._lock:
            index = self._index_by_id.get(operation_id)
            if index is None:
                index = len(self._index_by_id)
                self._index_by_id[operation_id] = index
                self._id_by_index[index] = operation_id
                self._choose_target(index, operation_id)
                self._events.emit("operation", index=index, operation_id=operation_id)
            self._index_by_key[key] = index
            self._key_headers.add(key_header.lower())
            return index

    def index_of(self, operation_id: str) -> int | None:
        with self._lock:
            return self._index_by_id.get(operation_id)

    def index_of_request(self, headers: Any) -> tuple[int, str] | None:
        with self._lock:
            for name in self._key_headers:
                key = headers.get(name)
                if key is not None and key in self._index_by_key:
                    return self._index_by_key[key], key
            return None

    def _choose_target(self, index: int, operation_id: str) -> None:
        if self._kill is None or self._target is not None:
            return
        if self._aimed_id is None:
            if index == self._kill[0]:
                self._target = index
        elif operation_id == self._aimed_id or (
            operation_id not in self._clean_ids and index == self._kill[0]
        ):
            self._target = index

    def aimed_at(self, index: int, step: str) -> bool:
        """Meeting this step of this operation once more is the meeting to die at."""
        with self._lock:
            return (
                self._kill is not None
                and self._target == index
                and self._kill[1] == step
                and self._meetings[index, step] + 1 == self._meeting
            )

    def reach(self, index: int, step: str) -> None:
        """Note the step; die here when this meeting of it is the one aimed at."""
        if self.note(index, step):
            self.die(index, step)

    def note(self, index: int, step: str) -> bool:
        """Note the step (and how many times it was met): True when it is the one aimed at."""
        with self._lock:
            aimed = self.aimed_at(index, step)
            self._meetings[index, step] += 1
            self._events.emit("step", index=index, step=step, meeting=self._meetings[index, step])
            return aimed

    def sent(self, index: int, key: str) -> None:
        """The aimed-at request is on the wire: the parent kills once the server answered."""
        with self._lock:
            meeting = self._meetings[index, AFTER_REQUEST_SENT]
        self._events.emit(
            "sent",
            index=index,
            key=key,
            operation_id=self.operation_id(index),
            pid=os.getpid(),
            meeting=meeting,
        )

    def operation_id(self, index: int) -> str:
        with self._lock:
            return self._id_by_index[index]

    def die(self, index: int, step: str) -> None:
        self._events.emit(
            "dying", index=index, step=step, operation_id=self.operation_id(index), pid=os.getpid()
        )
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached: SIGKILL cannot be caught


def watch_commits(journal: Any, tracker: Tracker) -> None:
    """Meet the journal steps at the one seam every write passes: the journal's commit
    of a batch, seen through its public observer (`Journal.observe_commits`)."""

    def before(writes: Sequence[Any], durable: bool) -> None:
        for write in writes:
            if isinstance(write, (Insert, Enqueue)):
                new = write.new
                index = tracker.new_key(new.operation_id, new.key, new.key_header)
                tracker.reach(index, BEFORE_KEY_COMMIT)
            elif isinstance(write, Record) and write.record.status_code is not None:
                found = tracker.index_of(write.operation_id)
                if found is not None:
                    tracker.reach(found, BEFORE_ANSWER_RECORDED)

    def after(writes: Sequence[Any], outcomes: Sequence[Any]) -> None:
        # Before any caller waiting for the batch goes on: nothing is sent after it yet.
        for write, outcome in zip(writes, outcomes, strict=True):
            if isinstance(write, (Insert, Enqueue)) and outcome is True:
                index = tracker.index_of(write.new.operation_id)
                if index is not None:
                    tracker.reach(index, AFTER_KEY_COMMIT)

    journal.observe_commits(before=before, after=after)


def _raw_request(request: Any) -> bytes | None:
    """The request as HTTP/1.1 bytes, or None when it cannot be written by hand."""
    url = request.url
    if url.scheme != "http":
        return None
    try:
        content = bytes(request.content)
    except Exception:  # a streamed body not read yet: send it the normal way
        return None
    head = f"{request.method} {url.raw_path.decode('ascii')} HTTP/1.1\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in request.headers.items())
    return head.encode("latin-1") + b"\r\n" + content


def _send_and_wait(tracker: Tracker, index: int, key: str, request: Any) -> bool:
    """Write the request whole on a socket nobody reads, and wait for the parent's SIGKILL.

    The parent kills this process once the server has answered: the server acted,
    and its answer is lost with the process. False: it cannot be written by hand.
    """
    raw = _raw_request(request)
    if raw is None:
        return False
    url = request.url
    sock = socket.create_connection((url.host, url.port or 80))
    sock.sendall(raw)
    tracker.note(index, AFTER_REQUEST_SENT)  # the parent kills, once the server answered
    tracker.sent(index, key)
    while True:
        time.sleep(60)


def wrap_transports(tracker: Tracker) -> None:
    """Meet the wire steps inside the HTTP transports (httpx, and httpx2 if installed)."""
    modules = [importlib.import_module("httpx")]
    with contextlib.suppress(ImportError):
        modules.append(importlib.import_module("httpx2"))
    for module in modules:
        sync_transport = module.HTTPTransport
        sync_transport.handle_request = _dying_send(sync_transport.handle_request, tracker)
        async_transport = module.AsyncHTTPTransport
        async_transport.handle_async_request = _dying_async_send(
            async_transport.handle_async_request, tracker
        )


def _before_send(tracker: Tracker, request: Any) -> int | None:
    """The operation a request is an attempt of (None: not one the journal made), with
    ``after_request_sent`` met: where the process dies, when that is the step aimed at."""
    found = tracker.index_of_request(request.headers)
    if found is None:
        return None
    index, key = found
    if tracker.aimed_at(index, AFTER_REQUEST_SENT):
        _send_and_wait(tracker, index, key, request)
    tracker.reach(index, AFTER_REQUEST_SENT)
    return index


def _dying_send(send: Callable[..., Any], tracker: Tracker) -> Callable[..., Any]:
    def dying_send(self: Any, request: Any) -> Any:
        index = _before_send(tracker, request)
        response = send(self, request)
        if index is not None:
            response.read()
            tracker.reach(index, AFTER_ANSWER_ARRIVED)
        return response

    return dying_send


def _dying_async_send(send: Callable[..., Any], tracker: Tracker) -> Callable[..., Any]:
    async def dying_send(self: Any, request: Any) -> Any:
        index = _before_send(tracker, request)
        response = await send(self, request)
        if index is not None:
            await response.aread()
            tracker.reach(index, AFTER_ANSWER_ARRIVED)
        return response

    return dying_send


def resolve(reference: dict[str, Any]) -> Callable[..., Any]:
    """The function a reference names: by module and qualified name, or by file."""
    module_name, qualname = reference["module"], reference["qualname"]
    if reference.get("file"):
        spec = importlib.util.spec_from_file_location(SCRIPT_MODULE, reference["file"])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part)
    return found  # type: ignore[no-any-return]


def default_session(journal: Path, base_url: str, *, asynchronous: bool) -> Any:
    import idempotently

    session_class = idempotently.AsyncSession if asynchronous else idempotently.Session
    return session_class(
        journal, base_url=base_url, headers={"Authorization": f"Bearer {DEFAULT_TOKEN}"}
    )


def checked_session(session: Any, *, asynchronous: bool) -> Any:
    """What the factory made, if recovery can resume with it (and the scenario await it)."""
    import idempotently

    wanted = idempotently.AsyncSession if asynchronous else idempotently.Session
    if not isinstance(session, wanted):
        scenario = "an async def scenario" if asynchronous else "a scenario that is not async"
        raise TypeError(
            f"the session factory returned {type(session).__name__}: {scenario} needs an"
            f" idempotently.{wanted.__name__} (recovery calls its resume()), opened on the"
            " journal path the factory is given"
        )
    return session


def run(spec: dict[str, Any], events: Events) -> None:
    scenario = resolve(spec["scenario"])
    factory = resolve(spec["session"]) if spec.get("session") else None
    asynchronous = inspect.iscoroutinefunction(scenario)
    journal, url = Path(spec["journal"]), spec["url"]

    tracker = Tracker(events, spec.get("kill"))

    def make() -> Any:
        if factory is None:
            session = default_session(journal, url, asynchronous=asynchronous)
        else:
            session = checked_session(factory(journal, url), asynchronous=asynchronous)
        watch_commits(session.journal, tracker)
        return session

    wrap_transports(tracker)
    recover = spec["mode"] == "recover"
    if not asynchronous:
        with contextlib.closing(make()) as session:
            if recover:
                results = session.resume()
                events.emit("resumed", results=[result.to_json() for result in results])
            if not recover or spec.get("rerun", True):
                returned = scenario(session)
                if inspect.isawaitable(returned):
                    with contextlib.suppress(Exception):
                        returned.close()  # type: ignore[attr-defined]
                    raise TypeError(
                        "the scenario returned an awaitable, so none of its calls ran: it is"
                        " an async function behind a decorator that is not; make the function"
                        " crash_points is given an `async def` one"
                    )
    else:
        import anyio

        async def main() -> None:
            session = make()
            try:
                if recover:
                    results = await session.resume()
                    events.emit("resumed", results=[result.to_json() for result in results])
                if not recover or spec.get("rerun", True):
                    await scenario(session)
            finally:
                await session.aclose()

        anyio.run(main, backend=spec.get("backend", "asyncio"))
    events.emit("finished")


def watch_the_parent(parent: int) -> None:
    """End this process if the harness's process is gone (killed, or interrupted
    before it could kill this one): nothing else would, when it waits to be killed."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="idempotently-crash-parent", daemon=True).start()


def threads_left_running() -> list[str]:
    """The threads that would keep this process alive after the scenario returned, given
    a moment to end (an event loop's worker threads end soon after the loop closes)."""
    left = [
        thread
        for thread in threading.enumerate()
        if thread is not threading.main_thread() and not thread.daemon and thread.is_alive()
    ]
    deadline = time.monotonic() + THREAD_GRACE
    for thread in left:
        thread.join(max(deadline - time.monotonic(), 0.0))
    return sorted(thread.name for thread in left if thread.is_alive())


def main(argv: Sequence[str] | None = None) -> int:
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    events = Events(int(spec["events_fd"]))
    if spec.get("parent"):
        watch_the_parent(int(spec["parent"]))
    try:
        run(spec, events)
    except BaseException as error:  # the parent reports it, with the log's traceback
        traceback.print_exc()
        events.emit("error", error=f"{type(error).__name__}: {error}")
        return 1
    left = threads_left_running()
    if left:
        # The process would not exit until they end; their calls would mix with the next run's.
        message = (
            f"the scenario returned with threads still running ({', '.join(left)}): join"
            " the threads it starts before it returns"
        )
        print(message, file=sys.stderr)
        events.emit("error", error=message)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
