"""The raw psycopg pool of the node task's hot path, on the loopback PostgreSQL."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest
from sqlalchemy.exc import OperationalError

from app.db.direct import DirectPool, psycopg_conninfo
from tests.support.postgres import temporary_database


def test_conninfo_drops_the_driver_and_refuses_other_databases() -> None:
    assert psycopg_conninfo("postgresql+psycopg://u:pw@h:5433/db") == "postgresql://u:pw@h:5433/db"
    with pytest.raises(ValueError, match="PostgreSQL"):
        psycopg_conninfo("sqlite:///x.db")


def test_connections_are_autocommit_reused_and_take_server_options() -> None:
    with temporary_database("infe_direct") as url:
        pool = DirectPool(url, size=2, options="-c synchronous_commit=off")
        try:
            with pool.connection() as conn:
                first = conn.info.backend_pid
                assert conn.autocommit
                assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
                conn.execute("CREATE TABLE t (x int)")
            with pool.connection() as conn:
                assert conn.info.backend_pid == first  # the idle connection is given out again
                conn.execute("INSERT INTO t VALUES (1)")
            # autocommit: another connection sees the row at once
            with psycopg.connect(psycopg_conninfo(url)) as other:
                assert other.execute("SELECT count(*) FROM t").fetchone() == (1,)
            # a statement error leaves a sound connection, kept for the next caller
            with pytest.raises(psycopg.errors.UndefinedTable), pool.connection() as conn:
                conn.execute("SELECT * FROM missing")
            with pool.connection() as conn:
                assert conn.info.backend_pid == first
        finally:
            pool.close()


def test_a_dropped_connection_is_an_invalidated_operational_error_and_is_replaced() -> None:
    with temporary_database("infe_direct") as url:
        pool = DirectPool(url, size=1)
        try:
            with pool.connection() as conn:
                victim = conn.info.backend_pid
            with psycopg.connect(psycopg_conninfo(url), autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", [victim])
            with pytest.raises(OperationalError) as raised, pool.connection() as conn:
                conn.execute("SELECT 1")
            assert raised.value.connection_invalidated  # callers retry on this, as on a restart
            with pool.connection() as conn:  # the slot was freed and a new connection opened
                assert conn.info.backend_pid != victim
                assert conn.execute("SELECT 1").fetchone() == (1,)
        finally:
            pool.close()


def test_threads_wait_for_a_free_connection() -> None:
    with temporary_database("infe_direct") as url:
        pool = DirectPool(url, size=2)
        in_use = 0
        most = 0
        lock = threading.Lock()

        def work() -> None:
            nonlocal in_use, most
            with pool.connection() as conn:
                with lock:
                    in_use += 1
                    most = max(most, in_use)
                conn.execute("SELECT pg_sleep(0.05)")
                time.sleep(0.01)
                with lock:
                    in_use -= 1

        try:
            threads = [threading.Thread(target=work) for _ in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
            assert most == 2
        finally:
            pool.close()
        with pytest.raises(RuntimeError, match="closed"), pool.connection():
            pass
