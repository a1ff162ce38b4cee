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


# A URL naming this project (its docs site, its code host) is a claim the
# repository cannot back: nothing here shows such a site or organisation exists.
# A `.invalid` host (RFC 2606: never resolves) claims nothing, e.g. the mock
# server's problem types.
PROJECT_URL = re.compile(r"https?://(?![\w.-]*\.invalid/)[^\s)>\]\"']*idempotently", re.IGNORECASE)


def project_text_files() -> list[Path]:
    """What states where the project lives: user-facing text plus packaging and site config."""
    return [*user_facing_files(), ROOT / "pyproject.toml", ROOT / "mkdocs.yml"]


def test_nothing_claims_a_docs_site_or_code_host_the_repository_cannot_show() -> None:
    """No README, docs page, docstring, pyproject or mkdocs.yml names a URL for this project."""
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in project_text_files()
        for match in PROJECT_URL.finditer(path.read_text(encoding="utf-8"))
    ]
    assert [] == found


def test_the_project_url_pattern_catches_the_old_claims() -> None:
    """The pattern matches the docs site and code host the README used to assert."""
    old = "at <https://idempotently.readthedocs.io/> and https://github.com/idempotently/x"
    assert 2 == len(PROJECT_URL.findall(old))
    assert not PROJECT_URL.search("https://brandur.org/idempotency-keys")


def test_readme_says_how_to_build_the_docs_locally() -> None:
    """With no published site to point at, the README gives the commands that build it."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "python3 -m mkdocs serve" in readme
    assert "python3 -m nox -s docs" in readme


def test_readme_has_no_relative_links() -> None:
    """The package index cannot resolve a relative link: the README names paths as text."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert [] == [target for target in targets if not target.startswith("https://")]


def test_the_license_file_is_the_mit_license_pyproject_declares() -> None:
    """LICENSE exists and is MIT, as pyproject's license and the README say."""
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert license_text.startswith("MIT License")
    assert re.search(r'^license = "MIT"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert "MIT license" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_docs_and_examples_use_the_default_journal_name() -> None:
    """Every journal file a reader is shown is `idempotently.db`, the CLI's default."""
    from idempotently.cli import DEFAULT_JOURNAL

    shown = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    shown += sorted((ROOT / "examples").glob("*.py"))
    names = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in shown
        for name in re.findall(r"[\w./-]+\.db\b", path.read_text(encoding="utf-8"))
        # `*-api.db`: an example's stand-in API keeping its own records, not a journal;
        # `shop.db` (`shop-sqlalchemy.db`, `shop-django.db`: the ORM examples'): the
        # outbox's journal is the application's own database, named so.
        if Path(name).name
        not in (DEFAULT_JOURNAL, "shop.db", "shop-sqlalchemy.db", "shop-django.db")
        and not name.endswith("-api.db")
        and name != "django.db"  # Django's module (`from django.db import ...`), no file
    }
    # One page shows --journal choosing another file, which is what the option is for;
    # one shows a second journal beside the first, encrypted with a codec.
    assert {"docs/cli.md: payments.db", "docs/journal.md: encrypted.db"} == names


def nav_pages(nav: object) -> list[str]:
    """The pages of mkdocs.yml's nav, in order."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    if isinstance(nav, list):
        return [page for item in nav for page in nav_pages(item)]
    return []


def site_nav() -> list[str]:
    import yaml

    class Loader(yaml.SafeLoader):
        """mkdocs.yml may hold !!python/name tags (material's emoji); none are needed here."""

    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=Loader)
    return nav_pages(config["nav"])


def test_the_nav_lists_every_page_once() -> None:
    """mkdocs.yml's nav holds every page under docs/ exactly once."""
    pages = sorted(str(path.relative_to(ROOT / "docs")) for path in (ROOT / "docs").rglob("*.md"))
    assert pages == sorted(site_nav())


def test_the_nav_reads_in_the_order_a_user_learns() -> None:
    """Home first, then contract, journal, crash, CLI; the reference late; the changelog last."""
    nav = site_nav()
    order = ["index.md", "contract.md", "journal.md", "after-a-crash.md", "cli.md"]
    assert order == [page for page in nav if page in order]
    assert nav.index("mock-server.md") < nav.index("reference/index.md")
    assert ["decisions.md", "changelog.md"] == nav[-2:]


def test_mock_server_help_says_where_its_api_is_described() -> None:
    """`mock-server --help` lists its control endpoints and the pydoc command, not a URL."""
    result = subprocess.run(
        [sys.executable, "-m", "idempotently", "mock-server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert 0 == result.returncode, result.stderr
    assert "/v1/_faults" in result.stdout
    assert "python -m pydoc idempotently.testing" in result.stdout
    assert not re.search(r"https?://", result.stdout)
    assert not re.search(r"\bdocs/[\w-]+\.md\b", result.stdout)
