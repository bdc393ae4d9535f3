"""Group commit of the node task's hot statements, on the loopback PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import psycopg
import pytest
from sqlalchemy.exc import OperationalError

from app.db.direct import DirectPool, psycopg_conninfo
from app.db.group_commit import GroupCommit
from tests.support.postgres import temporary_database

INSERT = "INSERT INTO t (x) VALUES (%(x)s) ON CONFLICT DO NOTHING RETURNING x"


@pytest.fixture
def db() -> Iterator[tuple[str, DirectPool]]:
    with temporary_database("infe_group") as url:
        pool = DirectPool(url, size=4)
        try:
            with pool.connection() as conn:
                conn.execute("CREATE TABLE t (x int PRIMARY KEY CHECK (x >= 0))")
            yield url, pool
        finally:
            pool.close()


def in_threads(
    count: int, work: Callable[[int], object]
) -> tuple[dict[int, object], dict[int, BaseException]]:
    """Run ``work(i)`` for ``i < count`` in as many threads, started together; their results and errors."""
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}
    start = threading.Barrier(count)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = work(i)
        except BaseException as exc:
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def rows(url: str) -> list[int]:
    with psycopg.connect(psycopg_conninfo(url)) as conn:
        return [x for (x,) in conn.execute("SELECT x FROM t ORDER BY x")]


def test_concurrent_statements_share_transactions_and_each_caller_gets_its_rows(
    db: tuple[str, DirectPool],
) -> None:
    url, pool = db
    group = GroupCommit(pool, max_batch=8)
    results, errors = in_threads(40, lambda i: group.execute(INSERT, {"x": i % 20}, (i,)))
    assert not errors
    # every statement ran once, in its own caller's name: of two inserts of a value, exactly one returns it
    assert sorted(x for r in results.values() for (x,) in r) == list(range(20))  # type: ignore[attr-defined]
    assert rows(url) == list(range(20))  # committed before any caller returned
    assert group.statements == 40
    assert group.transactions <= 40


def test_a_failing_statement_fails_its_caller_only(db: tuple[str, DirectPool]) -> None:
    url, pool = db
    group = GroupCommit(pool, max_batch=64)
    # x = -1 breaks the CHECK: its batch rolls back and every statement runs again alone
    results, errors = in_threads(16, lambda i: group.execute(INSERT, {"x": i - 1}, (i,)))
    assert set(errors) == {0}
    assert isinstance(errors[0], psycopg.errors.CheckViolation)
    assert sorted(x for r in results.values() for (x,) in r) == list(range(15))  # type: ignore[attr-defined]
    assert rows(url) == list(range(15))


def test_a_lost_connection_is_an_invalidated_operational_error(db: tuple[str, DirectPool]) -> None:
    url, pool = db
    group = GroupCommit(pool)
    with pool.connection() as conn:
        victim = conn.info.backend_pid
    with psycopg.connect(psycopg_conninfo(url), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [victim])
    with pytest.raises(OperationalError) as raised:
        group.execute(INSERT, {"x": 1})
    assert raised.value.connection_invalidated  # callers retry on this, as on a restart
    assert group.execute(INSERT, {"x": 1}) == [(1,)]  # the next batch takes a fresh connection


def test_batch_size_and_leaders_must_be_positive(db: tuple[str, DirectPool]) -> None:
    with pytest.raises(ValueError):
        GroupCommit(db[1], max_batch=0)
    with pytest.raises(ValueError):
        GroupCommit(db[1], leaders=0)
