"""The matrix-product ceiling of the engine on this machine: the throughput decoding could reach if a step were
nothing but its matrix products (every projection of every layer and the LM head, on the real weights, through
the engine's own ``linear``), for several batch sizes.

    .venv/bin/python scripts/engine_roofline.py                 # SmolLM2, 2 threads, rows 1, 16, 64, 128
    .venv/bin/python scripts/engine_roofline.py --rows 1,64,512 --threads 2

Compare a workload's measured tokens/s (scripts/bench_engine.py) with the ceiling at its batch size: the gap is
what attention, norms, sampling and Python cost.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine import LLMEngine
from app.engine.models.layers import linear


def product_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weight of every matrix product of one decode step (Llama layout), the LM head last."""
    weights: list[torch.Tensor] = []
    for layer in model.layers:  # type: ignore[union-attr]
        attn, mlp = layer.self_attn, layer.mlp
        weights += [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
    weights.append(model.lm_head_weight())  # type: ignore[operator]
    return weights


def time_step(weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def step() -> None:
        for w in weights:
            linear(inputs[w.shape[1]], w)

    step()
    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,16,64,128", help="batch sizes (tokens per step), comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(model=args.model, num_threads=args.threads, kv_cache_memory_bytes=256 * 1024**2)
    model = engine.runner.model
    if not hasattr(model, "layers") or not hasattr(model.layers[0], "mlp"):
        raise SystemExit("this script knows the Llama layout only")
    weights = product_weights(model)
    flops = sum(2 * w.shape[0] * w.shape[1] for w in weights)
    print(f"{flops / 1e6:.0f} MFLOP of matrix products per token, {args.threads} threads, float32")
    print(f"{'rows':>6} {'step ms':>9} {'ceiling tok/s':>14} {'GFLOP/s':>9}")
    for rows in (int(r) for r in args.rows.split(",") if r.strip()):
        seconds = time_step(weights, rows, repeats=max(3, 300 // max(rows, 1)))
        print(f"{rows:>6} {seconds * 1000:>9.2f} {rows / seconds:>14.1f} {flops * rows / seconds / 1e9:>9.1f}")


if __name__ == "__main__":
    main()
