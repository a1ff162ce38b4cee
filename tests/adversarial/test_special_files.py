"""A journal path naming a FIFO, a directory, a device or a socket fails fast, in one line.

SQLite opens whatever it is given, and its open of a FIFO blocks until a
writer comes: every command here runs on a thread with a deadline, so a
regression fails instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import idempotently
from idempotently._special_files import refuse_special_file, special_file_kind
from idempotently.cli import cli

COMMANDS = ["stats", "list", "show op", "resume", "resume --dry-run", "prune --older-than 1d"]
DEADLINE = 5.0
"""Seconds a refusal may take at most on a loaded machine; it takes milliseconds."""


def within_deadline(run: Callable[[], Any]) -> tuple[Any, float]:
    """``run()``'s result and the seconds it took, or a failure if it is still running."""
    outcome: list[Any] = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: outcome.append(run()), daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive(), f"still running after {DEADLINE}s: it blocked on the path"
    return outcome[0], time.monotonic() - started


@pytest.fixture
def fifo(scratch: Path) -> Iterator[Path]:
    path = scratch / "ops.db"
    os.mkfifo(path)
    yield path
    # Release a reader a regression left blocked in open(): a writer lets it through.
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.fixture
def unix_socket(scratch: Path) -> Iterator[Path]:
    path = scratch / "ops.db"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        yield path


@pytest.fixture
def directory(scratch: Path) -> Path:
    path = scratch / "ops.db"
    path.mkdir()
    return path


@pytest.fixture(params=["fifo", "unix_socket", "char_device", "directory"])
def special(request: pytest.FixtureRequest) -> tuple[Path, str]:
    """A path that is not a regular file, and the words that say what it is."""
    return _special(request, request.param)


def _special(request: pytest.FixtureRequest, kind: str) -> tuple[Path, str]:
    """A path of this kind (from its fixture; /dev/null for a device) and what it is called."""
    if kind == "char_device":
        return Path(os.devnull), "a character device"
    words = {"fifo": "a FIFO (named pipe)", "unix_socket": "a socket", "directory": "a directory"}
    return request.getfixturevalue(kind), words[kind]


def invoke(journal: Path, command: str, *, after: bool = False) -> Result:
    args = command.split()
    if after:  # --journal given after the command name
        return CliRunner().invoke(cli, [args[0], "--journal", str(journal), *args[1:]])
    return CliRunner().invoke(cli, ["--journal", str(journal), *args])


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["fifo", "unix_socket", "char_device"])
def test_a_special_file_as_journal_fails_fast_in_one_line(
    request: pytest.FixtureRequest, kind: str, command: str
) -> None:
    """A FIFO, a socket or /dev/null as --journal: exit 1 at once (never blocked on the
    path), one line naming it."""
    path, words = _special(request, kind)
    result, _ = within_deadline(lambda: invoke(path, command))
    lines = result.output.strip().splitlines()
    assert (1, 1, True, True) == (
        result.exit_code,
        len(lines),
        str(path) in lines[0],
        words in lines[0],
    ), result.output


@pytest.mark.parametrize("command", ["stats", "list", "show op"])
def test_a_fifo_given_after_the_command_fails_fast_too(fifo: Path, command: str) -> None:
    """``idempotently stats --journal FIFO`` is refused like the global option."""
    result, _ = within_deadline(lambda: invoke(fifo, command, after=True))
    assert (1, True) == (result.exit_code, "a FIFO (named pipe)" in result.output), result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_a_directory_as_journal_names_it_and_runs_nothing(directory: Path, command: str) -> None:
    """A directory as --journal is refused before anything opens it, naming the path."""
    result, _ = within_deadline(lambda: invoke(directory, command))
    assert (2, True, True) == (
        result.exit_code,
        str(directory) in result.output,
        "is a directory" in result.output,
    ), result.output


def test_the_journal_refused_is_left_as_it_was(fifo: Path) -> None:
    """Refusing a FIFO creates nothing beside it and leaves it a FIFO."""
    within_deadline(lambda: invoke(fifo, "resume"))
    assert (True, ["ops.db"]) == (
        stat.S_ISFIFO(os.stat(fifo).st_mode),
        sorted(os.listdir(fifo.parent)),
    )


# -- the library's check ---------------------------------------------------------------------


def test_refuse_special_file_names_each_kind(special: tuple[Path, str]) -> None:
    """The check raises a JournalError naming the path and what it is."""
    path, words = special
    with pytest.raises(idempotently.JournalCorruptError) as caught:
        refuse_special_file(path)
    assert (True, True) == (str(path) in str(caught.value), words in str(caught.value))


@pytest.mark.parametrize(
    "name", ["missing.db", "no-such-directory/missing.db", ":memory:", "postgresql://db/ops"]
)
def test_a_missing_path_memory_or_url_is_left_to_the_open(scratch: Path, name: str) -> None:
    """A path that does not exist (it may be created), ``:memory:`` or a URL is no special file."""
    path = name if name.startswith(("postgresql:", ":memory:")) else str(scratch / name)
    assert None is special_file_kind(path)


def test_a_regular_file_and_a_symlink_to_one_pass(scratch: Path) -> None:
    """A journal file, directly or through a symlink, is what a journal should be."""
    real = scratch / "real.db"
    real.write_bytes(b"")
    (scratch / "link.db").symlink_to(real)
    assert [None, None] == [special_file_kind(real), special_file_kind(scratch / "link.db")]


def test_a_symlink_to_a_fifo_is_refused(fifo: Path) -> None:
    """What counts is what the open would reach: a link to a FIFO is a FIFO."""
    link = fifo.parent / "link.db"
    link.symlink_to(fifo)
    assert "a FIFO (named pipe)" == special_file_kind(link)


@pytest.mark.parametrize("readonly", [False, True])
def test_the_library_refuses_a_special_file_as_a_journal(
    special: tuple[Path, str], readonly: bool
) -> None:
    """Journal(path) (and so Session, AsyncSession, Transport) on a FIFO, a socket, a device
    or a directory raises JournalCorruptError naming the path and what it is, at once:
    the open never blocks on a FIFO waiting for a writer."""
    path, kind = special

    def open_it() -> BaseException:
        try:
            idempotently.Journal(path, readonly=readonly).close()
        except idempotently.JournalError as error:
            return error
        raise AssertionError(f"{path} was opened as a journal")

    refused, _ = within_deadline(open_it)
    assert isinstance(refused, idempotently.JournalCorruptError)
    assert kind in str(refused) and str(path) in str(refused)
