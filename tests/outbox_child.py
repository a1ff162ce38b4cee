"""A process of the outbox crash tests: a shop that enqueues charges, or a relay.

``shop`` takes orders one after the other: in one transaction of its own
connection (sqlite3 on the journal's file, psycopg on the journal's
PostgreSQL database) it inserts the order's row and enqueues its charge, then
commits. With ``--kill-after-commit K`` it SIGKILLs itself right after order
K's commit returns, before anything else happens.

``--orm sqlalchemy`` takes each order in a SQLAlchemy Session's transaction instead
(an AsyncSession on aiosqlite or asyncpg under ``--backend asyncio``), ``--orm django``
in Django's ``transaction.atomic()`` (sync only).

``relay`` runs ``Session.resume()``, printing one line per result as soon as
it is known (the test SIGKILLs it mid-batch). ``--backend asyncio|trio`` does
either through AsyncSession instead.

Every line is flushed as it is written, so a test waits on lines, never on sleeps.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
from typing import Any

import anyio

import idempotently


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def charge_body(order: int) -> dict[str, Any]:
    return {
        "amount": 100 + order,
        "currency": "usd",
        "customer": "cus_1",
        "metadata": {"order_id": f"order-{order}"},
    }


def connect(journal: str, table: str) -> Any:
    """The shop's own connection to the journal's database, with its orders table."""
    if journal.startswith("postgresql://"):
        import psycopg

        conn: Any = psycopg.connect(journal)
        conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (id text PRIMARY KEY)")
    else:
        conn = sqlite3.connect(journal)
        conn.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY)")
    conn.commit()
    return conn


def orm_shop(
    session: idempotently.Session,
    journal: str,
    user: str,
    orders: int,
    kill_after: int | None,
    orm: str,
) -> None:
    """``shop`` in a SQLAlchemy Session's transaction, or Django's atomic block."""
    from orm_apps import django_alias, is_postgres, sqlalchemy_engine  # beside this file

    table = f"public.orders_{user}" if is_postgres(journal) else "orders"
    create = f"CREATE TABLE IF NOT EXISTS {table} (id text PRIMARY KEY)"
    if orm == "django":
        from django.db import connections, transaction

        alias = django_alias(journal)
        with connections[alias].cursor() as cursor:
            cursor.execute(create)

        def take(order: int) -> idempotently.Operation:
            with transaction.atomic(using=alias):
                with connections[alias].cursor() as cursor:
                    cursor.execute(f"INSERT INTO {table} VALUES (%s)", [f"order-{order}"])
                return enqueue_charge(session, order, connections[alias])

    else:
        from sqlalchemy import text
        from sqlalchemy.orm import Session

        engine = sqlalchemy_engine(journal)
        with engine.begin() as db:
            db.execute(text(create))

        def take(order: int) -> idempotently.Operation:
            with Session(engine) as db, db.begin():
                db.execute(text(f"INSERT INTO {table} VALUES (:id)"), {"id": f"order-{order}"})
                return enqueue_charge(session, order, db)

    for order in range(orders):
        operation = take(order)  # committed when it returns
        if order == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        emit("committed", order=order, operation_id=operation.operation_id, key=operation.key)
    emit("done")


def enqueue_charge(
    session: idempotently.Session, order: int, connection: Any
) -> idempotently.Operation:
    return session.enqueue(
        "POST",
        "/v1/charges",
        json=charge_body(order),
        operation_id=f"order-{order}:charge",
        connection=connection,
    )


async def aorm_shop(
    session: idempotently.AsyncSession,
    journal: str,
    user: str,
    orders: int,
    kill_after: int | None,
) -> None:
    """``orm_shop`` in a SQLAlchemy AsyncSession's transaction (aiosqlite, asyncpg)."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession

    from orm_apps import async_sqlalchemy_engine, is_postgres

    table = f"public.orders_{user}" if is_postgres(journal) else "orders"
    engine = async_sqlalchemy_engine(journal, "asyncpg")
    async with engine.begin() as db:
        await db.execute(text(f"CREATE TABLE IF NOT EXISTS {table} (id text PRIMARY KEY)"))
    for order in range(orders):
        async with AsyncSession(engine) as db, db.begin():
            await db.execute(text(f"INSERT INTO {table} VALUES (:id)"), {"id": f"order-{order}"})
            operation = await session.enqueue(
                "POST",
                "/v1/charges",
                json=charge_body(order),
                operation_id=f"order-{order}:charge",
                connection=db,
            )
        if order == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        emit("committed", order=order, operation_id=operation.operation_id, key=operation.key)
    emit("done")


def shop(
    session: idempotently.Session, journal: str, user: str, orders: int, kill_after: int | None
) -> None:
    # A table per shop on PostgreSQL: the test database outlives one test.
    table, marker = (
        (f"public.orders_{user}", "%s") if journal.startswith("postgresql://") else ("orders", "?")
    )
    conn = connect(journal, table)
    for order in range(orders):
        conn.execute(f"INSERT INTO {table} VALUES ({marker})", (f"order-{order}",))
        operation = session.enqueue(
            "POST",
            "/v1/charges",
            json=charge_body(order),
            operation_id=f"order-{order}:charge",
            connection=conn,
        )
        conn.commit()
        if order == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        emit("committed", order=order, operation_id=operation.operation_id, key=operation.key)
    emit("done")


async def ashop(
    session: idempotently.AsyncSession,
    journal: str,
    user: str,
    orders: int,
    kill_after: int | None,
) -> None:
    """``shop`` through AsyncSession.enqueue: psycopg's AsyncConnection on PostgreSQL,
    the application's sqlite3 connection on SQLite."""
    postgres = journal.startswith("postgresql://")
    table, marker = (f"public.orders_{user}", "%s") if postgres else ("orders", "?")
    if postgres:
        import psycopg

        conn: Any = await psycopg.AsyncConnection.connect(journal)
        await conn.execute(f"CREATE TABLE IF NOT EXISTS {table} (id text PRIMARY KEY)")
        await conn.commit()
    else:
        conn = connect(journal, table)
    for order in range(orders):
        inserted = conn.execute(f"INSERT INTO {table} VALUES ({marker})", (f"order-{order}",))
        if postgres:
            await inserted
        operation = await session.enqueue(
            "POST",
            "/v1/charges",
            json=charge_body(order),
            operation_id=f"order-{order}:charge",
            connection=conn,
        )
        if postgres:
            await conn.commit()
        else:
            conn.commit()
        if order == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        emit("committed", order=order, operation_id=operation.operation_id, key=operation.key)
    emit("done")


async def arelay(session: idempotently.AsyncSession) -> None:
    emit("relaying")
    await session.resume(
        on_result=lambda result: emit(
            "result", operation_id=result.operation_id, action=result.action
        )
    )
    emit("done")


async def amain(args: argparse.Namespace) -> None:
    async with idempotently.AsyncSession(
        args.journal,
        base_url=args.base_url,
        headers={"Authorization": f"Bearer {args.user}"},
        timeout=60.0,
    ) as session:
        if args.mode == "shop" and args.orm == "sqlalchemy":
            await aorm_shop(session, args.journal, args.user, args.orders, args.kill_after_commit)
        elif args.mode == "shop":
            await ashop(session, args.journal, args.user, args.orders, args.kill_after_commit)
        else:
            await arelay(session)


def relay(session: idempotently.Session) -> None:
    emit("relaying")
    session.resume(
        on_result=lambda result: emit(
            "result", operation_id=result.operation_id, action=result.action
        )
    )
    emit("done")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("shop", "relay"))
    parser.add_argument("--journal", required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--user", required=True)
    parser.add_argument("--orders", type=int, default=3)
    parser.add_argument("--kill-after-commit", type=int, default=None)
    parser.add_argument("--backend", choices=("sync", "asyncio", "trio"), default="sync")
    parser.add_argument("--orm", choices=("none", "sqlalchemy", "django"), default="none")
    args = parser.parse_args()
    if args.backend != "sync":
        anyio.run(amain, args, backend=args.backend)
        return
    with idempotently.Session(
        args.journal,
        base_url=args.base_url,
        headers={"Authorization": f"Bearer {args.user}"},
        timeout=60.0,
    ) as session:
        if args.mode == "shop" and args.orm != "none":
            orm_shop(
                session, args.journal, args.user, args.orders, args.kill_after_commit, args.orm
            )
        elif args.mode == "shop":
            shop(session, args.journal, args.user, args.orders, args.kill_after_commit)
        else:
            relay(session)


if __name__ == "__main__":
    main()
