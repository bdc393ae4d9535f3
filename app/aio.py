"""Small asyncio helpers shared by every layer.

Python 3.11's ``asyncio.wait_for`` can swallow a cancellation that arrives while its inner wait is completing
(gh-86296, fixed in 3.12): a ``while True`` loop stopped by ``task.cancel()`` then runs on and whoever awaits it
hangs. ``asyncio.timeout`` waits in the caller's own task, so a cancel always reaches it.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout`` seconds pass; True when it is set."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        pass
    return event.is_set()
