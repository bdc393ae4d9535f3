"""Group commit of the node task's hot statements, on the loopback PostgreSQL."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest
from sqlalchemy.exc import OperationalError

from app.db.direct import DirectPool, psycopg_conninfo
from app.db.group_commit import GroupCommit, retired_committer_cpu_s
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


@pytest.fixture
def group(db: tuple[str, DirectPool]) -> Iterator[GroupCommit]:
    group = GroupCommit(db[1], max_batch=8)
    yield group
    group.close()


def test_concurrent_statements_share_transactions_and_each_caller_gets_its_rows(
    db: tuple[str, DirectPool], group: GroupCommit
) -> None:
    url, _ = db
    results, errors = in_threads(40, lambda i: group.execute(INSERT, {"x": i % 20}, (i,)))
    assert not errors
    # every statement ran once, in its own caller's name: of two inserts of a value, exactly one returns it
    assert sorted(x for r in results.values() for (x,) in r) == list(range(20))  # type: ignore[attr-defined]
    assert rows(url) == list(range(20))  # committed before any caller returned
    assert group.statements == 40
    assert group.transactions <= 40


def test_what_queued_during_a_batch_goes_out_as_the_next_batch(db: tuple[str, DirectPool]) -> None:
    url, pool = db
    group = GroupCommit(pool, max_batch=64)
    try:
        with psycopg.connect(psycopg_conninfo(url)) as locker:
            locker.execute("INSERT INTO t (x) VALUES (100)")  # uncommitted: an insert of 100 waits for it
            first = threading.Thread(target=group.execute, args=(INSERT, {"x": 100}))
            first.start()
            while group.statements < 1:  # the committer has taken the first statement and waits on the lock
                time.sleep(0.005)
            threads = [threading.Thread(target=group.execute, args=(INSERT, {"x": i}, (i,))) for i in range(20)]
            for t in threads:
                t.start()
            while group.queued < 20:
                time.sleep(0.005)
            locker.rollback()
        first.join()
        for t in threads:
            t.join()
    finally:
        group.close()
    assert rows(url) == [*range(20), 100]
    assert (group.transactions, group.statements) == (2, 21)  # the 20 queued meanwhile: one transaction


def test_close_runs_what_is_queued_stops_the_committer_and_refuses_more(db: tuple[str, DirectPool]) -> None:
    url, pool = db
    group = GroupCommit(pool)
    before = set(threading.enumerate())
    assert group.execute(INSERT, {"x": 1}) == [(1,)]
    assert [t.name for t in set(threading.enumerate()) - before] == ["group-commit"]  # waits for the next
    group.close()
    assert set(threading.enumerate()) <= before  # joined
    with pytest.raises(RuntimeError):
        group.execute(INSERT, {"x": 2})
    group.close()  # twice is fine
    assert rows(url) == [1]


def test_an_idle_committer_stops_and_the_next_statement_starts_another(db: tuple[str, DirectPool]) -> None:
    _, pool = db
    group = GroupCommit(pool, idle_s=0.0)
    retired = retired_committer_cpu_s()
    try:
        for x in range(3):
            assert group.execute(INSERT, {"x": x}) == [(x,)]
            for t in threading.enumerate():
                if t.name == "group-commit":
                    t.join()  # it stops once nothing is queued (idle_s=0)
    finally:
        group.close()
    assert group.transactions == 3
    assert retired_committer_cpu_s() > retired  # a stopped committer's CPU still counts in the benchmark


def test_a_failing_statement_fails_its_caller_only(db: tuple[str, DirectPool]) -> None:
    url, pool = db
    group = GroupCommit(pool, max_batch=64)
    try:
        # x = -1 breaks the CHECK: its batch rolls back and every statement runs again alone
        results, errors = in_threads(16, lambda i: group.execute(INSERT, {"x": i - 1}, (i,)))
    finally:
        group.close()
    assert set(errors) == {0}
    assert isinstance(errors[0], psycopg.errors.CheckViolation)
    assert sorted(x for r in results.values() for (x,) in r) == list(range(15))  # type: ignore[attr-defined]
    assert rows(url) == list(range(15))


def test_a_lost_connection_is_an_invalidated_operational_error(
    db: tuple[str, DirectPool], group: GroupCommit
) -> None:
    url, pool = db
    with pool.connection() as conn:
        victim = conn.info.backend_pid
    with psycopg.connect(psycopg_conninfo(url), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [victim])
    with pytest.raises(OperationalError) as raised:
        group.execute(INSERT, {"x": 1})
    assert raised.value.connection_invalidated  # callers retry on this, as on a restart
    assert group.execute(INSERT, {"x": 1}) == [(1,)]  # the next batch takes a fresh connection


def test_a_lost_connection_fails_every_statement_of_its_batch(db: tuple[str, DirectPool]) -> None:
    url, pool = db
    group = GroupCommit(pool, max_batch=64)
    conninfo = psycopg_conninfo(url)
    with psycopg.connect(conninfo) as hold_100, psycopg.connect(conninfo) as hold_101:
        hold_100.execute("INSERT INTO t (x) VALUES (100)")  # uncommitted: holds the first batch
        hold_101.execute("INSERT INTO t (x) VALUES (101)")  # holds the second, in flight when its backend dies
        first = threading.Thread(target=group.execute, args=(INSERT, {"x": 100}))
        first.start()
        while group.statements < 1:
            time.sleep(0.005)
        xs = [101, 1, 2, 3, 4]
        results, errors = {}, {}

        def run(x: int) -> None:
            try:
                results[x] = group.execute(INSERT, {"x": x}, (x,))
            except BaseException as exc:
                errors[x] = exc

        threads = [threading.Thread(target=run, args=(x,)) for x in xs]
        for t in threads:
            t.start()
        while group.queued < len(xs):
            time.sleep(0.005)
        hold_100.rollback()
        first.join()
        with psycopg.connect(conninfo, autocommit=True) as admin:
            waiting: list[tuple[int]] = []
            while not waiting:  # the batch's backend, blocked on 101
                waiting = admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
                ).fetchall()
            admin.execute("SELECT pg_terminate_backend(%s)", [waiting[0][0]])
        for t in threads:
            t.join()
        hold_101.rollback()
    try:
        assert not results and set(errors) == set(xs)
        assert all(isinstance(e, OperationalError) and e.connection_invalidated for e in errors.values())
        assert group.execute(INSERT, {"x": 1}) == [(1,)]  # a retry takes a fresh connection
    finally:
        group.close()
    assert (group.transactions, group.statements) == (3, 7)
    assert rows(url) == [1, 100]


def test_batch_size_and_idle_time_must_be_valid(db: tuple[str, DirectPool]) -> None:
    with pytest.raises(ValueError):
        GroupCommit(db[1], max_batch=0)
    with pytest.raises(ValueError):
        GroupCommit(db[1], idle_s=-1)
