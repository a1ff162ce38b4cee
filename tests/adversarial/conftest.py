from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adversarial.wire import Wire, serve

# These tests are about values, not durability: journals live in memory-backed
# files where there is one, so that an fsync costs nothing.
_TMPFS = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture(scope="session")
def _wire() -> Iterator[Wire]:
    with serve() as wire:
        yield wire


@pytest.fixture
def wire(_wire: Wire) -> Iterator[Wire]:
    """A raw loopback server: scripted answers, every request kept byte for byte."""
    _wire.reset()
    yield _wire
    _wire.reset()


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """A private directory for journals (on tmpfs when the machine has one)."""
    if _TMPFS is None:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=_TMPFS, prefix="idempotently-adversarial-") as path:
        yield Path(path)


@pytest.fixture
def journal(scratch: Path) -> Path:
    return scratch / "ops.db"
