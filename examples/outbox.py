"""The outbox: an order row and its charge in one transaction, a crash, the relay.

The shop writes the order and enqueues its charge in one transaction on the
journal's own SQLite file (its tables and the journal's live in one database):
both commit, or neither. The shop is killed right after its commit, before
anything is sent; the relay (`idempotently resume --watch` on a server, or
`Session.resume()` as here) sends the charge, once. With a PostgreSQL journal
the same code takes a psycopg connection to the application's database.
"""

import multiprocessing
import os
import signal
import sqlite3

import idempotently
from idempotently.testing import serve

JOURNAL = "shop.db"
AUTH = {"Authorization": "Bearer shop_1"}


def take_orders(base_url: str) -> None:
    """The shop: each order and its charge commit together; then the process dies."""
    with idempotently.Session(JOURNAL, base_url=base_url, headers=AUTH) as session:
        db = sqlite3.connect(JOURNAL)
        db.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, amount INTEGER)")
        for order_id, amount, in_stock in (("order-41", 700, False), ("order-42", 1000, True)):
            try:
                with db:  # one transaction: committed at the end of the block, or rolled back
                    db.execute("INSERT INTO orders VALUES (?, ?)", (order_id, amount))
                    session.enqueue(
                        "POST",
                        "/v1/charges",
                        json={"amount": amount, "currency": "usd", "customer": "cus_7"},
                        operation_id=f"{order_id}:charge",
                        connection=db,
                    )
                    if not in_stock:
                        raise LookupError(f"{order_id}: out of stock")
            except LookupError as error:
                print("rolled back:", error)  # the order and its charge are both gone
        os.kill(os.getpid(), signal.SIGKILL)  # a crash right after the last commit


if __name__ == "__main__":
    with serve() as api:
        shop = multiprocessing.get_context("spawn").Process(target=take_orders, args=(api.url,))
        shop.start()
        shop.join()
        assert shop.exitcode == -signal.SIGKILL and api.charges() == []  # nothing sent yet

        # The relay, in another process (or the same one, restarted): credentials come
        # from its own client, never from the journal.
        with idempotently.Session(JOURNAL, base_url=api.url, headers=AUTH) as relay:
            for result in relay.resume():
                print(result.operation_id, result.action, result.status_code)
            assert relay.resume() == []  # nothing left to send
        assert [charge.amount for charge in api.charges()] == [1000]  # charged once

    orders = sqlite3.connect(JOURNAL).execute("SELECT id FROM orders").fetchall()
    assert orders == [("order-42",)]
