"""The outbox in Django: an order and its charge commit in one ``transaction.atomic()``.

A minimal Django configured in the script (an app's settings.py says the same):
the default database is the journal's own SQLite file (with a PostgreSQL
journal, it is the application's database, where the journal's tables live in
schema ``idempotently``). Each order is created and its charge enqueued inside
one atomic block, on ``django.db.connection``: both commit, or neither. The shop
is killed right after its commit, before anything is sent; the relay
(``idempotently resume --watch`` on a server, or ``Session.resume()`` as here)
sends the charge, once.

Install: ``pip install 'idempotently[django]'``
"""

import multiprocessing
import os
import signal

import django
from django.conf import settings

import idempotently
from idempotently.testing import serve

JOURNAL = "shop-django.db"
AUTH = {"Authorization": "Bearer shop_1"}

settings.configure(
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": JOURNAL}},
    INSTALLED_APPS=[],
    USE_TZ=True,
)
django.setup()

from django.db import connection, models, transaction  # noqa: E402 (after settings)


class Order(models.Model):
    id = models.CharField(primary_key=True, max_length=40)
    amount = models.IntegerField()

    class Meta:
        app_label = "shop"
        db_table = "orders"


def take_orders(base_url: str) -> None:
    """The shop: each order and its charge commit together; then the process dies."""
    with idempotently.Session(JOURNAL, base_url=base_url, headers=AUTH) as payments:
        if "orders" not in connection.introspection.table_names():
            with connection.schema_editor() as schema:  # a migration, in an app
                schema.create_model(Order)
        for order_id, amount, in_stock in (("order-61", 700, False), ("order-62", 1000, True)):
            try:
                with transaction.atomic():  # commits at the end of the block, or rolls back
                    Order.objects.update_or_create(id=order_id, defaults={"amount": amount})
                    payments.enqueue(
                        "POST",
                        "/v1/charges",
                        json={"amount": amount, "currency": "usd", "customer": "cus_7"},
                        operation_id=f"{order_id}:charge",
                        connection=connection,  # Django's: the charge joins the atomic block
                    )
                    if not in_stock:
                        raise LookupError(f"{order_id}: out of stock")
            except LookupError as error:
                print("rolled back:", error)  # the order and its charge are both gone
        os.kill(os.getpid(), signal.SIGKILL)  # a crash right after the last commit


if __name__ == "__main__":
    # A fixed port and a file for the stand-in API's own records: a re-run in the same
    # folder sends the request journaled the first time, and the API remembers it.
    with serve(port=8422, db="outbox-django-api.db") as api:
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

    assert list(Order.objects.values_list("id", flat=True)) == ["order-62"]
