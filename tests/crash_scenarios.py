"""Scenarios for `idempotently.testing.crash_points`: module level, so a child process finds them.

Each is a user's code as the harness gets it: a function of the session it is
given. The careless ones are what the harness exists to catch.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import idempotently

ORDERS = ("order-1", "order-2")
USER_2 = {"Authorization": "Bearer user_2"}


def charge(order: str, amount: int = 100) -> dict[str, Any]:
    return {
        "amount": amount,
        "currency": "usd",
        "customer": "cus_1",
        "metadata": {"order_id": order},
    }


def place_orders(session: idempotently.Session) -> None:
    """Crash-safe: each operation id comes from the order it charges."""
    for order in ORDERS:
        session.post("/v1/charges", operation_id=f"{order}:charge", json=charge(order))


async def place_orders_async(session: idempotently.AsyncSession) -> None:
    for order in ORDERS:
        await session.post("/v1/charges", operation_id=f"{order}:charge", json=charge(order))


def fresh_ids(session: idempotently.Session) -> None:
    """Careless: a new operation id each run, so a restart charges again."""
    for order in ORDERS:
        session.post("/v1/charges", operation_id=str(uuid.uuid4()), json=charge(order))


def priced_by_the_clock(session: idempotently.Session) -> None:
    """Careless: the body changes from run to run, so the journal refuses the rerun."""
    session.post(
        "/v1/charges",
        operation_id="order-1:charge",
        json=charge("order-1", amount=100 + int(time.time_ns() % 1000)),
    )


def fails(session: idempotently.Session) -> None:
    raise RuntimeError("the scenario's own bug")


def sends_nothing(session: idempotently.Session) -> None:
    """Makes its calls with a plain httpx client, past the journal."""


def hangs(session: idempotently.Session) -> None:
    time.sleep(3600)


def session_with_a_fresh_journal(journal: Path, base_url: str) -> idempotently.Session:
    """Careless operator: every process starts from an empty journal."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{journal}{suffix}").unlink(missing_ok=True)
    return idempotently.Session(
        journal, base_url=base_url, headers={"Authorization": "Bearer user_2"}
    )


def session_as_user_2(journal: Path, base_url: str) -> idempotently.Session:
    return idempotently.Session(
        journal, base_url=base_url, headers={"Authorization": "Bearer user_2"}
    )


def session_elsewhere(journal: Path, base_url: str) -> idempotently.Session:
    return idempotently.Session(
        journal.with_name("other.db"), base_url=base_url, headers={"Authorization": "Bearer user_1"}
    )


GROUP_STEPS = ("charge", "ship", "email")


def three_step_group(session: idempotently.Session) -> None:
    """Crash-safe: an operation group whose steps are sent in order, each once."""
    group = session.group("order-7")
    for step in GROUP_STEPS:
        group.post("/v1/charges", step=step, json=charge(f"order-7-{step}"))


async def three_step_group_async(session: idempotently.AsyncSession) -> None:
    group = session.group("order-7")
    for step in GROUP_STEPS:
        await group.post("/v1/charges", step=step, json=charge(f"order-7-{step}"))
