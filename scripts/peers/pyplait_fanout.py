"""Peer benchmark: the fan-out workflow written in the published `pyplait` framework.

Run by the Python 3.13 venv that ``scripts/setup_peers.sh`` creates, as a subprocess of
``scripts/bench_pipeline.py``::

    .venv-pyplait/bin/python scripts/peers/pyplait_fanout.py \
        --base-url http://127.0.0.1:PORT/v1 --items 500 --max-concurrent 64

Workflow per input text: two extractions of the same text in parallel (two LLM calls with
different system prompts), then one comparison call that reads both extractions.

Prints exactly one JSON line on stdout::

    {"framework": "pyplait", "version": ..., "items": N, "ok": k, "makespan_s": ...,
     "peak_rss_mb": ..., "resources": "config" | "manager"}

Everything else goes to stderr.

Notes on pyplait 2026.1.1 (read from its installed source):

* The README shows ``self.analyzer(f"Analyze this summary:\\n{summary}")``. Under tracing,
  ``summary`` is a ``plait.values.Value`` placeholder (a dataclass with no ``__format__``),
  so the f-string writes the Value's dataclass repr into the prompt *and* drops the
  dependency: the comparison node is traced with no dependencies and runs concurrently with
  the extractions, on a prompt like ``"A:\\nValue(kind=<ValueKind.RESPONSE...>, payload=None, ...)"``.
* ``plait.functional`` ops (``F.concat``, ``F.format``, ``F.render``) are plain eager
  functions, not recorded in the graph: at trace time ``F.concat`` returns a
  ``Value(ERROR, "All parts must be text-like")`` (every item then fails), and ``F.format``
  produces the literal text ``"None"`` for each placeholder, again with no dependency.
* The most natural form that works: a small non-LLM ``Module`` whose ``forward`` builds the
  comparison prompt. Calling a Module under tracing records a graph node with real
  dependencies, and the scheduler runs its ``forward`` on the unwrapped strings.
* Batches: ``await pipeline(list_of_inputs)`` starts one ``plait.execution.run()`` per
  input (``asyncio.gather``). Each ``run()`` traces the module again, builds its own
  ``Scheduler(max_concurrent=...)``, and, when the bound resources are a ``ResourceConfig``
  (the README's way), its own ``ResourceManager``: a new ``openai.AsyncOpenAI`` client with
  its own connection pool, plus a new endpoint semaphore, for every item. So neither
  ``bind(max_concurrent=...)`` nor ``EndpointConfig.max_concurrent`` limits the whole batch
  in that mode. Binding one shared ``ResourceManager`` (``--resources manager``) makes the
  endpoint semaphore (and the HTTP client) global, so the 64-request cap really applies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from importlib.metadata import version


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def peak_rss_mb() -> float:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_inputs(n: int) -> list[str]:
    return [
        f"Document {i}: On 2024-03-{(i % 28) + 1:02d} the board of Company{i % 37} met in "
        f"City{i % 11} and approved a budget of {1000 + i} units for project P{i}, "
        f"led by Person{i % 53}."
        for i in range(n)
    ]


def build_pipeline_class():  # imported lazily so --help works without plait installed
    from plait import LLMInference, Module

    class ComparePrompt(Module):
        """Plain (non-LLM) node that formats the two extractions into one prompt.

        An f-string directly in FanOut.forward would bake Value reprs into the prompt (see
        the module docstring); inside this node's forward the arguments are real strings.
        """

        def forward(self, entities: str, facts: str) -> str:
            return (
                "Compare the two extractions below and list any disagreements.\n\n"
                f"Extraction A (entities):\n{entities}\n\n"
                f"Extraction B (facts):\n{facts}"
            )

    class FanOut(Module):
        def __init__(self) -> None:
            super().__init__()
            self.extract_entities = LLMInference(
                alias="llm",
                system_prompt="Extract every named entity (people, organisations, places).",
                temperature=0.0,
                max_tokens=64,
            )
            self.extract_facts = LLMInference(
                alias="llm",
                system_prompt="Extract every dated fact and number.",
                temperature=0.0,
                max_tokens=64,
            )
            self.compare_prompt = ComparePrompt()
            self.compare = LLMInference(
                alias="llm",
                system_prompt="You compare two extractions of the same document.",
                temperature=0.0,
                max_tokens=64,
            )

        def forward(self, text: str) -> str:
            entities = self.extract_entities(text)
            facts = self.extract_facts(text)
            return self.compare(self.compare_prompt(entities, facts))

    return FanOut


async def run_batch(args: argparse.Namespace) -> dict[str, object]:
    from plait.resources import OpenAIEndpointConfig, ResourceConfig, ResourceManager

    config = ResourceConfig(
        endpoints={
            "llm": OpenAIEndpointConfig(
                model=args.model,
                base_url=args.base_url,
                api_key=args.api_key,
                max_concurrent=args.max_concurrent,
                timeout=args.timeout,
            )
        }
    )
    resources = ResourceManager(config) if args.resources == "manager" else config

    FanOut = build_pipeline_class()
    pipeline = FanOut().bind(resources=resources, max_concurrent=args.max_concurrent)
    inputs = make_inputs(args.items)
    log(
        f"pyplait: {args.items} items, max_concurrent={args.max_concurrent}, "
        f"resources={args.resources}, rss before batch {peak_rss_mb():.1f} MB"
    )

    t0 = time.perf_counter()
    outputs = await pipeline(inputs)
    makespan = time.perf_counter() - t0

    # run() records task failures in its state instead of raising: a failed item comes
    # back as {} (no output) or as a Value(ERROR). A success is a non-empty string.
    ok = sum(1 for out in outputs if isinstance(out, str) and out)
    if ok < len(outputs):
        bad = next(out for out in outputs if not (isinstance(out, str) and out))
        log(f"pyplait: {len(outputs) - ok} items failed; first: {bad!r:.300}")
    return {"ok": ok, "makespan_s": round(makespan, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True, help="OpenAI-compatible base URL, .../v1")
    ap.add_argument("--items", type=int, default=500)
    ap.add_argument("--max-concurrent", type=int, default=64)
    ap.add_argument("--model", default="fake-model")
    ap.add_argument("--api-key", default="sk-bench", help="literal key or env var name")
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    ap.add_argument(
        "--resources",
        choices=("config", "manager"),
        default="config",
        help="config: bind a ResourceConfig as the README does (one client and semaphore "
        "per item); manager: bind one shared ResourceManager (global 64-request cap)",
    )
    args = ap.parse_args()

    result = asyncio.run(run_batch(args))
    line = {
        "framework": "pyplait",
        "version": version("pyplait"),
        "items": args.items,
        "ok": result["ok"],
        "makespan_s": result["makespan_s"],
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "resources": args.resources,
    }
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
