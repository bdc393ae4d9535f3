"""inf-engine on the fan-out workflow: two parallel extractions per document, then one comparison.

Run with the project's venv (bench_pipeline.py does)::

    .venv/bin/python scripts/peers/inf_engine_fanout.py --base-url http://127.0.0.1:PORT/v1 --items 500

Prints one JSON line like the other peers: framework, version, items, ok, makespan_s, peak_rss_mb.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.pipeline import EndpointConfig, LLMInference, Module, ResourceConfig
from scripts.peers.bare_aiohttp_fanout import (
    COMPARE_PROMPT,
    ENTITIES_PROMPT,
    FACTS_PROMPT,
    make_inputs,
)


class FanOut(Module):
    def __init__(self) -> None:
        super().__init__()
        self.entities = LLMInference("llm", system_prompt=ENTITIES_PROMPT, temperature=0.0, max_tokens=64)
        self.facts = LLMInference("llm", system_prompt=FACTS_PROMPT, temperature=0.0, max_tokens=64)
        self.compare = LLMInference("llm", system_prompt=COMPARE_PROMPT, temperature=0.0, max_tokens=64)

    def forward(self, text):
        entities, facts = self.entities(text), self.facts(text)
        return self.compare(
            "Compare the two extractions below and list any disagreements.\n\n"
            f"Extraction A (entities):\n{entities}\n\nExtraction B (facts):\n{facts}"
        )


async def main(args: argparse.Namespace) -> dict[str, object]:
    resources = ResourceConfig(
        {"llm": EndpointConfig("openai", args.model, base_url=args.base_url, api_key=args.api_key)}
    )
    pipeline = FanOut().bind(resources=resources, max_concurrent=args.max_concurrent, streaming=True)
    inputs = make_inputs(args.items)
    start = time.perf_counter()
    ok = 0
    async for result in pipeline(inputs):
        ok += result.ok
    makespan = time.perf_counter() - start
    return {"ok": ok, "makespan_s": round(makespan, 4)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--max-concurrent", type=int, default=64)
    parser.add_argument("--model", default="bench-model")
    parser.add_argument("--api-key", default="sk-bench")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        result = uvloop.run(main(args))
    else:
        result = asyncio.run(main(args))
    result.update(
        framework="inf-engine" + (" (uvloop)" if args.uvloop else ""),
        version="0.1.0",
        items=args.items,
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    )
    print(json.dumps(result))
