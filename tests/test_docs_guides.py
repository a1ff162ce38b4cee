"""The guides say what the code is: every public exception in contract.md's tree, under
its real parent; every guide linked from the home page; only indexes the journal has."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import idempotently
from idempotently import _exceptions
from idempotently._journal import _sqlite

DOCS = Path(__file__).parent.parent / "docs"


def public_exceptions() -> dict[str, str | None]:
    """Each public exception (idempotently.__all__ and _exceptions), and its parent in
    the tree (the base that is an IdempotentlyError; None for the root)."""
    found = {
        name: value
        for name, value in [
            *((name, getattr(idempotently, name)) for name in idempotently.__all__),
            *vars(_exceptions).items(),
        ]
        if inspect.isclass(value) and issubclass(value, idempotently.IdempotentlyError)
    }
    assert len(found) >= 22
    return {
        name: next(
            (b.__name__ for b in cls.__bases__ if issubclass(b, idempotently.IdempotentlyError)),
            None,
        )
        for name, cls in found.items()
    }


def drawn_tree(page: str) -> dict[str, str | None]:
    """The exception tree drawn in a page's code block: each name and its parent."""
    block = re.search(r"^```\n(IdempotentlyError\n.*?)^```", page, re.DOTALL | re.MULTILINE)
    assert block is not None, "no exception tree starting at IdempotentlyError"
    parents: dict[str, str | None] = {}
    stack: list[str] = []
    for line in block.group(1).splitlines():
        match = re.match(r"^([│├└─\s]*)(\w+Error)\b", line)
        if match is None:
            continue
        depth = len(match.group(1)) // 4
        del stack[depth:]
        parents[match.group(2)] = stack[-1] if stack else None
        stack.append(match.group(2))
    return parents


def test_contracts_exception_tree_names_every_public_exception_under_its_parent() -> None:
    """contract.md draws every public exception, each under the class it subclasses."""
    contract = (DOCS / "contract.md").read_text(encoding="utf-8")
    assert public_exceptions() == drawn_tree(contract)


def test_a_missing_exception_is_noticed() -> None:
    """The tree reader sees a name left out (the check cannot pass on an empty tree)."""
    page = "```\nIdempotentlyError\n├── JournalError\n│   └── CodecError\n└── KeyReuseError\n```\n"
    assert {
        "IdempotentlyError": None,
        "JournalError": "IdempotentlyError",
        "CodecError": "JournalError",
        "KeyReuseError": "IdempotentlyError",
    } == drawn_tree(page)


def test_the_home_page_links_every_guide() -> None:
    """docs/index.md links each page of docs/ (the reference through its own index)."""
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]*)?\)", index))
    guides = {path.name for path in DOCS.glob("*.md")} - {"index.md"}
    assert set() == (guides | {"reference/index.md"}) - linked


def test_the_journal_guide_names_only_indexes_the_journal_has() -> None:
    """journal.md's account of how audits stay fast names indexes a current journal has
    (operations_by_status and operations_finished went with the development schemas)."""
    page = (DOCS / "journal.md").read_text(encoding="utf-8")
    section = page[page.index("## How audits stay fast") :]
    section = section[: section.index("\n## ", 1)]
    every_index = set(re.findall(r"CREATE INDEX (\w+)", inspect.getsource(_sqlite)))
    current = every_index & _sqlite._SCHEMA_NAMES
    named = set(re.findall(r"`(\w+)`", section)) & every_index
    assert named and set() == named - current
