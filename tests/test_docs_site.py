"""The documentation site stays complete and speaks to a user.

Every public name has a reference entry, no page cites what a reader outside
the project cannot follow, the README's links work on the package index, and
the changelog keeps the Keep a Changelog headings the site shows.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import idempotently
from idempotently import profiles, testing

ROOT = Path(__file__).parent.parent
REFERENCE = ROOT / "docs" / "reference"
DOCS_URL = "https://idempotently.readthedocs.io/"
DIRECTIVE = re.compile(r"^:::[ \t]+([\w.]+)[ \t]*$", re.MULTILINE)

# What a reader outside the project cannot follow: our own planning documents,
# issue numbers, people's roles, work sessions, an article nobody names.
# Name the source instead (Brandur Leach's "Implementing Stripe-like
# Idempotency Keys in Postgres", https://brandur.org/idempotency-keys), or
# say the thing itself.
INTERNAL = {
    "a planning document": re.compile(r"\b(?:DESIGN|STYLE|DEVELOPERS)(?:\.md)?\b|§"),
    "an issue number": re.compile(r"\bissue\s*#?\d+|\bcore issue\b", re.IGNORECASE),
    "an unnamed article": re.compile(r"\bthe article\b|\barticle's\b", re.IGNORECASE),
    "the spec": re.compile(r"\bthe spec\b", re.IGNORECASE),
    "a role in the project": re.compile(r"\bthe lead\b", re.IGNORECASE),
    "a work session": re.compile(
        r"\b(?:previous|last|next) session\b|\bin this session\b", re.IGNORECASE
    ),
}


def documented() -> set[str]:
    """Every object path named by a `::: path` directive in docs/reference/."""
    return {
        path
        for page in REFERENCE.rglob("*.md")
        for path in DIRECTIVE.findall(page.read_text(encoding="utf-8"))
    }


def public_names() -> list[tuple[ModuleType, str]]:
    """Each name a user may import: the package's, profiles' and testing's `__all__`."""
    return [
        (module, name) for module in (idempotently, profiles, testing) for name in module.__all__
    ]


def resolve(path: str) -> object:
    """The object a dotted path names (a module, or an attribute of one)."""
    module_name, _, attribute = path.rpartition(".")
    try:
        return sys.modules.get(path) or __import__(path, fromlist=["_"])
    except ImportError:
        return getattr(__import__(module_name, fromlist=["_"]), attribute)


def is_documented(module: ModuleType, name: str, paths: set[str]) -> bool:
    """`module.name` has an entry, or the same object has one under another public path."""
    if f"{module.__name__}.{name}" in paths:
        return True
    target = getattr(module, name)
    return any(path.rpartition(".")[2] == name and resolve(path) is target for path in paths)


def user_facing_files() -> list[Path]:
    """What a user reads: README, changelog, every docs page, examples, the package's text."""
    return [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "examples").rglob("*.py")),
        *sorted((ROOT / "src" / "idempotently").rglob("*.py")),
    ]


@pytest.mark.parametrize(
    ("module", "name"), public_names(), ids=lambda value: getattr(value, "__name__", value)
)
def test_every_public_name_has_a_reference_entry(module: ModuleType, name: str) -> None:
    """Each name in `__all__` has a `::: path` entry on a page under docs/reference/."""
    if not is_documented(module, name, documented()):
        pytest.fail(
            f"{module.__name__}.{name} is public but no page in docs/reference/ has"
            f" '::: {module.__name__}.{name}'",
            pytrace=False,
        )


def test_a_missing_reference_entry_is_noticed() -> None:
    """The check fails for a public name whose entry is removed."""
    paths = documented()
    assert is_documented(idempotently, "Session", paths)
    assert not is_documented(idempotently, "Session", paths - {"idempotently.Session"})


def test_every_reference_entry_names_a_real_object() -> None:
    """No `::: path` names something that does not exist (a rename would leave one behind)."""
    for path in documented():
        resolve(path)


def test_the_site_includes_the_changelog() -> None:
    """docs/changelog.md is the CHANGELOG itself, not a copy that drifts."""
    assert '--8<-- "CHANGELOG.md"' in (ROOT / "docs" / "changelog.md").read_text()


def test_changelog_headings_follow_keep_a_changelog() -> None:
    """Versions are `## [Unreleased]` or `## [X.Y.Z] - YYYY-MM-DD`, sections the standard six."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    versions = re.findall(r"^## (.*)$", text, re.MULTILINE)
    assert "[Unreleased]" == versions[0]
    for version in versions[1:]:
        assert re.fullmatch(r"\[\d+\.\d+\.\d+(?:[-.]?\w+)*\] - \d{4}-\d{2}-\d{2}", version), version
    kinds = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
    assert set(re.findall(r"^### (.*)$", text, re.MULTILINE)) <= kinds


@pytest.mark.parametrize("path", user_facing_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_no_internal_references(path: Path) -> None:
    """User-facing text cites nothing a reader outside the project cannot follow."""
    text = path.read_text(encoding="utf-8")
    found = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}: {what}:"
        f" {match.group(0)!r}"
        for what, pattern in INTERNAL.items()
        for match in pattern.finditer(text)
    ]
    assert [] == found


def test_internal_reference_patterns_catch_the_old_wording() -> None:
    """The patterns match the phrasings the docs used to have."""
    old = [
        "as the article says",
        "DESIGN §3.3",
        "the core issue's target",
        "see issue 11",
        "in the previous session",
        "where the spec was silent",
    ]
    for phrase in old:
        assert any(pattern.search(phrase) for pattern in INTERNAL.values()), phrase


def test_readme_links_are_absolute() -> None:
    """Every README link works on the package index, which cannot resolve relative paths."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"<(https?://[^>]+)>", text)
    assert targets
    assert [] == [target for target in targets if not target.startswith("https://")]


def test_mock_server_help_points_at_the_site() -> None:
    """`mock-server --help` sends a reader to the docs site, not to a file the wheel lacks."""
    result = subprocess.run(
        [sys.executable, "-m", "idempotently", "mock-server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert 0 == result.returncode, result.stderr
    assert DOCS_URL in result.stdout
    assert not re.search(r"\bdocs/[\w-]+\.md\b", result.stdout)


def test_project_urls_name_the_site_the_changelog_and_the_issues() -> None:
    """The package index links to the docs site, the changelog and the issue tracker."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.urls]", 1)[1].split("\n[", 1)[0]
    urls = dict(re.findall(r'^(\w+) = "([^"]+)"$', section, re.MULTILINE))
    assert DOCS_URL == urls["Documentation"]
    assert urls["Changelog"].endswith("/CHANGELOG.md")
    assert urls["Issues"].endswith("/issues")
    assert urls["Homepage"].startswith("https://")
