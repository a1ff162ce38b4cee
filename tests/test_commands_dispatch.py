"""Every dispatch on a command's type handles every command: mypy fails where a new
command is not handled (each dispatch is a `match` ending in `assert_never`), every
store applies every write, and each write class carries its own traits."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import pytest

from idempotently import _commands, _commands_rare
from idempotently._commands import (
    BindCredentials,
    ClaimDue,
    Enqueue,
    ExtendLeases,
    Find,
    Insert,
    Journaled,
    JournalWrite,
    PauseOrigin,
    Pauses,
    RebaseOperation,
    RebasePause,
    Record,
    Release,
    RenewLease,
    SetStatus,
    TakeLease,
)
from idempotently._commands_rare import (
    Act,
    AuditNote,
    AuditTrail,
    ForksTaken,
    GroupSteps,
    JournalCommand,
    LookUpLater,
    Queue,
    SwapPause,
    Unpause,
    Write,
)
from idempotently._journal import _closed_message
from idempotently._journal._sqlite import SqliteStore
from idempotently._journal._store import Store
from idempotently._rows import AttemptRecord, Failed, NewOperation, Operation
from tests.memory_store import MemoryStore

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "idempotently"
NOW = 1_800_000_000.0
OWNER = "owner-1"
ORIGIN = "https://api.example.test"
TRAITS = ("durable", "starts_send", "one_statement", "synchronous")


def new(operation_id: str) -> NewOperation:
    return NewOperation(
        operation_id=operation_id,
        key=f"key-{operation_id}",
        delivery="exactly_once",
        method="POST",
        url=f"{ORIGIN}/v1/charges",
        request_headers=(("content-type", "application/json"),),
        request_body=b'{"amount": 1000}',
        fingerprint="f",
        profile="generic",
        key_header="Idempotency-Key",
        created_at=NOW,
        key_expires_at=NOW + 86400,
        deadline_at=None,
    )


def writes(operation: Operation) -> list[Write]:
    """One write of every class, for ``operation`` (op-1, inserted and leased to OWNER)."""
    note = AuditNote("op-1", "lookup", "look_up_later", "not found yet", None)
    return [
        Insert(new("op-2"), OWNER, NOW + 30),
        Enqueue(new("op-3")),
        BindCredentials("op-1", OWNER, record="digest-record"),
        RenewLease("op-1", OWNER, NOW + 60, NOW),
        ExtendLeases((("op-1", OWNER),), NOW + 90, NOW),
        RebaseOperation("op-1", operation.updated_at, NOW),
        PauseOrigin(ORIGIN, "credentials", NOW + 60, "429", NOW),
        RebasePause(ORIGIN, "credentials", NOW),
        SwapPause(ORIGIN, "credentials", "429", NOW, None),
        Unpause(ORIGIN),
        Record(
            "op-1",
            AttemptRecord(started_at=NOW, elapsed=0.1, outcome="answered", status_code=500),
            NOW,
            OWNER,
        ),
        Release("op-1", OWNER),
        TakeLease(operation, OWNER, NOW + 30, NOW),
        ClaimDue(OWNER, NOW, NOW + 30, 10),
        SetStatus("op-3", "abandoned", "not wanted", NOW),
        LookUpLater("op-1", NOW + 60, NOW, note),
        Act(
            operation_id="op-2",
            expect_status="pending",
            expect_lease_owner=OWNER,
            expect_lease_until=NOW + 30,
            expect_updated_at=NOW,
            status="abandoned",
            reason="an operator abandoned it",
            now=NOW,
            audit=(AuditNote("op-2", "operator", "abandon", None, None),),
        ),
    ]


def commands(operation: Operation) -> list[JournalCommand]:
    """One journal command of every class, reads and writes."""
    reads: list[JournalCommand] = [
        Find("op-1", None),
        Queue(("pending",)),
        Pauses(NOW),
        AuditTrail("op-1"),
        ForksTaken(operation),
        GroupSteps("order-42"),
    ]
    return reads + list(writes(operation))


def classes_in_commands_module(base: type) -> set[type]:
    """The classes of ``_commands.py`` and ``_commands_rare.py`` (the commands a call never
    yields, loaded when first named) that subclass ``base``."""
    return {
        value
        for module in (_commands, _commands_rare)
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, base) and value is not base
    }


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres), "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """An empty store of each kind."""
    opened: Store
    if request.param == "sqlite":
        opened = SqliteStore(tmp_path / "journal.db")
    elif request.param == "postgres":
        from idempotently._journal._postgres import PostgresStore

        opened = PostgresStore(str(request.getfixturevalue("postgres_url")))
    else:
        opened = MemoryStore()
    try:
        yield opened
    finally:
        opened.close()


def sample_operation(tmp_path: Path) -> Operation:
    """op-1 as a throwaway SQLite journal holds it, inserted and leased to OWNER."""
    opened = SqliteStore(tmp_path / "journal.db")
    try:
        return leased(opened)
    finally:
        opened.close()


def leased(store: Store) -> Operation:
    """op-1, inserted and leased to OWNER."""
    (inserted,) = store.commit([Insert(new("op-1"), OWNER, NOW + 30)], True)
    assert True is inserted
    operation = store.find("op-1", None)
    assert operation is not None
    return operation


def test_the_unions_name_every_command_class_once() -> None:
    """Write holds every write class of the commands' modules, and JournalCommand every journal
    command class: a class left out of the union would be left out of every dispatch."""
    assert classes_in_commands_module(JournalWrite) == set(get_args(Write))
    assert classes_in_commands_module(Journaled) - {JournalWrite} == set(get_args(JournalCommand))
    assert len(get_args(JournalCommand)) == len(set(get_args(JournalCommand)))


def test_every_write_class_sets_each_of_its_traits_itself() -> None:
    """durable, starts_send, one_statement and synchronous are set on each write class
    (a bool), never inherited: a new write says what it is."""
    unset = {
        (write.__name__, trait)
        for write in get_args(Write)
        for trait in TRAITS
        if not isinstance(vars(write).get(trait), bool)
    }
    assert set() == unset


def test_the_traits_are_those_the_stores_relied_on() -> None:
    """The writes that are durable, start a send, are one statement or always synchronous
    are the ones the journal, SQLite and PostgreSQL treated so before they were traits."""
    expected = {
        "durable": {"Insert", "Enqueue", "BindCredentials"},
        "starts_send": {
            "Insert",
            "Enqueue",
            "TakeLease",
            "RenewLease",
            "BindCredentials",
            "ClaimDue",
        },
        "one_statement": {
            "Insert",
            "Enqueue",
            "TakeLease",
            "RenewLease",
            "BindCredentials",
            "Release",
        },  # not SetStatus: its change to the counts is a second statement (schema 10)
        "synchronous": {write.__name__ for write in get_args(Write)}
        - {"Insert", "Enqueue", "Record"},
    }
    actual = {
        trait: {write.__name__ for write in get_args(Write) if getattr(write, trait)}
        for trait in TRAITS
    }
    assert expected == actual


def test_the_samples_hold_one_command_of_every_class(tmp_path: Path) -> None:
    """The commands the tests below run are one of every journal command class."""
    sampled = [type(command) for command in commands(sample_operation(tmp_path))]
    assert set(get_args(JournalCommand)) == set(sampled)
    assert len(sampled) == len(set(sampled))


def test_every_store_applies_every_write_alone_and_in_one_batch(store: Store) -> None:
    """Each write class is applied by each store, alone and all in one transaction:
    none fails (a write a store did not handle would fail its batch)."""
    every = writes(leased(store))
    alone = [store.commit([write], False)[0] for write in every]
    batch = store.commit(every, False)
    failed = [
        (type(write).__name__, outcome.error)
        for write, outcome in [*zip(every, alone, strict=True), *zip(every, batch, strict=True)]
        if isinstance(outcome, Failed)
    ]
    assert [] == failed


CLOSED_MESSAGES = {
    "in flight": {"Record"},
    "lease was left to expire": {"Release", "ExtendLeases", "RenewLease"},
    "nothing was sent": {
        "Insert",
        "Find",
        "TakeLease",
        "BindCredentials",
        "Queue",
        "ClaimDue",
        "Pauses",
        "AuditTrail",
        "ForksTaken",
        "GroupSteps",
    },
    "this write was not journaled": {
        "Enqueue",
        "SetStatus",
        "Act",
        "LookUpLater",
        "PauseOrigin",
        "RebasePause",
        "RebaseOperation",
        "SwapPause",
        "Unpause",
    },
}


def test_a_closed_journal_says_what_it_means_for_every_command(tmp_path: Path) -> None:
    """A command that finds the journal closed is told what that means for it: in flight
    for an answer, the lease left to expire, nothing sent before a send, or the write
    not journaled."""
    operation = sample_operation(tmp_path)
    actual: dict[str, set[str]] = {phrase: set() for phrase in CLOSED_MESSAGES}
    for command in commands(operation):
        message = _closed_message("journal.db", command)
        (phrase,) = [phrase for phrase in CLOSED_MESSAGES if phrase in message]
        actual[phrase].add(type(command).__name__)
    assert CLOSED_MESSAGES == actual


# -- mypy proves each dispatch exhaustive ---------------------------------------------------

PROBES = """

@attrs.frozen
class ProbeWrite(JournalWrite):
    durable: ClassVar[bool] = False
    starts_send: ClassVar[bool] = False
    one_statement: ClassVar[bool] = False
    synchronous: ClassVar[bool] = False

    operation_id: str


@attrs.frozen
class ProbeRead(Journaled):
    operation_id: str


@attrs.frozen
class ProbeCommand:
    seconds: float


"""

# Where a dispatch must notice each probe: (module, function, the probe it misses).
DISPATCHES = {
    ("_journal/_sqlite.py", "SqliteStore._apply", "ProbeWrite"),
    ("_journal/_postgres.py", "PostgresStore._send", "ProbeWrite"),
    ("_journal/_postgres.py", "PostgresStore._result", "ProbeWrite"),
    ("_journal/__init__.py", "_closed_message", "ProbeWrite"),
    ("_journal/__init__.py", "_closed_message", "ProbeRead"),
    ("_journal/__init__.py", "Journal._execute", "ProbeRead"),
    ("_journal/__init__.py", "Journal._aexecute", "ProbeRead"),
    ("_drivers.py", "run", "ProbeCommand"),
    ("_drivers.py", "arun", "ProbeCommand"),
}


def with_probes(source: str) -> str:
    """``_commands_rare.py`` (where the unions are) with a new write, a new read and a new
    driver command, each added to its union and handled nowhere."""
    changes = [
        ("\nWrite = (\n", PROBES + "Write = (\n    ProbeWrite\n    | "),
        ("\nRead = ", "\nRead = ProbeRead | "),
        ("\nCommand = (\n", "\nCommand = (\n    ProbeCommand\n    | "),
    ]
    for old, replacement in changes:
        assert 1 == source.count(old), f"_commands_rare.py no longer has {old.strip()!r}"
        source = source.replace(old, replacement, 1)
    return source


def function_at(path: Path, line: int) -> str:
    """The qualified name of the innermost function of ``path`` holding ``line``."""
    found = ""

    def visit(node: ast.AST, prefix: str) -> None:
        nonlocal found
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                end = child.end_lineno or child.lineno
                if child.lineno <= line <= end:
                    if not isinstance(child, ast.ClassDef):
                        found = name
                    visit(child, f"{name}.")

    visit(ast.parse(path.read_text()), "")
    return found


@pytest.mark.slow
def test_mypy_fails_at_every_dispatch_that_misses_a_new_command(tmp_path: Path) -> None:
    """A write, a read and a driver command added to their unions and handled nowhere:
    mypy (strict, the project's configuration) reports each dispatch that misses one,
    at its assert_never, and nothing else."""
    pytest.importorskip("mypy")
    shadow = tmp_path / "_commands_rare.py"  # where the unions are
    shadow.write_text(with_probes((PACKAGE / "_commands_rare.py").read_text()))
    cache = tmp_path / "mypy_cache"
    if (ROOT / ".mypy_cache").is_dir():
        # A warm cache for the third-party stubs; a stale entry is only rechecked.
        shutil.copytree(ROOT / ".mypy_cache", cache)
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--cache-dir",
            str(cache),
            "--shadow-file",
            str(PACKAGE / "_commands_rare.py"),
            str(shadow),
            "--no-error-summary",
            "--no-pretty",
            "--show-error-codes",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    reported: set[tuple[str, str, str]] = set()
    for line in checked.stdout.splitlines():
        error = re.match(r"(?P<path>[^:]+):(?P<line>\d+): error: (?P<message>.*)", line)
        if error is None:
            continue
        path = (ROOT / error["path"]).resolve()
        module = path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else path
        missed = re.match(
            r'Argument 1 to "assert_never" has incompatible type "([^"]+)"', error["message"]
        )
        where = (str(module), function_at(path, int(error["line"])))
        for what in missed[1].split(" | ") if missed is not None else [error["message"]]:
            reported.add((*where, what))
    assert DISPATCHES == reported, checked.stdout + checked.stderr
