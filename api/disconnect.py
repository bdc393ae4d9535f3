"""Run a handler's work until it finishes or the client goes away, whichever comes first.

Starlette keeps running a non-streaming handler after its client disconnects; cancelling the work instead
closes its backend streams, which aborts the requests in the engine and frees their KV-cache blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    task: asyncio.Task[T] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            watcher.cancel()
            raise ClientDisconnected()
        watcher.cancel()
    return task.result()
