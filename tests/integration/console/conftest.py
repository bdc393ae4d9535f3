"""The console's browser tests: uvicorn on loopback over a fresh PostgreSQL database (tests/support/console.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.console import Console, serve_console


@pytest.fixture(scope="module")
def console() -> Iterator[Console]:
    yield from serve_console()
