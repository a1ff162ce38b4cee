"""docs/cli.md cannot drift from the CLI: every command, every option, every example."""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import click
import pytest

from idempotently.cli import cli

DOCS = Path(__file__).parent.parent / "docs" / "cli.md"
# Documented ahead of its code (issue 4, item 4); once registered it is
# checked like every other command.
UPCOMING = {"demo"}
_HEADING = re.compile(r"^(#{1,6})\s+`?([^`\n]+?)`?\s*$", re.MULTILINE)


def sections() -> dict[str, str]:
    """Heading text -> the text under it, up to the next heading of the same or higher level."""
    text = DOCS.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", lambda m: m.group(0).replace("#", "\0"), text, flags=re.DOTALL)
    headings = list(_HEADING.finditer(text))
    found: dict[str, str] = {}
    for index, heading in enumerate(headings):
        level = len(heading.group(1))
        end = len(text)
        for later in headings[index + 1 :]:
            if len(later.group(1)) <= level:
                end = later.start()
                break
        found[heading.group(2)] = text[heading.end() : end].replace("\0", "#")
    return found


def registered() -> dict[str, click.Command]:
    """Every command reachable from the group, subcommands named `group sub`."""
    commands: dict[str, click.Command] = {}

    def walk(group: click.Group, prefix: str) -> None:
        for name, command in group.commands.items():
            commands[prefix + name] = command
            if isinstance(command, click.Group):
                walk(command, f"{prefix}{name} ")

    walk(cli, "")
    return commands


def spellings(param: click.Parameter) -> list[str]:
    """How a parameter appears in the docs: every flag spelling, or an argument's metavar."""
    if isinstance(param, click.Option):
        return [*param.opts, *param.secondary_opts]
    return [param.metavar or (param.name or "").upper()]


def examples() -> list[str]:
    """Every `idempotently ...` invocation in the docs' code blocks, synopses excluded."""
    found = []
    for block in re.findall(r"```console\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.DOTALL):
        for line in block.splitlines():
            match = re.search(r"(?:^|\s)idempotently\s+(.*)$", line)
            # A `[` before any pipe marks a synopsis (`[--json]`), not an example.
            if match and "[" not in match.group(1).partition(" | ")[0]:
                found.append(match.group(1))
    return found


COMMANDS = sorted(registered())


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_a_section(name: str) -> None:
    """Each registered command has a `## <name>` (or `### <name>`) section in docs/cli.md."""
    assert name in sections(), f"docs/cli.md has no '## {name}' section"


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_is_documented_in_its_section(name: str) -> None:
    """Each option and argument of a command appears in that command's section."""
    section = sections().get(name, "")
    missing = [
        spelling
        for param in registered()[name].params
        if not getattr(param, "hidden", False)
        for spelling in spellings(param)
        if spelling not in section
    ]
    assert [] == missing, f"undocumented in '## {name}'"


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help(name: str) -> None:
    """`--help` says what each command does."""
    assert (registered()[name].help or "").strip()


def test_global_options_are_documented() -> None:
    """The group's own options, the journal's environment variable included."""
    section = sections()["Global options"]
    for param in cli.params:
        for spelling in spellings(param):
            assert spelling in section
    assert "IDEMPOTENTLY_JOURNAL" in section


def test_no_section_for_a_command_that_does_not_exist() -> None:
    """A lowercase heading is a command's section: it must name a registered command."""
    commandlike = {title for title in sections() if re.fullmatch(r"[a-z][a-z0-9 -]*", title)}
    assert set() == commandlike - set(COMMANDS) - UPCOMING


@pytest.mark.parametrize("example", examples())
def test_examples_parse(example: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every example invocation in the docs is accepted by the CLI as written."""
    lexer = shlex.shlex(example, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    args = []
    for token in lexer:
        if set(token) <= set("();<>|&"):
            break  # a pipe, a redirect, `&&`: the rest is not ours
        args.append(token)
    while args and args[0].startswith("--journal"):
        args = args[2:] if args[0] == "--journal" else args[1:]
    name, rest = args[0], args[1:]
    if name in UPCOMING and name not in COMMANDS:
        pytest.skip(f"{name} is not registered yet")
    for flag, value in itertools.pairwise(rest):
        if flag == "--header-env":
            monkeypatch.setenv(value.partition("=")[2], "set for the example")
    assert name in COMMANDS
    # Under the group's context, as the CLI runs it: a command's context made without
    # it would cache click's default help option (--help only) on the shared command
    # object, and `-h` would fail for every later test.
    group = cli.make_context("idempotently", [], resilient_parsing=True)
    registered()[name].make_context(name, rest, parent=group)  # raises on any usage error


def test_examples_cover_every_command() -> None:
    """Each command has at least one example people can copy."""
    shown = {example.split()[0] for example in examples() if not example.startswith("--")}
    shown |= {example.split()[2] for example in examples() if example.startswith("--journal ")}
    assert set() == set(COMMANDS) - shown


@pytest.mark.parametrize("name", COMMANDS)
def test_every_choice_of_every_option_is_documented(name: str) -> None:
    """Each value a command's choice options accept (e.g. `--format csv`) is in its section."""
    section = sections().get(name, "")
    missing = [
        f"{param.opts[0]} {choice}"
        for param in registered()[name].params
        if isinstance(param, click.Option) and isinstance(param.type, click.Choice)
        if param.opts[0] != "--status"  # documented as prose: every status is listed there
        for choice in param.type.choices
        # `csv`, `table|json|csv`, `{409,423,wait}`: the spellings a section uses.
        if not re.search(rf"[`{{,|]{re.escape(choice)}[`}},|]", section)
    ]
    assert [] == missing, f"undocumented in '## {name}'"


def test_help_options_are_documented() -> None:
    """`-h` and `--help`, the spellings the group accepts, are in Global options."""
    context = cli.make_context("idempotently", ["--journal", "x.db"], resilient_parsing=True)
    for spelling in context.help_option_names:
        assert f"`{spelling}`" in sections()["Global options"]
