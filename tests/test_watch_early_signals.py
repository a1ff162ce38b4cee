"""A `resume --watch` worker stopped by SIGTERM exits 0, even in its first moments.

A supervisor that starts a worker and stops it at once (a rollout, a failed
health check) must see a clean stop, not a death by signal (-15). Real
processes: the handlers that matter are installed by the interpreter's import
of the package.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import idempotently
from idempotently import _early_signals

REPO = Path(__file__).resolve().parents[1]
WAIT = 30.0
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    """An empty journal, as a worker finds one on a quiet day."""
    path = tmp_path / "journal.db"
    idempotently.Journal(path).close()
    return path


def start_worker(journal: Path, *options: str) -> subprocess.Popen[str]:
    """``idempotently --journal JOURNAL resume --watch --json``: its events on stdout."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "idempotently",
            "--journal",
            str(journal),
            "resume",
            "--watch",
            "--json",
            *options,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def ended(worker: subprocess.Popen[str]) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of a worker, once it has ended."""
    out, err = worker.communicate(timeout=WAIT)
    return worker.returncode, out, err


def catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (Linux: SigCgt in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(line for line in status if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


def first_moment(worker: subprocess.Popen[str]) -> float:
    """Seconds after start at which the worker first catches SIGTERM (polled every ms)."""
    started = time.monotonic()
    while not catches_sigterm(worker.pid):
        assert worker.poll() is None, worker.stderr.read() if worker.stderr else ""
        assert time.monotonic() - started < WAIT, "the worker never caught SIGTERM"
        time.sleep(0.001)
    return time.monotonic() - started


@pytest.fixture
def stopped() -> Iterator[list[subprocess.Popen[str]]]:
    workers: list[subprocess.Popen[str]] = []
    yield workers
    for worker in workers:
        if worker.poll() is None:
            worker.kill()
        worker.wait(timeout=WAIT)
        if worker.stderr is not None:
            worker.stderr.close()


def holds_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open (Linux: its /proc fd links)."""
    fds = f"/proc/{pid}/fd"
    return any(os.path.realpath(os.path.join(fds, fd)) == str(path) for fd in os.listdir(fds))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_sigterm_as_soon_as_the_handler_exists_is_a_clean_stop(
    journal: Path, stopped: list[subprocess.Popen[str]]
) -> None:
    """The worker catches SIGTERM before it even opens its journal; one sent then: exit 0."""
    worker = start_worker(journal)
    stopped.append(worker)
    first_moment(worker)
    worker.send_signal(signal.SIGSTOP)  # hold it where it was when it first caught SIGTERM
    journal_open = holds_open(worker.pid, journal.resolve())
    worker.send_signal(signal.SIGTERM)
    worker.send_signal(signal.SIGCONT)
    code, _, err = ended(worker)
    assert (False, 0) == (journal_open, code), err


def test_sigterm_50_ms_after_start_is_a_clean_stop(
    journal: Path, stopped: list[subprocess.Popen[str]]
) -> None:
    """SIGTERM 50 ms after start (the interpreter is still importing): exit 0, not -15."""
    worker = start_worker(journal)
    stopped.append(worker)
    # Real time on purpose: the race is with a real interpreter, which is by then
    # importing the package (a bare interpreter starts in about 20 ms). Python's
    # own start cannot catch anything: on a machine slow enough that 50 ms ends
    # inside it, wait for the package's first line.
    time.sleep(0.05)
    if os.path.exists(f"/proc/{worker.pid}/status"):
        first_moment(worker)
    worker.send_signal(signal.SIGTERM)
    code, _, err = ended(worker)
    assert 0 == code, err


def test_sigterm_once_running_is_a_clean_stop(
    journal: Path, stopped: list[subprocess.Popen[str]]
) -> None:
    """SIGTERM after the worker said it started: exit 0, saying why it stopped."""
    worker = start_worker(journal)
    stopped.append(worker)
    assert worker.stdout is not None
    for line in worker.stdout:
        if '"watch_started"' in line:
            break
    worker.send_signal(signal.SIGTERM)
    code, out, err = ended(worker)
    assert (0, True) == (code, '"signal": "SIGTERM"' in out), err


def test_an_early_sigterm_is_logged_like_a_late_one(
    journal: Path, stopped: list[subprocess.Popen[str]]
) -> None:
    """A SIGTERM noted during start-up is announced as the stop's reason, then the worker ends."""
    worker = start_worker(journal)
    stopped.append(worker)
    if os.path.exists(f"/proc/{worker.pid}/status"):
        first_moment(worker)
    worker.send_signal(signal.SIGTERM)
    code, out, err = ended(worker)
    assert (0, True, True) == (
        code,
        '"signal": "SIGTERM"' in out,
        '"watch_stopped"' in out,
    ), err


def test_resume_without_watch_installs_no_early_handler() -> None:
    """`idempotently resume` (no --watch) keeps Python's defaults: SIGTERM still ends it."""
    code = (
        "import signal, sys\n"
        "sys.argv = ['idempotently', 'resume']\n"
        "import idempotently\n"
        "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert 0 == result.returncode, result.stderr


def test_a_usage_error_gives_a_noted_signal_back(tmp_path: Path) -> None:
    """A command that is not a watch after all re-raises a signal noted early: it dies of it."""
    code = (
        "import os, signal, sys\n"
        "sys.argv = ['idempotently', 'list', 'resume', '--watch']\n"
        "import idempotently\n"
        "from idempotently import _early_signals\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"  # noted, not fatal
        "_early_signals.release()\n"  # what the CLI does for `list`
        "sys.exit(3)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert -signal.SIGTERM == result.returncode, result.stderr


@pytest.mark.parametrize(
    ("argv", "orig_argv", "expected"),
    [
        (["/venv/bin/idempotently", "resume", "--watch"], [], True),
        (["-m", "resume", "--watch"], ["python", "-m", "idempotently", "resume", "--watch"], True),
        (["/venv/bin/idempotently", "--journal", "j.db", "resume", "--watch"], [], True),
        (["/venv/bin/idempotently", "resume"], [], False),
        (["/venv/bin/idempotently", "list"], [], False),
        (["-m", "resume", "--watch"], ["python", "-m", "myapp", "resume", "--watch"], False),
        (["/app/worker.py", "resume", "--watch"], ["python", "/app/worker.py"], False),
        ([], [], False),
    ],
)
def test_only_the_watch_command_notes_early_signals(
    argv: list[str], orig_argv: list[str], expected: bool
) -> None:
    """The early handlers are for `idempotently resume --watch` only, never an app's process."""
    assert expected is _early_signals._is_watch_worker(argv, orig_argv)


def test_a_library_import_changes_no_signal_handler() -> None:
    """Importing idempotently in this (pytest) process left SIGTERM's handler alone."""
    assert _early_signals._note is not signal.getsignal(signal.SIGTERM)


def test_a_watch_started_in_process_sends_nothing_after_an_early_signal(journal: Path) -> None:
    """A signal noted before the watch took over stops it before its first round."""
    sent: list[httpx.Request] = []
    _early_signals._previous[signal.SIGTERM] = signal.getsignal(signal.SIGTERM)
    _early_signals._received.append(signal.SIGTERM)
    try:
        from idempotently._cli_watch import run_watch

        answer = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(201))
        with idempotently.Session(journal, transport=answer) as session:
            summary = run_watch(
                session,
                interval=0.01,
                concurrency=1,
                base_url=None,
                as_json=True,
                terminal=False,
            )
    finally:
        _early_signals._previous.clear()
        _early_signals._received.clear()
    assert ([], 0) == (sent, summary.operations)
