"""The profile an operation was made under is journaled with it, and resume reads it back.

The server these tests describe answers a payload mismatch with 417 and does not
store 5xx answers: it releases the key and runs the handler again, so every 500
it answers may have charged. Read with the generic profile, a resume retries
those 500s and charges once per attempt; read with its own profile, the first
500 goes to reconciliation.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from click.testing import CliRunner, Result
from hypothesis import given
from hypothesis import strategies as st

import idempotently
from idempotently import profiles
from idempotently._profiles import cached_profile, profile_from_spec, profile_spec
from idempotently.cli import cli
from tests.scripted_server import Answer, ScriptedApp
from tests.support import URL, FakeTime

RELEASES = attrs.evolve(
    profiles.GENERIC,
    name="releases",
    mismatch_statuses=frozenset({417}),
    stores_server_errors=False,
)
"""A server that answers a mismatch with 417 and does not store 5xx."""

ONE_TRY = idempotently.RetryPolicy(max_attempts=1)


def three_charges() -> list[httpx.Response]:
    """What the server answers to three sends of one operation: each of them charged."""
    return [httpx.Response(500), httpx.Response(500), httpx.Response(201)]


def mentions_reuse(response: httpx.Response) -> bool:
    """A user's own matcher, importable by name."""
    return b"reused" in response.content


def timeout(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("the answer never came", request=request)


def journal_pending(
    path: Path, profile: idempotently.ServerProfile, *, url: str = URL, age: float = 60.0
) -> str:
    """One pending operation ("op", its first attempt timed out) made under ``profile``;
    its key."""
    fake = FakeTime(now=time.time() - age)
    with (
        idempotently.Session(
            path,
            transport=httpx.MockTransport(timeout),
            profile=profile,
            policy=ONE_TRY,
            clock=fake.clock,
            sleep=fake.sleep,
        ) as session,
        pytest.raises(idempotently.OperationPendingError) as raised,
    ):
        session.post(url, json={"amount": 100}, operation_id="op")
    assert raised.value.key is not None
    return raised.value.key


def scripted_transport(answers: list[httpx.Response]) -> tuple[httpx.MockTransport, list[str]]:
    """Answers in order; the list of keys the server saw (one charge each)."""
    charges: list[str] = []
    script = iter(answers)

    def answer(request: httpx.Request) -> httpx.Response:
        charges.append(request.headers["idempotency-key"])
        return next(script)

    return httpx.MockTransport(answer), charges


def set_stored_profile(path: Path, text: str) -> None:
    """What another version (or a damaged deploy) left in the operation's profile column."""
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE operations SET profile = ?", (text,))
    conn.close()


def stored_profile_text(path: Path) -> str:
    with sqlite3.connect(path) as conn:
        (text,) = conn.execute("SELECT profile FROM operations").fetchone()
    conn.close()
    return str(text)


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


# -- what is journaled -------------------------------------------------------------


def test_a_builtin_profile_is_journaled_by_its_name(tmp_path: Path) -> None:
    """An operation made under a built-in (equal field for field) journals just its name."""
    journal_pending(tmp_path / "j.db", attrs.evolve(profiles.STRIPE))
    assert "stripe" == stored_profile_text(tmp_path / "j.db")


def test_a_custom_profile_is_journaled_as_its_spec(tmp_path: Path) -> None:
    """An operation made under a custom profile journals its every field, as JSON."""
    journal_pending(tmp_path / "j.db", RELEASES)
    assert RELEASES == profile_from_spec(stored_profile_text(tmp_path / "j.db"))


@pytest.mark.parametrize("builtin", sorted(profiles.BUILTIN_PROFILES))
def test_every_builtin_survives_a_spec_round_trip(builtin: str) -> None:
    """profile_from_spec(profile_spec(p)) is p again, for each built-in."""
    profile = profiles.BUILTIN_PROFILES[builtin]
    assert profile == profile_from_spec(profile_spec(profile))


def classify_nothing(status: int, headers: httpx.Headers, body: bytes) -> None:
    """A classifier importable by name (it leaves every answer to the built-in table)."""
    return None


CHANGES: dict[str, Any] = {
    "name": "other",
    "key_header": "X-Request-Key",
    "key_format": "sf-string",
    "max_key_length": 64,
    "key_lifetime": 3600.0,
    "in_progress_statuses": frozenset({409, 423}),
    "in_progress_timeout": None,
    "mismatch_statuses": frozenset({417}),
    "mismatch_matcher": mentions_reuse,
    "stores_server_errors": False,
    "handler_errors": frozenset({502, 503, 504}),
    "key_expiry_margin": 1800.0,
    "replay_headers": ("X-Replayed", "X-Idempotency-Status: hit"),
    "retry_hint_headers": ("X-Retry",),
    "classify": classify_nothing,
    "pause_origin": False,
    "key_bound_to_credentials": True,
    "operation_id_field": "metadata.operation_id",
    "attempt_header": "Idempotency-Attempt",
    "rate_limit_headers": ("retry-after", "x-ratelimit", "ratelimit"),
}


def test_the_changes_cover_every_profile_field() -> None:
    """The round trip below changes every field a ServerProfile has (a new one must join)."""
    expected = sorted(field.name for field in attrs.fields(profiles.ServerProfile) if field.init)
    assert expected == sorted(CHANGES)


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_a_custom_profile_with_any_field_changed_survives_a_round_trip(field: str) -> None:
    """Each field is in the spec: changed, it changes the spec and comes back as set."""
    profile = attrs.evolve(profiles.GENERIC, **{"name": "custom", field: CHANGES[field]})
    base = attrs.evolve(profiles.GENERIC, name="custom") if field != "name" else profiles.GENERIC
    assert profile == profile_from_spec(profile_spec(profile))
    assert profile_spec(base) != profile_spec(profile)


statuses = st.frozensets(st.integers(400, 599), max_size=4)
header_names = st.lists(st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,20}", fullmatch=True), max_size=3)
matchers = st.one_of(
    st.builds(
        lambda words, codes: profiles.body_mentions(*words, statuses=codes),
        st.lists(st.text(min_size=1, max_size=10), max_size=3),
        statuses,
    ),
    st.builds(
        lambda types, codes: profiles.error_type(*types, statuses=codes),
        st.lists(st.text(min_size=1, max_size=10), max_size=3),
        statuses,
    ),
    st.just(profiles.never),
    st.just(mentions_reuse),
)


@given(
    name=st.text(st.characters(min_codepoint=0xC0, max_codepoint=0x2FF), min_size=1, max_size=30),
    lifetime=st.floats(min_value=0.001, max_value=86400.0 * 365),
    in_progress=statuses,
    mismatch=statuses,
    matcher=matchers,
    stores=st.booleans(),
    replay=header_names,
    length=st.integers(1, 8192),
)
def test_any_profile_survives_a_spec_round_trip(
    name: str,
    lifetime: float,
    in_progress: frozenset[int],
    mismatch: frozenset[int],
    matcher: profiles.MismatchMatcher,
    stores: bool,
    replay: list[str],
    length: int,
) -> None:
    """Whatever its fields, a profile read back from its spec is the same profile, and
    its spec is canonical (written again, the same text)."""
    profile = profiles.ServerProfile(
        name=name,
        key_lifetime=lifetime,
        in_progress_statuses=in_progress,
        mismatch_statuses=mismatch,
        mismatch_matcher=matcher,
        stores_server_errors=stores,
        replay_headers=tuple(replay),
        max_key_length=length,
    )
    text = profile_spec(profile)
    assert profile == profile_from_spec(text)
    assert text == profile_spec(profile_from_spec(text))


def test_the_library_matchers_compare_by_value() -> None:
    """body_mentions(...) and error_type(...) are values: built twice, equal."""
    assert profiles.body_mentions("Reused", statuses={409}) == profiles.body_mentions("reused")
    assert profiles.error_type("idempotency_error") == profiles.STRIPE.mismatch_matcher


def test_a_lambda_matcher_is_refused_when_the_session_is_built(tmp_path: Path) -> None:
    """A matcher that cannot be imported by name is a ValueError naming the field and
    what to pass instead; no journal is created."""
    profile = attrs.evolve(profiles.GENERIC, name="x", mismatch_matcher=lambda response: False)
    with pytest.raises(ValueError) as raised:
        idempotently.Session(tmp_path / "j.db", profile=profile)
    assert "mismatch_matcher" in str(raised.value)
    assert "profiles.body_mentions(...)" in str(raised.value)
    assert not (tmp_path / "j.db").exists()


# -- resume reads the stored profile -----------------------------------------------


def test_resume_reads_an_operation_with_the_profile_it_was_made_under(tmp_path: Path) -> None:
    """The bug: a generic Session resuming an operation made under a server that does not
    store 5xx sends it once (the 500 may have charged), not once per 500."""
    key = journal_pending(tmp_path / "j.db", RELEASES)
    transport, charges = scripted_transport(three_charges())
    fake = FakeTime(now=time.time())
    with idempotently.Session(
        tmp_path / "j.db", transport=transport, clock=fake.clock, sleep=fake.sleep
    ) as session:
        results = session.resume()
    assert [key] == charges
    assert [("needs_reconcile", 500)] == [(r.status, r.status_code) for r in results]


@pytest.mark.anyio
async def test_async_resume_reads_the_stored_profile(tmp_path: Path) -> None:
    """AsyncSession.resume (asyncio and trio) uses the stored profile too: one charge."""
    key = journal_pending(tmp_path / "j.db", RELEASES)
    charges: list[str] = []
    script = iter(three_charges())

    async def answer(request: httpx.Request) -> httpx.Response:
        charges.append(request.headers["idempotency-key"])
        return next(script)

    fake = FakeTime(now=time.time())
    async with idempotently.AsyncSession(
        tmp_path / "j.db",
        transport=httpx.MockTransport(answer),
        clock=fake.clock,
        sleep=fake.async_sleep,
    ) as session:
        results = await session.resume()
    assert [key] == charges
    assert ["needs_reconcile"] == [r.status for r in results]


def test_a_call_again_reads_the_stored_profile(tmp_path: Path) -> None:
    """A second call with the operation's id, from a generic Session, reads its answers
    with the stored profile: the 500 may have charged, so it is not sent again."""
    journal_pending(tmp_path / "j.db", RELEASES)
    transport, charges = scripted_transport(three_charges())
    fake = FakeTime(now=time.time())
    with (
        idempotently.Session(
            tmp_path / "j.db", transport=transport, clock=fake.clock, sleep=fake.sleep
        ) as session,
        pytest.raises(idempotently.NeedsReconcileError),
    ):
        session.post(URL, json={"amount": 100}, operation_id="op")
    assert 1 == len(charges)


GONE = json.dumps(
    {**json.loads(profile_spec(RELEASES)), "mismatch_matcher": "payments_gone.matchers:reused"},
    sort_keys=True,
    separators=(",", ":"),
)
"""A stored profile whose matcher's module no longer exists (renamed, uninstalled)."""


def test_a_stored_matcher_that_cannot_be_imported_keeps_the_operation_pending(
    tmp_path: Path,
) -> None:
    """Never a guess: resume sends nothing, says why, and the operation stays pending."""
    journal_pending(tmp_path / "j.db", RELEASES)
    set_stored_profile(tmp_path / "j.db", GONE)
    transport, charges = scripted_transport([httpx.Response(201)])
    with idempotently.Session(tmp_path / "j.db", transport=transport) as session:
        results = session.resume()
        operation = session.journal.operation("op")
    assert [] == charges
    assert [("pending", "not_sent")] == [(r.status, r.action) for r in results]
    assert "payments_gone.matchers:reused" in results[0].detail
    assert "cannot be imported" in results[0].detail
    assert operation is not None and "pending" == operation.status


def test_a_call_again_with_an_unimportable_stored_matcher_raises_naming_the_operation(
    tmp_path: Path,
) -> None:
    """A live call with the operation's id raises StoredProfileError (id and key) and
    sends nothing."""
    key = journal_pending(tmp_path / "j.db", RELEASES)
    set_stored_profile(tmp_path / "j.db", GONE)
    transport, charges = scripted_transport([httpx.Response(201)])
    with (
        idempotently.Session(tmp_path / "j.db", transport=transport) as session,
        pytest.raises(idempotently.StoredProfileError) as raised,
    ):
        session.post(URL, json={"amount": 100}, operation_id="op")
    assert [] == charges
    assert ("op", key, "unavailable") == (
        raised.value.operation_id,
        raised.value.key,
        raised.value.kind,
    )


def test_a_spec_is_parsed_once_per_distinct_text() -> None:
    """The journaled spec of many operations is read back once (cached)."""
    cached_profile.cache_clear()
    text = profile_spec(RELEASES)
    assert cached_profile(text) is cached_profile(text)


def test_a_legacy_row_is_read_with_the_sessions_profile_by_the_library(tmp_path: Path) -> None:
    """A row journaled before profiles were stored (a bare custom name) is read with the
    session's profile: the legacy rule."""
    journal_pending(tmp_path / "j.db", RELEASES)
    set_stored_profile(tmp_path / "j.db", "releases")
    transport, charges = scripted_transport(three_charges())
    fake = FakeTime(now=time.time())
    with idempotently.Session(
        tmp_path / "j.db", transport=transport, profile=RELEASES, clock=fake.clock
    ) as session:
        results = session.resume()
    assert (1, ["needs_reconcile"]) == (len(charges), [r.status for r in results])


# -- the library: Session(profile_rule=...), what `resume --profile` builds on ----------


def test_profile_rule_checked_refuses_an_operation_whose_stored_profile_differs(
    tmp_path: Path,
) -> None:
    """Session(profile_rule="checked") with another profile than the stored one:
    profile_for says so (StoredProfileError naming the operation and its key) and
    resume sends nothing; the operation stays pending."""
    key = journal_pending(tmp_path / "j.db", RELEASES)
    transport, charges = scripted_transport([httpx.Response(201)])
    with idempotently.Session(
        tmp_path / "j.db", transport=transport, profile=profiles.GENERIC, profile_rule="checked"
    ) as session:
        operation = session.journal.operation("op")
        assert operation is not None
        with pytest.raises(idempotently.StoredProfileError) as raised:
            session.profile_for(operation)
        [result] = session.resume()
    assert ("op", key, "disagrees") == (
        raised.value.operation_id,
        raised.value.key,
        raised.value.kind,
    )
    assert ([], "pending", "not_sent") == (charges, result.status, result.action)


def test_profile_rule_checked_reads_an_operation_with_the_profile_that_agrees(
    tmp_path: Path,
) -> None:
    """Session(profile_rule="checked") with the profile the operation was made under:
    read with it (its first 500 goes to reconciliation: one charge)."""
    journal_pending(tmp_path / "j.db", RELEASES)
    transport, charges = scripted_transport(three_charges())
    with idempotently.Session(
        tmp_path / "j.db", transport=transport, profile=RELEASES, profile_rule="checked"
    ) as session:
        operation = session.journal.operation("op")
        assert operation is not None
        assert RELEASES == session.profile_for(operation)
        [result] = session.resume()
    assert (1, "needs_reconcile") == (len(charges), result.status)


def test_profile_rule_forced_reads_every_operation_with_the_sessions_profile(
    tmp_path: Path,
) -> None:
    """Session(profile_rule="forced"): the session's profile, whatever was stored; read
    as generic, the 500s are retried (three sends) where the stored profile sends one."""
    journal_pending(tmp_path / "j.db", RELEASES)
    transport, charges = scripted_transport(three_charges())
    fake = FakeTime(now=time.time())
    with idempotently.Session(
        tmp_path / "j.db",
        transport=transport,
        profile=profiles.GENERIC,
        profile_rule="forced",
        clock=fake.clock,
        sleep=fake.sleep,
    ) as session:
        operation = session.journal.operation("op")
        assert operation is not None
        assert profiles.GENERIC == session.profile_for(operation)
        [result] = session.resume()
    assert (3, "succeeded") == (len(charges), result.status)


def test_profile_rule_stored_only_refuses_a_legacy_row(tmp_path: Path) -> None:
    """Session(profile_rule="stored_only"): a row journaled before profiles were stored
    is not read with the session's profile (as "stored" does): nothing is sent."""
    journal_pending(tmp_path / "j.db", RELEASES)
    set_stored_profile(tmp_path / "j.db", "releases")
    transport, charges = scripted_transport(three_charges())
    with idempotently.Session(
        tmp_path / "j.db", transport=transport, profile=RELEASES, profile_rule="stored_only"
    ) as session:
        operation = session.journal.operation("op")
        assert operation is not None
        with pytest.raises(idempotently.StoredProfileError, match="before profiles were stored"):
            session.profile_for(operation)
        [result] = session.resume()
    assert ([], "pending", "not_sent") == (charges, result.status, result.action)


@pytest.mark.parametrize(("rule", "sent"), [("stored", 1), ("checked", 0)])
def test_a_transport_continuing_an_operation_reads_its_profile_by_its_profile_rule(
    tmp_path: Path, rule: str, sent: int
) -> None:
    """Transport(profile_rule="checked") with another profile than the stored one: a
    request that continues the operation (its key) raises StoredProfileError and sends
    nothing; under the default rule it is sent."""
    key = journal_pending(tmp_path / "j.db", RELEASES)
    transport, charges = scripted_transport([httpx.Response(201)])
    journaled = idempotently.Transport(
        tmp_path / "j.db", transport=transport, profile=profiles.GENERIC, profile_rule=rule
    )
    with httpx.Client(transport=journaled) as client:
        if sent:
            client.post(URL, json={"amount": 100}, headers={"Idempotency-Key": key})
        else:
            with pytest.raises(idempotently.StoredProfileError, match="profile_rule='stored'"):
                client.post(URL, json={"amount": 100}, headers={"Idempotency-Key": key})
    assert [key] * sent == charges


@pytest.mark.parametrize("session_class", [idempotently.Session, idempotently.AsyncSession])
@pytest.mark.parametrize("rule", ["force", "", None, 1, ["stored"]], ids=repr)
def test_an_unknown_profile_rule_is_refused_before_the_journal_is_created(
    tmp_path: Path, session_class: type[Any], rule: object
) -> None:
    """profile_rule that is none of the four: a ValueError in one line naming the
    argument and the choices; no journal file is created."""
    with pytest.raises(ValueError, match="profile_rule must be one of 'stored'") as raised:
        session_class(tmp_path / "j.db", profile_rule=rule)
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "j.db").exists()


# -- the command line ---------------------------------------------------------------

PROFILE = f"{__name__}:RELEASES"


def test_cli_resume_uses_the_stored_profile_by_default(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """The bug, end to end: `idempotently resume` without --profile charges once (the 500
    goes to reconciliation), not three times."""
    app, url = scripted
    key = journal_pending(tmp_path / "j.db", RELEASES)
    app.answer(Answer(500), Answer(500), Answer(201))
    result = run("--journal", str(tmp_path / "j.db"), "resume", "--base-url", url)
    assert 1 == result.exit_code, result.output  # needs_reconcile is left
    assert [key] == [arrival.key for arrival in app.arrivals]
    assert "needs_reconcile" in result.stdout


def test_cli_refuses_a_profile_that_disagrees_with_the_stored_one(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """--profile generic on an operation made under another profile: exit 2, one line
    naming the operation and both profiles, nothing sent."""
    app, url = scripted
    journal_pending(tmp_path / "j.db", RELEASES)
    app.answer(Answer(201))
    result = run(
        "--journal", str(tmp_path / "j.db"), "resume", "--base-url", url, "--profile", "generic"
    )
    assert 2 == result.exit_code, result.output
    assert [] == app.arrivals
    (line,) = result.stderr.splitlines()
    assert "'op'" in line and "'releases' (custom)" in line and "'generic'" in line
    assert "mismatch_statuses" in line and "--force-profile" in line


def test_cli_force_profile_reads_every_operation_with_the_one_given(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """--force-profile overrides the stored profile: read as generic, the 500s are retried."""
    app, url = scripted
    journal_pending(tmp_path / "j.db", RELEASES)
    app.answer(Answer(500), Answer(201))
    result = run(
        "--journal",
        str(tmp_path / "j.db"),
        "resume",
        "--base-url",
        url,
        "--profile",
        "generic",
        "--force-profile",
    )
    assert 0 == result.exit_code, result.output
    assert 2 == len(app.arrivals)


def test_cli_accepts_a_profile_that_agrees_with_the_stored_one(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """--profile module:NAME equal to the stored profile is no disagreement."""
    app, url = scripted
    journal_pending(tmp_path / "j.db", RELEASES)
    app.answer(Answer(201))
    result = run(
        "--journal", str(tmp_path / "j.db"), "resume", "--base-url", url, "--profile", PROFILE
    )
    assert 0 == result.exit_code, result.output
    assert 1 == len(app.arrivals)


def test_cli_force_profile_needs_a_profile(tmp_path: Path) -> None:
    """--force-profile alone is a usage error: there is nothing to force."""
    journal_pending(tmp_path / "j.db", RELEASES)
    result = run("--journal", str(tmp_path / "j.db"), "resume", "--force-profile")
    assert 2 == result.exit_code
    assert "--force-profile needs --profile" in result.stderr


def test_cli_a_legacy_row_needs_an_explicit_profile(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """An operation journaled before profiles were stored (a bare custom name): resume
    without --profile says it needs one and sends nothing; with it, it is read so."""
    app, url = scripted
    journal_pending(tmp_path / "j.db", RELEASES)
    set_stored_profile(tmp_path / "j.db", "releases")
    app.answer(Answer(500), Answer(500), Answer(201))
    refused = run("--journal", str(tmp_path / "j.db"), "resume", "--base-url", url)
    assert 2 == refused.exit_code, refused.output
    assert [] == app.arrivals
    assert "before profiles were stored" in refused.stderr and "--profile" in refused.stderr
    resumed = run(
        "--journal", str(tmp_path / "j.db"), "resume", "--base-url", url, "--profile", PROFILE
    )
    assert 1 == resumed.exit_code, resumed.output
    assert 1 == len(app.arrivals)  # read with RELEASES: the 500 goes to reconciliation


def test_cli_a_legacy_row_under_another_name_is_refused(tmp_path: Path) -> None:
    """--profile whose name differs from a legacy row's: refused, not guessed."""
    journal_pending(tmp_path / "j.db", RELEASES)
    set_stored_profile(tmp_path / "j.db", "someone-else")
    result = run("--journal", str(tmp_path / "j.db"), "resume", "--profile", PROFILE)
    assert 2 == result.exit_code, result.output
    assert "'someone-else' (journaled before profiles were stored)" in result.stderr


def test_cli_an_unimportable_stored_matcher_is_reported_not_sent(
    tmp_path: Path, scripted: tuple[ScriptedApp, str]
) -> None:
    """resume without --profile on a stored matcher that is gone: that operation is not
    sent and stays pending, with the reason (exit 1)."""
    app, url = scripted
    journal_pending(tmp_path / "j.db", RELEASES)
    set_stored_profile(tmp_path / "j.db", GONE)
    result = run("--journal", str(tmp_path / "j.db"), "resume", "--base-url", url, "--json")
    assert 1 == result.exit_code, result.output
    assert [] == app.arrivals
    [entry] = json.loads(result.stdout)
    assert ("pending", "not_sent") == (entry["status"], entry["action"])
    assert "payments_gone.matchers:reused" in entry["detail"]


def test_cli_show_names_a_custom_profile_without_its_json(tmp_path: Path) -> None:
    """show prints the stored custom profile as its name, not its spec."""
    journal_pending(tmp_path / "j.db", RELEASES)
    result = run("--journal", str(tmp_path / "j.db"), "show", "op")
    assert "profile releases (custom)" in result.stdout


def test_a_spec_journaled_before_a_field_existed_agrees_with_a_profile_at_its_default() -> None:
    """A custom profile's spec without a field added since (it reads as the default) is the
    same profile as one given with that field at its default: no disagreement."""
    from idempotently._profiles import stored_profile

    spec = json.loads(profile_spec(RELEASES))
    del spec["key_bound_to_credentials"]
    older = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    read = stored_profile(older, RELEASES, "checked", operation_id="op", key="k")
    assert RELEASES == read
    other = attrs.evolve(RELEASES, key_bound_to_credentials=True)
    with pytest.raises(idempotently.StoredProfileError, match="key_bound_to_credentials"):
        stored_profile(older, other, "checked", operation_id="op", key="k")
