"""One command runner: `nox -s tests lint mypy docs` is what CI runs (see .ci/run)."""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
# A machine without some interpreter still runs what it can.
nox.options.error_on_missing_interpreters = False
nox.options.sessions = ["tests", "lint", "mypy", "docs"]

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite on the interpreter running nox (always present)."""
    session.install("-e", ".[tests]")
    session.run("pytest", "-n", "2", *session.posargs)


@nox.session(python=PYTHONS)
def tests_all(session: nox.Session) -> None:
    """The test suite on every supported interpreter this machine has."""
    session.install(".[tests]")
    session.run("pytest", "-n", "2", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.5")
    session.run("ruff", "check", "src", "tests", "examples", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "examples", "benchmarks", "noxfile.py")


@nox.session
def mypy(session: nox.Session) -> None:
    """Strict mypy on the package and tests/typing: only what they import, not the
    ``tests`` extra (SDKs, Hypothesis, the docs toolchain), which the tests session
    installs once."""
    session.install(
        "-e",
        ".[mock,postgres,otel,httpx2,fernet,sqlalchemy,django]",
        "mypy>=1.10",
        "pytest>=8",  # idempotently.testing.pytest_plugin
        "trio>=0.25",  # _drivers.py wakes a trio loop
        "typing-extensions>=4.6",  # tests/typing/api.py: assert_type on Python 3.10
    )
    session.run("mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml), built with every warning an error."""
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict", "--site-dir", f"{session.create_tmp()}/site")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (not part of CI): the wall-clock table, then the load-independent counts.

    ``nox -s bench`` runs benchmarks/bench.py, then benchmarks/bench_counts.py
    (needs valgrind and strace). ``nox -s bench -- wall ARGS`` runs only bench.py,
    ``nox -s bench -- counts ARGS`` only bench_counts.py, ``nox -s bench -- import`` only
    bench_import.py (what ``import idempotently`` costs), ``nox -s bench -- resume ARGS``
    only bench_resume.py (``idempotently resume`` against a counting app, beside bare
    httpx), each with ARGS; any other arguments go to bench.py, and bench_counts.py runs
    after it with its defaults.
    """
    session.install("-e", ".[mock,postgres]")
    choice, *rest = session.posargs or [""]
    if choice == "counts":
        session.run("python", "benchmarks/bench_counts.py", *rest)
        return
    if choice == "resume":
        session.run("python", "benchmarks/bench_resume.py", *rest)
        return
    if choice == "import":
        session.run("python", "benchmarks/bench_import.py", *rest)
        return
    if choice == "wall":
        session.run("python", "benchmarks/bench.py", *rest)
        return
    session.run("python", "benchmarks/bench.py", *session.posargs)
    session.run("python", "benchmarks/bench_counts.py")
