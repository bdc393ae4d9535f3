"""Is this server ready for traffic? What ``GET /ready`` answers (``/health`` stays the liveness probe).

Ready means the jobs database answers and its schema is at the head of the installed migrations; otherwise one
line says why (unreachable, or "at revision X, not at head Y: run `inf-engine db upgrade`"). Cheap: the head is
read once per process, and the database gets one connection with a short timeout per check. A server without a
configured database whose SQLite file does not exist yet is ready when it creates that file itself at first use
(``db_auto_upgrade``, the default).

A server that migrates by itself and could not at start (its database was down) retries its start from here, at
most every ``START_RETRY_S``: behind an orchestrator that sends no traffic to an unready server, no jobs request
would come to do it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from app.db.migrate import CHECK_TIMEOUT_S, SchemaStatus, head_revision, schema_status
from app.jobs.runtime.server import JobsRuntime

log = logging.getLogger(__name__)

#: at most one start attempt of the jobs runtime per this many seconds, from readiness checks
START_RETRY_S = 30.0


@dataclass(frozen=True)
class ReadinessReport:
    ok: bool
    database: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None  # one line: why not ready
    code: str | None = None  # database_unreachable | schema_not_at_head


class Readiness:
    def __init__(
        self, jobs: JobsRuntime, *, timeout_s: float = CHECK_TIMEOUT_S, retry_every_s: float = START_RETRY_S
    ) -> None:
        self.jobs = jobs
        self.timeout_s = timeout_s
        self.retry_every_s = retry_every_s
        self._retry: asyncio.Task[None] | None = None
        self._last_retry = -math.inf
        self._stopped = False

    async def check(self) -> ReadinessReport:
        jobs = self.jobs
        if not jobs.has_state() and jobs.settings.db_auto_upgrade:
            head = await asyncio.to_thread(head_revision)
            return ReadinessReport(True, {"revision": None, "head": head, "at_head": False,
                                          "created": "at first use (SQLite)"})
        try:
            # the driver's own timeouts bound the thread; this bounds the answer should they not
            status = await asyncio.wait_for(
                asyncio.to_thread(schema_status, jobs.url, timeout_s=self.timeout_s), 2 * self.timeout_s + 1
            )
        except TimeoutError:
            head = await asyncio.to_thread(head_revision)
            status = SchemaStatus(None, head, error=f"no answer within {2 * self.timeout_s + 1:g} s")
        if status.error is None and jobs.has_state() and (status.at_head or jobs.settings.db_auto_upgrade):
            self._start_soon()
        return ReadinessReport(status.at_head, status.as_dict(), status.problem, status.code)

    def _start_soon(self) -> None:
        """Start the jobs runtime in the background (it migrates first with ``db_auto_upgrade``); a runtime that
        runs already returns at once."""
        if self._stopped or (self._retry is not None and not self._retry.done()):
            return
        now = time.monotonic()
        if now - self._last_retry < self.retry_every_s:
            return
        self._last_retry = now
        self._retry = asyncio.get_running_loop().create_task(self._start())

    async def _start(self) -> None:
        try:
            await self.jobs.ensure_started()
        except Exception as exc:
            log.warning("jobs are still unavailable (%s: %s); /ready tries again in %.0f s",
                        type(exc).__name__, exc, self.retry_every_s)

    async def stop(self) -> None:
        self._stopped = True
        if self._retry is not None and not self._retry.done():
            self._retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retry
