"""The catalog of server profiles: each reads its server's answers as that server means them.

Every case is an answer the server gives according to its own source or docs
(see docs/profiles.md), and what the right profile does with it; each case
fails if the profile lost the field that makes the difference.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest
import respx
from click.testing import CliRunner

import idempotently
from idempotently import profiles
from idempotently.cli import cli
from tests.support import URL, FakeTime, make_session

CATALOG = [
    profiles.DJANGO_IDEMPOTENCY_KEY,
    profiles.ASGI_IDEMPOTENCY_HEADER,
    profiles.EXPRESS_IDEMPOTENCY,
    profiles.ROCKET_RIDES,
    profiles.ADYEN,
    profiles.PAYPAL,
]
PLAIN_500 = httpx.Response(500, text="Internal Server Error")  # Starlette's, Django's, Express's


def outcome(
    tmp_path: Path,
    fake_time: FakeTime,
    router: respx.MockRouter,
    profile: idempotently.ServerProfile,
    answers: list[httpx.Response],
) -> tuple[int, str]:
    """How many requests one call sent, and the operation's status after it."""
    route = router.post(URL).mock(side_effect=[*answers, httpx.Response(201)])
    with make_session(tmp_path, fake_time, profile=profile) as session:
        with contextlib.suppress(idempotently.IdempotentlyError):
            session.post(URL, json={"amount": 1}, operation_id="op")
        operation = session.journal.operation("op")
    assert operation is not None
    return route.call_count, operation.status


@pytest.mark.parametrize(
    "profile",
    [
        profiles.DJANGO_IDEMPOTENCY_KEY,
        profiles.ASGI_IDEMPOTENCY_HEADER,
        profiles.EXPRESS_IDEMPOTENCY,
    ],
    ids=lambda profile: profile.name,
)
def test_a_middleware_that_releases_the_key_on_a_500_is_not_sent_it_again(
    tmp_path: Path,
    fake_time: FakeTime,
    router: respx.MockRouter,
    profile: idempotently.ServerProfile,
) -> None:
    """A 500 from a server that does not store it may have acted: needs_reconcile, one send."""
    assert (1, "needs_reconcile") == outcome(tmp_path, fake_time, router, profile, [PLAIN_500])


def test_the_generic_profile_would_retry_that_500(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """What the catalog protects against: the default retries the 500 (a second charge there)."""
    assert (2, "succeeded") == outcome(tmp_path, fake_time, router, profiles.GENERIC, [PLAIN_500])


def test_rocket_rides_retries_a_500_because_it_resumes_from_its_recovery_point(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """rocket-rides unlocks the key on a 500 and resumes the request's phases: retry it."""
    assert (2, "succeeded") == outcome(
        tmp_path, fake_time, router, profiles.ROCKET_RIDES, [PLAIN_500]
    )


def test_django_waits_through_its_busy_lock(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """django-idempotency-key answers 423 when its storage lock is busy: in progress, retried."""
    locked = httpx.Response(423, json={"error": "Resource Locked (423)"})
    assert (2, "succeeded") == outcome(
        tmp_path, fake_time, router, profiles.DJANGO_IDEMPOTENCY_KEY, [locked]
    )


def test_express_417_is_the_mismatch_answer(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """express-idempotency's 417 ("misuse of the idempotency key") is final, never retried."""
    misuse = httpx.Response(417, text="Misuse of the idempotency key. Please check your request.")
    count, _status = outcome(tmp_path, fake_time, router, profiles.EXPRESS_IDEMPOTENCY, [misuse])
    assert 1 == count
    assert profiles.EXPRESS_IDEMPOTENCY.is_payload_mismatch(misuse)
    assert not profiles.GENERIC.is_payload_mismatch(misuse)


def test_rocket_rides_tells_a_mismatch_409_from_an_in_progress_409(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """Both are 409: the body saying "mismatch" is final, "in progress" is waited through."""
    mismatch = httpx.Response(
        409,
        json={
            "error": "There was a mismatch between this request's parameters and the"
            " parameters of a previously stored request with the same Idempotency-Key."
        },
    )
    busy = httpx.Response(
        409, json={"error": "An API request with the same Idempotency-Key is already in progress."}
    )
    assert profiles.ROCKET_RIDES.is_payload_mismatch(mismatch)
    assert not profiles.ROCKET_RIDES.is_payload_mismatch(busy)
    assert 1 == outcome(tmp_path, fake_time, router, profiles.ROCKET_RIDES, [mismatch])[0]


def test_rocket_rides_422_is_a_validation_error_not_a_mismatch() -> None:
    """A 422 there means a bad parameter; only the generic profile reads it as a mismatch."""
    invalid = httpx.Response(422, json={"error": "Parameter 'origin_lat' must be a float."})
    assert not profiles.ROCKET_RIDES.is_payload_mismatch(invalid)
    assert profiles.GENERIC.is_payload_mismatch(invalid)


def test_asgi_replays_are_recognised(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """asgi-idempotency-header marks a stored answer `Idempotent-Replayed: true`."""
    replay = httpx.Response(201, json={"id": "ch_1"}, headers={"Idempotent-Replayed": "true"})
    router.post(URL).mock(return_value=replay)
    with make_session(tmp_path, fake_time, profile=profiles.ASGI_IDEMPOTENCY_HEADER) as session:
        response = session.post(URL, json={}, operation_id="op")
    assert response.extensions["idempotently"].replayed


def test_paypal_sends_the_key_as_paypal_request_id(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """PayPal's key header is PayPal-Request-Id, and only that one carries the key."""
    route = router.post(URL).mock(return_value=httpx.Response(201))
    with make_session(tmp_path, fake_time, profile=profiles.PAYPAL) as session:
        key = session.post(URL, json={}, operation_id="op").extensions["idempotently"].key
    request = route.calls[0].request
    assert (key, None) == (
        request.headers["PayPal-Request-Id"],
        request.headers.get("Idempotency-Key"),
    )


def test_adyen_refuses_a_key_over_64_characters_before_sending(
    tmp_path: Path, fake_time: FakeTime, router: respx.MockRouter
) -> None:
    """Adyen takes keys of at most 64 characters: a longer one is refused, nothing sent."""
    route = router.post(URL).mock(return_value=httpx.Response(201))
    with make_session(tmp_path, fake_time, profile=profiles.ADYEN) as session:
        with pytest.raises(idempotently.InvalidKeyError):
            session.post(URL, json={}, idempotency_key="k" * 65)
        assert 201 == session.post(URL, json={}, idempotency_key="k" * 64).status_code
    assert 1 == route.call_count


@pytest.mark.parametrize(
    ("profile", "hours"),
    [
        (profiles.DJANGO_IDEMPOTENCY_KEY, 300 / 3600),
        (profiles.ROCKET_RIDES, 72),
        (profiles.ADYEN, 31 * 24),
        (profiles.PAYPAL, 6),
    ],
    ids=lambda value: getattr(value, "name", str(value)),
)
def test_each_key_lifetime_is_the_one_its_server_documents(
    profile: idempotently.ServerProfile, hours: float
) -> None:
    """Past the key lifetime resume never resends: it must not outlive the server's memory."""
    assert hours * 3600 == profile.key_lifetime


@pytest.mark.parametrize("profile", CATALOG, ids=lambda profile: profile.name)
def test_every_catalog_profile_is_built_in_by_its_name(profile: idempotently.ServerProfile) -> None:
    """`BUILTIN_PROFILES[name]` is the profile: what a journaled name and `--profile` resolve to."""
    assert profile is profiles.BUILTIN_PROFILES[profile.name]


@pytest.mark.parametrize("name", sorted(profiles.BUILTIN_PROFILES))
def test_resume_accepts_every_built_in_profile_by_name(tmp_path: Path, name: str) -> None:
    """`idempotently resume --profile NAME` takes each built-in name."""
    journal = tmp_path / "j.db"
    idempotently.Journal(journal).close()
    result = CliRunner().invoke(
        cli, ["--journal", str(journal), "resume", "--dry-run", "--profile", name]
    )
    assert 0 == result.exit_code, result.output


def test_resume_refuses_an_unknown_profile_name(tmp_path: Path) -> None:
    """A name that is no built-in (and no module:NAME) is a usage error naming the choices."""
    journal = tmp_path / "j.db"
    idempotently.Journal(journal).close()
    result = CliRunner().invoke(
        cli, ["--journal", str(journal), "resume", "--dry-run", "--profile", "djangoo"]
    )
    assert 2 == result.exit_code
    assert "django-idempotency-key" in result.output


def test_the_guide_table_has_a_row_for_every_built_in_profile() -> None:
    """docs/profiles.md lists each built-in profile by the name --profile takes."""
    page = (Path(__file__).parent.parent / "docs" / "profiles.md").read_text(encoding="utf-8")
    assert [] == [name for name in profiles.BUILTIN_PROFILES if f"| `{name}`" not in page]
