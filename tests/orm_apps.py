"""An application's ORM on the journal's database, as the outbox tests and their child
processes open it: a SQLAlchemy engine (sync or async, on a driver of choice) and a
Django connection alias, made from a journal target (a SQLite path or a PostgreSQL URL).
"""

from __future__ import annotations

import itertools
from typing import Any

SYNC_DRIVERS = {
    "sqlite": "sqlite",
    "psycopg": "postgresql+psycopg",
    "psycopg2": "postgresql+psycopg2",
}
ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "psycopg": "postgresql+psycopg_async",
    "asyncpg": "postgresql+asyncpg",
}


def is_postgres(target: str) -> bool:
    return "://" in target


def sqlalchemy_url(target: str, driver: str | None = None, *, asynchronous: bool = False) -> str:
    """The SQLAlchemy URL of the journal's database through ``driver`` (psycopg by
    default on PostgreSQL; sqlite3, or aiosqlite when async, on SQLite)."""
    if not is_postgres(target):
        return f"{'sqlite+aiosqlite' if asynchronous else 'sqlite'}:///{target}"
    drivers = ASYNC_DRIVERS if asynchronous else SYNC_DRIVERS
    scheme = drivers[driver or "psycopg"]
    return scheme + "://" + target.split("://", 1)[1]


def sqlalchemy_engine(target: str, driver: str | None = None) -> Any:
    import sqlalchemy

    return sqlalchemy.create_engine(sqlalchemy_url(target, driver))


def async_sqlalchemy_engine(target: str, driver: str | None = None) -> Any:
    from sqlalchemy.ext.asyncio import create_async_engine

    return create_async_engine(sqlalchemy_url(target, driver, asynchronous=True))


_aliases = itertools.count()


def django_alias(target: str) -> str:
    """A new Django connection alias on the journal's database (Django configured once
    per process, with no apps)."""
    import django
    from django.conf import settings
    from django.db import connections

    if not settings.configured:
        settings.configure(DATABASES={}, INSTALLED_APPS=[], USE_TZ=True)
        django.setup()
    if is_postgres(target):
        from urllib.parse import urlsplit

        url = urlsplit(target)
        database = {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": url.path.lstrip("/"),
            "USER": url.username or "",
            "PASSWORD": url.password or "",
            "HOST": url.hostname or "",
            "PORT": str(url.port or ""),
        }
    else:
        database = {"ENGINE": "django.db.backends.sqlite3", "NAME": target}
    alias = f"shop{next(_aliases)}"
    connections.settings[alias] = connections.configure_settings({"default": database})["default"]
    return alias


def orders_table(target: str) -> str:
    return "public.orders" if is_postgres(target) else "orders"
