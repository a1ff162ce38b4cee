"""Crash-point testing of your own code: kill it at every journal step, recover, count the money.

`crash_points(scenario)` runs `scenario(session)` in a child process against a
mock server of its own, once cleanly to learn its operations and the steps each
meets, then once per (operation, step): the child is killed with SIGKILL at that
step of that operation, a fresh process recovers the way an application does
on restart (`session.resume()`, then the scenario again), and the server's
ledger is compared with the clean run's. A crash anywhere must leave the world
as if there had been none: the same charges, each made once, and no operation
left pending.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs

from idempotently.testing._config import MockServerConfig

if TYPE_CHECKING:
    from idempotently.testing._server import MockServer

CrashStep = Literal[
    "before_key_commit",
    "after_key_commit",
    "after_request_sent",
    "after_answer_arrived",
    "before_answer_recorded",
]

CRASH_STEPS: tuple[CrashStep, ...] = (
    "before_key_commit",
    "after_key_commit",
    "after_request_sent",
    "after_answer_arrived",
    "before_answer_recorded",
)
"""Where a crash can come, in the order an operation meets them:

- `before_key_commit`: the key's journal write is about to commit (nothing is durable);
- `after_key_commit`: the key is durable, not a byte is sent;
- `after_request_sent`: the request went out whole and the server answered, but
  the answer is never read (it is lost with the process);
- `after_answer_arrived`: the HTTP client read the answer; the library never saw it;
- `before_answer_recorded`: the library has the answer, its journal write is about
  to commit.
"""

UNSETTLED = ("pending", "needs_reconcile")
RETRIED_STEPS = ("after_request_sent", "after_answer_arrived", "before_answer_recorded")
"""The steps each attempt meets (a key commits once; a call made again writes no new key)."""
CHILD_MARKER = "IDEMPOTENTLY_CRASH_POINTS_CHILD"
"""Set in the environment of the scenario's processes (a scenario's import calling
`crash_points` again would start processes without end)."""
IDLE_CHECK = 0.25
"""Seconds without an event after which the harness looks whether the child is still alive."""
MAX_TIMEOUT = 24 * 60 * 60.0
"""The longest `timeout` a process may be given, in seconds (a day)."""
LOG_TAIL_LINES = 15


class CrashHarnessError(Exception):
    """The harness could not run the scenario as asked (not a crash-safety finding)."""


@attrs.frozen
class CrashPointResult:
    """What happened when the scenario was killed at one step of one operation."""

    operation: int
    """Which operation (0: the first whose key the scenario journaled, in the clean run's order)."""
    operation_id: str
    """That operation's id in the clean run."""
    step: CrashStep
    """Where the process was killed (see `CRASH_STEPS`)."""
    killed: bool
    """The process died at that step (False: the run never reached it; see `problems`)."""
    charges_at_crash: int
    """How many charges the server had made when the process died."""
    problems: tuple[str, ...]
    """Each way the world after recovery differs from the clean run; empty when it held."""
    directory: Path
    """Its journal and the logs of its processes."""

    @property
    def ok(self) -> bool:
        """Killed where aimed, and recovery left the world as the clean run did."""
        return self.killed and not self.problems

    def __str__(self) -> str:
        verb = "killed" if self.killed else "not killed at"
        head = f"operation {self.operation} ({self.operation_id}) {verb} {self.step}"
        if self.ok:
            return f"{head}: exactly once"
        return f"{head}: " + "; ".join(self.problems)


@attrs.frozen
class CrashReport:
    """Every crash point's result, and the clean run they are compared with."""

    operations: tuple[str, ...]
    """The clean run's operation ids, in the order their keys were journaled."""
    charges: int
    """How many charges the clean run made."""
    points: tuple[CrashPointResult, ...]
    """One result per (operation, step) crashed."""
    directory: Path
    """Where every run's journal and logs are (a temporary one is removed once every point held)."""

    @property
    def failures(self) -> tuple[CrashPointResult, ...]:
        """The points where exactly-once did not hold (or the kill never came)."""
        return tuple(point for point in self.points if not point.ok)

    @property
    def ok(self) -> bool:
        """Every point held."""
        return not self.failures

    def assert_exactly_once(self) -> None:
        """Raise `AssertionError` listing every point that did not hold."""
        if self.failures:
            raise AssertionError(self.describe())

    def describe(self) -> str:
        """A summary line and one line per point."""
        held = len(self.points) - len(self.failures)
        summary = (
            f"{held} of {len(self.points)} crash points held exactly once"
            f" ({len(self.operations)} operations, {self.charges} charges in the clean run"
        )
        summary += f"; journals and logs in {self.directory})" if self.failures else ")"
        lines = [summary]
        lines += [f"  {'ok  ' if point.ok else 'FAIL'} {point}" for point in self.points]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def _reference(function: Callable[..., Any], what: str) -> dict[str, Any]:
    """How the child finds ``function``: its module and name (a `__main__` by its file)."""
    if not callable(function):
        raise TypeError(f"{what} must be a function, not {function!r}")
    if inspect.ismethod(function):
        raise TypeError(
            f"{what} {function!r} is a bound method, which a fresh process cannot rebuild"
            " (it would get the session as its self): define a function at the top level"
            " of a module"
        )
    qualname = getattr(function, "__qualname__", None)
    module = getattr(function, "__module__", None)
    if not qualname or not module or "<" in qualname:
        raise TypeError(
            f"{what} {function!r} cannot be found by a fresh process: crash_points runs it"
            " in a child process, so define it at the top level of a module (not a lambda"
            " or a function inside a function)"
        )
    reference: dict[str, Any] = {"module": module, "qualname": qualname, "file": None}
    if module == "__main__":
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None)
        if path is None or getattr(main, qualname.partition(".")[0], None) is None:
            raise TypeError(
                f"{what} {qualname} was not defined in a file (an interactive session, or"
                " code run by exec): put it in a module or a script, which the child"
                " process can load"
            )
        reference["file"] = str(Path(path).resolve())
    return reference


def _check_steps(steps: Iterable[str]) -> tuple[CrashStep, ...]:
    if isinstance(steps, str) or not isinstance(steps, Iterable):
        raise TypeError(
            f"steps must be a list of step names, not {steps!r}: e.g. steps=[{steps!r}]"
            if isinstance(steps, str)
            else f"steps must be a list of step names, not {steps!r}"
        )
    chosen = tuple(steps)
    unknown = [step for step in chosen if step not in CRASH_STEPS]
    if unknown:
        raise ValueError(
            f"unknown crash step {', '.join(map(repr, unknown))}: choose from"
            f" {', '.join(CRASH_STEPS)}"
        )
    if not chosen:
        raise ValueError(f"steps is empty: choose one or more of {', '.join(CRASH_STEPS)}")
    return chosen  # type: ignore[return-value]


def _check_directory(root: Path) -> None:
    """``root`` exists (made if need be) and takes new files, or a clear error."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as error:
        raise CrashHarnessError(
            f"directory {str(root)!r} cannot hold the runs' journals and logs"
            f" ({error.strerror or error}): pass a directory this process can create and"
            " write to, or leave it out for a temporary one"
        ) from None


def _fresh(run_directory: Path) -> Path:
    """An empty directory for one run: an earlier call's journal there would answer
    this run's calls from its own rows (or refuse them, the server being a new one)."""
    shutil.rmtree(run_directory, ignore_errors=True)
    run_directory.mkdir(parents=True)
    return run_directory


@attrs.frozen
class _Run:
    """One child process's end: its exit, the events it wrote, its log."""

    returncode: int
    events: tuple[dict[str, Any], ...]
    log: Path

    def of(self, name: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["event"] == name]

    def tail(self) -> str:
        try:
            lines = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def error(self) -> str:
        errors = self.of("error")
        if errors:
            return str(errors[-1]["error"])
        if self.returncode < 0:
            with contextlib.suppress(ValueError):
                return (
                    f"its process was killed by {signal.Signals(-self.returncode).name}"
                    " before the scenario returned"
                )
        return (
            f"its process exited with status {self.returncode} before the scenario returned"
            " (os._exit, or a forked process returning into the scenario?)"
        )


class _Child:
    """The scenario's process, with a pipe for its events and a log file for its output."""

    def __init__(self, spec: dict[str, Any], log: Path, timeout: float) -> None:
        read_end, write_end = os.pipe()
        self._log = log
        self._deadline = time.monotonic() + timeout
        self._timeout = timeout
        env = dict(os.environ)
        # The child imports what this process can: the scenario's module and its own.
        env["PYTHONPATH"] = os.pathsep.join(path or os.getcwd() for path in sys.path)
        env[CHILD_MARKER] = "1"
        with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as output:
            try:
                self._process = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "idempotently.testing._crash_child",
                        json.dumps({**spec, "events_fd": write_end}),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    pass_fds=(write_end,),
                    env=env,
                    # Its own process group: a kill takes whatever it started along.
                    start_new_session=True,
                )
            finally:
                os.close(write_end)
        self._pipe = os.fdopen(read_end, "rb")
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._pipe, selectors.EVENT_READ)
        self._buffer = b""
        self.events: list[dict[str, Any]] = []

    def next_event(self) -> dict[str, Any] | None:
        """The next event, or None once the child closed its end (it exited)."""
        while b"\n" not in self._buffer:
            left = self._deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise CrashHarnessError(
                    f"the scenario's process ran past {self._timeout} s and was killed"
                    f" (its output: {self._log})"
                )
            if not self._selector.select(timeout=min(left, IDLE_CHECK)):
                if self._exited():
                    # It exited; a process it started may still hold the pipe open.
                    self._kill_group()
                continue
            chunk = os.read(self._pipe.fileno(), 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        event: dict[str, Any] = json.loads(line)
        self.events.append(event)
        return event

    def kill(self) -> None:
        """SIGKILL the scenario's process and every process it started."""
        self._kill_group()
        with contextlib.suppress(ProcessLookupError):
            self._process.send_signal(signal.SIGKILL)

    def _kill_group(self) -> None:
        if self._process.returncode is not None:
            # Reaped: its id, and so its group's, may be another process's by now.
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signal.SIGKILL)

    def _exited(self) -> bool:
        """The child has exited; where the system allows, it is left unreaped, so that its
        group can still be killed without the risk of its id having been given again."""
        if self._process.returncode is not None:
            return True
        if hasattr(os, "waitid"):
            try:
                flags = os.WEXITED | os.WNOWAIT | os.WNOHANG
                return os.waitid(os.P_PID, self._process.pid, flags) is not None
            except ChildProcessError:
                return True
        return self._process.poll() is not None

    def finish(self) -> _Run:
        while self.next_event() is not None:
            pass
        limit = time.monotonic() + max(self._deadline - time.monotonic(), 1.0)
        while not self._exited() and time.monotonic() < limit:
            time.sleep(0.005)
        # Whatever it started goes with it (it is a zombie at most: its group is its own).
        self.kill()
        returncode = self._process.wait()
        self.close()
        return _Run(returncode, tuple(self.events), self._log)

    def close(self) -> None:
        """Leave nothing running and nothing open (also when the harness itself is
        interrupted: a child waiting to be killed would wait forever)."""
        self.kill()
        self._process.wait()
        if not self._pipe.closed:
            self._selector.close()
            self._pipe.close()

    def __enter__(self) -> _Child:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _charges(server: MockServer) -> collections.Counter[str]:
    """The ledger as what moved (user, amount, currency, customer, metadata), ids aside."""
    return collections.Counter(
        json.dumps(
            [charge.user, charge.amount, charge.currency, charge.customer, charge.metadata],
            sort_keys=True,
        )
        for charge in server.charges()
    )


def _describe_charge(content: str, server: MockServer) -> str:
    user, amount, currency, customer, metadata = json.loads(content)
    keys = [
        charge.key
        for charge in server.charges()
        if [charge.user, charge.amount, charge.currency, charge.customer, charge.metadata]
        == [user, amount, currency, customer, metadata]
    ]
    what = f"{amount} {currency} to {customer}"
    if metadata:
        what += f" {json.dumps(metadata, sort_keys=True)}"
    return f"{what} (keys {', '.join(keys)})" if keys else what


def _journal_problems(path: Path, reference_statuses: collections.Counter[str]) -> list[str]:
    from idempotently import Journal, JournalError

    if not path.exists():
        return ["the journal file is gone"] if reference_statuses else []
    try:
        with contextlib.closing(Journal(path, readonly=True)) as journal:
            operations = journal.operations(newest_first=False)
    except JournalError as error:
        return [f"the journal cannot be read after recovery: {error}"]
    problems = [
        f"{operation.operation_id} (key {operation.key}) left {operation.status}"
        for operation in operations
        if operation.status in UNSETTLED
    ]
    statuses = collections.Counter(operation.status for operation in operations)
    if not problems and statuses != reference_statuses:
        problems.append(
            f"the journal ends with {dict(sorted(statuses.items()))}, the clean run with"
            f" {dict(sorted(reference_statuses.items()))}"
        )
    return problems


class _Harness:
    def __init__(
        self,
        scenario: dict[str, Any],
        session: dict[str, Any] | None,
        config: MockServerConfig | None,
        *,
        rerun: bool,
        backend: str,
        directory: Path,
        timeout: float,
    ) -> None:
        self._spec = {"scenario": scenario, "session": session, "backend": backend}
        self._config = config
        self._rerun = rerun
        self._directory = directory
        self._timeout = timeout
        self._operations: list[str] = []
        """The clean run's operation ids, in the order their keys were journaled."""
        self._meetings: dict[tuple[int, str], int] = {}
        """How many times the clean run met each (operation, step): a crash is aimed at the
        last, the attempt that got the final answer (the first may have been a 503)."""

    @contextlib.contextmanager
    def _server(self) -> Iterator[MockServer]:
        try:
            from idempotently.testing._server import serve
        except ImportError as error:
            raise CrashHarnessError(
                "crash_points needs the mock server, in the [mock] extra:"
                " pip install 'idempotently[mock]'"
            ) from error
        with serve(self._config) as server:
            yield server

    def _child(self, run_directory: Path, server: MockServer, mode: str, **extra: Any) -> _Child:
        spec = {
            **self._spec,
            "parent": os.getpid(),
            "mode": mode,
            "journal": str(run_directory / "idempotently.db"),
            "url": server.url,
            "rerun": self._rerun,
            **extra,
        }
        return _Child(spec, run_directory / f"{mode}.log", self._timeout)

    def clean_run(self) -> tuple[list[str], list[set[str]], collections.Counter[str], Any]:
        run_directory = _fresh(self._directory / "clean")
        with self._server() as server:
            with self._child(run_directory, server, "trace") as child:
                run = child.finish()
            if run.returncode != 0 or not run.of("finished"):
                raise CrashHarnessError(
                    f"the scenario fails with no crash at all ({run.error()}); make it pass"
                    f" first. Its output ({run.log}):\n{run.tail()}"
                )
            operations = [str(event["operation_id"]) for event in run.of("operation")]
            if not operations:
                raise CrashHarnessError(
                    "the scenario journaled no operation, so there is nowhere to crash: it"
                    " must send its calls through the session it is given"
                )
            self._operations = operations
            steps: list[set[str]] = [set() for _ in operations]
            for event in run.of("step"):
                steps[int(event["index"])].add(str(event["step"]))
                key = (int(event["index"]), str(event["step"]))
                if key[1] in RETRIED_STEPS:
                    self._meetings[key] = max(self._meetings.get(key, 1), int(event["meeting"]))
            charges = _charges(server)
            if not charges:
                raise CrashHarnessError(
                    f"the scenario's {len(operations)} operation(s) made no charge without a"
                    " crash, so there is nothing to count after one: crash_points compares"
                    " the charges the mock server makes (POST /v1/charges that it accepts);"
                    f" make the scenario's calls charges. Its output ({run.log}):\n{run.tail()}"
                )
        return operations, steps, charges, self._statuses(run_directory / "idempotently.db")

    def _statuses(self, path: Path) -> collections.Counter[str]:
        from idempotently import Journal

        if not path.exists():
            raise CrashHarnessError(
                f"the scenario's session journaled elsewhere than {path}: the session"
                " factory must open its journal at the path it is given (a fresh one per run)"
            )
        with contextlib.closing(Journal(path, readonly=True)) as journal:
            return collections.Counter(op.status for op in journal.operations())

    def crash_at(
        self,
        operation: int,
        operation_id: str,
        step: CrashStep,
        reference: collections.Counter[str],
        statuses: collections.Counter[str],
    ) -> CrashPointResult:
        run_directory = _fresh(self._directory / f"operation-{operation}-{step}")
        problems: list[str] = []
        with self._server() as server:
            with self._child(
                run_directory,
                server,
                "crash",
                kill={
                    "operation": operation,
                    "operation_id": operation_id,
                    "operations": self._operations,
                    "step": step,
                    "meeting": self._meetings.get((operation, step), 1),
                },
            ) as child:
                while (event := child.next_event()) is not None:
                    if event["event"] == "sent":
                        self._wait_for_the_answer(
                            server, str(event["key"]), int(event.get("meeting", 1))
                        )
                        child.kill()
                crashed = child.finish()
            charges_at_crash = len(server.charges())
            deaths = crashed.of("dying") + crashed.of("sent")
            killed = crashed.returncode == -signal.SIGKILL and bool(deaths)
            if deaths:
                operation_id = str(deaths[0]["operation_id"])
            if not killed:
                if crashed.returncode == 0:
                    meeting = self._meetings.get((operation, step), 1)
                    problems.append(
                        f"the run never reached {step} of operation {operation}"
                        + (f" (for the {_ordinal(meeting)} time)" if meeting > 1 else "")
                        + ": the scenario did not repeat the clean run (make its calls depend"
                        " only on its input)"
                    )
                else:
                    problems.append(f"the scenario failed before the crash: {crashed.error()}")
            with self._child(run_directory, server, "recover") as child:
                recovered = child.finish()
            if recovered.returncode != 0 or not recovered.of("finished"):
                problems.append(
                    f"recovery failed: {recovered.error()} (its output: {recovered.log})"
                )
            problems += self._ledger_problems(server, reference)
        problems += _journal_problems(run_directory / "idempotently.db", statuses)
        return CrashPointResult(
            operation=operation,
            operation_id=operation_id,
            step=step,
            killed=killed,
            charges_at_crash=charges_at_crash,
            problems=tuple(problems),
            directory=run_directory,
        )

    def _wait_for_the_answer(self, server: MockServer, key: str, meeting: int = 1) -> None:
        """Until the server has answered the request carrying ``key`` (or the timeout): its
        ``meeting``-th with that key, so that a retry's is not taken for the first
        attempt's (on a loaded machine the retry may not have arrived yet)."""
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if sum(entry.key == key for entry in server.requests) >= meeting:
                return
            time.sleep(0.002)

    def _ledger_problems(
        self, server: MockServer, reference: collections.Counter[str]
    ) -> list[str]:
        after = _charges(server)
        problems = []
        for content in after - reference:
            made, meant = after[content], reference[content]
            times = _times(made) if meant == 1 else f"{_times(made)} ({_times(meant)} cleanly)"
            if meant == 0:
                times = f"{_times(made)}, never in the clean run"
            problems.append(f"charged {times}: {_describe_charge(content, server)}")
        for content in reference - after:
            made, meant = after[content], reference[content]
            what = _describe_charge(content, server)
            if made:
                problems.append(f"lost: {what} charged {_times(made)}, {_times(meant)} cleanly")
            else:
                problems.append(
                    f"lost: {what} never charged" + (f" ({meant} missing)" if meant > 1 else "")
                )
        return problems


def _ordinal(number: int) -> str:
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(number % 10 if number % 100 not in (11, 12, 13) else 0)
    return f"{number}{suffix or 'th'}"


def _times(count: int) -> str:
    return {1: "once", 2: "twice"}.get(count, f"{count} times")


def _unreached(operation: int, operation_id: str, step: CrashStep, clean: Path) -> CrashPointResult:
    """A point the clean run never reached: not crashed, so it cannot have held."""
    if step in ("after_request_sent", "after_answer_arrived"):
        why = (
            "it was never sent, or sent through a transport crash_points cannot see (it"
            " sees httpx's and httpx2's HTTPTransport and AsyncHTTPTransport)"
        )
    elif step == "before_answer_recorded":
        why = "no answer to it was ever recorded in the journal"
    else:
        why = "its key was never committed to the journal at the path the session was given"
    return CrashPointResult(
        operation=operation,
        operation_id=operation_id,
        step=step,
        killed=False,
        charges_at_crash=0,
        problems=(f"not crashed: the clean run never reached {step} of it ({why})",),
        directory=clean,
    )


class _Progress:
    """One line per point on a terminal's stderr (nothing when stderr is not a terminal)."""

    def __init__(self, total: int) -> None:
        self._total = total
        self._done = 0
        self._stream = sys.stderr
        self._on = bool(getattr(self._stream, "isatty", lambda: False)())

    def show(self, point: CrashPointResult) -> None:
        self._done += 1
        if self._on:
            mark = "ok  " if point.ok else "FAIL"
            print(f"[{self._done}/{self._total}] {mark} {point}", file=self._stream, flush=True)


def crash_points(
    scenario: Callable[..., Any],
    *,
    session: Callable[[Path, str], Any] | None = None,
    config: MockServerConfig | None = None,
    steps: Sequence[CrashStep] = CRASH_STEPS,
    operations: Sequence[int] | None = None,
    rerun: bool = True,
    backend: Literal["asyncio", "trio"] = "asyncio",
    directory: str | os.PathLike[str] | None = None,
    timeout: float = 60.0,
    on_point: Callable[[CrashPointResult], object] | None = None,
) -> CrashReport:
    """Kill `scenario` at every journal step of every operation, recover, compare the ledger.

    ```python
    def place_orders(session: idempotently.Session) -> None:
        for order in ("order-1", "order-2"):
            session.post("/v1/charges", operation_id=f"{order}:charge",
                         json={"amount": 100, "currency": "usd", "customer": "cus_1",
                               "metadata": {"order_id": order}})

    crash_points(place_orders).assert_exactly_once()
    ```

    The scenario runs in child processes against a mock server started for each
    run, with a journal of its own per run. First a clean run learns its
    operations (in the order their keys are journaled) and the steps each meets.
    Then, for each operation and each step, a child is killed with SIGKILL
    there, and a new process recovers as an application does when it restarts:
    `session.resume()`, then the scenario again (it must derive its operation
    ids from its input, as crash-safe code does). The point holds when the
    server's ledger then shows exactly the clean run's charges, none twice and
    none lost, and the journal has no operation left pending or to reconcile.

    The scenario and the session factory must be importable by a fresh process:
    functions at the top level of a module (a test module is fine). An `async`
    scenario gets an `AsyncSession` and runs on `backend`.

    Args:
        scenario: `scenario(session)`: your code's calls, made through `session`.
        session: `session(journal_path, base_url)` returns the `Session` (or
            `AsyncSession`) the scenario gets, for your profile, policy and
            headers; by default one on `base_url` authenticated as `user_1`.
        config: The mock server's behaviour (`MockServerConfig()` by default).
        steps: The steps to crash at (all of `CRASH_STEPS` by default).
        operations: Which operations to crash (their positions in the clean
            run; all by default).
        rerun: Recovery runs the scenario again after `resume()` (False: resume only).
        backend: The event loop of an async scenario: `"asyncio"` or `"trio"`.
        directory: Where the runs' journals and logs go (a new temporary
            directory by default, removed when every point held).
        timeout: Seconds each process may take before it is killed and the
            harness gives up.
        on_point: Called with each point's result as soon as it is known (without
            it, each point is shown as a line on stderr when stderr is a terminal).

    Returns:
        The report; `report.assert_exactly_once()` fails a test listing the points
        that did not hold.

    Raises:
        CrashHarnessError: The scenario fails or journals nothing without a crash,
            or a process ran past `timeout`.
    """
    if os.environ.get(CHILD_MARKER):
        raise CrashHarnessError(
            "crash_points was called in one of its own child processes: the module that"
            " defines the scenario calls it as it is imported, and each child imports that"
            ' module. Call it under `if __name__ == "__main__":` or in a test function'
        )
    scenario_reference = _reference(scenario, "scenario")
    session_reference = _reference(session, "session") if session is not None else None
    chosen_steps = _check_steps(steps)
    if backend not in ("asyncio", "trio"):
        raise ValueError(f"backend must be 'asyncio' or 'trio', not {backend!r}")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout <= MAX_TIMEOUT
    ):
        raise ValueError(
            f"timeout must be a positive number of seconds (at most {MAX_TIMEOUT:g}),"
            f" not {timeout!r}"
        )
    if config is not None and not isinstance(config, MockServerConfig):
        raise TypeError(f"config must be a MockServerConfig, not {config!r}")
    if not isinstance(rerun, bool):
        raise TypeError(f"rerun must be True or False, not {rerun!r}")
    if on_point is not None and not callable(on_point):
        raise TypeError(f"on_point must be a function of a CrashPointResult, not {on_point!r}")
    if operations is not None:
        if isinstance(operations, (str, bytes)) or not isinstance(operations, Iterable):
            raise TypeError(
                f"operations must be a list of operation positions (e.g. [0, 1]), not"
                f" {operations!r}"
            )
        operations = list(operations)
        if not operations:
            raise ValueError(
                "operations is empty, so nothing would be crashed: list the positions to"
                " crash (e.g. [0]), or leave it out to crash every operation"
            )
        for index in operations:
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ValueError(
                    f"operations: {index!r} is not the position of an operation (0 is the"
                    " first whose key the scenario journals, 1 the next, ...)"
                )
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, not {directory!r}")
    made_directory = directory is None
    root = Path(tempfile.mkdtemp(prefix="idempotently-crash-") if directory is None else directory)
    _check_directory(root)
    harness = _Harness(
        scenario_reference,
        session_reference,
        config,
        rerun=rerun,
        backend=backend,
        directory=root,
        timeout=float(timeout),
    )
    ids, met, reference, statuses = harness.clean_run()
    aimed = range(len(ids)) if operations is None else operations
    for index in aimed:
        if index >= len(ids):
            raise ValueError(
                f"operations: {index!r} is not the position of one of the scenario's"
                f" {len(ids)} operations (0 to {len(ids) - 1})"
            )
    points = []
    progress = _Progress(len(aimed) * len(chosen_steps)) if on_point is None else None
    for index in aimed:
        for step in chosen_steps:
            if step in met[index]:
                point = harness.crash_at(index, ids[index], step, reference, statuses)
            else:
                point = _unreached(index, ids[index], step, root / "clean")
            points.append(point)
            if on_point is not None:
                on_point(point)
            elif progress is not None:
                progress.show(point)
    report = CrashReport(
        operations=tuple(ids),
        charges=sum(reference.values()),
        points=tuple(points),
        directory=root,
    )
    if made_directory and report.ok:
        shutil.rmtree(root, ignore_errors=True)
    return report


__all__ = [
    "CRASH_STEPS",
    "CrashHarnessError",
    "CrashPointResult",
    "CrashReport",
    "CrashStep",
    "crash_points",
]
