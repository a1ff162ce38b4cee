"""ServerProfile(handler_errors=...): 5xx statuses that come from the server's handler,
not from a gateway in front of it.

Behind API Gateway every error a Lambda function raises is a 502, and Powertools'
idempotency utility deletes the key's record when the handler raises: a blind retry
runs the handler, and charges, again. Under the Powertools profile such a 502 goes to
needs_reconcile after one charge, and the lookup reconciler settles it.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

import idempotently
from idempotently import profiles
from tests.keyed_server import KeyedServer
from tests.scripted_server import serve

CHARGE = {"amount": 100, "metadata": {"operation_id": "op"}}
THREE_TRIES = idempotently.RetryPolicy(
    max_attempts=3, initial_backoff=0.01, max_backoff=0.01, budget=None
)


def charges_after_a_502(tmp_path: Path, profile: idempotently.ServerProfile) -> tuple[int, str]:
    """A Lambda that charges, then raises (the gateway answers 502, the key released):
    how many charges one call with three attempts made, and the operation's status."""
    server = KeyedServer(profile, lambda: 0.0, error_after_charge=502)
    with (
        serve(server) as url,
        idempotently.Session(
            tmp_path / "j.db", base_url=url, profile=profile, policy=THREE_TRIES
        ) as s,
    ):
        with pytest.raises(idempotently.IdempotentlyError):
            s.post("/v1/charges", json=CHARGE, operation_id="op")
        status = s.journal.operation("op").status
    return len(server.charges), status


def test_a_502_from_a_powertools_handler_is_charged_once_and_needs_reconcile(
    tmp_path: Path,
) -> None:
    """Under the Powertools profile: one charge, needs_reconcile (not three charges)."""
    assert (1, "needs_reconcile") == charges_after_a_502(tmp_path, profiles.AWS_POWERTOOLS)


def test_without_handler_errors_the_same_502_is_retried_into_three_charges(
    tmp_path: Path,
) -> None:
    """The field makes the difference: the same profile without handler_errors reads the
    502 as a gateway's and retries it, and the server charges on every attempt."""
    profile = attrs.evolve(profiles.AWS_POWERTOOLS, name="no-handler", handler_errors=frozenset())
    assert (3, "pending") == charges_after_a_502(tmp_path, profile)


def test_a_server_that_stores_its_errors_still_retries_a_handlers_502(tmp_path: Path) -> None:
    """handler_errors is read under stores_server_errors: a server that stores its own
    5xx replays it, so a retry is safe and is made."""
    profile = attrs.evolve(
        profiles.GENERIC, name="stores", handler_errors=frozenset({502, 503, 504})
    )
    assert (3, "pending") == charges_after_a_502(tmp_path, profile)


def test_the_lookup_reconciler_settles_a_powertools_502(tmp_path: Path) -> None:
    """The charge the 502 hid is found by a lookup on the operation id: succeeded, with
    the object as its answer; still one charge."""
    profile = profiles.AWS_POWERTOOLS
    server = KeyedServer(profile, lambda: 0.0, error_after_charge=502)
    with (
        serve(server) as url,
        idempotently.Session(
            tmp_path / "j.db", base_url=url, profile=profile, policy=THREE_TRIES
        ) as s,
    ):
        with pytest.raises(idempotently.NeedsReconcileError):
            s.post("/v1/charges", json=CHARGE, operation_id="op")
        [result] = s.resume(
            reconciler=idempotently.Lookup(
                f"{url}/v1/charges", params={"operation_id": "{operation_id}"}
            )
        )
        operation = s.journal.operation("op")
    assert ("succeeded", 1) == (operation.status, len(server.charges))
    assert "reconciled" == result.action


@pytest.mark.parametrize("statuses", [frozenset({404}), frozenset({600}), {502}])
def test_handler_errors_are_a_frozenset_of_5xx_statuses(statuses: object) -> None:
    """Anything else is a ValueError naming the field."""
    with pytest.raises(ValueError, match="handler_errors"):
        attrs.evolve(profiles.GENERIC, name="x", handler_errors=statuses)
