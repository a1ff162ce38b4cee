"""Every CLI option given a hostile value: exit 2 with a message naming the option.

Never a traceback, never a send, never a write to the journal; afterwards the
journal still reads with every command.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import idempotently
from idempotently.cli import cli
from tests.adversarial.invariants import assert_sound
from tests.adversarial.wire import RESET, Wire

ONE_TRY = idempotently.RetryPolicy(max_attempts=1)
HUGE_DURATION = "9" * 400 + "d"
"""Digits enough that float() gives inf: a duration nobody means."""


def invoke(journal: Path, *args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, ["--journal", str(journal), *args], env=env)


def assert_usage_error(result: Result, option: str) -> None:
    """Exit 2, the option named in the message, no traceback."""
    assert not isinstance(result.exception, Exception) or isinstance(
        result.exception, SystemExit
    ), repr(result.exception)
    assert (2, True) == (result.exit_code, option in result.output), result.output
    assert "Traceback" not in result.output


@pytest.fixture
def pending(journal: Path, wire: Wire) -> Path:
    """A journal with one pending operation on the loopback server (its answer was lost)."""
    wire.answer(RESET)
    with (
        idempotently.Session(journal, policy=ONE_TRY) as session,
        pytest.raises(idempotently.OperationPendingError),
    ):
        session.post(f"{wire.url}/v1/charges", json={"amount": 1}, operation_id="op")
    wire.reset()
    return journal


def attempts(journal: Path) -> int:
    with idempotently.Journal(journal, create=False) as opened:
        operation = opened.operation("op")
    assert operation is not None
    return operation.attempt_count


# -- list, stats, prune: durations and counts --------------------------------------------------


@pytest.mark.parametrize(
    "args, option",
    [
        (("list", "--status", "bogus"), "--status"),
        (("list", "--status", "PENDING"), "--status"),
        (("list", "--status", ""), "--status"),
        (("list", "--since", "-1h"), "--since"),
        (("list", "--since", "abc"), "--since"),
        (("list", "--since", ""), "--since"),
        (("list", "--since", "1h-"), "--since"),
        (("list", "--since", "1e400"), "--since"),
        (("list", "--since", "nan"), "--since"),
        (("list", "--since", "inf"), "--since"),
        (("list", "--since", "1.5.5h"), "--since"),
        pytest.param(
            ("list", "--since", HUGE_DURATION),
            "--since",
        ),
        (("list", "--limit", "0"), "--limit"),
        (("list", "--limit", "-1"), "--limit"),
        (("list", "--limit", "abc"), "--limit"),
        (("list", "--limit", "1.5"), "--limit"),
        pytest.param(
            ("list", "--limit", "99999999999999999999999"),
            "--limit",
        ),
        (("list", "--json=yes"), "--json"),
        (("stats", "--stuck-after", "-1s"), "--stuck-after"),
        (("stats", "--stuck-after", "soon"), "--stuck-after"),
        (("stats", "--stuck-after", "1e400"), "--stuck-after"),
        pytest.param(
            ("stats", "--stuck-after", HUGE_DURATION),
            "--stuck-after",
        ),
        pytest.param(
            ("stats", "--json", "--stuck-after", HUGE_DURATION),
            "--stuck-after",
        ),
        (("stats", "--fail-on-stuck=yes"), "--fail-on-stuck"),
        (("prune",), "--older-than"),
        (("prune", "--older-than", "-7d"), "--older-than"),
        (("prune", "--older-than", "a week"), "--older-than"),
        (("prune", "--older-than", "1e400"), "--older-than"),
        pytest.param(
            ("prune", "--older-than", HUGE_DURATION),
            "--older-than",
        ),
        pytest.param(
            ("prune", "--json", "--older-than", HUGE_DURATION),
            "--older-than",
        ),
        (("show",), "OPERATION_ID_OR_KEY"),
        (("list", "--no-such-option"), "--no-such-option"),
    ],
    ids=lambda value: " ".join(value)[:50] if isinstance(value, tuple) else None,
)
def test_hostile_audit_option_is_a_usage_error(
    pending: Path, wire: Wire, args: tuple[str, ...], option: str
) -> None:
    """A value an audit command cannot use exits 2 naming the option; the journal is untouched."""
    assert_usage_error(invoke(pending, *args), option)
    assert [] == wire.arrivals
    assert_sound(pending, operations=["op"])


CENTURY = "36600d"
"""The longest duration the parser accepts: 100 years of 366 days, reaching back before 1970."""


@pytest.mark.parametrize(
    "args, expected_code",
    [
        (("list", "--since", "0"), 0),
        (("list", "--since", "21000d"), 0),
        (("list", "--since", CENTURY), 0),
        (("list", "--json", "--since", CENTURY), 0),
        (("stats", "--stuck-after", "0"), 0),
        (("stats", "--stuck-after", CENTURY), 0),
        (("stats", "--json", "--expiring-within", "0"), 0),
        (("stats", "--json", "--expiring-within", CENTURY), 0),
        (("prune", "--older-than", "0", "--dry-run"), 0),
        (("prune", "--older-than", CENTURY), 0),
        (("prune", "--json", "--older-than", CENTURY, "--dry-run"), 0),
    ],
    ids=lambda value: " ".join(value)[:50] if isinstance(value, tuple) else None,
)
def test_an_audit_duration_at_its_extremes_is_honoured(
    pending: Path, wire: Wire, args: tuple[str, ...], expected_code: int
) -> None:
    """0 and the longest accepted duration (before 1970) run cleanly: no traceback, no send."""
    result = invoke(pending, *args)
    assert (expected_code, None) == (
        result.exit_code,
        None if isinstance(result.exception, SystemExit | None) else repr(result.exception),
    ), result.output
    assert [] == wire.arrivals
    assert_sound(pending, operations=["op"])


def test_list_since_before_1970_lists_everything(pending: Path) -> None:
    """``--since`` reaching back before the epoch means "all of them", not a ValueError."""
    result = invoke(pending, "list", "--since", "21000d", "--format", "nl")
    assert (0, ["op"]) == (
        result.exit_code,
        [json.loads(line)["operation_id"] for line in result.output.splitlines()],
    )


@pytest.mark.parametrize("option", ["--provider-latency", "--stale-after", "--key-ttl", "--port"])
@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e400", "soon", "", "99999999999"])
def test_a_hostile_mock_server_number_is_a_usage_error(option: str, value: str) -> None:
    """mock-server refuses a negative, non-finite, huge or garbage number before listening."""
    result = CliRunner().invoke(cli, ["mock-server", option, value])
    assert_usage_error(result, option)


# -- resume ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, option, env",
    [
        (("--base-url", "ftp://api.example.test"), "--base-url", {}),
        (("--base-url", "api.example.test"), "--base-url", {}),
        (("--base-url", "http://"), "--base-url", {}),
        (("--base-url", "http://[::1"), "--base-url", {}),
        pytest.param(
            ("--base-url", "http://127.0.0.1:99999"),
            "--base-url",
            {},
        ),
        (("--header-env", "Authorization"), "--header-env", {}),
        (("--header-env", "=TOKEN"), "--header-env", {"TOKEN": "x"}),
        (("--header-env", "Authorization="), "--header-env", {}),
        (("--header-env", "Authorization=UNSET_TOKEN_VAR"), "--header-env", {}),
        pytest.param(
            ("--header-env", "Authorization=TOKEN"),
            "--header-env",
            {"TOKEN": "Bearer s€cret-token"},
        ),
        pytest.param(
            ("--header-env", "Bad Name=TOKEN"),
            "--header-env",
            {"TOKEN": "x"},
        ),
        pytest.param(
            ("--header-env", "Authorization=TOKEN"),
            "--header-env",
            {"TOKEN": "Bearer secret-token\n"},
        ),
        (("--param-env", "api_key"), "--param-env", {}),
        (("--param-env", "=API_KEY"), "--param-env", {"API_KEY": "x"}),
        (("--param-env", "api_key="), "--param-env", {}),
        (("--param-env", "api_key=UNSET_API_KEY_VAR"), "--param-env", {}),
        (("--param-env", "api_key=API_KEY"), "--param-env", {"API_KEY": ""}),
        pytest.param(
            ("--param-env", "api_key=API_KEY"),
            "--param-env",
            {"API_KEY": "sk_live_param_secret\n"},
        ),
        pytest.param(
            ("--param-env", "api_key=API_KEY"),
            "--param-env",
            {"API_KEY": "sk_live_param\x07secret"},
        ),
        (("--param-env", "api\x1bkey=API_KEY"), "--param-env", {"API_KEY": "x"}),
        (("--codec", "bogus"), "--codec", {}),
        (("--codec", "os:path"), "--codec", {}),
        (("--codec", "no_such_module_for_idempotently:CODEC"), "--codec", {}),
        (("--codec", "idempotently:FernetCodec"), "--codec", {}),
        (("--codec", ":CODEC"), "--codec", {}),
        (("--profile", "bogus"), "--profile", {}),
        (("--profile", "os:path"), "--profile", {}),
        (("--profile", "no_such_module_for_idempotently:P"), "--profile", {}),
        (("--profile", ":GENERIC"), "--profile", {}),
        (("--profile", "idempotently.profiles:"), "--profile", {}),
        (("--dry-run=yes",), "--dry-run", {}),
    ],
    ids=lambda value: " ".join(value)[:60] if isinstance(value, tuple) else None,
)
def test_hostile_resume_option_is_a_usage_error_before_anything_is_sent(
    pending: Path, wire: Wire, args: tuple[str, ...], option: str, env: dict[str, str]
) -> None:
    """resume checks every option before it sends or journals anything; no secret is echoed."""
    result = invoke(pending, "resume", *args, env=env)
    secrets = [value.strip() for value in env.values() if len(value) > 4]
    assert [] == [secret for secret in secrets if secret in result.output]
    assert_usage_error(result, option)
    assert [] == wire.arrivals
    assert 1 == attempts(pending)
    assert_sound(pending, operations=["op"], secrets=secrets)


@pytest.mark.parametrize(
    "args, option",
    [
        (("--deadline", "0"), "--deadline"),
        (("--deadline", "-1s"), "--deadline"),
        (("--deadline", "soon"), "--deadline"),
        (("--deadline", HUGE_DURATION), "--deadline"),
        (("--interval", "0", "--watch"), "--interval"),
        (("--interval", "-5s", "--watch"), "--interval"),
        (("--interval", HUGE_DURATION, "--watch"), "--interval"),
        (("--lease-duration", "0"), "--lease-duration"),
        (("--lease-duration", "-1s"), "--lease-duration"),
        (("--lease-duration", CENTURY), "--lease-duration"),
        (("--lease-duration", HUGE_DURATION), "--lease-duration"),
        (("--key-expiry-margin", "0"), "--key-expiry-margin"),
        (("--key-expiry-margin", "-1s"), "--key-expiry-margin"),
        (("--key-expiry-margin", "59s"), "--key-expiry-margin"),
        (("--key-expiry-margin", "1d"), "--key-expiry-margin"),
        (("--key-expiry-margin", CENTURY), "--key-expiry-margin"),
        (("--key-expiry-margin", HUGE_DURATION), "--key-expiry-margin"),
        (("--key-expiry-margin", "soon", "--watch"), "--key-expiry-margin"),
        (("--key-expiry-margin", HUGE_DURATION, "--watch"), "--key-expiry-margin"),
        (("--concurrency", "0"), "--concurrency"),
        (("--concurrency", "99999999999999999999"), "--concurrency"),
        (("--max-attempts", "0"), "--max-attempts"),
        (("--max-attempts", "-1"), "--max-attempts"),
        (("--max-attempts", "99999999999999999999"), "--max-attempts"),
    ],
    ids=lambda value: " ".join(value)[:60] if isinstance(value, tuple) else None,
)
def test_a_resume_number_out_of_range_is_a_usage_error(
    pending: Path, wire: Wire, args: tuple[str, ...], option: str
) -> None:
    """resume's durations and counts at 0, negative, huge or garbage exit 2 before any send."""
    assert_usage_error(invoke(pending, "resume", *args), option)
    assert [] == wire.arrivals
    assert 1 == attempts(pending)


@pytest.mark.parametrize(
    "args",
    [
        ("--deadline", CENTURY),
        ("--lease-duration", "1d"),
        ("--max-attempts", "1000"),
        ("--key-expiry-margin", "60s"),
        ("--key-expiry-margin", "23h59m"),
    ],
)
def test_a_resume_number_at_its_largest_still_resumes(
    pending: Path, wire: Wire, args: tuple[str, ...]
) -> None:
    """The largest accepted deadline, lease and attempt count resume the operation once."""
    result = invoke(pending, "resume", *args)
    assert (0, 1, 2) == (result.exit_code, len(wire.arrivals), attempts(pending)), result.output


def test_a_profile_module_that_fails_to_import_is_a_usage_error(
    pending: Path, wire: Wire, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--profile naming a module that raises while importing exits 2, naming the option."""
    (scratch / "exploding_profile_module.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(scratch))
    result = invoke(pending, "resume", "--profile", "exploding_profile_module:PROFILE")
    sys.modules.pop("exploding_profile_module", None)
    assert_usage_error(result, "--profile")
    assert "boom at import" in result.output
    assert [] == wire.arrivals


def test_a_base_url_with_credentials_never_prints_or_stores_them(pending: Path, wire: Wire) -> None:
    """A password on --base-url is refused or ignored: never sent, printed or journaled."""
    result = invoke(
        pending, "resume", "--base-url", wire.url.replace("//", "//user:base-url-pass@")
    )
    assert "base-url-pass" not in result.output
    assert all(arrival.header("Authorization") is None for arrival in wire.arrivals)
    assert_sound(pending, secrets=["base-url-pass"])


# -- the journal option ------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["list", "show op", "stats", "resume", "prune --older-than 1d"])
def test_a_directory_as_journal_is_a_usage_error(scratch: Path, command: str) -> None:
    """--journal naming a directory exits 2 before any command runs."""
    result = CliRunner().invoke(cli, ["--journal", str(scratch), *command.split()])
    assert_usage_error(result, "--journal")


@pytest.mark.parametrize("command", ["list", "show op", "stats", "resume", "prune --older-than 1d"])
def test_a_missing_journal_is_never_created(scratch: Path, command: str) -> None:
    """A journal path that does not exist is an error (exit 1), and no file appears."""
    missing = scratch / "missing.db"
    result = CliRunner().invoke(cli, ["--journal", str(missing), *command.split()])
    assert 1 == result.exit_code
    assert "no journal at" in result.output
    assert not missing.exists()


RESUME_NUMBERS = {
    "--deadline": (),
    "--interval": ("--watch",),
    "--lease-duration": (),
    "--concurrency": (),
    "--max-attempts": (),
    "--absent-after": ("--reconcile-lookup", "/v1/charges"),
    "--backoff": ("--reconcile-lookup", "/v1/charges"),
    "--max-backoff": ("--reconcile-lookup", "/v1/charges"),
}
"""resume's numeric options, each with what it needs beside it."""


@pytest.mark.parametrize("value", ["0", "-1", "-0.0", "nan", "inf", "-inf", "1" + "0" * 400])
@pytest.mark.parametrize("option", RESUME_NUMBERS)
def test_every_resume_number_at_its_extremes_is_a_usage_error_or_honoured(
    pending: Path, wire: Wire, option: str, value: str
) -> None:
    """Each numeric option of resume at 0, -1, -0.0, NaN, ±inf and 10**400 exits 2 naming
    it before anything is sent; only a zero may be in range (a lookup's backoff), and then
    the resume runs as usual. Never a traceback."""
    result = invoke(pending, "resume", option, value, *RESUME_NUMBERS[option])
    if result.exit_code != 2 and value in ("0", "-0.0"):
        assert not isinstance(result.exception, Exception) or isinstance(
            result.exception, SystemExit
        ), repr(result.exception)
        assert "Traceback" not in result.output
        return
    assert_usage_error(result, option)
    assert [] == wire.arrivals
    assert 1 == attempts(pending)
