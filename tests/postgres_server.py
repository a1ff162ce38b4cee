"""A throwaway PostgreSQL server for the tests (and the benchmarks), on 127.0.0.1.

``PostgresServer.start()`` runs Debian's ``initdb`` and ``pg_ctl`` (under
``/usr/lib/postgresql/<version>/bin``, or ``$IDEMPOTENTLY_PG_BIN``) in a
temporary directory: trust authentication, loopback only, a port of its own,
its socket in that directory. As root they run as the ``postgres`` user
(``runuser``); PostgreSQL refuses to run as root. ``stop()`` shuts it down
(immediate mode) and deletes the directory.

Tests get a URL from the ``postgres_url`` fixture (tests/conftest.py): a fresh
database per test. Other code calls :func:`postgres_server` (one server per
pytest-xdist worker) and ``server.new_database()``.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import attrs

_BIN_GLOB = "/usr/lib/postgresql/*/bin"


class PostgresUnavailable(Exception):
    """PostgreSQL cannot be started on this machine (the reason is the message)."""


def find_bin() -> Path:
    """The directory holding initdb and pg_ctl: $IDEMPOTENTLY_PG_BIN, else the newest Debian one."""
    configured = os.environ.get("IDEMPOTENTLY_PG_BIN")
    if configured:
        candidates = [configured]
    else:
        candidates = sorted(
            glob.glob(_BIN_GLOB), key=lambda p: int(Path(p).parent.name), reverse=True
        )
        found = shutil.which("initdb")
        if found:
            candidates.append(str(Path(found).parent))
    for candidate in candidates:
        if (Path(candidate) / "initdb").exists() and (Path(candidate) / "pg_ctl").exists():
            return Path(candidate)
    where = ", ".join(candidates) or f"{_BIN_GLOB} or PATH"
    raise PostgresUnavailable(
        f"no initdb/pg_ctl in {where}; install PostgreSQL (apt-get install postgresql) "
        "or set IDEMPOTENTLY_PG_BIN"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@attrs.define
class PostgresServer:
    """One running server; ``url`` reaches its ``postgres`` database as user ``postgres``."""

    directory: Path
    port: int
    bin: Path
    as_user: list[str]
    fsync: bool
    _names: Iterator[int] = attrs.field(factory=itertools.count)

    @classmethod
    def start(cls, *, fsync: bool = False, parent: Path | None = None) -> PostgresServer:
        """initdb + pg_ctl start; raises PostgresUnavailable with the reason if it cannot.

        The data directory goes in a new directory under ``parent`` (else the
        system's temporary directory).
        """
        bin_dir = find_bin()
        as_user: list[str] = []
        directory = Path(tempfile.mkdtemp(prefix="idempotently-pg-", dir=parent))
        try:
            if os.geteuid() == 0:
                try:
                    shutil.chown(directory, "postgres", "postgres")
                except (LookupError, OSError) as error:
                    raise PostgresUnavailable(
                        f"running as root and cannot hand a directory to user postgres ({error})"
                    ) from error
                as_user = ["runuser", "-u", "postgres", "--"]
            server = cls(directory, _free_port(), bin_dir, as_user, fsync)
            server._run(
                "initdb",
                "-D",
                str(directory / "data"),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            )
            server._pg_ctl_start()
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return server

    def _run(self, program: str, *args: str) -> None:
        command = [*self.as_user, str(self.bin / program), *args]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise PostgresUnavailable(f"{program} failed: {error}") from error
        if result.returncode != 0:
            raise PostgresUnavailable(
                f"{program} exited {result.returncode}: {(result.stderr or result.stdout)[-800:]}"
            )

    def _pg_ctl_start(self) -> None:
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self.directory),
            "fsync": "on" if self.fsync else "off",
            "full_page_writes": "on" if self.fsync else "off",
            "max_connections": "200",
            "shared_buffers": "32MB",
        }
        options = " ".join(f"-c {name}={value}" for name, value in settings.items())
        try:
            self._run(
                "pg_ctl",
                "-D",
                str(self.directory / "data"),
                "-l",
                str(self.directory / "server.log"),
                "-o",
                options,
                "-w",
                "-t",
                "60",
                "start",
            )
        except PostgresUnavailable as error:
            log = self.directory / "server.log"
            tail = log.read_text(errors="replace")[-800:] if log.exists() else ""
            raise PostgresUnavailable(f"{error}\n{tail}") from None

    def url(self, database: str = "postgres", *, password: str | None = None) -> str:
        secret = f":{password}" if password is not None else ""
        return f"postgresql://postgres{secret}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database on this server; its URL."""
        import psycopg

        name = f"t{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name} TEMPLATE template0 STRATEGY file_copy")
        return self.url(name)

    def stop(self) -> None:
        """Stop the server (immediate mode) and delete its directory; safe to call twice."""
        if (self.directory / "data" / "postmaster.pid").exists():
            with contextlib.suppress(PostgresUnavailable):
                self._run("pg_ctl", "-D", str(self.directory / "data"), "-m", "immediate", "stop")
        shutil.rmtree(self.directory, ignore_errors=True)


@contextlib.contextmanager
def postgres_server(*, fsync: bool = False, parent: Path | None = None) -> Iterator[PostgresServer]:
    """A server for the duration of the block, stopped (and deleted) however the block ends."""
    server = PostgresServer.start(fsync=fsync, parent=parent)
    try:
        yield server
    finally:
        server.stop()
