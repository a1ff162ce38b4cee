"""The key-expiry margin: short-lived keys can be resent, and no key is resent once the
server may have forgotten it, even by a host whose clock was up to 59 s ahead.

The margin defaults to ``min(3600, max(60, lifetime / 10))``; a profile may set its own
(journaled with it); a resume may give a larger one. Every catalog profile is proved
against a loopback server that keeps keys as the profile says, on a clock the test moves.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import pytest
from click.testing import CliRunner

import idempotently
from idempotently import profiles
from idempotently.cli import cli
from idempotently.profiles import ServerProfile
from tests.conftest import STORES
from tests.keyed_server import KeyedServer
from tests.scripted_server import serve

CATALOG = sorted(profiles.BUILTIN_PROFILES.values(), key=lambda profile: profile.name)
ONE_TRY = idempotently.RetryPolicy(max_attempts=1, budget=None)
CHARGE = {"amount": 100, "metadata": {"operation_id": "op"}}
T0 = 1_800_000_000.0


@attrs.define
class Clock:
    """The true time, which the server keeps; a host's clock may run ``ahead`` of it."""

    now: float = T0

    def true(self) -> float:
        return self.now

    def ahead(self, seconds: float) -> object:
        return lambda: self.now + seconds


@contextlib.contextmanager
def keyed(
    profile: ServerProfile, clock: Clock, **options: object
) -> Iterator[tuple[KeyedServer, str]]:
    server = KeyedServer(profile, clock.true, **options)  # type: ignore[arg-type]
    with serve(server) as url:
        yield server, url


def session(
    path: Path, url: str, profile: ServerProfile, clock: object, **options: object
) -> idempotently.Session:
    return idempotently.Session(
        path,
        base_url=url,
        profile=profile,
        policy=ONE_TRY,
        clock=clock,
        **options,  # type: ignore[arg-type]
    )


def lose_the_answer(path: Path, url: str, profile: ServerProfile, clock: object) -> None:
    """The charge is made, its answer lost: the operation is pending with its key."""
    with (
        session(path, url, profile, clock) as s,
        pytest.raises(idempotently.OperationPendingError),
    ):
        s.post("/v1/charges", json=CHARGE, operation_id="op")


@pytest.mark.parametrize("profile", CATALOG, ids=lambda profile: profile.name)
@pytest.mark.parametrize("how", ["call", "resume", "watch"])
def test_a_lost_answer_is_resent_with_its_key_a_second_later(
    tmp_path: Path, profile: ServerProfile, how: str
) -> None:
    """One second after a lost answer, the same call, a resume or a watch relay resends
    the key and the server replays: succeeded, one charge, under every catalog profile
    (300 s keys too)."""
    clock = Clock()
    with keyed(profile, clock, lose_answers=1) as (server, url):
        lose_the_answer(tmp_path / "j.db", url, profile, clock.true)
        clock.now += 1
        with session(tmp_path / "j.db", url, profile, clock.true) as s:
            if how == "call":
                assert 201 == s.post("/v1/charges", json=CHARGE, operation_id="op").status_code
            elif how == "resume":
                [result] = s.resume()
                assert "succeeded" == result.action
            else:
                assert "succeeded" == relay_once(s).action
            assert "succeeded" == s.journal.operation("op").status
    assert (2, 1) == (server.arrivals, len(server.charges))


def relay_once(s: idempotently.Session) -> idempotently.ResumeResult:
    """What a watch worker (the outbox relay) does with the one due operation."""
    stop = threading.Event()
    results: list[idempotently.ResumeResult] = []

    def on_result(result: idempotently.ResumeResult) -> None:
        results.append(result)
        stop.set()

    s.watch(
        stop,
        interval=0.01,
        concurrency=1,
        on_result=on_result,
    )
    [result] = results
    return result


@pytest.mark.parametrize(
    "profile",
    [profiles.DJANGO_IDEMPOTENCY_KEY, profiles.AWS_POWERTOOLS, profiles.PAYPAL],
    ids=lambda profile: profile.name,
)
def test_an_sdks_own_retry_through_transport_a_second_later_is_resent(
    tmp_path: Path, profile: ServerProfile
) -> None:
    """An SDK that retries with its own key one second after a lost answer, through
    Transport: the same operation, resent with the key, replayed; one charge."""
    clock = Clock()
    headers = {profile.key_header: profile.render_key("sdk-key-1")}
    with keyed(profile, clock, lose_answers=1) as (server, url):
        for attempt in range(2):
            transport = idempotently.Transport(
                tmp_path / "j.db", profile=profile, policy=ONE_TRY, clock=clock.true
            )
            with httpx.Client(base_url=url, transport=transport) as client:
                if attempt == 0:
                    with pytest.raises(idempotently.OperationPendingError):
                        client.post("/v1/charges", json=CHARGE, headers=headers)
                    clock.now += 1
                else:
                    assert (
                        201 == client.post("/v1/charges", json=CHARGE, headers=headers).status_code
                    )
    assert (2, 1) == (server.arrivals, len(server.charges))


@pytest.mark.anyio
@pytest.mark.parametrize(
    "profile",
    [profiles.DJANGO_IDEMPOTENCY_KEY, profiles.AWS_POWERTOOLS],
    ids=lambda profile: profile.name,
)
async def test_an_async_session_resends_a_short_lived_key_a_second_later(
    tmp_path: Path, profile: ServerProfile
) -> None:
    """AsyncSession, on asyncio and trio: a lost answer, then the same call a second
    later is resent and replayed; one charge."""
    clock = Clock()
    with keyed(profile, clock, lose_answers=1) as (server, url):
        for attempt in range(2):
            async with idempotently.AsyncSession(
                tmp_path / "j.db", base_url=url, profile=profile, policy=ONE_TRY, clock=clock.true
            ) as s:
                if attempt == 0:
                    with pytest.raises(idempotently.OperationPendingError):
                        await s.post("/v1/charges", json=CHARGE, operation_id="op")
                    clock.now += 1
                else:
                    response = await s.post("/v1/charges", json=CHARGE, operation_id="op")
                    assert 201 == response.status_code
    assert (2, 1) == (server.arrivals, len(server.charges))


@pytest.mark.parametrize("store", STORES)
def test_a_short_lived_key_on_either_store(tmp_path: Path, journal_target: str) -> None:
    """SQLite and PostgreSQL journals alike: a 300 s key resent a second after a lost
    answer; one past its lifetime minus 60 s not resent."""
    profile = profiles.DJANGO_IDEMPOTENCY_KEY
    clock = Clock()
    with keyed(profile, clock, lose_answers=2) as (server, url):
        for op in ("soon", "late"):
            with (
                session(journal_target, url, profile, clock.true) as s,  # type: ignore[arg-type]
                pytest.raises(idempotently.OperationPendingError),
            ):
                s.post("/v1/charges", json=CHARGE, operation_id=op)
        clock.now += 1
        with session(journal_target, url, profile, clock.true) as s:  # type: ignore[arg-type]
            assert 201 == s.post("/v1/charges", json=CHARGE, operation_id="soon").status_code
            clock.now = T0 + 300 - 60 + 1
            with pytest.raises(idempotently.NeedsReconcileError):
                s.post("/v1/charges", json=CHARGE, operation_id="late")
    assert (3, 2) == (server.arrivals, len(server.charges))


@pytest.mark.parametrize("profile", CATALOG, ids=lambda profile: profile.name)
@pytest.mark.parametrize(
    ("writer_ahead", "when"),
    [(0.0, "journal"), (59.0, "journal"), (59.0, "server_forgets")],
    ids=["same-clocks", "writer-59s-ahead", "writer-59s-ahead-at-server-expiry"],
)
def test_a_key_past_its_lifetime_minus_the_margin_is_not_resent(
    tmp_path: Path, profile: ServerProfile, writer_ahead: float, when: str
) -> None:
    """One second past lifetime minus margin (as the journal counts it), or the moment the
    server forgets the key though the host that journaled it ran 59 s ahead: not resent,
    needs_reconcile, one charge."""
    clock = Clock()
    lifetime, margin = profile.key_lifetime, profile.expiry_margin
    with keyed(profile, clock, lose_answers=1) as (server, url):
        lose_the_answer(tmp_path / "j.db", url, profile, clock.ahead(writer_ahead))
        if when == "journal":
            clock.now = T0 + writer_ahead + lifetime - margin + 1
        else:
            clock.now = T0 + lifetime
        with session(tmp_path / "j.db", url, profile, clock.true) as s:
            [result] = s.resume()
    assert ("needs_reconcile", 1, 1) == (result.action, server.arrivals, len(server.charges))


@pytest.mark.parametrize(
    ("lifetime", "margin"),
    [(300.0, 60.0), (3600.0, 360.0), (6 * 3600.0, 2160.0), (86400.0, 3600.0), (1e6, 3600.0)],
)
def test_the_default_margin_is_a_tenth_of_the_lifetime_within_a_minute_and_an_hour(
    lifetime: float, margin: float
) -> None:
    """min(3600 s, max(60 s, lifetime / 10)): long-lived keys keep the hour."""
    assert margin == ServerProfile(name="p", key_lifetime=lifetime).expiry_margin


@pytest.mark.parametrize("margin", [59.9, 0, -1, float("nan"), float("inf"), 3600, 7200])
def test_a_profile_margin_below_a_minute_or_at_the_lifetime_is_refused(margin: float) -> None:
    """A margin under 60 s cannot cover clock skew; one at the lifetime resends nothing."""
    with pytest.raises(ValueError, match="key_expiry_margin"):
        ServerProfile(name="p", key_lifetime=3600.0, key_expiry_margin=margin)


def test_a_profile_margin_is_honoured_and_journaled_with_it(tmp_path: Path) -> None:
    """ServerProfile(key_expiry_margin=1800) on a 1 h key: past 30 min it is not resent,
    also by a session made with another profile (the margin is read from the journal);
    the default (6 min) would have resent it."""
    profile = ServerProfile(name="half-hour", key_lifetime=3600.0, key_expiry_margin=1800.0)
    clock = Clock()
    with keyed(profile, clock, lose_answers=1) as (server, url):
        lose_the_answer(tmp_path / "j.db", url, profile, clock.true)
        clock.now += 1801
        with session(tmp_path / "j.db", url, profiles.GENERIC, clock.true) as s:
            [result] = s.resume()
    assert ("needs_reconcile", 1) == (result.action, server.arrivals)
    assert "safety margin 1800s" in result.detail


def test_a_given_margin_applies_only_where_larger_than_the_journaled_one(tmp_path: Path) -> None:
    """A session given key_expiry_margin=600 on a 1 h key (journaled margin 6 min) does
    not resend at 50 min; one given 60 s does not shrink the journaled 6 min either."""
    profile = profiles.AWS_POWERTOOLS
    clock = Clock()
    with keyed(profile, clock, lose_answers=2) as (server, url):
        for op in ("a", "b"):
            with (
                session(tmp_path / "j.db", url, profile, clock.true) as s,
                pytest.raises(idempotently.OperationPendingError),
            ):
                s.post("/v1/charges", json=CHARGE, operation_id=op)
        clock.now += 3600 - 600 + 1
        with (
            session(tmp_path / "j.db", url, profile, clock.true, key_expiry_margin=600) as s,
            pytest.raises(idempotently.NeedsReconcileError, match="safety margin 600s"),
        ):
            s.post("/v1/charges", json=CHARGE, operation_id="a")
        clock.now = T0 + 3600 - 360 + 1
        with (
            session(tmp_path / "j.db", url, profile, clock.true, key_expiry_margin=60) as s,
            pytest.raises(idempotently.NeedsReconcileError, match="safety margin 360s"),
        ):
            s.post("/v1/charges", json=CHARGE, operation_id="b")
    assert 2 == server.arrivals


@pytest.mark.parametrize("margin", [30, 300])
def test_a_session_margin_below_a_minute_or_at_the_lifetime_is_refused(
    tmp_path: Path, margin: float
) -> None:
    """Session(key_expiry_margin=...) under 60 s, or at the profile's key lifetime: a
    ValueError in one line, before the journal is created."""
    with pytest.raises(ValueError, match="key_expiry_margin") as raised:
        idempotently.Session(
            tmp_path / "j.db", profile=profiles.DJANGO_IDEMPOTENCY_KEY, key_expiry_margin=margin
        )
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "j.db").exists()


def test_a_stored_only_session_bounds_its_margin_by_each_operations_lifetime(
    tmp_path: Path,
) -> None:
    """Session(profile_rule="stored_only", key_expiry_margin=600) under a 300 s profile
    (what `resume --key-expiry-margin 10m` builds without --profile): accepted, since no
    operation is read with that profile, and applied to a 1 h key 51 min old (not
    resent: needs_reconcile); the same margin without "stored_only" is refused."""
    with pytest.raises(ValueError, match="key_expiry_margin"):
        idempotently.Session(
            tmp_path / "j.db", profile=profiles.DJANGO_IDEMPOTENCY_KEY, key_expiry_margin=600
        )
    profile = profiles.AWS_POWERTOOLS
    clock = Clock()
    with keyed(profile, clock, lose_answers=1) as (server, url):
        lose_the_answer(tmp_path / "j.db", url, profile, clock.true)
        clock.now += 3600 - 600 + 60
        with session(
            tmp_path / "j.db",
            url,
            profiles.DJANGO_IDEMPOTENCY_KEY,
            clock.true,
            profile_rule="stored_only",
            key_expiry_margin=600,
        ) as s:
            [result] = s.resume()
    assert ("needs_reconcile", 1) == (result.action, server.arrivals)
    assert "safety margin 600s" in result.detail


# -- the CLI: resume and resume --watch take --key-expiry-margin -------------------------


@pytest.mark.parametrize("watch", [[], ["--watch"]], ids=["resume", "watch"])
def test_cli_refuses_a_margin_below_a_minute(tmp_path: Path, watch: list[str]) -> None:
    """`resume [--watch] --key-expiry-margin 30s`: a usage error (exit 2) in one line."""
    idempotently.Journal(str(tmp_path / "j.db")).close()
    result = CliRunner().invoke(
        cli, ["--journal", str(tmp_path / "j.db"), "resume", *watch, "--key-expiry-margin", "30s"]
    )
    assert 2 == result.exit_code
    assert "--key-expiry-margin" in result.output and "at least 60" in result.output


def test_cli_refuses_a_margin_at_a_pending_operations_lifetime(tmp_path: Path) -> None:
    """A margin of 5m with a pending django-idempotency-key operation (300 s keys): refused,
    naming the operation and its key; nothing sent."""
    clock = Clock(time.time())
    profile = profiles.DJANGO_IDEMPOTENCY_KEY
    with keyed(profile, clock, lose_answers=1) as (server, url):
        lose_the_answer(tmp_path / "j.db", url, profile, clock.true)
        result = CliRunner().invoke(
            cli, ["--journal", str(tmp_path / "j.db"), "resume", "--key-expiry-margin", "5m"]
        )
    assert 2 == result.exit_code
    assert "'op'" in result.output and "key lifetime (5m)" in result.output
    assert 1 == server.arrivals


@pytest.mark.parametrize(("flag", "sent"), [([], 2), (["--key-expiry-margin", "10m"], 1)])
def test_cli_resume_applies_a_given_margin_larger_than_the_journaled_one(
    tmp_path: Path, flag: list[str], sent: int
) -> None:
    """A 1 h Powertools key 51 min old (journaled margin 6 min): `resume` resends it;
    `resume --key-expiry-margin 10m` does not (needs_reconcile)."""
    profile = profiles.AWS_POWERTOOLS
    clock = Clock(time.time() - (3600 - 600 + 60))
    with keyed(profile, clock, lose_answers=1) as (server, url):
        lose_the_answer(tmp_path / "j.db", url, profile, clock.true)
        clock.now = time.time()
        CliRunner().invoke(cli, ["--journal", str(tmp_path / "j.db"), "resume", *flag])
        status = idempotently.Journal(str(tmp_path / "j.db")).operation("op").status
    assert (sent, "succeeded" if sent == 2 else "needs_reconcile") == (server.arrivals, status)


def test_retry_keeps_the_margin_of_the_operations_profile(tmp_path: Path) -> None:
    """`Journal.retry_now` on a 300 s key: made due a second after its lost answer (the
    profile's 60 s margin, not a flat hour), refused once less than 60 s is left."""
    profile = profiles.DJANGO_IDEMPOTENCY_KEY
    clock = Clock(time.time())
    with keyed(profile, clock, lose_answers=2) as (server, url):
        lose_the_answer(tmp_path / "j.db", url, profile, clock.true)
        clock.now -= 300 - 60 + 1  # as if journaled 241 s ago
        with (
            session(tmp_path / "j.db", url, profile, clock.true) as s,
            pytest.raises(idempotently.OperationPendingError),
        ):
            s.post("/v1/charges", json=CHARGE, operation_id="old")
    with idempotently.Journal(str(tmp_path / "j.db")) as journal:
        assert "pending" == journal.retry_now("op").status
        with pytest.raises(idempotently.OperatorActionError, match="60 s margin"):
            journal.retry_now("old")
    assert 2 == server.arrivals


@pytest.mark.parametrize("margin", [10**400, float("inf"), float("nan"), -0.0, True, "1h"])
def test_a_hostile_profile_margin_is_refused_naming_the_field(margin: object) -> None:
    """10**400, ±inf, NaN, -0.0, a bool or a str: a TypeError or ValueError naming
    key_expiry_margin, never a raw OverflowError."""
    with pytest.raises((TypeError, ValueError), match="key_expiry_margin"):
        ServerProfile(name="p", key_expiry_margin=margin)  # type: ignore[arg-type]


def poison_key_expiry(journal: str, value: float) -> None:
    """The operation's key_expires_at overwritten by hand (or by a damaged disk)."""
    if journal.startswith("postgresql"):
        import psycopg

        with psycopg.connect(journal, autocommit=True) as conn:
            conn.execute("UPDATE idempotently.operations SET key_expires_at = %s", (value,))
        return
    import sqlite3

    conn = sqlite3.connect(journal)
    with conn:
        conn.execute("UPDATE operations SET key_expires_at = ?", (value,))
    conn.close()


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_a_key_whose_expiry_is_no_number_is_never_resent(journal_target: str, value: float) -> None:
    """A row whose key_expires_at is infinite or NaN (damaged): when the server forgets
    its key cannot be known, so a lost answer is not resent under it (before: `now >
    nan - margin` is false, so the key counted as alive for ever and was resent)."""
    if value != value and not journal_target.startswith("postgresql"):
        pytest.skip("SQLite stores a NaN as NULL: a corrupt row, reported as such")
    profile = profiles.DJANGO_IDEMPOTENCY_KEY
    clock = Clock()
    with keyed(profile, clock, lose_answers=1) as (server, url):
        lose_the_answer(journal_target, url, profile, clock.true)  # type: ignore[arg-type]
        poison_key_expiry(journal_target, value)
        clock.now += 1
        with session(journal_target, url, profile, clock.true) as s:  # type: ignore[arg-type]
            [result] = s.resume()
    assert ("needs_reconcile", 1) == (result.action, server.arrivals)
