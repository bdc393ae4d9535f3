"""Benchmark LLM HTTP clients against the fake server running in its own process.

    .venv/bin/python scripts/bench_client.py [--concurrency 64] [--latency 0.05] [--seconds 5]

Each client keeps ``concurrency`` requests in flight for ``seconds`` (after a warm-up) and reports requests/s and
p50/p99 latency; the ideal is concurrency / latency. Clients: our OpenAICompatibleClient, a bare aiohttp loop (the
floor our client's overhead is judged against) and httpx.AsyncClient (the usual alternative).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.pipeline.resources import EndpointConfig, LLMRequest, OpenAICompatibleClient
from app.testing.fake_llm_server import start_fake_server_process, stop_fake_server_process

Call = Callable[[int], Awaitable[Any]]
Factory = Callable[[str], AbstractAsyncContextManager[Call]]


@asynccontextmanager
async def ours(base_url: str):  # type: ignore[no-untyped-def]
    client = OpenAICompatibleClient(EndpointConfig("vllm", "fake-model", base_url=base_url, api_key="EMPTY"))

    async def call(i: int) -> Any:
        return await client.complete(LLMRequest(f"request {i}", max_tokens=16))

    try:
        yield call
    finally:
        await client.aclose()


@asynccontextmanager
async def bare_aiohttp(base_url: str):  # type: ignore[no-untyped-def]
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    url = f"{base_url}/chat/completions"
    headers = {"Content-Type": "application/json", "Authorization": "Bearer EMPTY"}

    async def call(i: int) -> Any:
        body = json.dumps(
            {"model": "fake-model", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 16}
        ).encode()
        async with session.post(url, data=body, headers=headers) as resp:
            data = json.loads(await resp.read())
        return data["choices"][0]["message"]["content"]

    try:
        yield call
    finally:
        await session.close()


@asynccontextmanager
async def httpx_client(base_url: str):  # type: ignore[no-untyped-def]
    import httpx

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    client = httpx.AsyncClient(limits=limits, timeout=60.0)
    url = f"{base_url}/chat/completions"
    headers = {"Content-Type": "application/json", "Authorization": "Bearer EMPTY"}

    async def call(i: int) -> Any:
        body = json.dumps(
            {"model": "fake-model", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 16}
        ).encode()
        resp = await client.post(url, content=body, headers=headers)
        return resp.json()["choices"][0]["message"]["content"]

    try:
        yield call
    finally:
        await client.aclose()


CLIENTS: dict[str, tuple[str, Factory]] = {
    "ours": ("OpenAICompatibleClient (aiohttp)", ours),
    "aiohttp": ("bare aiohttp loop", bare_aiohttp),
    "httpx": ("httpx.AsyncClient", httpx_client),
}


async def drive(call: Call, concurrency: int, seconds: float) -> tuple[int, float, list[float]]:
    """Keep ``concurrency`` calls in flight for ``seconds``; returns (completed, elapsed, latencies in s)."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    counter = 0
    errors = 0

    async def worker() -> None:
        nonlocal counter, errors
        while time.perf_counter() < deadline:
            counter += 1
            t0 = time.perf_counter()
            try:
                await call(counter)
            except Exception:
                errors += 1
                continue
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    if errors:
        print(f"  ({errors} errors)", file=sys.stderr)
    return len(latencies), elapsed, latencies


async def bench_one(factory: Factory, base_url: str, args: argparse.Namespace) -> tuple[float, float, float, int]:
    async with factory(base_url) as call:
        await drive(call, args.concurrency, args.warmup)
        done, elapsed, lat = await drive(call, args.concurrency, args.seconds)
    lat.sort()
    p50 = statistics.median(lat) * 1000 if lat else float("nan")
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000 if lat else float("nan")
    return done / elapsed, p50, p99, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--clients", default="ours,aiohttp,httpx", help="comma-separated: ours, aiohttp, httpx")
    parser.add_argument("--no-uvloop", action="store_true", help="run the clients on the default asyncio loop")
    args = parser.parse_args()

    runner: Callable[[Any], Any] = asyncio.run
    loop_name = "asyncio"
    if not args.no_uvloop:
        try:
            import uvloop

            runner, loop_name = uvloop.run, "uvloop"
        except ImportError:
            pass

    proc, base_url = start_fake_server_process(latency=args.latency)
    try:
        ideal = args.concurrency / args.latency
        print(
            f"fake server at {base_url} (own process, uvloop), latency {args.latency * 1000:g} ms; "
            f"{args.concurrency} in flight; clients on {loop_name}; {args.seconds:g} s each after "
            f"{args.warmup:g} s warm-up\n"
        )
        print(f"{'client':<36} {'req/s':>9} {'x ideal':>8} {'p50 ms':>8} {'p99 ms':>8} {'requests':>9}")
        print("-" * 83)
        for key in [k.strip() for k in args.clients.split(",") if k.strip()]:
            if key not in CLIENTS:
                parser.error(f"unknown client {key!r}; choose from {', '.join(CLIENTS)}")
            name, factory = CLIENTS[key]
            rps, p50, p99, done = runner(bench_one(factory, base_url, args))
            print(f"{name:<36} {rps:>9.0f} {rps / ideal:>8.2f} {p50:>8.1f} {p99:>8.1f} {done:>9}", flush=True)
        print(f"{'ideal (concurrency / latency)':<36} {ideal:>9.0f} {1.0:>8.2f} {args.latency * 1000:>8.1f}")
    finally:
        stop_fake_server_process(proc)


if __name__ == "__main__":
    main()
