"""kombu's Redis channel keeps one client per connection pool once inf-engine's Celery app is built."""

from __future__ import annotations

import uuid

import pytest
from kombu import Connection
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from app.jobs.distributed.transport.redis_clients import share_redis_clients


def test_a_channel_reuses_its_client_until_its_pool_changes() -> None:
    share_redis_clients()
    share_redis_clients()  # idempotent
    prefix = f"infe_test_rc_{uuid.uuid4().hex[:8]}:"
    with Connection("redis://127.0.0.1:6379/0", transport_options={"global_keyprefix": prefix}) as conn:
        channel = conn.channel()
        try:
            with channel.conn_or_acquire() as opening:  # kombu's way: this creates the channel's pool
                assert opening.llen("q") == 0
            with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
                assert first is second
                first.lpush("q", "m")  # the client works, under the key prefix
                assert second.llen("q") == 1
            explicit = object()
            with channel.conn_or_acquire(explicit) as given:
                assert given is explicit  # a client passed in is used as is
            channel._disconnect_pools()  # what a fork or a reconnect does: kombu's way again, then a new pool
            with channel.conn_or_acquire() as third, channel.conn_or_acquire() as fourth:
                assert third is not first and fourth is not first
                assert third.llen("q") == 1
            with channel.conn_or_acquire() as fifth, channel.conn_or_acquire() as sixth:
                assert fifth is sixth is not first  # cached again, for the new pool
                fifth.rpop("q")
            channel._closing = True  # a closing channel gives back its messages through kombu's own code
            with channel.conn_or_acquire() as closing:
                assert closing is not fifth
        finally:
            channel.close()
    with Redis.from_url("redis://127.0.0.1:6379/0") as plain:
        assert plain.llen(f"{prefix}q") == 0  # the keys were the prefixed ones, and are gone


def test_a_channel_whose_connection_is_gone_raises_a_connection_error() -> None:
    """After a Redis restart a channel may close after its connection: kombu expects a connection error there
    (an AttributeError from building a pool would stop the worker)."""
    share_redis_clients()
    with Connection("redis://127.0.0.1:6379/0") as conn:
        channel = conn.channel()
        transport = channel.connection
        channel._disconnect_pools()
        transport.client = None  # what closing the connection does
        try:
            with pytest.raises(RedisConnectionError), channel.conn_or_acquire():
                pass
            assert isinstance(RedisConnectionError("x"), conn.connection_errors)  # one kombu handles
        finally:
            transport.client = conn
            channel.close()
