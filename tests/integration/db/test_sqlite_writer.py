"""SQLite's group commit (:class:`app.db.sqlite_writer.SqliteWriter`) and the process's write lock of a database
file (:mod:`app.db.sqlite_lock`), on a real SQLite file."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError, OperationalError

from app.db import create_db_engine
from app.db.sqlite_lock import FairLock, write_lock
from app.db.sqlite_writer import SqliteWriter


@pytest.fixture
def path(tmp_path: Path) -> Path:
    file = tmp_path / "w.db"
    with sqlite3.connect(file) as conn:
        conn.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT NOT NULL)")
    return file


@pytest.fixture
def writer(path: Path) -> Iterator[SqliteWriter]:
    w = SqliteWriter(path)
    yield w
    w.close()


def rows(path: Path) -> dict[int, str]:
    with sqlite3.connect(path) as conn:
        return dict(conn.execute("SELECT k, v FROM t"))


def insert(k: int, v: str = "x") -> Callable[[sqlite3.Connection], int]:
    def work(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO t (k, v) VALUES (?, ?)", (k, v))
        return k

    return work


def test_units_of_many_threads_share_transactions_and_each_gets_its_result(writer: SqliteWriter, path: Path) -> None:
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda k: writer.run(insert(k)), range(200)))
    assert results == list(range(200))
    assert len(rows(path)) == 200
    assert writer.units == 200 and writer.transactions < 200  # some ran together


def test_a_failing_unit_fails_alone(writer: SqliteWriter, path: Path) -> None:
    writer.run(insert(1, "first"))
    gate = threading.Event()

    def slow(conn: sqlite3.Connection) -> None:
        gate.wait(5)  # holds the writer while the next units queue up, so they run as one batch

    def half_done(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO t (k, v) VALUES (50, 'half')")
        raise RuntimeError("a bug")

    with ThreadPoolExecutor(4) as pool:
        blocker = pool.submit(writer.run, slow)
        time.sleep(0.05)
        ok = pool.submit(writer.run, insert(2))
        duplicate = pool.submit(writer.run, insert(1))
        bug = pool.submit(writer.run, half_done)
        time.sleep(0.05)
        gate.set()
        blocker.result()
        assert ok.result() == 2
        with pytest.raises(IntegrityError):  # sqlite3's error, as SQLAlchemy's
            duplicate.result()
        with pytest.raises(RuntimeError, match="a bug"):
            bug.result()
    assert rows(path) == {1: "first", 2: "x"}  # the failed units changed nothing


def test_close_runs_what_is_queued_then_refuses(writer: SqliteWriter, path: Path) -> None:
    writer.run(insert(1))
    writer.close()
    assert rows(path) == {1: "x"}
    with pytest.raises(RuntimeError):
        writer.run(insert(2))


def test_the_writer_stops_when_idle_and_starts_again(path: Path) -> None:
    w = SqliteWriter(path, idle_s=0.05)
    try:
        w.run(insert(1))
        time.sleep(0.3)
        assert not any(t.name == "sqlite-writer" for t in threading.enumerate())
        w.run(insert(2))
    finally:
        w.close()
    assert set(rows(path)) == {1, 2}


# -- the write lock ------------------------------------------------------------------------------------------
def test_the_fair_lock_is_handed_over_in_arrival_order() -> None:
    lock = FairLock()
    assert lock.acquire()
    order: list[int] = []

    def take(n: int) -> None:
        assert lock.acquire(timeout=5)
        order.append(n)
        lock.release()

    threads = []
    for n in range(5):
        thread = threading.Thread(target=take, args=(n,))
        thread.start()
        threads.append(thread)
        time.sleep(0.02)  # each waits before the next comes
    lock.release()
    for thread in threads:
        thread.join(5)
    assert order == [0, 1, 2, 3, 4] and not lock.locked


def test_a_fair_lock_wait_times_out_and_the_lock_still_works() -> None:
    lock = FairLock()
    assert lock.acquire()
    assert not lock.acquire(timeout=0.05)
    released = threading.Thread(target=lock.release)  # any thread may release it
    released.start()
    released.join()
    assert lock.acquire(timeout=1)
    lock.release()
    assert not lock.locked


@pytest.fixture
def engine(path: Path) -> Iterator[Engine]:
    e = create_db_engine(f"sqlite:///{path}")
    yield e
    e.dispose()


def test_an_engines_transaction_holds_the_files_write_lock_until_it_ends(engine: Engine, path: Path) -> None:
    lock = write_lock(path)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO t (k, v) VALUES (1, 'a')"))
        assert lock.locked
    assert not lock.locked and rows(path) == {1: "a"}
    with pytest.raises(ZeroDivisionError), engine.begin() as conn:
        conn.execute(text("INSERT INTO t (k, v) VALUES (2, 'b')"))
        raise ZeroDivisionError
    assert not lock.locked and rows(path) == {1: "a"}  # rolled back, and the lock is free
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(text("INSERT INTO t (k, v) VALUES (1, 'again')"))
    assert not lock.locked


def test_writers_of_one_process_queue_on_the_lock(engine: Engine, writer: SqliteWriter, path: Path) -> None:
    """A transaction held open by one thread makes the writer thread wait for it (not fail, not interleave)."""
    inside = threading.Event()
    finish = threading.Event()

    def hold() -> None:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO t (k, v) VALUES (1, 'engine')"))
            inside.set()
            finish.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(5)
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(writer.run, lambda conn: conn.execute("SELECT v FROM t WHERE k = 1").fetchone())
        time.sleep(0.1)
        assert not queued.done()
        finish.set()
        assert queued.result(5) == ("engine",)  # it ran after the engine's transaction committed
    holder.join(5)


def test_a_lock_held_past_the_timeout_turns_into_database_is_locked(path: Path) -> None:
    """Another process (here: a connection outside this module) holding the database: the busy timeout applies."""
    engine = create_db_engine(f"sqlite:///{path}", connect_args={"timeout": 0.1, "check_same_thread": False})
    outsider = sqlite3.connect(path, isolation_level=None)
    try:
        outsider.execute("BEGIN IMMEDIATE")
        with pytest.raises(OperationalError, match="locked"), engine.begin() as conn:
            conn.execute(text("SELECT 1"))
        assert not write_lock(path).locked
    finally:
        outsider.execute("ROLLBACK")
        outsider.close()
        engine.dispose()
