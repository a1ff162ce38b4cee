"""SIGTERM/SIGINT noted from the first moment of an ``idempotently resume --watch`` worker.

A supervisor (systemd, Kubernetes, a deploy script) may stop a worker it has
just started. Importing the package takes a few hundred milliseconds, and a
SIGTERM in that time used to kill the worker by the signal (exit -15) rather
than ending it cleanly (exit 0). So this module, imported first by the
package, installs handlers at once in a process that is the ``idempotently``
command about to run ``resume --watch``; nothing else is touched, and a
library import never changes a signal handler. The handlers only note the
signal; `take` hands it to the watch's own handlers, and
`release` puts the defaults back (and re-raises a noted signal) when
the command turns out not to be a watch.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
from types import FrameType

WATCHED = (signal.SIGTERM, signal.SIGINT)
_received: list[int] = []
_previous: dict[int, object] = {}


def _is_watch_worker(argv: list[str], orig_argv: list[str]) -> bool:
    """Whether this process is ``idempotently [...] resume [...] --watch``."""
    program = os.path.basename(argv[0]) if argv else ""
    as_script = program in ("idempotently", "idempotently.exe")
    as_module = any(
        flag == "-m" and module == "idempotently" for flag, module in itertools.pairwise(orig_argv)
    )
    return (as_script or as_module) and "resume" in argv[1:] and "--watch" in argv[1:]


def _note(signum: int, frame: FrameType | None) -> None:
    if _received:
        os._exit(128 + signum)  # a second signal: stop now, as the watch does
    _received.append(signum)


def install() -> None:
    """Note SIGTERM and SIGINT from now on, if this process is a watch worker."""
    if _previous or not _is_watch_worker(sys.argv, getattr(sys, "orig_argv", sys.argv)):
        return
    try:
        for signum in WATCHED:
            _previous[signum] = signal.signal(signum, _note)
    except ValueError:  # not the main thread: leave signals alone
        _previous.clear()


def take() -> int | None:
    """The signal noted before the watch took over (None if none); the early handlers
    are no longer needed once the caller installs its own."""
    installed = bool(_previous)
    _previous.clear()
    return _received[0] if installed and _received else None


def release() -> None:
    """Give SIGTERM and SIGINT back their previous handlers; re-raise one noted meanwhile.

    For a command that turned out not to be a watch (a usage error, ``resume``
    without ``--watch``): it is stopped by the signal as it would have been.
    """
    if not _previous:
        return
    for signum, previous in _previous.items():
        signal.signal(signum, previous)  # type: ignore[arg-type]  # what signal() returned
    _previous.clear()
    if _received:
        signal.raise_signal(_received[0])


install()  # on import: the package imports this module before anything slow
