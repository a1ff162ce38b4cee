"""A PostgreSQL transaction the server ends as a deadlock's victim wrote nothing, so the
journal runs it again (as PostgreSQL asks of its clients) instead of failing a fleet's
writes: three watch workers draining one queue once failed a call this way.

The deadlock is made, not hoped for: another session holds operation B's row, the
journal's batch takes A's and waits for B's, then that session asks for A's. The other
session's ``deadlock_timeout`` is long, so the journal's backend is the one that finds
the deadlock and is ended.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import idempotently
from idempotently._commands import SetStatus

pytestmark = pytest.mark.postgres


def test_a_batch_ended_by_a_deadlock_runs_again_and_commits(postgres_url: str) -> None:
    """Both writes of the deadlock's victim are committed by its second run; none fails."""
    import psycopg

    with idempotently.Session(postgres_url, base_url="http://127.0.0.1:9") as session:
        for name in ("a", "b"):
            session.enqueue("POST", "/v1/charges", json={"order": name}, operation_id=name)
        journal = session.journal
        results: list[Any] = []
        errors: list[BaseException] = []
        now = time.time()
        writes = [SetStatus(name, "abandoned", "by the batch", now) for name in ("a", "b")]

        def batch() -> None:
            try:
                results.extend(journal._store.commit(writes, durable=True))
            except BaseException as error:
                errors.append(error)

        with psycopg.connect(postgres_url) as other:
            other.execute("SET deadlock_timeout = '60s'")
            other.execute(
                "UPDATE idempotently.operations SET reason = 'held' WHERE operation_id = 'b'"
            )
            worker = threading.Thread(target=batch)
            worker.start()
            waiting = 0
            for _ in range(600):  # the batch holds a's row and waits for b's
                with psycopg.connect(postgres_url, autocommit=True) as watcher:
                    row = watcher.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND pid <> %s",
                        (other.info.backend_pid,),
                    ).fetchone()
                waiting = 0 if row is None else int(row[0])
                if waiting:
                    break
                time.sleep(0.05)
            assert 1 == waiting
            other.execute(
                "UPDATE idempotently.operations SET reason = 'held' WHERE operation_id = 'a'"
            )
            other.commit()
        worker.join(60)
        statuses = {name: journal.operation(name).status for name in ("a", "b")}  # type: ignore[union-attr]
    assert ([], [True, True]) == (errors, results)
    assert {"a": "abandoned", "b": "abandoned"} == statuses
