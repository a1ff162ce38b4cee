"""The outbox in a SQLAlchemy Session: an order and its charge commit together.

The shop keeps its orders with the SQLAlchemy ORM, in the journal's own SQLite
file (with a PostgreSQL journal, the engine's URL is the application's database,
where the journal's tables live in schema ``idempotently``). Each order is added
and its charge enqueued in one ``Session`` transaction: both commit, or neither.
The shop is killed right after its commit, before anything is sent; the relay
(``idempotently resume --watch`` on a server, or ``Session.resume()`` as here)
sends the charge, once.

Install: ``pip install 'idempotently[sqlalchemy]'``
"""

import multiprocessing
import os
import signal

from sqlalchemy import create_engine, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import idempotently
from idempotently.testing import serve

JOURNAL = "shop-sqlalchemy.db"
AUTH = {"Authorization": "Bearer shop_1"}


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(primary_key=True)
    amount: Mapped[int]


def take_orders(base_url: str) -> None:
    """The shop: each order and its charge commit together; then the process dies."""
    with idempotently.Session(JOURNAL, base_url=base_url, headers=AUTH) as payments:
        engine = create_engine(f"sqlite:///{JOURNAL}")  # the journal's own file
        Base.metadata.create_all(engine)
        for order_id, amount, in_stock in (("order-51", 700, False), ("order-52", 1000, True)):
            try:
                with Session(engine) as db, db.begin():  # commits at the end, or rolls back
                    db.merge(Order(id=order_id, amount=amount))  # run again: still one row
                    payments.enqueue(
                        "POST",
                        "/v1/charges",
                        json={"amount": amount, "currency": "usd", "customer": "cus_7"},
                        operation_id=f"{order_id}:charge",
                        connection=db,  # the Session: the charge joins its transaction
                    )
                    if not in_stock:
                        raise LookupError(f"{order_id}: out of stock")
            except LookupError as error:
                print("rolled back:", error)  # the order and its charge are both gone
        os.kill(os.getpid(), signal.SIGKILL)  # a crash right after the last commit


if __name__ == "__main__":
    # A fixed port and a file for the stand-in API's own records: a re-run in the same
    # folder sends the request journaled the first time, and the API remembers it.
    with serve(port=8421, db="outbox-sqlalchemy-api.db") as api:
        charged = len(api.charges())  # 0, or the charge of a previous run
        shop = multiprocessing.get_context("spawn").Process(target=take_orders, args=(api.url,))
        shop.start()
        shop.join()
        assert shop.exitcode == -signal.SIGKILL and len(api.charges()) == charged  # none sent

        with idempotently.Session(JOURNAL, base_url=api.url, headers=AUTH) as relay:
            for result in relay.resume():
                print(result.operation_id, result.action, result.status_code)
            assert relay.resume() == []  # nothing left to send
        assert [charge.amount for charge in api.charges()] == [1000]  # charged once

    with Session(create_engine(f"sqlite:///{JOURNAL}")) as db:
        assert db.scalars(select(Order.id)).all() == ["order-52"]
