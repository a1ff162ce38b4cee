"""Every third-party module the package imports is a dependency it declares.

A fresh install resolves only what pyproject.toml names: a module that the test
environment happens to bring in through another package (sniffio came with trio,
openai and anthropic) imports fine here and fails on a user's machine. So the
imports are read from the source (an ast walk over every ``.py``), and each
third-party one must be declared: in ``[project].dependencies`` when a module that
``import idempotently`` loads imports it as it loads, otherwise in the optional
extra it belongs to.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before 3.11
    import tomli as tomllib  # type: ignore[import-not-found,no-redef,unused-ignore]

REPO = Path(__file__).parent.parent
SOURCE = REPO / "src" / "idempotently"

EXTRA_OF_MODULE = {
    "cryptography": "fernet",
    "django": "django",
    "httpx2": "httpx2",
    "opentelemetry": "otel",
    "psycopg": "postgres",
    "psycopg_pool": "postgres",
    "sqlalchemy": "sqlalchemy",
    "starlette": "mock",
    "uvicorn": "mock",
}
"""The optional extra that installs each module imported only on demand."""

BROUGHT_BY_THE_CALLER = {
    "pytest": "the pytest plugin is loaded by pytest itself",
    "trio": "imported only on a trio event loop, which the caller is already running",
}
"""Modules imported only from inside a program that has already imported them."""


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def third_party(name: str) -> str | None:
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top == "idempotently":
        return None
    return top


def imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def guards_import_error(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError"}
    return any(
        handler.type is not None
        and names & {n.id for n in ast.walk(handler.type) if isinstance(n, ast.Name)}
        for handler in node.handlers
    )


def run_on_load(statements: list[ast.stmt]) -> Iterator[str]:
    """The modules these statements import when their module is loaded: not inside a
    function, nor under ``if TYPE_CHECKING``, nor in a ``try`` that expects it missing."""
    for statement in statements:
        yield from imported(statement)
        if isinstance(statement, ast.If):
            if not is_type_checking(statement.test):
                yield from run_on_load(statement.body)
            yield from run_on_load(statement.orelse)
        elif isinstance(statement, ast.Try):
            if not guards_import_error(statement):
                yield from run_on_load(statement.body)
            yield from run_on_load(statement.orelse + statement.finalbody)
        elif isinstance(statement, (ast.With, ast.ClassDef)):
            yield from run_on_load(statement.body)


def loaded_by_import() -> set[str]:
    """The package's modules that ``import idempotently`` loads, in a fresh interpreter."""
    probe = "import idempotently, json, sys; print(json.dumps(sorted(sys.modules)))"
    output = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    ).stdout
    return {name for name in json.loads(output) if name.split(".")[0] == "idempotently"}


def distributions(requirement: str) -> set[str]:
    """The distribution a requirement names and those its extras bring (``psycopg[pool]``
    installs psycopg-pool)."""
    match = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?", requirement)
    assert match is not None, requirement
    name, extras = match.group(1), match.group(2)
    found = {normalized(name)}
    for extra in (e.strip() for e in (extras or "").split(",") if e.strip()):
        for brought in importlib.metadata.requires(name) or []:
            if re.search(rf"extra\s*==\s*['\"]{re.escape(extra)}['\"]", brought):
                found |= distributions(brought.split(";")[0])
    return found


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = {d for r in project["dependencies"] for d in distributions(r)}
    extras = {
        extra: {d for r in requirements for d in distributions(r)}
        for extra, requirements in project["optional-dependencies"].items()
    }
    return required, extras


@functools.cache
def installed() -> Mapping[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions_of(module: str) -> set[str]:
    return {normalized(d) for d in installed().get(module, [])}


def test_every_third_party_import_is_a_declared_dependency() -> None:
    """Each third-party module src/idempotently imports is declared where a fresh install
    finds it: a dependency when `import idempotently` imports it, else its extra."""
    loaded = loaded_by_import()
    required, extras = declared()
    undeclared = []
    for path in sorted(SOURCE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        on_load = {third_party(name) for name in run_on_load(tree.body)} - {None}
        anywhere = {third_party(n) for node in ast.walk(tree) for n in imported(node)} - {None}
        for module in sorted(m for m in anywhere if m is not None):
            if module in BROUGHT_BY_THE_CALLER:
                continue
            dists = distributions_of(module)
            where = f"{path.relative_to(REPO)} imports {module} (distribution {sorted(dists)})"
            if module_name(path) in loaded and module in on_load:
                if not dists & required:
                    undeclared.append(
                        f"{where} as `import idempotently` loads: not in dependencies"
                    )
            elif not dists & (required | extras.get(EXTRA_OF_MODULE.get(module, ""), set())):
                extra = EXTRA_OF_MODULE.get(module)
                undeclared.append(f"{where}: not in dependencies nor in extra {extra!r}")
    assert [] == undeclared


def test_the_mapped_extras_exist() -> None:
    """Each extra the test maps a module to is one pyproject.toml declares."""
    _, extras = declared()
    assert set() == set(EXTRA_OF_MODULE.values()) - set(extras)
