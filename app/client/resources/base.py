"""What the asynchronous resources share: the HTTP core and waiting for a run to end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from app.client._core import HTTPCore
from app.client.types import TERMINAL


class HasStatus(Protocol):
    @property
    def status(self) -> str: ...


S = TypeVar("S", bound=HasStatus)


class AsyncResource:
    """A group of the API's calls (``/v1/jobs``, ``/v1/files``...) over one :class:`HTTPCore`."""

    def __init__(self, core: HTTPCore) -> None:
        self._core = core


async def wait_terminal(get: Callable[[], Awaitable[S]], poll_interval: float, timeout: float | None) -> S:
    """Poll ``get`` until what it returns has a final status; TimeoutError after ``timeout`` seconds."""
    if poll_interval <= 0:
        raise ValueError(f"poll_interval must be positive, not {poll_interval}")
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        view = await get()
        if str(view.status) in TERMINAL:
            return view
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"still {view.status} after {timeout} s")
        await asyncio.sleep(poll_interval)
