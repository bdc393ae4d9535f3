"""wait_event: a poll loop that waits on an event stops when it is cancelled, even if the event fires then."""

from __future__ import annotations

import asyncio

import pytest

from app.aio import wait_event


async def test_returns_true_when_the_event_is_set_and_false_after_the_timeout() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5.0) is True


async def test_a_cancel_that_races_the_event_stops_the_loop() -> None:
    # Python 3.11's wait_for swallows this cancel (gh-86296) and the loop below would run forever
    event = asyncio.Event()
    turns = 0

    async def poll_loop() -> None:
        nonlocal turns
        while True:
            turns += 1
            await wait_event(event, 0.05)
            event.clear()

    task = asyncio.create_task(poll_loop())
    await asyncio.sleep(0.01)
    event.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2.0)
    assert turns == 1
