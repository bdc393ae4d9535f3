"""Which workers are up and which queues they consume, as seen from Redis.

A worker started with ``--engine`` alone consumes only the engine queue; with no worker on the ``cpu`` queue the
sweeper (a beat task on that queue) never runs, and the nodes of a killed worker stay ``running`` for ever. So
every worker announces its queues under ``<prefix>:workers:<hostname>`` with a TTL, renewed from a daemon thread
(a killed worker's entry lapses within the TTL); beat warns and the API's ``/health`` reports when no worker
consumes the sweeper's queue.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis import Redis

from app.jobs.distributed.transport.queues import Queues

log = logging.getLogger(__name__)

#: the queue kind the sweeper's beat task is sent to (workers/beat.py)
SWEEPER_QUEUE_KIND = "cpu"
ANNOUNCE_TTL_S = 60.0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class WorkerPresence:
    """Announce this worker's queues, or read everyone's (``redis`` is a sync client)."""

    def __init__(self, redis: Redis, prefix: str, ttl_s: float = ANNOUNCE_TTL_S) -> None:
        self.redis = redis
        self.prefix = prefix
        self.ttl_s = ttl_s

    def key(self, hostname: str) -> str:
        return f"{self.prefix}:workers:{hostname}"

    def announce(self, hostname: str, queues: Sequence[str], concurrency: int | None = None) -> None:
        value = json.dumps({"queues": list(queues), "concurrency": concurrency, "at": time.time()})
        self.redis.set(self.key(hostname), value, px=int(self.ttl_s * 1000))

    def withdraw(self, hostname: str) -> None:
        self.redis.delete(self.key(hostname))

    def workers(self) -> dict[str, list[str]]:
        """Every announced worker (hostname → the queues it consumes)."""
        return {host: queues for host, (queues, _) in self._announced().items()}

    def capacity(self, queue: str) -> int | None:
        """The task slots of the announced workers that consume ``queue`` (None: none announced any)."""
        slots = [n for queues, n in self._announced().values() if queue in queues and n]
        return sum(slots) if slots else None

    def _announced(self) -> dict[str, tuple[list[str], int | None]]:
        found: dict[str, tuple[list[str], int | None]] = {}
        start = len(self.key(""))
        for key in self.redis.scan_iter(match=self.key("*"), count=200):
            raw = self.redis.get(key)
            if raw is None:  # lapsed between the scan and the read
                continue
            try:
                entry = json.loads(_text(raw))
                queues = [str(q) for q in entry.get("queues", [])]
                concurrency = entry.get("concurrency")
            except (ValueError, AttributeError):
                continue
            found[_text(key)[start:]] = (queues, int(concurrency) if isinstance(concurrency, int) else None)
        return found

    def keep_announcing(
        self, hostname: str, queues: Sequence[str], concurrency: int | None = None
    ) -> threading.Event:
        """Announce now and every third of the TTL from a daemon thread; set the event to stop (and withdraw)."""
        stop = threading.Event()

        def loop() -> None:
            while True:
                try:
                    self.announce(hostname, queues, concurrency)
                except Exception as exc:  # Redis away: the entry may lapse; the next round puts it back
                    log.warning("cannot announce worker %s: %s", hostname, exc)
                if stop.wait(self.ttl_s / 3):
                    break
            try:
                self.withdraw(hostname)
            except Exception as exc:
                log.warning("cannot withdraw worker %s: %s", hostname, exc)

        threading.Thread(target=loop, name=f"presence-{hostname}", daemon=True).start()
        return stop


def consumers_by_queue(workers: Mapping[str, Sequence[str]], queues: Sequence[str]) -> dict[str, list[str]]:
    """For each of ``queues``, the workers that consume it."""
    return {queue: sorted(host for host, consumed in workers.items() if queue in consumed) for queue in queues}


def sweeper_queue(prefix: str) -> str:
    return Queues.from_prefix(prefix).resolve(SWEEPER_QUEUE_KIND)


def no_sweeper_message(queue: str) -> str:
    return (
        f"no worker consumes the queue {queue}, which runs the sweeper: lost nodes are never re-sent and a "
        "killed worker's nodes stay running until one does (start `inf-engine worker`, whose default queues "
        "include cpu)"
    )


@dataclass(frozen=True)
class PlatformHealth:
    """What ``/health`` reports about the workers (``problems`` empty when the platform can recover)."""

    workers: dict[str, list[str]]
    consumers: dict[str, list[str]]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.ok else "degraded",
            "workers": len(self.workers),
            "consumers": self.consumers,
            "problems": self.problems,
        }


def platform_health(presence: WorkerPresence, queue_prefix: str) -> PlatformHealth:
    """The workers Redis knows of, the consumers of each queue, and what cannot recover."""
    try:
        workers = presence.workers()
    except Exception as exc:
        return PlatformHealth({}, {}, [f"cannot read the workers from Redis: {exc}"])
    queues = Queues.from_prefix(queue_prefix)
    consumers = consumers_by_queue(workers, queues.all())
    sweeper = sweeper_queue(queue_prefix)
    problems = [] if consumers.get(sweeper) else [no_sweeper_message(sweeper)]
    return PlatformHealth(workers, consumers, problems)
