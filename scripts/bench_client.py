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
from typing import Any, NamedTuple

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
            {
                "model": "fake-model",
                "messages": [{"role": "user", "content": f"request {i}"}],
                "max_tokens": 16,
            }
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
            {
                "model": "fake-model",
                "messages": [{"role": "user", "content": f"request {i}"}],
                "max_tokens": 16,
            }
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


class Result(NamedTuple):
    rps: float
    p50_ms: float
    p99_ms: float
    done: int
    client_cpu_us: float  # this process's CPU time per request
    server_cpu_us: float  # the server process's CPU time per request


def _server_cpu(pid: int) -> float:
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except Exception:  # psutil missing: the column shows nan
        return float("nan")


async def bench_one(factory: Factory, base_url: str, args: argparse.Namespace, server_pid: int) -> Result:
    async with factory(base_url) as call:
        await drive(call, args.concurrency, args.warmup)
        cpu0, srv0 = time.process_time(), _server_cpu(server_pid)
        done, elapsed, lat = await drive(call, args.concurrency, args.seconds)
        cpu1, srv1 = time.process_time(), _server_cpu(server_pid)
    lat.sort()
    p50 = statistics.median(lat) * 1000 if lat else float("nan")
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000 if lat else float("nan")
    n = max(done, 1)
    return Result(done / elapsed, p50, p99, done, (cpu1 - cpu0) / n * 1e6, (srv1 - srv0) / n * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument(
        "--clients", default="ours,aiohttp,httpx", help="comma-separated: ours, aiohttp, httpx"
    )
    parser.add_argument(
        "--no-uvloop", action="store_true", help="run the clients on the default asyncio loop"
    )
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
        ideal = args.concurrency / args.latency if args.latency > 0 else float("inf")
        print(
            f"fake server at {base_url} (own process, uvloop), latency {args.latency * 1000:g} ms; "
            f"{args.concurrency} in flight; clients on {loop_name}; {args.seconds:g} s each after "
            f"{args.warmup:g} s warm-up\n"
        )
        print(
            f"{'client':<34} {'req/s':>7} {'x ideal':>8} {'p50 ms':>7} {'p99 ms':>7} {'requests':>9} "
            f"{'client CPU/req':>15} {'server CPU/req':>15}"
        )
        print("-" * 108)
        for key in [k.strip() for k in args.clients.split(",") if k.strip()]:
            if key not in CLIENTS:
                parser.error(f"unknown client {key!r}; choose from {', '.join(CLIENTS)}")
            name, factory = CLIENTS[key]
            r: Result = runner(bench_one(factory, base_url, args, proc.pid))
            print(
                f"{name:<34} {r.rps:>7.0f} {r.rps / ideal:>8.2f} {r.p50_ms:>7.1f} {r.p99_ms:>7.1f} {r.done:>9} "
                f"{r.client_cpu_us:>12.0f} us {r.server_cpu_us:>12.0f} us",
                flush=True,
            )
        print(f"{'ideal (concurrency / latency)':<34} {ideal:>7.0f} {1.0:>8.2f} {args.latency * 1000:>7.1f}")
        print(
            "\nCPU/req is CPU time per completed request: 1e6 / (server CPU/req) is what the fake server could "
            "serve per core; 1e6 / (client CPU/req) what the client could drive per core."
        )
    finally:
        stop_fake_server_process(proc)


if __name__ == "__main__":
    main()
