"""What ``import idempotently`` costs, in instructions (callgrind), beside importing its
own required dependencies in the same environment.

    python benchmarks/bench_import.py                        (nox -s bench -- import)

Both statements run in a fresh interpreter under ``valgrind --tool=callgrind``, each
after a first run that writes their bytecode (to a private ``PYTHONPYCACHEPREFIX``),
as an installed package is imported: pip compiles a wheel's modules at install time.
The figure is the whole process (the interpreter's own start-up included, the same in
both), so the ratio is what a user's ``import`` adds on top of httpx, attrs and anyio.
It also lists the third-party modules that ``import idempotently`` loads beyond them:
the ones that load only when used (sqlite-utils, httpx2, the CLI's click, psycopg,
OpenTelemetry) must not be among them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

DEPENDENCIES = "import httpx, attrs, anyio, sqlite3"
PACKAGE = "import idempotently"
LOADED = (
    "import sys; {deps}; before = set(sys.modules); import idempotently; "
    "print(' '.join(sorted({{m.split('.')[0] for m in set(sys.modules) - before}})))"
)


def instructions(statement: str, env: dict[str, str]) -> int:
    subprocess.run([sys.executable, "-c", statement], env=env, check=True)  # bytecode
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "callgrind.out")
        result = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-c",
                statement,
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    found = re.search(r"Collected : (\d+)", result.stderr)
    if found is None:
        raise SystemExit(f"callgrind said no total:\n{result.stderr}")
    return int(found.group(1))


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PYTHONPYCACHEPREFIX": cache}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        deps = instructions(DEPENDENCIES, env)
        package = instructions(PACKAGE, env)
        loaded = subprocess.run(
            [sys.executable, "-c", LOADED.format(deps=DEPENDENCIES)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    print(f"$ python benchmarks/bench_import.py  (Python {sys.version.split()[0]})")
    print(f"{DEPENDENCIES:<40} {deps / 1e6:>8,.0f} M instructions")
    print(f"{PACKAGE:<40} {package / 1e6:>8,.0f} M instructions  ({package / deps:.2f}x)")
    print("top-level modules it loads beyond them: " + " ".join(loaded))


if __name__ == "__main__":
    main()
