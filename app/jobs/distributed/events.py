"""In-process notifications "job X has new results or changed state", so ``?follow=true`` streams answer as soon
as the executor commits instead of polling fast. Followers still poll slowly: another process may run the job."""

from __future__ import annotations

import asyncio

from app.aio import wait_event


class JobEvents:
    """Take a ``watch(job_id)`` token *before* reading the database, then ``wait(token, timeout)``: a publish that
    lands between the read and the wait is not lost."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def watch(self, job_id: str) -> asyncio.Event:
        event = self._events.get(job_id)
        if event is None:
            event = self._events[job_id] = asyncio.Event()
        return event

    def publish(self, job_id: str) -> None:
        event = self._events.pop(job_id, None)
        if event is not None:
            event.set()

    @staticmethod
    async def wait(token: asyncio.Event, timeout: float) -> bool:
        """True when the job changed, False after ``timeout`` seconds without news."""
        return await wait_event(token, timeout)
