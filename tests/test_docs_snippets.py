"""Every ```python block in README.md and docs/**/*.md runs, as a reader would run it.

How a page is run (new pages are picked up without an edit here):

- Its blocks run in order, in one namespace, as a reader reads the page top to
  bottom; each page starts with a fresh namespace in a fresh, empty directory,
  so ``"idempotently.db"`` is a new journal.
- ``https://api.example.com``, the docs' stand-in for your API, is replaced
  by the URL of a companion mock server started for the page
  (``idempotently.testing.serve()``): every request a block sends gets a real
  answer over loopback. So is ``http://127.0.0.1:8400``, where the tutorial
  has the reader start ``idempotently mock-server --port 8400``.
- A block titled as a file (``title="checkout.py"``) is not run: it is saved
  in that directory under its name, as a reader would save it, and later
  blocks import it (all such files are saved before the first block runs).
- A block may use ``await`` and ``async with`` at top level, as in the
  ``python -m asyncio`` console; it then runs on asyncio.
- A DeprecationWarning is an error: the docs must not teach what is going away.

No block is skipped: one that cannot run as written must be rewritten so that it
can. A failure names the page and the line where the block starts.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from idempotently.testing import serve

from .support import fixed_port_lock

ROOT = Path(__file__).parent.parent
API_PLACEHOLDER = "https://api.example.com"
MOCK_SERVER_ADDRESS = "http://127.0.0.1:8400"
"""Where the tutorial's reader starts `idempotently mock-server`: the page's server too."""
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
# A block titled as a file (```python title="checkout.py") is a file the reader
# saves: it is written to the page's directory, where later blocks import it.
FILE_FENCE = re.compile(
    r'^```python[ \t]+title="([\w.-]+\.py)"[ \t]*\n(.*?)^```[ \t]*$', re.DOTALL | re.MULTILINE
)


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(text: str) -> Iterator[tuple[int, str]]:
    """(line of the block's first code line, code) for each ```python block."""
    for match in FENCE.finditer(text):
        yield text.count("\n", 0, match.start(1)) + 1, match.group(1)


def on_the_page_server(code: str, api_url: str) -> str:
    """The code, its API addresses the page's mock server."""
    return code.replace(API_PLACEHOLDER, api_url).replace(MOCK_SERVER_ADDRESS, api_url)


def run_page(path: Path, name: str, api_url: str) -> None:
    """Run the page's blocks in order in one namespace; fail naming the block that broke."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    text = path.read_text(encoding="utf-8")
    for match in FILE_FENCE.finditer(text):
        Path(match.group(1)).write_text(on_the_page_server(match.group(2), api_url))
    for line, code in python_blocks(text):
        run_block(namespace, name, line, code, api_url)


def run_block(namespace: dict[str, object], name: str, line: int, code: str, api_url: str) -> None:
    """Run one block (starting at ``line`` of page ``name``) in ``namespace``; fail naming
    the block if it raises."""
    # Blank lines first, so that a traceback's line numbers are the page's.
    source = "\n" * (line - 1) + on_the_page_server(code, api_url)
    failure = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            compiled = compile(source, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            if compiled.co_flags & inspect.CO_COROUTINE:
                asyncio.run(eval(compiled, namespace))
            else:
                exec(compiled, namespace)
    except Exception:
        failure = traceback.format_exc()
    if failure is not None:
        pytest.fail(f"the ```python block at {name}:{line} failed:\n{failure}", pytrace=False)


PAGES = [path for path in pages() if any(python_blocks(path.read_text(encoding="utf-8")))]


@pytest.mark.parametrize("path", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_python_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Python block on the page runs as written (the API placeholder on a mock server)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with fixed_port_lock(path.read_text(encoding="utf-8")), serve() as api:
        run_page(path, str(path.relative_to(ROOT)), api.url)


def test_pages_with_python_are_found() -> None:
    """The collector sees the README's and the guides' blocks (it cannot silently find none)."""
    names = {path.relative_to(ROOT).as_posix() for path in PAGES}
    assert {"README.md", "docs/contract.md", "docs/mock-server.md"} <= names


def test_a_failing_block_is_reported_with_its_page_and_line(tmp_path: Path) -> None:
    """A block that raises fails the test with the page and the block's line."""
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n```python\nx = 1\n```\n\ntext\n\n```python\nassert x == 2\n```\n")
    with pytest.raises(pytest.fail.Exception) as failure:
        run_page(page, "docs/page.md", "http://127.0.0.1:9")
    assert "docs/page.md:10" in str(failure.value)
    assert "AssertionError" in str(failure.value)


def test_top_level_await_runs() -> None:
    """A block may await at top level, as in `python -m asyncio`."""
    namespace: dict[str, object] = {}
    code = compile(
        "import asyncio\nawait asyncio.sleep(0)\ndone = True\n",
        "x",
        "exec",
        flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
    )
    assert code.co_flags & inspect.CO_COROUTINE
    asyncio.run(eval(code, namespace))
    assert namespace["done"] is True
