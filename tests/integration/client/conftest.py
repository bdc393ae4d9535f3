"""Fixtures of the client tests (a migrated PostgreSQL database per session; see tests/support/postgres.py)."""

from tests.support.postgres import committed, pg_engine, pg_url

__all__ = ["committed", "pg_engine", "pg_url"]
