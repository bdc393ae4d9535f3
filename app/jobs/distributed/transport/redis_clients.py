"""One Redis client object per kombu channel and connection pool, instead of one per operation.

kombu's Redis transport builds a new ``redis.Redis`` object for every publish, acknowledgement and event
(``Channel.conn_or_acquire``). The connections come from the channel's pool either way, but building the
client object (its table of response callbacks) is paid three times per node task (send, ack, event): keeping
one took a worker's CPU per node task from 3.3 to 2.7 ms (1,200-item dispatch-bound job, one worker, 2 cores).
A ``redis.Redis`` object is safe to share between
threads (each command takes a connection from the pool), so the channel keeps one per pool; a new pool (after
a fork or a reconnect) gets a new client. While a channel has no pool, or is closing (after a lost connection
it gives back its unacknowledged messages), kombu's own code runs, except that a channel whose connection is
already gone raises a connection error (which kombu handles) instead of an AttributeError (which stops the
worker: seen after a Redis restart in `test_redis_restart_mid_job_completes`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_PATCHED = "_inf_engine_shared_client"
#: what the patch below reads or replaces on ``kombu.transport.redis.Channel`` (kombu 5.5 to 5.7 have them all)
PATCHED_ATTRIBUTES = ("conn_or_acquire", "_create_client", "_pool", "_closing", "client")


class KombuIncompatibleError(ImportError):
    """The installed kombu lacks what the shared-client patch relies on."""


def check_kombu(channel_cls: Any = None) -> None:
    """Fail with one clear line, naming the kombu version, when the Redis channel lacks a patched attribute."""
    import kombu
    from kombu.transport import redis as kombu_redis

    channel_cls = channel_cls if channel_cls is not None else kombu_redis.Channel
    missing = [name for name in PATCHED_ATTRIBUTES if not hasattr(channel_cls, name)]
    if missing:
        raise KombuIncompatibleError(
            f"kombu {kombu.__version__} is not supported: kombu.transport.redis.Channel has no "
            f"{', '.join(missing)} (inf-engine patches it; install the kombu its dependencies pin: "
            "pip install 'kombu>=5.5,<5.8')"
        )


def share_redis_clients() -> None:
    """Install the shared-client ``conn_or_acquire`` on kombu's Redis channel (idempotent)."""
    import redis
    from kombu.transport import redis as kombu_redis

    channel_cls: Any = kombu_redis.Channel
    check_kombu(channel_cls)
    if getattr(channel_cls.conn_or_acquire, _PATCHED, False):
        return

    original = channel_cls.conn_or_acquire

    @contextmanager
    def conn_or_acquire(self: Any, client: Any = None) -> Iterator[Any]:
        pool = self._pool
        if not client and pool is None and getattr(self.connection, "client", None) is None:
            # A channel closed after its connection went away (a Redis restart) gives its unacknowledged
            # messages back through here, and kombu would fail to build a pool with an AttributeError that
            # stops the worker. A connection error instead is one kombu expects while closing: the worker
            # reconnects, and the messages come back by the visibility timeout (the sweeper re-sends the nodes).
            raise redis.exceptions.ConnectionError("the channel's connection is closed")
        if client or pool is None or getattr(self, "_closing", False):
            # kombu's own way: a client passed in, no pool yet (or it was dropped after a lost connection), or
            # a channel that is closing (it gives back unacknowledged messages while its connection goes away)
            with original(self, client) as acquired:
                yield acquired
            return
        cached = self.__dict__.get("_inf_shared_client")
        if cached is None or cached[0] is not pool:
            cached = (pool, self._create_client())
            self.__dict__["_inf_shared_client"] = cached
        yield cached[1]

    setattr(conn_or_acquire, _PATCHED, True)
    channel_cls.conn_or_acquire = conn_or_acquire
