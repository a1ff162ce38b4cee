"""The lease registry: who owns a lease, and whether that owner still runs (the one part
of the flow that asks the operating system: its hostname, pids, the environment).
"""

from __future__ import annotations

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
# a hostname) is told apart from an ended flow of ours. Made again after a fork.
_PROCESS_TAG: tuple[int, str] = (os.getpid(), uuid.uuid4().hex[:6])


def _process_tag() -> str:
    global _PROCESS_TAG
    pid, tag = _PROCESS_TAG
    if pid != os.getpid():
        _PROCESS_TAG = pid, tag = os.getpid(), uuid.uuid4().hex[:6]
    return tag


def new_lease_owner(host_id: str = _HOST) -> str:
    # Six random hex digits, as the first six of a uuid4's hex (which are random too),
    # without building a UUID: one is made per call.
    return f"{host_id}:{os.getpid()}:{_process_tag()}{os.urandom(3).hex()}"


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
