"""`import idempotently` loads what a Session needs, and the rest when it is used.

Each probe runs in a fresh interpreter (what a process pays at start-up), and
compares the modules it loaded with those `import httpx, attrs, anyio, sqlite3`
loads. The cost in instructions is measured by `benchmarks/bench_import.py`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

LOADED_WHEN_USED = (
    # third-party: optional extras, and sqlite-utils (only `Journal.db` needs it)
    "sqlite_utils",
    "httpx2",
    "psycopg",
    "psycopg_pool",
    "opentelemetry",
    "cryptography",
    "uvicorn",
    "starlette",
    # what a call answered on its first attempt never uses: tenacity computes a retry's
    # wait, anyio's threads and checkpoints serve async calls
    "tenacity",
    "anyio.to_thread",
    "anyio.lowlevel",
    # the package's own rooms that a call does not use
    "idempotently.cli",
    "idempotently.otel",
    "idempotently.testing",
    "idempotently._journal._postgres",
    "idempotently._transport",
    "idempotently._lookup",
    "idempotently._operator",
    "idempotently._watch",
    "idempotently._flow._resume",
    "idempotently._flow._reconcile",
    "idempotently._flow._enqueue",
    "idempotently._differences",
    "idempotently._waits",
    "idempotently._events",
    "idempotently._commands_rare",
    "idempotently._rows_audit",
)

PROBE = """
import json, sys
import httpx, attrs, anyio, sqlite3
before = set(sys.modules)
{code}
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def loaded(code: str, cwd: Path) -> set[str]:
    """The modules ``code`` loads beyond httpx, attrs, anyio and sqlite3."""
    output = subprocess.run(
        [sys.executable, "-c", PROBE.format(code=code)],
        capture_output=True,
        text=True,
        check=True,
        cwd=cwd,
    ).stdout
    return set(json.loads(output.splitlines()[-1]))


def test_importing_the_package_loads_nothing_a_call_does_not_use(tmp_path: Path) -> None:
    """No CLI, PostgreSQL, OpenTelemetry, lookup, operator action, transport, resume or
    sqlite-utils is loaded by `import idempotently`."""
    modules = loaded("import idempotently", tmp_path)

    assert "idempotently._session" in modules  # the probe sees the package's own modules
    assert [] == [name for name in LOADED_WHEN_USED if name in modules]


def test_a_journaled_call_loads_nothing_more_of_those(tmp_path: Path) -> None:
    """A journaled POST, answered, needs none of the parts loaded when used."""
    code = (
        "import idempotently\n"
        "with idempotently.Session('journal.db', transport=httpx.MockTransport("
        "lambda request: httpx.Response(201))) as session:\n"
        "    assert 201 == session.post('https://api.example/v1/charges', json={}).status_code\n"
    )
    modules = loaded(code, tmp_path)

    assert [] == [name for name in LOADED_WHEN_USED if name in modules]


def test_an_async_journaled_call_loads_none_of_the_packages_rooms(tmp_path: Path) -> None:
    """An AsyncSession's POST, answered (asyncio), needs none of the package's parts loaded
    when used (anyio's threads and checkpoints it does need)."""
    code = (
        "import asyncio, idempotently\n"
        "async def main():\n"
        "    async with idempotently.AsyncSession('journal.db', transport=httpx.MockTransport("
        "lambda request: httpx.Response(201))) as session:\n"
        "        response = await session.post('https://api.example/v1/charges', json={})\n"
        "        assert 201 == response.status_code\n"
        "asyncio.run(main())\n"
    )
    modules = loaded(code, tmp_path)

    assert [] == [
        name for name in LOADED_WHEN_USED if name.startswith("idempotently") and name in modules
    ]


@pytest.mark.parametrize(
    ("code", "module"),
    [
        ("idempotently.Transport", "idempotently._transport"),
        ("idempotently.AsyncTransport", "idempotently._transport"),
        ("idempotently.Lookup", "idempotently._lookup"),
        ("idempotently.Journal('journal.db').db", "sqlite_utils"),
        ("idempotently.Session('journal.db').resume()", "idempotently._flow._resume"),
        ("idempotently.Journal('journal.db').abandon", "idempotently._journal"),
        ("idempotently.RetryPolicy().backoff(1)", "tenacity"),
        ("idempotently.OperationStarted", "idempotently._events"),
        ("idempotently.Journal('journal.db').stats(now=0.0)", "idempotently._rows_audit"),
        (
            "idempotently.Journal('journal.db').unpause('https://api.example')",
            "idempotently._commands_rare",
        ),
    ],
)
def test_what_is_loaded_when_used_is_there_when_used(
    tmp_path: Path, code: str, module: str
) -> None:
    """The public names loaded on first use resolve, and load their module then."""
    modules = loaded(f"import idempotently\n_ = {code}", tmp_path)

    assert module in modules


def test_every_public_name_resolves() -> None:
    """Everything `__all__` names is an attribute (a star import gets them all), and
    `dir()` lists the names loaded on first use."""
    import idempotently

    namespace: dict[str, object] = {}
    exec("from idempotently import *", namespace)

    assert [] == [name for name in idempotently.__all__ if name not in namespace]
    assert {"Transport", "AsyncTransport", "Lookup", "OperationStarted"} <= set(dir(idempotently))
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        idempotently.Nothing  # type: ignore[attr-defined]  # noqa: B018


def test_no_class_on_the_import_path_has_a_builtin_converter(tmp_path: Path) -> None:
    """attrs reads each converter's signature as it makes the class: a builtin's (``tuple``)
    is parsed from its text signature by the tokenizer, 15 M instructions at import."""
    modules = loaded("import idempotently", tmp_path)

    builtin = [
        f"{name}.{cls.__name__}.{field.name}"
        for name in sorted(modules)
        if name.startswith("idempotently")
        for cls in vars(importlib.import_module(name)).values()
        if isinstance(cls, type) and cls.__module__ == name and attrs.has(cls)
        for field in attrs.fields(cls)
        if isinstance(field.converter, type) or inspect.isbuiltin(field.converter)
    ]

    assert [] == builtin
