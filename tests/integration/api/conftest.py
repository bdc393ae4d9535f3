"""Fixtures of the API tests on PostgreSQL (a migrated PostgreSQL database per session; see tests/postgres.py)."""

from tests.postgres import committed, db, pg_engine, pg_url

__all__ = ["committed", "db", "pg_engine", "pg_url"]
