"""The `idempotently` command: a thin layer over Journal and Session.

Each command opens the journal, makes one library call and prints the result:
an aligned table for people on a terminal, one escaped tab-separated record per line
when piped, or ``--format json|csv|nl|...`` for scripts. No command creates a
journal, and read-only ones (list, show, stats, any --dry-run) open it read-only;
any `JournalError` becomes a one-line error (exit 1).
Usage errors (bad option values) exit 2. Reference: the command-line page of the docs.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import re
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

import click
import httpx

from idempotently import __version__, _cli_watch, _early_signals
from idempotently._cli_durations import DURATION, format_duration
from idempotently._cli_format import (
    OPERATION_FIELDS,
    csv_text,
    iso,
    nl_lines,
    one_line,
    operation_detail_json,
    operation_json,
    operation_lines,
    operation_record,
    operation_records,
    operations_table,
    operator_json,
    operator_lines,
    pause_json,
    plural,
    printable,
    record,
    stats_fields,
    stats_lines,
    stats_prometheus,
    wrap_words,
)
from idempotently._cli_watch import ResultTable, run_watch, summary_lines
from idempotently._codec import check_codec
from idempotently._exceptions import JournalError, JournalMissingError, StoredProfileError
from idempotently._flow._checks import check_host_id
from idempotently._flow._config import DEFAULT_KEY_EXPIRY_MARGIN, DEFAULT_LEASE_DURATION
from idempotently._flow._leases import HOST_ID_ENVVAR
from idempotently._flow._operation import ResumeResult
from idempotently._journal import MAX_LIMIT, Journal, migration_sql
from idempotently._lookup import (
    ABSENT_CHOICES,
    DEFAULT_ABSENT_AFTER,
    DEFAULT_BACKOFF,
    DEFAULT_MAX_PAGES,
    Lookup,
)
from idempotently._operator import ActionName
from idempotently._policy import (
    DEFAULT_DEADLINE,
    DEFAULT_MAX_ATTEMPTS,
    MAX_TOTAL_ATTEMPTS_LIMIT,
    RetryPolicy,
    key_born_at,
)
from idempotently._profiles import (
    BUILTIN_PROFILES,
    GENERIC,
    ServerProfile,
    check_key_expiry_margin,
)
from idempotently._rows import Operation
from idempotently._secret_params import param_name_problem, param_value_problem
from idempotently._session import (
    MAX_LEASE_DURATION,
    MAX_RESUME_CONCURRENCY,
    Session,
    check_origin,
)
from idempotently._special_files import refuse_special_file
from idempotently._vocabulary import RESUME_DONE, STATUSES, Status

JOURNAL_ENVVAR = "IDEMPOTENTLY_JOURNAL"
JSON_ESCAPES = {
    code: f"\\u{code:04x}"
    for code in (*range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A))
}
DEFAULT_JOURNAL = "idempotently.db"

F = TypeVar("F", bound=Callable[..., Any])


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--journal",
    "journal_path",
    type=click.Path(dir_okay=False),
    envvar=JOURNAL_ENVVAR,
    show_envvar=True,
    default=DEFAULT_JOURNAL,
    show_default=True,
    metavar="PATH",
    help="The journal your Session writes: a file, or a postgresql:// URL.",
)
@click.version_option(__version__, prog_name="idempotently")
@click.pass_context
def cli(ctx: click.Context, journal_path: str) -> None:
    """Audit and resume the idempotently journal.

    Tables for people on a terminal; piped, one tab-separated record per line
    (escaped: no value can add a field or a line); --format json, csv or nl (one
    JSON object per line) for scripts. Exit status: 0 success, 1 failure (including a missing or
    unreadable journal), 2 usage error.
    """
    if ctx.invoked_subcommand != "resume":
        _early_signals.release()  # only a watch worker keeps what came early


# -- reusable pieces ---------------------------------------------------------------


@contextmanager
def journal_errors() -> Iterator[None]:
    """A journal that cannot be used is the user's to fix: one line, exit 1."""
    try:
        yield
    except JournalError as error:
        raise click.ClickException(str(error)) from None


def with_journal(*, readonly: bool = False, readonly_if: str | None = None) -> Callable[[F], F]:
    """Open the journal but never create it; pass it as the command's first argument.

    ``readonly`` opens it read-only (nothing is created, initialised or written);
    ``readonly_if`` names a flag (``dry_run``) that makes this run read-only.
    Also accepts ``--journal`` after the command name, which wins over the global one.
    """

    def decorate(command: F) -> F:
        def wrapper(ctx: click.Context, /, journal_path: str | None, **options: Any) -> Any:
            path = journal_path or ctx.find_root().params["journal_path"]
            read_only = readonly or bool(readonly_if and options[readonly_if])
            codec = options.pop("codec", None)  # from codec_option, on commands that read bodies
            with journal_errors():
                # Before any open: SQLite's open of a FIFO blocks until a writer comes.
                refuse_special_file(path)
                journal = Journal(path, create=False, readonly=read_only, codec=codec)
            with journal_errors(), journal:
                return command(journal, **options)

        functools.update_wrapper(wrapper, command)
        decorated = click.option(
            "--journal",
            "journal_path",
            type=click.Path(dir_okay=False),
            default=None,
            metavar="PATH",
            help="The journal (same as the global --journal, given after the command).",
        )(click.pass_context(wrapper))
        return decorated  # type: ignore[return-value]  # one parameter less than F

    return decorate


def imported_object(value: str, what: str, ctx: click.Context, param: click.Parameter) -> Any:
    """The object ``package.module:NAME`` names, or a usage error saying why not."""
    module_name, sep, attribute = value.partition(":")
    if not sep or not module_name or not attribute:
        raise click.BadParameter(f"{value!r} is not module:NAME ({what})", ctx, param)
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # an import error of the user's module, whatever it is
        raise click.BadParameter(
            f"cannot import {module_name!r} ({type(error).__name__}: {error}); is it on "
            "PYTHONPATH?",
            ctx,
            param,
        ) from None
    found: Any = module
    for part in attribute.split("."):
        found = getattr(found, part, None)
    return found


def codec_argument(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """``--codec module:NAME``: the codec the journal's bodies were encoded with."""
    if value is None:
        return None
    codec = imported_object(value, "the codec object, e.g. myapp.journal:CODEC", ctx, param)
    try:
        return check_codec(codec)
    except (TypeError, ValueError) as error:
        raise click.BadParameter(f"{value!r}: {error}", ctx, param) from None


def codec_option(command: F) -> F:
    """``--codec module:NAME`` for a command that reads or resends stored bodies
    (``with_journal`` opens the journal with it)."""
    return click.option(
        "--codec",
        "codec",
        callback=codec_argument,
        metavar="MODULE:NAME",
        help="The codec the journal's bodies were encoded with (Journal(codec=...)), named as "
        "module:NAME, e.g. myapp.journal:CODEC. Without it, encoded bodies are not "
        "shown and their operations are not sent.",
    )(command)


FORMAT_MEANINGS = {
    "table": "aligned columns for people",
    "text": "for people",
    "json": "JSON",
    "csv": "CSV with a header row",
    "nl": "one JSON object per line",
    "prometheus": "Prometheus text format, for node-exporter's textfile collector",
}


def format_option(*formats: str, json_flag_as_bool: bool = False) -> Callable[[F], F]:
    """``--format`` with these choices (the first is the default), and ``--json`` for ``json``.

    The command receives ``output_format`` (or, with ``json_flag_as_bool``, only
    ``as_json``). ``--json`` with another ``--format`` is a usage error.
    """
    meanings = "; ".join(f"{name}: {FORMAT_MEANINGS[name]}" for name in formats)

    def decorate(command: F) -> F:
        @functools.wraps(command)
        def wrapper(**options: Any) -> Any:
            as_json, chosen = options.pop("as_json"), options.pop("output_format")
            if as_json and chosen not in (None, "json"):
                raise click.UsageError(f"--json and --format {chosen} contradict; give one")
            output_format = "json" if as_json else chosen or formats[0]
            if json_flag_as_bool:
                return command(**options, as_json=output_format == "json")
            return command(**options, output_format=output_format)

        with_json = click.option("--json", "as_json", is_flag=True, help="Same as --format json.")(
            wrapper
        )
        return click.option(  # type: ignore[return-value]  # keeps F's signature but two options
            "--format",
            "output_format",
            type=click.Choice(formats),
            default=None,
            help=f"How to print ({meanings}). Default: {formats[0]}.",
        )(with_json)

    return decorate


def echo_json(value: object) -> None:
    # JSON escapes C0 controls itself; DEL, C1 and bidi overrides are escaped here too,
    # so no value can drive the terminal of someone reading the output.
    click.echo(json.dumps(value, indent=2, ensure_ascii=False).translate(JSON_ESCAPES))


def echo_records(
    records: Sequence[dict[str, Any]], output_format: str, fields: Sequence[str] = ()
) -> None:
    """Records as ``json`` (one array), ``nl`` (one object per line) or ``csv`` (its
    header row from ``fields`` even when there are no records)."""
    if output_format == "json":
        echo_json(list(records))
    elif output_format == "nl":
        for line in nl_lines(records):
            click.echo(line.translate(JSON_ESCAPES))
    else:
        click.echo(csv_text(records, fields), nl=False)


def terminal_width() -> int:
    """Columns a table may use: the terminal's (or ``COLUMNS``), 80 when unknown."""
    return shutil.get_terminal_size().columns


def prose_width() -> int | None:
    """Columns to wrap sentences at on a terminal (its width, or ``COLUMNS``); None (no
    wrapping) when the output goes to a pipe or a file, so a script reads each value on
    one line."""
    return terminal_width() if _cli_watch.stdout_is_terminal() else None


def echo_records_tsv(records: Iterable[Sequence[object]]) -> None:
    """Piped output for people's tools (grep, cut, awk): one record per line, its
    fields tab-separated, each escaped so that no text can add a field or a line."""
    for cells in records:
        click.echo(record(cells))


def echo_lines(lines: Sequence[str], indent: str = "") -> None:
    for line in lines:
        click.echo(printable(f"{indent}{line}".rstrip()))


def fail(message: str, *, wrap: bool = False) -> None:
    """Exit 1 with the reason on stderr, after the normal output was printed.

    ``wrap``: a long sentence for people is broken between words at the terminal's width.
    """
    text = f"idempotently: {message}"
    click.echo("\n".join(wrap_words(text, terminal_width())) if wrap else text, err=True)
    raise click.exceptions.Exit(1)


# -- list --------------------------------------------------------------------------


@cli.command("list")
@click.option(
    "--status",
    "statuses",
    type=click.Choice(STATUSES),
    multiple=True,
    help="Only operations in this status; repeat for several.",
)
@click.option(
    "--since",
    type=DURATION,
    metavar="DURATION",
    help="Only operations created within this long ago, e.g. 1h or 7d.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=MAX_LIMIT),
    metavar="N",
    help="At most N operations, newest first.",
)
@click.option(
    "--group",
    "group_id",
    metavar="GROUP",
    help="Only the steps of this operation group, in their order.",
)
@format_option("table", "json", "csv", "nl")
@with_journal(readonly=True)
def list_command(
    journal: Journal,
    statuses: tuple[str, ...],
    since: float | None,
    limit: int | None,
    group_id: str | None,
    output_format: str,
) -> None:
    """List operations, newest first.

    With --group, the steps of that operation group, in their order.

    On a terminal the table fits its width: an operation id is never cut (one too
    wide gets a line of its own), the URL gives way first, keeping its host and port.
    Piped, one line per operation, tab-separated and escaped, every value whole.
    """
    now = time.time()
    if group_id is not None:
        # A group's steps are few: filtered here, in their order.
        operations = [
            operation
            for operation in journal.group(group_id)
            if (not statuses or operation.status in statuses)
            and (since is None or operation.created_at >= now - since)
        ][:limit]
    else:
        operations = journal.operations(
            status=statuses or None,  # type: ignore[arg-type]  # click.Choice checked them
            # A window reaching back past 1970 means "everything", not a negative time.
            since=None if since is None else max(0.0, now - since),
            limit=limit,
        )
    if output_format != "table":
        echo_records(
            [operation_json(operation) for operation in operations],
            output_format,
            OPERATION_FIELDS,
        )
        say_damaged(operations)
        return
    piped = not _cli_watch.stdout_is_terminal()
    if not operations:
        # Piped, stdout holds records only: the remark goes to stderr.
        click.echo(
            f"no operations in {journal.path} match"
            if statuses or since or group_id is not None
            else f"no operations in {journal.path}",
            err=piped,
        )
        return
    if piped:
        echo_records_tsv(operation_record(operation) for operation in operations)
    else:
        echo_lines(operations_table(operations, now, width=terminal_width()))
    say_damaged(operations)


def say_damaged(operations: Sequence[Operation]) -> None:
    """On stderr, each listed operation whose row cannot be read: listed with what could
    be read of it, never sent, and not to be mistaken for a sound one."""
    for operation in operations:
        if operation.damaged is not None:
            click.echo(
                printable(
                    f"idempotently: operation {operation.operation_id!r} (key "
                    f"{operation.key!r}) cannot be read: {operation.damaged}; it is never "
                    f"sent as it is: `idempotently show {operation.operation_id}` says what "
                    "is wrong"
                ),
                err=True,
            )


# -- show --------------------------------------------------------------------------


@cli.command("show")
@click.argument("operation_id_or_key", metavar="OPERATION_ID_OR_KEY")
@format_option("text", "json")
@codec_option
@with_journal(readonly=True)
def show_command(journal: Journal, operation_id_or_key: str, output_format: str) -> None:
    """Show one operation: its attempts, headers and bodies.

    For a name that is no operation's but an operation group's, the group: its steps
    in order, where it stopped, which step is next.

    Everything whole: ids, URLs, the reason and each attempt's error. Piped, one
    tab-separated record per line, led by what it is (a field, attempt, audit, ...).

    Secret headers (Authorization, Cookie, X-Api-Key, Proxy-Authorization) are
    never journaled, and never printed even if a journal holds them.
    """
    operation = journal.operation(operation_id_or_key)
    if operation is None and (steps := journal.group(operation_id_or_key)):
        from idempotently._cli_groups import group_json, group_lines

        if output_format == "json":
            echo_json(group_json(operation_id_or_key, steps))
        else:
            echo_lines(group_lines(operation_id_or_key, steps))
        return
    if operation is None:
        raise click.ClickException(
            f"no operation or key '{one_line(operation_id_or_key)}' in {journal.path}"
        )
    entries = journal.audit(operation.operation_id)
    if output_format == "json":
        echo_json({**operation_detail_json(operation), **operator_json(operation, entries)})
    elif not _cli_watch.stdout_is_terminal():
        echo_records_tsv(operation_records(operation, entries, time.time()))
    else:
        now = time.time()
        echo_lines(
            [
                *operation_lines(operation, now, width=prose_width()),
                "",
                *operator_lines(operation, entries, now),
            ]
        )
    if operation.unreadable is not None:
        # Printed without its bodies: a script must not take them for empty ones.
        shown = one_line(operation.operation_id)
        fail(f"the bodies of {shown} are not shown: {operation.unreadable}")


# -- stats -------------------------------------------------------------------------


@cli.command("stats")
@click.option(
    "--stuck-after",
    type=DURATION,
    default=f"{DEFAULT_LEASE_DURATION:g}s",
    show_default=True,
    metavar="DURATION",
    help="A pending operation nobody holds and idle this long counts as stuck.",
)
@click.option(
    "--expiring-within",
    type=DURATION,
    default=format_duration(DEFAULT_KEY_EXPIRY_MARGIN),
    show_default=True,
    metavar="DURATION",
    help="Count pending operations whose key expires within this long (the default, "
    "resume's key-expiry margin for keys that live 10h or more, counts those resume will "
    "no longer resend).",
)
@click.option(
    "--fail-on-stuck",
    is_flag=True,
    help="Exit 1 if anything is stuck or needs reconciling (for cron and alerting).",
)
@format_option("text", "json", "prometheus")
@with_journal(readonly=True)
def stats_command(
    journal: Journal,
    stuck_after: float,
    expiring_within: float,
    fail_on_stuck: bool,
    output_format: str,
) -> None:
    """Counts, rates, stuck operations and expiring keys.

    Operations per status, attempts, replay and 409 rates, retries per
    operation, the oldest pending operation's age, how many are stuck, and how
    many pending keys are about to expire.
    """
    stats = journal.stats(now=time.time(), stuck_after=stuck_after, expiring_within=expiring_within)
    pauses = journal.origin_pauses(now=stats.now)
    if output_format == "json":
        echo_json(
            {
                "journal": journal.path,
                **stats.to_json(),
                "stuck_after": stuck_after,
                "paused_origins": [pause_json(pause, stats.now) for pause in pauses],
                "open_breakers": sum(pause_json(pause)["breaker"] for pause in pauses),
            }
        )
    elif output_format == "prometheus":
        click.echo(stats_prometheus(stats, journal.path, pauses), nl=False)
    elif not _cli_watch.stdout_is_terminal():
        fields = stats_fields(stats, journal.path, stuck_after, pauses)
        echo_records_tsv((name.strip(), value) for name, value in fields)
    else:
        echo_lines(stats_lines(stats, journal.path, stuck_after, pauses, width=prose_width()))
    reconcile = stats.counts["needs_reconcile"]
    if fail_on_stuck and (stats.stuck or reconcile):
        problems = []
        if stats.stuck:
            problems.append(
                f"{plural(stats.stuck, 'operation')} stuck (idle over "
                f"{format_duration(stuck_after)}; run `idempotently resume`)"
            )
        if reconcile:
            problems.append(
                f"{plural(reconcile, 'operation')} "
                f"{'needs' if reconcile == 1 else 'need'} reconciling "
                "(`idempotently list --status needs_reconcile`)"
            )
        fail(f"{journal.path}: " + "; ".join(problems))


# -- resume ------------------------------------------------------------------------


# The lookup reconciler's options (`reconcile`, `resume --reconcile-lookup`).


def params_from_templates(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> dict[str, str]:
    """``NAME=TEMPLATE`` pairs: the lookup's query parameters."""
    params: dict[str, str] = {}
    for value in values:
        name, sep, template = value.partition("=")
        if not sep or not name:
            raise click.BadParameter(
                f"{value!r} is not NAME=TEMPLATE (e.g. 'metadata[operation_id]={{operation_id}}')",
                ctx,
                param,
            )
        params[name] = template
    return params


def lookup_options(*, prefix: str = "") -> Callable[[F], F]:
    """The lookup's options (``--param``, ``--absent``, ...), for ``reconcile`` and, with
    ``prefix="reconcile-"``, for ``resume``."""

    def decorate(command: F) -> F:
        for option in reversed(
            [
                click.option(
                    f"--{prefix}param",
                    "lookup_params",
                    multiple=True,
                    metavar="NAME=TEMPLATE",
                    callback=params_from_templates,
                    help="A query parameter of the lookup; {operation_id} and {key} are "
                    "filled in, URL-encoded. Repeatable.",
                ),
                click.option(
                    f"--{prefix}absent",
                    "absent",
                    type=click.Choice(ABSENT_CHOICES),
                    default="keep",
                    show_default=True,
                    help="What a lookup that finds nothing does: keep it needs_reconcile, "
                    "settle it failed, or settle it failed and fork it (resend under a new "
                    "key). failed and resend need the request to carry the id and the "
                    "consistency window to have passed.",
                ),
                click.option(
                    f"--{prefix}absent-after",
                    "absent_after",
                    type=DURATION,
                    default=format_duration(DEFAULT_ABSENT_AFTER),
                    show_default=True,
                    metavar="DURATION",
                    help="The server's consistency window: absence proves nothing until the "
                    "last attempt that may have been delivered is this old.",
                ),
                click.option(
                    f"--{prefix}match",
                    "match",
                    metavar="PATH",
                    help="Where the objects carry the operation id, a dotted path (default: "
                    "the profile's operation_id_field, else metadata.operation_id).",
                ),
                click.option(
                    f"--{prefix}backoff",
                    "backoff",
                    type=DURATION,
                    default=format_duration(DEFAULT_BACKOFF),
                    show_default=True,
                    metavar="DURATION",
                    help="The base of the lookup backoff: an operation a lookup leaves "
                    "unsettled is looked up again after a random wait up to this long, up "
                    "to twice as long after two unsettled lookups in a row, and so on.",
                ),
                click.option(
                    f"--{prefix}max-backoff",
                    "max_backoff",
                    type=DURATION,
                    default=None,
                    metavar="DURATION",
                    help="The cap of the lookup backoff  [default: 1h, or --backoff if longer]",
                ),
                click.option(
                    f"--{prefix}max-pages",
                    "max_pages",
                    type=click.IntRange(1, 1000),
                    default=DEFAULT_MAX_PAGES,
                    show_default=True,
                    metavar="N",
                    help="The most pages of a list one lookup reads; absence from a list not "
                    "read whole proves nothing.",
                ),
                click.option(
                    f"--{prefix}unpaged",
                    "unpaged",
                    is_flag=True,
                    help="The lookup endpoint never pages: an answer that says nothing of "
                    "pages is the whole list, even when it holds other objects.",
                ),
            ]
        ):
            command = option(command)
        return command

    return decorate


def make_lookup(
    url: str | None,
    params: dict[str, str],
    absent: str,
    absent_after: float,
    match: str | None,
    backoff: float,
    max_backoff: float | None = None,
    max_pages: int = DEFAULT_MAX_PAGES,
    unpaged: bool = False,
) -> Lookup | None:
    """The Lookup the options describe (None without a URL), or a usage error."""
    if url is None:
        return None
    if backoff < 1:
        raise click.BadParameter("must be at least 1s", param_hint="'--backoff'")
    try:
        return Lookup(
            url,
            params=params or None,
            absent=absent,  # type: ignore[arg-type]  # click.Choice checked it
            absent_after=absent_after,
            match=match,
            backoff=backoff,
            max_backoff=max_backoff,
            max_pages=max_pages,
            unpaged=unpaged,
        )
    except (TypeError, ValueError) as error:
        raise click.UsageError(f"the lookup: {error}") from None


def headers_from_env(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> dict[str, str]:
    """``NAME=ENVVAR`` pairs to headers; credentials come from the environment, never argv."""
    headers: dict[str, str] = {}
    for value in values:
        name, envvar = env_pair(value, "Authorization=MY_TOKEN", ctx, param)
        if not HEADER_NAME.fullmatch(name):
            raise click.BadParameter(
                "NAME must be a header name (letters, digits and !#$%&'*+-.^_`|~); what was "
                "given is not repeated here, in case it holds a credential",
                ctx,
                param,
            )
        if envvar not in os.environ:
            raise click.BadParameter(
                f"environment variable {envvar} is not set (needed for the {name} header)",
                ctx,
                param,
            )
        secret = os.environ[envvar]
        # Never quote the value: it is a credential.
        problem = header_value_problem(secret)
        if problem is not None:
            raise click.BadParameter(
                f"environment variable {envvar} (for the {name} header) {problem}; nothing "
                "was sent",
                ctx,
                param,
            )
        headers[name] = secret
    return headers


HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
ENVVAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def env_pair(
    value: str, example: str, ctx: click.Context, param: click.Parameter
) -> tuple[str, str]:
    """``NAME=ENVVAR`` split, or a usage error that never repeats ``value``.

    The usual slip is a credential where the variable's name belongs
    (``Authorization=Bearer sk_live_...``): echoing it would put the secret on the
    screen and in CI logs, so no message quotes what was given."""
    name, sep, envvar = value.partition("=")
    name, envvar = name.strip(), envvar.strip()
    if not sep or not name or not envvar:
        raise click.BadParameter(
            f"give NAME=ENVVAR (e.g. {example}); what was given is not repeated here, in "
            "case it holds a credential",
            ctx,
            param,
        )
    if not ENVVAR_NAME.fullmatch(envvar):
        raise click.BadParameter(
            "ENVVAR must be an environment variable's name (letters, digits and _, e.g. "
            f"{example}), not a value: put the credential in a variable and name that; "
            "what was given is not repeated here",
            ctx,
            param,
        )
    return name, envvar


def params_from_env(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> dict[str, str]:
    """``NAME=ENVVAR`` pairs to the values of redacted query parameters, from the
    environment (never argv); the value is never quoted in a message."""
    params: dict[str, str] = {}
    for value in values:
        name, envvar = env_pair(value, "api_key=MY_API_KEY", ctx, param)
        problem = param_name_problem(name)
        if problem is not None:
            raise click.BadParameter(
                f"NAME {problem}; what was given is not repeated here, in case it holds a "
                "credential",
                ctx,
                param,
            )
        if envvar not in os.environ:
            raise click.BadParameter(
                f"environment variable {envvar} is not set (needed for the {name} query parameter)",
                ctx,
                param,
            )
        secret = os.environ[envvar]
        problem = param_value_problem(secret)
        if problem is not None:
            raise click.BadParameter(
                f"environment variable {envvar} (for the {name} query parameter) {problem}; "
                "nothing was sent",
                ctx,
                param,
            )
        params[name] = secret
    return params


def header_value_problem(value: str) -> str | None:
    """What makes ``value`` unsendable as a header value, without quoting it; None if fine."""
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        return "holds characters outside latin-1"
    if value != value.strip(" \t\r\n"):
        return "starts or ends with whitespace or a line break (check for a stray newline)"
    if any((ord(char) < 0x20 and char != "\t") or ord(char) == 0x7F for char in value):
        return "holds a control character (a line break, NUL, ...)"
    return None


def checked_base_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        check_origin(value)
    except ValueError as error:
        raise click.BadParameter(str(error), ctx, param) from None
    return value


def profile_option(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> ServerProfile | None:
    """A built-in profile by name, or ``package.module:NAME`` for one of the user's;
    None when not given (each operation's stored profile)."""
    if value is None:
        return None
    if value in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[value]
    profile = imported_object(
        value,
        f"nor a built-in profile: {', '.join(sorted(BUILTIN_PROFILES))}",
        ctx,
        param,
    )
    if not isinstance(profile, ServerProfile):
        raise click.BadParameter(
            f"{value!r} is not an idempotently.ServerProfile (found {type(profile).__name__})",
            ctx,
            param,
        )
    return profile


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


def host_id_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return check_host_id(value)
    except ValueError as error:
        raise click.BadParameter(str(error), ctx, param) from None


@cli.command("resume")
@click.option("--dry-run", is_flag=True, help="Say what would be done; send nothing.")
@click.option(
    "--base-url",
    metavar="URL",
    callback=checked_base_url,
    help="Send to this origin (scheme, host, port) instead of the journaled one.",
)
@click.option(
    "--header-env",
    "headers",
    multiple=True,
    metavar="NAME=ENVVAR",
    callback=headers_from_env,
    help="Send header NAME with the value of environment variable ENVVAR; repeatable.",
)
@click.option(
    "--param-env",
    "params",
    multiple=True,
    metavar="NAME=ENVVAR",
    callback=params_from_env,
    help="Give the secret query parameter NAME (journaled redacted) the value of environment "
    "variable ENVVAR; repeatable.",
)
@codec_option
@click.option(
    "--profile",
    "profile",
    callback=profile_option,
    metavar="NAME",
    help="Read answers with this profile: a built-in's name (generic, stripe, ietf, "
    "django-idempotency-key, asgi-idempotency-header, express-idempotency, rocket-rides, "
    "adyen, paypal, aws-powertools, increase), or module:NAME for a ServerProfile of your "
    "own (default: the one each operation was journaled under; an operation whose stored "
    "profile differs is "
    "refused unless --force-profile).",
)
@click.option(
    "--force-profile",
    is_flag=True,
    help="With --profile: read every operation with it, even where it differs from the "
    "profile the operation was journaled under.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, MAX_RESUME_CONCURRENCY),
    default=1,
    show_default=True,
    metavar="N",
    help="Resume N operations at once, each under its own lease.",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(1, 1000),
    metavar="N",
    help=f"Attempts per operation in this run (default {DEFAULT_MAX_ATTEMPTS}).",
)
@click.option(
    "--max-total-attempts",
    type=click.IntRange(1, MAX_TOTAL_ATTEMPTS_LIMIT),
    metavar="N",
    help="Cap on the attempts that reached the server per operation, counted from the "
    "journal across every run and process: at the cap it goes to needs_reconcile (failed "
    "when none can have acted). With a cap journaled by the call, the smaller applies.",
)
@click.option(
    "--deadline",
    type=DURATION,
    metavar="DURATION",
    help="Time per operation in this run, waits and each attempt included, e.g. 10s "
    f"(default {DEFAULT_DEADLINE:g}s).",
)
@click.option(
    "--watch",
    is_flag=True,
    help="Keep resuming operations as they fall due, until SIGTERM or SIGINT (a worker).",
)
@click.option(
    "--interval",
    type=DURATION,
    default="5s",
    show_default=True,
    metavar="DURATION",
    help="With --watch: how long to sleep when nothing is due.",
)
@click.option(
    "--host-id",
    envvar=HOST_ID_ENVVAR,
    show_envvar=True,
    callback=host_id_option,
    metavar="ID",
    help="This host's identity in lease owners (default: the hostname).",
)
@click.option(
    "--lease-duration",
    type=DURATION,
    default=f"{DEFAULT_LEASE_DURATION:g}s",
    show_default=True,
    metavar="DURATION",
    help="How long a lease outlives a worker that died (live ones renew theirs).",
)
@click.option(
    "--key-expiry-margin",
    type=DURATION,
    metavar="DURATION",
    help="Do not resend a key with less than this left of its lifetime (at least 60s, below "
    "the key's lifetime; default: the margin journaled with each operation's profile, "
    "min(1h, max(60s, lifetime/10)) unless the profile sets one). The larger of the two "
    "applies.",
)
@click.option(
    "--reconcile-lookup",
    "reconcile_lookup",
    metavar="URL",
    help="Also reconcile needs_reconcile operations by looking each one up at URL "
    "(as `reconcile --lookup`); with --watch, as the worker goes.",
)
@lookup_options(prefix="reconcile-")
@format_option("table", "json", json_flag_as_bool=True)
@with_journal(readonly_if="dry_run")
def resume_command(
    journal: Journal,
    dry_run: bool,
    base_url: str | None,
    headers: dict[str, str],
    params: dict[str, str],
    profile: ServerProfile | None,
    force_profile: bool,
    concurrency: int,
    max_attempts: int | None,
    max_total_attempts: int | None,
    deadline: float | None,
    watch: bool,
    interval: float,
    host_id: str | None,
    lease_duration: float,
    key_expiry_margin: float | None,
    reconcile_lookup: str | None,
    lookup_params: dict[str, str],
    absent: str,
    absent_after: float,
    match: str | None,
    backoff: float,
    max_backoff: float | None,
    max_pages: int,
    unpaged: bool,
    as_json: bool,
) -> None:
    """Finish pending operations with their stored keys and bytes.

    Sends the journaled request bytes again, byte-identical. Operations whose
    key the server may have forgotten are not resent: they become
    needs_reconcile. Exit 1 if any operation ended failed or
    needs_reconcile, could not be sent, or is left pending, or if the journal
    still holds pending or needs_reconcile operations (with --dry-run, exit 0).
    With --watch, a worker: it resumes operations as they fall due and exits 0
    on SIGTERM or SIGINT once its leases are released.
    """
    if not watch:
        _early_signals.release()
    results: list[ResumeResult] = []
    if deadline is not None and deadline <= 0:
        raise click.BadParameter("must be more than 0s", param_hint="'--deadline'")
    if watch and dry_run:
        raise click.UsageError("--watch and --dry-run do not go together: a watch sends")
    lookup = make_lookup(
        reconcile_lookup,
        lookup_params,
        absent,
        absent_after,
        match,
        backoff,
        max_backoff,
        max_pages,
        unpaged,
    )
    if lookup is not None and dry_run:
        raise click.UsageError("--reconcile-lookup and --dry-run do not go together")
    if force_profile and profile is None:
        raise click.UsageError("--force-profile needs --profile NAME: the profile to force")
    if interval <= 0:
        raise click.BadParameter("must be more than 0s", param_hint="'--interval'")
    if not 0 < lease_duration <= MAX_LEASE_DURATION:
        raise click.BadParameter(
            f"must be more than 0s and at most {format_duration(MAX_LEASE_DURATION)}",
            param_hint="'--lease-duration'",
        )
    if key_expiry_margin is not None:
        try:
            check_key_expiry_margin(
                key_expiry_margin, None if profile is None else profile.key_lifetime, "it"
            )
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="'--key-expiry-margin'") from None
    policy = RetryPolicy(
        max_attempts=max_attempts or DEFAULT_MAX_ATTEMPTS,
        deadline=deadline or DEFAULT_DEADLINE,
        max_total_attempts=max_total_attempts,
    )
    # An attempt in flight is never cut short by the policy: the client's timeout
    # bounds it, so a dead host costs the deadline, not the default five seconds per try.
    timeout = httpx.Timeout(min(deadline, 5.0)) if deadline is not None else httpx.Timeout(5.0)
    session = Session(
        journal,
        headers=headers,
        # Whatever came from the environment is a credential: never journaled or printed.
        redact_headers=list(headers),
        profile=profile or GENERIC,
        profile_rule="stored_only" if profile is None else "forced" if force_profile else "checked",
        policy=policy,
        timeout=timeout,
        host_id=host_id,
        lease_duration=lease_duration,
        # Checked against the profile above; each operation's own lifetime is checked below.
        key_expiry_margin=key_expiry_margin,
        # Only the operations that were journaled with these parameters redacted get them.
        redacted_params=params,
    )
    with session:
        refuse_disagreeing_profiles(session, journal)
        if key_expiry_margin is not None:
            refuse_margin_past_lifetimes(journal, key_expiry_margin)
        if watch:
            run_watch(
                session,
                interval=interval,
                concurrency=concurrency,
                base_url=base_url,
                as_json=as_json,
                terminal=stderr_is_terminal(),
                reconciler=lookup,
            )
            return
        results = resume_printing(
            session, journal, dry_run, base_url, concurrency, as_json, reconciler=lookup
        )
    if as_json:
        echo_json([result.to_json() for result in results])
    else:
        echo_resume_summary(results, journal.path, dry_run)
    if dry_run:
        return
    unsettled = Counter(
        result.action
        for result in results
        if not (result.action in RESUME_DONE or result.status == "succeeded")
    )
    left = journal.counts()
    if unsettled or left["pending"] or left["needs_reconcile"]:
        ended = ", ".join(f"{count} {action}" for action, count in sorted(unsettled.items()))
        fail(
            (f"{ended}; " if ended else "") + f"{journal.path} has {left['pending']} pending and "
            f"{left['needs_reconcile']} needs_reconcile "
            "(`idempotently list --status pending --status needs_reconcile`)",
            wrap=stderr_is_terminal(),
        )


def refuse_disagreeing_profiles(session: Session, journal: Journal) -> None:
    """Exit 2, before anything is sent, if a pending operation's stored profile disagrees
    with ``--profile`` (or needs one: journaled before profiles were stored).

    A stored profile that cannot be read back (its matcher's module is gone) is no
    refusal: that operation is reported not_sent and stays pending; the others go on."""
    for operation in journal.operations(status="pending", newest_first=False):
        try:
            session.profile_for(operation)
        except StoredProfileError as error:
            if error.kind != "unavailable":
                click.echo(f"idempotently: {printable(str(error))}", err=True)
                raise click.exceptions.Exit(2) from None


def refuse_margin_past_lifetimes(journal: Journal, margin: float) -> None:
    """Exit 2, before anything is sent, if ``--key-expiry-margin`` is at or above the key
    lifetime of a pending operation: every such operation would go to needs_reconcile."""
    for operation in journal.operations(status="pending", newest_first=False):
        lifetime = operation.key_expires_at - key_born_at(operation)
        if margin >= lifetime:
            raise click.BadParameter(
                f"it ({format_duration(margin)}) is at or above the key lifetime "
                f"({format_duration(lifetime)}) of operation {operation.operation_id!r} (key "
                f"{operation.key!r}): no key could be resent; nothing was sent",
                param_hint="'--key-expiry-margin'",
            )


def resume_printing(
    session: Session,
    journal: Journal,
    dry_run: bool,
    base_url: str | None,
    concurrency: int,
    as_json: bool,
    reconciler: Lookup | None = None,
) -> list[ResumeResult]:
    """Resume, printing each result as soon as it is known (unless --json); a progress
    bar on stderr when it is a terminal and there is work, never for a dry run."""
    if as_json:
        return session.resume(
            reconciler=reconciler, dry_run=dry_run, base_url=base_url, concurrency=concurrency
        )
    counts = journal.counts()
    total = counts["pending"] + (counts["needs_reconcile"] if reconciler is not None else 0)
    statuses: tuple[Status, ...] = ("pending",)
    if reconciler is not None:
        statuses = ("pending", "needs_reconcile")
    return with_progress(
        "resuming",
        total if not dry_run else 0,
        ResultTable(
            sized_by(journal, statuses),
            dry_run=dry_run,
            terminal=_cli_watch.stdout_is_terminal(),
            clear_bar=bool(total) and not dry_run and stderr_is_terminal(),
        ),
        lambda on_result: session.resume(
            reconciler=reconciler,
            dry_run=dry_run,
            base_url=base_url,
            on_result=on_result,
            concurrency=concurrency,
        ),
    )


ID_SAMPLE = 1000
"""Ids a result table is sized by: the oldest this many of those it will print (an id
outside them that does not fit gets a line of its own, never cut)."""


def sized_by(journal: Journal, statuses: tuple[Status, ...]) -> list[str]:
    """The ids of the operations a run will print, to size its table's id column."""
    operations = journal.operations(status=statuses, limit=ID_SAMPLE, newest_first=False)
    return [operation.operation_id for operation in operations]


def with_progress(
    label: str,
    total: int,
    table: ResultTable,
    run: Callable[[Callable[[ResumeResult], None]], list[ResumeResult]],
) -> list[ResumeResult]:
    """``run`` with each result printed by ``table``, under a progress bar on stderr
    when it is a terminal and there is work (``table`` clears the bar's line first)."""
    if not (total and stderr_is_terminal()):
        return run(table)
    with click.progressbar(length=total, label=label, file=sys.stderr, show_pos=True) as bar:

        def on_result(result: ResumeResult) -> None:
            table(result)
            bar.update(1)

        return run(on_result)


def echo_summary(lines: Sequence[str]) -> None:
    """A run's summary: on a terminal after a blank line, wrapped; piped, on stderr, so
    stdout holds the records alone."""
    terminal = _cli_watch.stdout_is_terminal()
    width = terminal_width()
    if terminal:
        click.echo()
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip()) + 2)
        first, *rest = wrap_words(line, width - len(indent)) if terminal else [line]
        click.echo(first, err=not terminal)
        for more in rest:
            click.echo(indent + more, err=not terminal)


def echo_resume_summary(results: Sequence[ResumeResult], path: str, dry_run: bool) -> None:
    if not results:
        click.echo(f"nothing to resume in {path}", err=not _cli_watch.stdout_is_terminal())
        return
    echo_summary(summary_lines(results, "planned" if dry_run else "resumed"))


# -- reconcile: the lookup reconciler ----------------------------------------------


@cli.command("reconcile")
@click.option(
    "--lookup",
    "lookup_url",
    required=True,
    metavar="URL",
    help="Where to look each operation up: an absolute URL, or a path on each operation's "
    "own origin; {operation_id} and {key} are filled in, URL-encoded.",
)
@lookup_options()
@click.option(
    "--header-env",
    "headers",
    multiple=True,
    metavar="NAME=ENVVAR",
    callback=headers_from_env,
    help="Send header NAME with the value of environment variable ENVVAR; repeatable.",
)
@format_option("table", "json", json_flag_as_bool=True)
@with_journal()
def reconcile_command(
    journal: Journal,
    lookup_url: str,
    lookup_params: dict[str, str],
    absent: str,
    absent_after: float,
    match: str | None,
    backoff: float,
    max_backoff: float | None,
    max_pages: int,
    unpaged: bool,
    headers: dict[str, str],
    as_json: bool,
) -> None:
    """Settle needs_reconcile operations by looking them up.

    Looks each one up on the server.

    One GET per operation (credentials from --header-env, nothing journaled).
    Exactly one object carrying the operation's id settles it succeeded, the
    object stored as its answer; several leave it (ambiguous); none is what
    --absent says. Nothing pending is resent. Exit 0 when every operation
    looked at was settled, 1 when any stays or a lookup failed, 2 on usage
    errors.
    """
    lookup = make_lookup(
        lookup_url,
        lookup_params,
        absent,
        absent_after,
        match,
        backoff,
        max_backoff,
        max_pages,
        unpaged,
    )
    assert lookup is not None
    session = Session(
        journal,
        headers=headers,
        # Whatever came from the environment is a credential: never journaled or printed.
        redact_headers=list(headers),
        timeout=httpx.Timeout(10.0),
    )
    with session:
        if as_json:
            results = session.reconcile(lookup)
        else:
            total = journal.counts()["needs_reconcile"]
            table = ResultTable(
                sized_by(journal, ("needs_reconcile",)),
                dry_run=False,
                terminal=_cli_watch.stdout_is_terminal(),
                clear_bar=bool(total) and stderr_is_terminal(),
            )
            results = with_progress(
                "reconciling",
                total,
                table,
                lambda on_result: session.reconcile(lookup, on_result=on_result),
            )
    if as_json:
        echo_json([result.to_json() for result in results])
    elif not results:
        click.echo(
            f"nothing needs reconciling in {journal.path}",
            err=not _cli_watch.stdout_is_terminal(),
        )
    else:
        lines = summary_lines(results, "looked up")
        # Held back by a paused origin: nothing was sent to it (the lines say until when).
        deferred = sum(r.status == "needs_reconcile" and r.action == "waiting" for r in results)
        if deferred:
            lines.append(
                f"{plural(deferred, 'operation')} not looked up: origin paused (each line "
                "says until when; `idempotently stats` lists the pauses, `idempotently "
                "unpause ORIGIN` lifts one)"
            )
        echo_summary(lines)
    left = [result for result in results if result.action != "reconciled"]
    if left:
        fail(
            f"{plural(len(left), 'operation')} not settled "
            "(`idempotently list --status needs_reconcile`; `idempotently show ID` says why)"
        )


# -- prune -------------------------------------------------------------------------


@cli.command("prune")
@click.option(
    "--older-than",
    type=DURATION,
    required=True,
    metavar="DURATION",
    help="Delete finished operations not updated for this long, e.g. 7d.",
)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@format_option("text", "json")
@with_journal(readonly_if="dry_run")
def prune_command(journal: Journal, older_than: float, dry_run: bool, output_format: str) -> None:
    """Delete old finished operations and their attempts.

    Finished means succeeded, failed or abandoned. Never deletes pending or
    needs_reconcile operations: they still need work.
    """
    count = journal.prune(older_than=older_than, now=time.time(), dry_run=dry_run)
    if output_format == "json":
        verb = "would_delete" if dry_run else "deleted"
        echo_json({verb: count, "dry_run": dry_run, "older_than": older_than})
        return
    verb = "would delete" if dry_run else "deleted"
    click.echo(
        f"{verb} {plural(count, 'finished operation')} idle over "
        f"{format_duration(older_than)} from {journal.path}"
    )


# -- operator actions: settle, abandon, retry, fork -----------------------------------


def operator_options(*, note_required: bool) -> Callable[[F], F]:
    """``--note``, ``--actor``, ``--dry-run`` and ``--format``: what every action takes."""

    def decorate(command: F) -> F:
        for option in reversed(
            [
                click.option(
                    "--note",
                    required=note_required,
                    metavar="TEXT",
                    help="Why (what you checked): kept in the operation's audit trail."
                    + ("" if note_required else " Optional."),
                ),
                click.option(
                    "--actor",
                    metavar="NAME",
                    help="Who acts, for the audit trail (default: user@host).",
                ),
                click.option(
                    "--dry-run", is_flag=True, help="Check and say what it would do; write nothing."
                ),
                format_option("text", "json"),
            ]
        ):
            command = option(command)
        return command

    return decorate


def run_action(
    journal: Journal,
    action: ActionName,
    operation_id: str,
    *,
    note: str | None,
    actor: str | None,
    dry_run: bool,
    output_format: str,
    status: str | None = None,
) -> None:
    """One operator action through the library; one line (or JSON) about what it did."""
    from idempotently._exceptions import OperationInProgressError, OperatorActionError
    from idempotently._operator import check_actor

    try:
        who = check_actor(actor)
    except (TypeError, ValueError) as error:
        raise click.BadParameter(str(error), param_hint="'--actor'") from None
    try:
        # A damaged row can be settled or abandoned (never forked or made due).
        before = journal.operation(operation_id, damaged=action in ("settle", "abandon"))
        if action == "settle":
            after = journal.settle(
                operation_id,
                status,  # type: ignore[arg-type]  # the flags give succeeded or failed
                note=note or "",
                actor=who,
                dry_run=dry_run,
            )
        elif action == "abandon":
            after = journal.abandon(operation_id, note=note or "", actor=who, dry_run=dry_run)
        elif action == "retry":
            after = journal.retry_now(operation_id, note=note, actor=who, dry_run=dry_run)
        else:
            after = journal.fork(operation_id, note=note or "", actor=who, dry_run=dry_run)
    except (OperatorActionError, OperationInProgressError) as error:
        raise click.ClickException(printable(str(error))) from None
    except ValueError as error:  # a note that is empty or too long
        raise click.BadParameter(str(error), param_hint="'--note'") from None
    assert before is not None  # the action found it
    # Ids are supplied text: escaped as in a piped record, so none can start a line.
    was, now = one_line(before.operation_id), one_line(after.operation_id)
    if action == "fork":
        done = f"forked {was} as {now} (key {one_line(after.key)})"
        if before.status != "failed":
            done += f"; {was} settled failed (it was {before.status})"
    elif action == "retry":
        done = f"{now} is due now: the next resume sends it with its key"
    else:
        done = f"{now}: {before.status} -> {after.status}"
    if dry_run:
        done = f"dry run, nothing written: would have {done}"
    if output_format == "json":
        echo_json(
            {
                "action": action,
                "dry_run": dry_run,
                "actor": who,
                "note": note,
                "operation": operation_json(after),
                **({"forked_from": before.operation_id} if action == "fork" else {}),
                **({"fork_id": after.operation_id} if action == "fork" and dry_run else {}),
            }
        )
        return
    click.echo(done)


@cli.command("settle")
@click.argument("operation_id", metavar="OPERATION_ID")
@click.option("--succeeded", is_flag=True, help="It took effect.")
@click.option("--failed", is_flag=True, help="It provably did not.")
@operator_options(note_required=True)
@with_journal(readonly_if="dry_run")
def settle_command(
    journal: Journal,
    operation_id: str,
    succeeded: bool,
    failed: bool,
    note: str,
    actor: str | None,
    dry_run: bool,
    output_format: str,
) -> None:
    """Record what happened to an operation the journal cannot decide.

    For a pending, needs_reconcile or abandoned operation, once you have looked
    it up: --succeeded (it took effect) or --failed (it provably did not). The
    audit trail keeps who, when and --note. Refused for a completed operation,
    and while a live caller holds its lease.
    """
    # Two flags rather than one flag_value option: with flag_value the last one given
    # would silently win, and an operator's contradictory word must not be recorded.
    if succeeded and failed:
        raise click.UsageError("--succeeded and --failed contradict: give one")
    if not (succeeded or failed):
        raise click.UsageError("say what happened: --succeeded or --failed")
    status = "succeeded" if succeeded else "failed"
    run_action(
        journal,
        "settle",
        operation_id,
        note=note,
        actor=actor,
        dry_run=dry_run,
        output_format=output_format,
        status=status,
    )


@cli.command("abandon")
@click.argument("operation_id", metavar="OPERATION_ID")
@operator_options(note_required=True)
@with_journal(readonly_if="dry_run")
def abandon_command(
    journal: Journal,
    operation_id: str,
    note: str,
    actor: str | None,
    dry_run: bool,
    output_format: str,
) -> None:
    """Give up a pending or needs_reconcile operation for good.

    It is never sent again; the audit trail keeps who, when and --note.
    """
    run_action(
        journal,
        "abandon",
        operation_id,
        note=note,
        actor=actor,
        dry_run=dry_run,
        output_format=output_format,
    )


@cli.command("retry")
@click.argument("operation_id", metavar="OPERATION_ID")
@operator_options(note_required=False)
@with_journal(readonly_if="dry_run")
def retry_command(
    journal: Journal,
    operation_id: str,
    note: str | None,
    actor: str | None,
    dry_run: bool,
    output_format: str,
) -> None:
    """Make a pending operation due now, its wait cleared.

    Its not_before and lookup backoff are cleared.

    The next resume sends it with its own key. Never revives a key past its
    lifetime: fork such an operation instead.
    """
    run_action(
        journal,
        "retry",
        operation_id,
        note=note,
        actor=actor,
        dry_run=dry_run,
        output_format=output_format,
    )


@cli.command("fork")
@click.argument("operation_id", metavar="OPERATION_ID")
@operator_options(note_required=True)
@with_journal(readonly_if="dry_run")
def fork_command(
    journal: Journal,
    operation_id: str,
    note: str,
    actor: str | None,
    dry_run: bool,
    output_format: str,
) -> None:
    """Send a failed or abandoned operation again, under a new key.

    For a failed, abandoned or needs_reconcile operation.

    Makes OPERATION_ID~fork<n>: a new pending operation with the same request
    bytes and a new derived key, linked to this one; the next resume sends it.
    Forking a needs_reconcile or abandoned operation settles it failed in the
    same transaction, as your recorded word that it did not happen.
    """
    run_action(
        journal,
        "fork",
        operation_id,
        note=note,
        actor=actor,
        dry_run=dry_run,
        output_format=output_format,
    )


# -- unpause (retry control) -----------------------------------------------------------


@cli.command("unpause")
@click.argument("origin")
@click.option(
    "--actor", default=None, help="Who lifts the pause, for the audit log (default: user@host)."
)
@format_option("text", "json")
@with_journal()
def unpause_command(journal: Journal, origin: str, actor: str | None, output_format: str) -> None:
    """Lift the pause a 429 or 503 put on ORIGIN.

    ORIGIN is scheme://host[:port]; every credentials' pause of it is lifted, and
    each is logged with who lifted it. Calls and resumes send to it again at
    once (other processes within a second).
    """
    try:
        lifted = journal.unpause(origin, actor=actor)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="ORIGIN") from None
    if output_format == "json":
        echo_json({"origin": origin, "lifted": [pause_json(pause) for pause in lifted]})
        return
    if not lifted:
        click.echo(f"{printable(origin)} was not paused in {journal.path}")
        return
    for pause in lifted:
        click.echo(
            f"unpaused {printable(pause.origin)}: it was paused until {iso(pause.until)} "
            f"({printable(pause.reason or '')}), set {iso(pause.set_at)}"
        )


# -- migrate -------------------------------------------------------------------------


@cli.command("migrate")
@click.option(
    "--recount",
    is_flag=True,
    help="Count the operations and attempts again from the rows, in one transaction (the "
    "counts follow the journal's own writes: run it after editing rows by hand).",
)
@click.option(
    "--sql",
    "print_sql",
    is_flag=True,
    help="Print the statements instead (for your own migrations); change nothing.",
)
@click.option(
    "--from-version",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="With --sql: print the statements from schema version N (0: no journal yet) "
    "without reading the journal; only its kind (file or URL) is taken from --journal.",
)
@click.option(
    "--journal",
    "journal_path",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="PATH",
    help="The journal (same as the global --journal, given after the command).",
)
@click.pass_context
def migrate_command(
    ctx: click.Context,
    journal_path: str | None,
    print_sql: bool,
    from_version: int | None,
    recount: bool,
) -> None:
    """Create the journal's tables, or upgrade them to this version.

    For a postgresql:// URL, in that database (its own schema, idempotently),
    so they can live in your application's database: what Session.enqueue(...,
    connection=...) needs. With --sql, print the statements that would run,
    from the journal's present version (all of them when there is none yet),
    for applications that keep their own migrations.
    """
    path = journal_path or ctx.find_root().params["journal_path"]
    if from_version is not None and not print_sql:
        raise click.UsageError("--from-version goes with --sql (it prints; it changes nothing)")
    if recount and print_sql:
        raise click.UsageError("--recount writes; --sql prints and changes nothing")
    with journal_errors():
        refuse_special_file(path)
        if recount:
            with Journal(path, create=False) as journal:
                journal._store.recount()
                counts = journal.counts()
            shown = ", ".join(f"{status} {number}" for status, number in counts.items())
            click.echo(f"recounted {journal.path}: {shown}")
            return
        if print_sql:
            try:
                script = migration_sql(path, from_version)
            except ValueError as error:
                raise click.BadParameter(str(error), param_hint="--from-version") from None
            click.echo(script, nl=False)
            return
        before = 0
        with (
            suppress(JournalMissingError),
            Journal(path, create=False, readonly=True, adopt=True) as found,
        ):
            before = found.schema_version
        # Only here is an application's SQLite database adopted (outbox.md).
        with Journal(path, adopt=True) as journal:
            after = journal.schema_version
    if before == after:
        click.echo(f"{journal.path} is at journal schema version {after}: nothing to do")
    elif before == 0:
        click.echo(f"created the journal's tables in {journal.path} (schema version {after})")
    else:
        click.echo(f"upgraded {journal.path} from journal schema version {before} to {after}")


# -- companion commands --------------------------------------------------------------


def _register_companions() -> None:
    # Both import starlette/uvicorn only when they run, so the CLI works
    # without the [mock] extra and they say what to install.
    from idempotently._demo import demo_command
    from idempotently.testing.cli import mock_server_command

    cli.add_command(demo_command)
    cli.add_command(mock_server_command)


_register_companions()
