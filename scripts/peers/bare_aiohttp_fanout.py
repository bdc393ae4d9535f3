"""Lower bound: the fan-out workflow as a bare asyncio + aiohttp loop, no framework.

Run with the project's own venv::

    .venv/bin/python scripts/peers/bare_aiohttp_fanout.py \
        --base-url http://127.0.0.1:PORT/v1 --items 500 --max-concurrent 64

Per item: two chat completions on the same text with different system prompts, in
parallel, then one comparison call that reads both answers. All calls share one
``aiohttp.ClientSession`` (keep-alive pool) and one semaphore with ``--max-concurrent``
slots, held only while a request is in flight.

Prints one JSON line on stdout, in the same shape as ``pyplait_fanout.py``::

    {"framework": "bare-aiohttp", "version": <aiohttp version>, "items": N, "ok": k,
     "makespan_s": ..., "peak_rss_mb": ...}

Everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from typing import Any

import aiohttp

ENTITIES_PROMPT = "Extract every named entity (people, organisations, places)."
FACTS_PROMPT = "Extract every dated fact and number."
COMPARE_PROMPT = "You compare two extractions of the same document."


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def peak_rss_mb() -> float:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_inputs(n: int) -> list[str]:
    # Same texts as the pyplait peer.
    return [
        f"Document {i}: On 2024-03-{(i % 28) + 1:02d} the board of Company{i % 37} met in "
        f"City{i % 11} and approved a budget of {1000 + i} units for project P{i}, "
        f"led by Person{i % 53}."
        for i in range(n)
    ]


class Caller:
    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, slots: int) -> None:
        self.session = session
        self.url = url
        self.model = model
        self.sem = asyncio.Semaphore(slots)

    async def chat(self, system: str, user: str) -> str:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
            "temperature": 0.0,
            "max_tokens": 64,
        }
        async with self.sem, self.session.post(self.url, json=body) as resp:
            resp.raise_for_status()
            data = await resp.json()
        return data["choices"][0]["message"]["content"] or ""


async def one_item(caller: Caller, text: str) -> str:
    entities, facts = await asyncio.gather(
        caller.chat(ENTITIES_PROMPT, text),
        caller.chat(FACTS_PROMPT, text),
    )
    prompt = (
        "Compare the two extractions below and list any disagreements.\n\n"
        f"Extraction A (entities):\n{entities}\n\n"
        f"Extraction B (facts):\n{facts}"
    )
    return await caller.chat(COMPARE_PROMPT, prompt)


async def run_batch(args: argparse.Namespace) -> dict[str, Any]:
    url = args.base_url.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"}
    connector = aiohttp.TCPConnector(limit=args.max_concurrent, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    inputs = make_inputs(args.items)
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout) as session:
        caller = Caller(session, url, args.model, args.max_concurrent)
        log(
            f"bare-aiohttp: {args.items} items, max_concurrent={args.max_concurrent}, "
            f"loop={type(asyncio.get_running_loop()).__module__}"
        )
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_item(caller, text) for text in inputs), return_exceptions=True)
        makespan = time.perf_counter() - t0

    ok = sum(1 for r in results if isinstance(r, str) and r)
    if ok < len(results):
        bad = next(r for r in results if not (isinstance(r, str) and r))
        log(f"bare-aiohttp: {len(results) - ok} items failed; first: {bad!r:.300}")
    return {"ok": ok, "makespan_s": round(makespan, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="OpenAI-compatible base URL, .../v1")
    ap.add_argument("--items", type=int, default=500)
    ap.add_argument("--max-concurrent", type=int, default=64)
    ap.add_argument("--model", default="fake-model")
    ap.add_argument("--api-key", default="sk-bench")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    ap.add_argument("--uvloop", action="store_true", help="run the client on uvloop")
    args = ap.parse_args()

    if args.uvloop:
        import uvloop

        result = uvloop.run(run_batch(args))
    else:
        result = asyncio.run(run_batch(args))
    line = {
        "framework": "bare-aiohttp",
        "version": aiohttp.__version__,
        "items": args.items,
        "ok": result["ok"],
        "makespan_s": result["makespan_s"],
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "loop": "uvloop" if args.uvloop else "asyncio",
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
