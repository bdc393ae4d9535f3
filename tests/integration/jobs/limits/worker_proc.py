"""A stand-in worker process for the limit tests: ``python -m tests.integration.jobs.limits.worker_proc MODE ...``.

Each process builds its own limiter on its own Redis connection, exactly as a Celery worker would, so the tests
see what two machines sharing one endpoint would see.

Modes (arguments as JSON on argv[2]):
  rate   {prefix, endpoint, rpm, start_at, duration, concurrency}: acquire tokens until start_at + duration and
         print the wall-clock grant times as a JSON list.
  slots  {prefix, endpoint, max_slots, start_at, duration, concurrency, counter}: hold slots for a few ms each,
         counting holders in a Redis counter; print the highest count seen and the number of uses.
  hold   {prefix, endpoint, max_slots, lease_ttl}: take one slot (renewed in the background), print "held" and
         wait to be killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from redis.asyncio import Redis

from app.jobs.limits import ConcurrencySlots, GlobalRateLimiter, RateConfig
from tests.support.redisdb import SERVER


async def _sleep_until(at: float) -> None:
    await asyncio.sleep(max(0.0, at - time.time()))


async def rate(args: dict[str, Any]) -> Any:
    redis = Redis.from_url(SERVER, max_connections=64)
    limiter = GlobalRateLimiter(redis, args["endpoint"], RateConfig(rpm=args["rpm"]), prefix=args["prefix"])
    end = args["start_at"] + args["duration"]
    grants: list[float] = []

    async def one() -> None:
        while True:
            await limiter.acquire()
            now = time.time()
            if now >= end:
                return
            grants.append(now)

    await _sleep_until(args["start_at"])
    await asyncio.gather(*(one() for _ in range(args["concurrency"])))
    await redis.aclose()
    return grants


async def slots(args: dict[str, Any]) -> Any:
    redis = Redis.from_url(SERVER, max_connections=64)
    pool = ConcurrencySlots(
        redis, args["endpoint"], args["max_slots"], prefix=args["prefix"], lease_ttl_s=5.0
    )
    end = args["start_at"] + args["duration"]
    peak = 0
    uses = 0

    async def one() -> None:
        nonlocal peak, uses
        while time.time() < end:
            async with pool.slot():
                inside = int(await redis.incr(args["counter"]))
                peak = max(peak, inside)
                uses += 1
                await asyncio.sleep(0.005)
                await redis.decr(args["counter"])

    await _sleep_until(args["start_at"])
    await asyncio.gather(*(one() for _ in range(args["concurrency"])))
    await pool.aclose()
    await redis.aclose()
    return {"peak": peak, "uses": uses}


async def hold(args: dict[str, Any]) -> Any:
    redis = Redis.from_url(SERVER)
    pool = ConcurrencySlots(
        redis, args["endpoint"], args["max_slots"], prefix=args["prefix"], lease_ttl_s=args["lease_ttl"]
    )
    async with pool.slot():
        print("held", flush=True)
        await asyncio.sleep(3600)  # until SIGKILL: a worker that dies mid-request


def main() -> None:
    mode, raw = sys.argv[1], sys.argv[2]
    result = asyncio.run({"rate": rate, "slots": slots, "hold": hold}[mode](json.loads(raw)))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
