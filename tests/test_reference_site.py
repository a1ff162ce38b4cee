"""The API reference, as built: every field of every public class documented, no raw markup.

The site is built the way CI builds it (`mkdocs build --strict`, see the
noxfile's docs session); the checks read the HTML a user reads.
"""

from __future__ import annotations

import html
import inspect
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

import idempotently
from idempotently import profiles, testing

pytest.importorskip("mkdocs", reason="the docs extra builds the site: pip install '.[docs]'")

ROOT = Path(__file__).parent.parent
# A Sphinx role (":class:`Journal`", ":func:`~a.b`") is reStructuredText that a
# Markdown renderer shows as it is: the docstrings use `Name` instead.
SPHINX_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|ref|const):\s*`")
RENDERED_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|ref|const):\s*\S")
PRIVATE_BASE = re.compile(r"Bases:[^\n]*?\b_[A-Za-z]")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documentation site, built strictly into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", **__import__("os").environ},
    )
    assert 0 == result.returncode, result.stdout + result.stderr
    return out


def text_of(page: str) -> str:
    """A page's visible text: tags removed, entities decoded."""
    page = re.sub(r"<(script|style)\b.*?</\1>", " ", page, flags=re.DOTALL)
    return html.unescape(re.sub(r"<[^>]+>", "", page))


def reference_pages(site: Path) -> dict[str, str]:
    return {
        str(path.relative_to(site)): path.read_text(encoding="utf-8")
        for path in sorted((site / "reference").rglob("index.html"))
    }


def test_no_docstring_uses_a_sphinx_role() -> None:
    """The package's docstrings and comments speak Markdown, the renderer's one style."""
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "src" / "idempotently").rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if SPHINX_ROLE.search(line)
    ]
    assert [] == found


def test_the_built_site_shows_no_sphinx_role_and_no_private_base(site: Path) -> None:
    """No page of the built site shows `:class:` text or a private base class."""
    shown = {name: text_of(page) for name, page in reference_pages(site).items()}
    assert shown, "no reference page was built"
    roles = {name: RENDERED_ROLE.findall(text) for name, text in shown.items()}
    bases = {name: PRIVATE_BASE.findall(text) for name, text in shown.items()}
    assert {} == {name: found for name, found in roles.items() if found}
    assert {} == {name: found for name, found in bases.items() if found}


def public_attrs_classes() -> list[tuple[str, type]]:
    """Every public attrs class: its documented path and the class."""
    found = []
    for module in (idempotently, profiles, testing):
        for name in module.__all__:
            value = getattr(module, name)
            seen = any(value is cls for _, cls in found)  # profiles re-exports ServerProfile
            if isinstance(value, type) and attrs.has(value) and not seen:
                found.append((f"{module.__name__}.{name}", value))
    return found


def fields_table(site: Path, path: str) -> dict[str, tuple[str, str, str]]:
    """The rendered field table of the class at `path`: name -> (type, description, default)."""
    for page in reference_pages(site).values():
        start = page.find(f'id="{path}"')
        if start < 0:
            continue
        end = page.find('class="doc doc-heading"', page.find("</h", start))
        section = page[start : end if end > 0 else len(page)]
        table = re.search(r"<table>.*?</table>", section, re.DOTALL)
        if table is None:
            return {}
        rows = {}
        for row in re.findall(
            r"<tr class=\"doc-section-item\">(.*?)</tr>", table.group(0), re.DOTALL
        ):
            cells = [
                " ".join(text_of(cell).split())
                for cell in re.findall(r"<td>(.*?)</td>", row, re.DOTALL)
            ]
            name, *rest = cells
            rows[name] = (*rest, "", "", "")[:3]
        return rows
    pytest.fail(f"{path} has no entry on any reference page", pytrace=False)


@pytest.mark.parametrize(
    ("path", "cls"),
    public_attrs_classes(),
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_every_public_field_is_documented_with_its_type(site: Path, path: str, cls: type) -> None:
    """Each public field of the class shows in its reference table with a type and a description."""
    table = fields_table(site, path)
    fields = [field.name for field in attrs.fields(cls) if not field.name.startswith("_")]
    missing = [name for name in fields if name not in table]
    undescribed = [name for name in fields if name in table and not table[name][1]]
    untyped = [name for name in fields if name in table and not table[name][0]]
    assert ([], [], []) == (missing, undescribed, untyped)


def test_a_field_default_is_shown(site: Path) -> None:
    """Defaults are shown as values (RetryPolicy's max_attempts is 5), not as attrs.field(...)."""
    table = fields_table(site, "idempotently.RetryPolicy")
    assert "5" == table["max_attempts"][2]
    assert not any("attrs.field" in default for _, _, default in table.values())


def public_functions() -> list[tuple[str, object]]:
    """Every public function, and the constructors a user calls: path and object."""
    found: list[tuple[str, object]] = []
    for module in (idempotently, profiles, testing):
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isfunction(value) and not any(value is seen for _, seen in found):
                found.append((f"{module.__name__}.{name}", value))
    for name in ("Session", "AsyncSession", "Transport", "AsyncTransport", "Journal"):
        found.append((f"idempotently.{name}", getattr(idempotently, name).__init__))
    return found


@pytest.mark.parametrize(
    ("path", "function"), public_functions(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_argument_of_a_public_function_is_documented(
    site: Path, path: str, function: object
) -> None:
    """Each argument of a public function or constructor has a described row in its table."""
    wrapped = inspect.unwrap(function)  # type: ignore[arg-type]
    names = [
        ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
        for p in inspect.signature(wrapped).parameters.values()
        if p.name != "self"
    ]
    table = fields_table(site, path)
    assert [] == [name for name in names if not table.get(name, ("", ""))[1]]
