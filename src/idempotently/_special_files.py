"""Refusing a journal path that names something other than a regular file.

SQLite opens whatever it is given: a FIFO blocks the open until a writer
appears (``idempotently stats`` hung forever), ``/dev/null`` reads as an
empty journal, a directory or a socket fails later with a message about
something else. A path is looked at with ``stat``, which never blocks, before
anything opens it.
"""

from __future__ import annotations

import os
import stat

from idempotently._exceptions import JournalCorruptError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def special_file_kind(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is when it is not a regular file (``"a FIFO (named pipe)"``), else None.

    None too for a path that does not exist or cannot be looked at (a missing
    file, a missing directory, no permission, a ``postgresql://`` URL): opening
    it says what is wrong, and a missing file may be the one to create.
    Symlinks are followed: what counts is what SQLite would open.
    """
    if os.fspath(path) in (":memory:", b":memory:", ""):
        return None
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # missing, ENOTDIR, EACCES, ELOOP, a NUL in the name
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def refuse_special_file(path: str | os.PathLike[str]) -> None:
    """Raise `JournalCorruptError` if ``path`` exists and is not a regular file.

    Cheap (one ``stat``) and never blocks, so it runs before every open.
    """
    kind = special_file_kind(path)
    if kind is not None:
        shown = os.fsdecode(path)
        raise JournalCorruptError(
            f"{shown} is {kind}, not a journal file; point --journal (or Journal()) at the "
            "SQLite file your Session writes, or at a new file's path in an existing directory"
        )
