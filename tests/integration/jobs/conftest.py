"""Fixtures of the job-layer tests (a migrated PostgreSQL database per session; see tests/postgres.py)."""

from tests.support.postgres import committed, db, pg_engine, pg_url

__all__ = ["committed", "db", "pg_engine", "pg_url"]
