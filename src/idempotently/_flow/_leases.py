"""The lease registry: who owns a lease, and whether that owner still runs (the one part
of the flow that asks the operating system: its hostname, pids, the environment).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import uuid
from collections import Counter

from idempotently._flow._checks import MAX_HOST_ID_LENGTH, check_host_id

HOST_ID_ENVVAR = "IDEMPOTENTLY_HOST_ID"


def default_host_id() -> str:
    """``$IDEMPOTENTLY_HOST_ID`` if set and not empty (checked), else this machine's
    hostname. Empty counts as unset, as it does for the command line's ``--host-id``."""
    configured = os.environ.get(HOST_ID_ENVVAR)
    if configured:
        try:
            return check_host_id(configured)
        except ValueError as error:
            raise ValueError(f"{HOST_ID_ENVVAR}: {error}") from None
    host = socket.gethostname().replace(":", "_")[:MAX_HOST_ID_LENGTH]
    return host if host and host.isprintable() else "localhost"


_HOST = socket.gethostname().replace(":", "_")[:MAX_HOST_ID_LENGTH] or "localhost"


# A random tag of this process, at the start of every owner token it makes: another
# process with the same host id and the same pid (pid 1 in two containers that share
# a hostname) is told apart from an ended flow of ours. Made again after a fork, with
# the pid the owners name (so a call asks the OS for neither).
_PROCESS: tuple[str, str] = ("", "")
_SERIAL = itertools.count(1)


def _new_process() -> None:
    global _PROCESS
    _PROCESS = str(os.getpid()), uuid.uuid4().hex[:6]


_new_process()
os.register_at_fork(after_in_child=_new_process)


def _process_tag() -> str:
    return _PROCESS[1]


def new_lease_owner(host_id: str = _HOST) -> str:
    # The process's tag and a serial number: unique among this process's flows (the tag
    # tells processes with one pid apart), and no system call per call.
    pid, tag = _PROCESS
    return f"{host_id}:{pid}:{tag}{next(_SERIAL):x}"


# The lease owners of this process's flows that are running now (counted: a resume
# worker's owner is shared by the flows of the operations it claimed). A lease held
# by one of them is live even past its lease_until (a long attempt in flight); one
# of this process's owners that is not here belongs to a flow that has ended.
_IN_FLIGHT: Counter[str] = Counter()


_IN_FLIGHT_LOCK = threading.Lock()


def mark_in_flight(owner: str) -> None:
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[owner] += 1


def unmark_in_flight(owner: str) -> None:
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[owner] -= 1
        if _IN_FLIGHT[owner] <= 0:
            del _IN_FLIGHT[owner]


def lease_owner_alive(owner: str, host_id: str = _HOST) -> bool:
    """False only when the owner is provably gone: a dead process on this host, or a
    flow of this process that has ended. An owner of another host id (even another
    process on this machine with another ``host_id``) is alive until its lease expires."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != host_id or not pid_text.isdigit():
        return True
    pid = int(pid_text)
    if pid == os.getpid():
        if not owner.rpartition(":")[2].startswith(_process_tag()):
            return True  # another process with our pid: a container with our host id
        return in_flight(owner)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def in_flight(owner: str) -> bool:
    """Whether ``owner`` is a running flow of this process."""
    with _IN_FLIGHT_LOCK:
        return owner in _IN_FLIGHT
