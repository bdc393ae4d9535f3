"""Celery beat: the platform's periodic tasks (one hook to add them) and the lock that keeps beat single.

Two beats would enqueue every periodic task twice, so ``inf-engine beat`` first takes a Redis lock. A second beat
(a rolling deploy, a replica too many) stands by until the lock's holder stops renewing it, then takes over
within ``beat_lock_ttl`` seconds. A beat that loses its lock (Redis unreachable for longer than the TTL) stops,
and its supervisor restarts it as a standby.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery.beat import PersistentScheduler
from redis import Redis

from app.jobs.distributed.presence import SWEEPER_QUEUE_KIND, WorkerPresence, platform_health
from app.jobs.distributed.transport.queues import Queues
from app.settings import Settings, get_settings

log = logging.getLogger(__name__)

HEARTBEAT_EVERY_S = 30.0
#: beat's liveness: the heartbeat file older than this means beat is stuck (it ticks at least every sweep)
HEARTBEAT_MAX_AGE_S = 120.0
#: how often beat looks for a worker on the sweeper's queue (the first look after one period: workers start)
SWEEPER_WATCH_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class Periodic:
    """One periodic task: run ``task`` (a task name) every ``every_s`` seconds on the ``queue`` kind."""

    name: str
    task: str
    every_s: float
    queue: str = "cpu"
    args: tuple[Any, ...] = field(default_factory=tuple)


def periodic_tasks(settings: Settings) -> list[Periodic]:
    """The hook: every periodic task of the platform, in one list.

    The sweeper re-enqueues nodes whose worker vanished or whose message was lost and expires jobs past their
    window (``inf.sweep``, every ``settings.sweep_interval`` seconds); scheduled evaluations join this list next
    to the tasks they run.
    """
    return [
        Periodic("beat-heartbeat", "inf.beat_heartbeat", HEARTBEAT_EVERY_S),
        Periodic("sweeper", "inf.sweep", settings.sweep_interval, queue=SWEEPER_QUEUE_KIND),
        # scheduled evaluations: queue each due (schedule, fire time) once and send it to a worker
        Periodic("evaluation-schedules", "inf.fire_evaluation_schedules", settings.evaluation_schedule_interval),
    ]


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """``periodic_tasks`` as Celery's ``beat_schedule``. A run not started within its period is dropped
    (``expires``), so a backlog built while no worker was up does not fire all at once."""
    queues = Queues.from_prefix(settings.celery_queue_prefix)
    return {
        p.name: {
            "task": p.task,
            "schedule": p.every_s,
            "args": p.args,
            "options": {"queue": queues.resolve(p.queue), "expires": p.every_s},
        }
        for p in periodic_tasks(settings)
    }


def heartbeat_key(settings: Settings) -> str:
    """Where the heartbeat task stores the time of beat's last tick."""
    return f"{settings.redis_prefix}:beat:heartbeat"


def heartbeat_file(settings: Settings) -> Path:
    """Touched by beat itself on every scheduler tick and while it stands by: its liveness probe reads it
    (``inf-engine beat --check``), so a beat is judged by its own life, not by a worker's or Redis's."""
    return Path(settings.data_dir).expanduser() / "beat-heartbeat"


def touch(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError as exc:  # a read-only data dir: the probe will say so
        log.warning("cannot write beat's heartbeat %s: %s", path, exc)


def heartbeat_age(settings: Settings, now: float | None = None) -> float | None:
    """Seconds since beat's last heartbeat; None when it never beat (in this data dir)."""
    try:
        mtime = heartbeat_file(settings).stat().st_mtime
    except OSError:
        return None
    return max(0.0, (time.time() if now is None else now) - mtime)


class SweeperWatch:
    """Warns (every ``every_s``) while no worker consumes the sweeper's queue."""

    def __init__(self, presence: WorkerPresence, queue_prefix: str, every_s: float = SWEEPER_WATCH_EVERY_S) -> None:
        self.presence = presence
        self.queue_prefix = queue_prefix
        self.every_s = every_s
        self._next = time.monotonic() + every_s

    def check(self, now: float | None = None) -> list[str]:
        """The problems found when a look is due (logged as warnings), else []."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return []
        self._next = now + self.every_s
        problems = platform_health(self.presence, self.queue_prefix).problems
        for problem in problems:
            log.warning(problem)
        return problems


class HeartbeatScheduler(PersistentScheduler):  # type: ignore[misc]
    """Celery's persistent scheduler, plus beat's heartbeat file and the sweeper watch on every tick."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = get_settings()
        self._heartbeat = heartbeat_file(settings)
        redis = Redis.from_url(settings.redis_url or "", socket_timeout=5)
        self._watch = SweeperWatch(WorkerPresence(redis, settings.redis_prefix), settings.celery_queue_prefix)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        touch(self._heartbeat)
        try:
            self._watch.check()
        except Exception as exc:  # Redis away: the schedule still runs
            log.warning("cannot look for the sweeper's workers: %s", exc)
        return float(super().tick(*args, **kwargs))


def lock_key(settings: Settings) -> str:
    return f"{settings.redis_prefix}:beat:lock"


_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class SingletonLock:
    """A Redis lock with a TTL, held by one process and renewed by it; only its holder can renew or free it."""

    def __init__(self, redis: Redis, key: str, ttl_s: float) -> None:
        self.redis = redis
        self.key = key
        self.ttl_ms = int(ttl_s * 1000)
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    def try_acquire(self) -> bool:
        return bool(self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms))

    def renew(self) -> bool:
        """Extend the lock; if Redis lost it (a restart without persistence) and nobody took it, take it again."""
        if self._renew(keys=[self.key], args=[self.token, self.ttl_ms]):
            return True
        return self.try_acquire()

    def release(self) -> bool:
        return bool(self._release(keys=[self.key], args=[self.token]))

    def holder(self) -> str | None:
        value = self.redis.get(self.key)
        return value.decode() if isinstance(value, bytes) else None

    def wait(
        self,
        poll_s: float,
        on_standby: Callable[[str | None], None] | None = None,
        on_poll: Callable[[], None] | None = None,
    ) -> None:
        """Block until this process holds the lock (``on_poll`` runs at every try)."""
        told = False
        while True:
            if on_poll is not None:
                on_poll()
            if self.try_acquire():
                return
            if not told and on_standby is not None:
                on_standby(self.holder())
                told = True
            time.sleep(poll_s)

    def keep(self, on_lost: Callable[[], None]) -> threading.Event:
        """Renew every third of the TTL from a daemon thread; call ``on_lost`` once if renewal fails.
        Set the returned event to stop renewing."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self.ttl_ms / 3000):
                try:
                    ok = self.renew()
                except Exception as exc:  # Redis down: keep trying until the TTL would have run out
                    log.warning("cannot renew the lock %s: %s", self.key, exc)
                    ok = self._still_within_ttl()
                else:
                    self._renewed_at = time.monotonic()
                if not ok:
                    on_lost()
                    return

        self._renewed_at = time.monotonic()
        threading.Thread(target=loop, name=f"lock-{self.key}", daemon=True).start()
        return stop

    def _still_within_ttl(self) -> bool:
        return time.monotonic() - self._renewed_at < self.ttl_ms / 1000


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def run_beat(
    celery: Any, settings: Settings, *, loglevel: str = "INFO", say: Callable[[str], None] = print
) -> None:
    """Run Celery beat for ``celery`` while holding the single-instance lock (blocks until beat stops)."""
    redis = Redis.from_url(settings.redis_url or "", socket_timeout=10)
    lock = SingletonLock(redis, lock_key(settings), settings.beat_lock_ttl)

    def standby(holder: str | None) -> None:
        say(f"another beat holds {lock.key} ({holder or 'unknown'}); standing by until it stops")

    def lost() -> None:
        log.error("lost the beat lock %s; stopping so that only one beat runs", lock.key)
        os.kill(os.getpid(), signal.SIGTERM)

    # Until Celery installs its own handlers, a SIGTERM must still unwind through `finally` and free the lock.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    beating = heartbeat_file(settings)  # a standby beat is alive too: it beats while it waits
    lock.wait(poll_s=max(1.0, settings.beat_lock_ttl / 3), on_standby=standby, on_poll=lambda: touch(beating))
    say(f"holding {lock.key} as {lock.token}; starting beat")
    stop = lock.keep(lost)
    schedule = settings.data_dir / "celerybeat-schedule"
    schedule.parent.mkdir(parents=True, exist_ok=True)
    try:
        celery.start(
            [
                "beat",
                f"--loglevel={loglevel}",
                f"--schedule={schedule}",
                f"--scheduler={HeartbeatScheduler.__module__}:{HeartbeatScheduler.__name__}",
            ]
        )
    finally:
        stop.set()
        try:
            lock.release()
        finally:
            redis.close()
