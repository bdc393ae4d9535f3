"""Fixtures of the API tests on PostgreSQL (a migrated PostgreSQL database per session; see tests/postgres.py)."""

import gc
from collections.abc import Iterator

import pytest

from tests.support.postgres import committed, db, pg_engine, pg_url

__all__ = ["committed", "db", "pg_engine", "pg_url"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """No garbage collection while a failure's report is written: with the fuzz test's leftovers (connections,
    server objects) a finalizer that runs inside ``ast.parse`` trips CPython 3.11's "AST constructor recursion
    depth mismatch" SystemError, and pytest stops with an INTERNALERROR instead of showing the failing request."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
