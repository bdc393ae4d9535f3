"""Our GGML dequantisers (``app.engine.loading.dequant``) against the ``gguf`` package's reference ones
(``gguf.quants.dequantize``), on the tensors of the shipped SmolLM2 GGUF and on random Q4_0 data.

    .venv/bin/python scripts/bench_dequant.py              # best of 3 per format
    .venv/bin/python scripts/bench_dequant.py --repeats 5

The loader keeps its own functions only where this table shows them faster; both results must be equal.
Prints a markdown table of measured figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from app.engine.loading import default_model_path
from app.engine.loading.dequant import dequantize


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def tensors_by_format() -> dict[str, list[tuple[np.ndarray, tuple[int, ...]]]]:
    """Raw blocks and shape of every tensor of the shipped file, by format, plus random Q4_0 (not shipped)."""
    found: dict[str, list[tuple[np.ndarray, tuple[int, ...]]]] = {}
    for tensor in GGUFReader(str(default_model_path())).tensors:
        kind = tensor.tensor_type.name
        if kind in ("Q8_0", "Q4_1"):
            shape = tuple(int(d) for d in reversed(tensor.shape))
            found.setdefault(kind, []).append((np.asarray(tensor.data), shape))
    weights = np.random.default_rng(0).normal(size=(30 * 1536, 576)).astype(np.float32)
    found["Q4_0 (random)"] = [(quantize(weights, GGMLQuantizationType.Q4_0), weights.shape)]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for kind, tensors in tensors_by_format().items():
        qtype = int(GGMLQuantizationType[kind.split()[0]])
        numel = sum(int(np.prod(shape)) for _, shape in tensors)

        def ours(tensors: list[tuple[np.ndarray, tuple[int, ...]]] = tensors, qtype: int = qtype) -> list[np.ndarray]:
            return [dequantize(raw, qtype, shape) for raw, shape in tensors]

        def reference(
            tensors: list[tuple[np.ndarray, tuple[int, ...]]] = tensors, qtype: int = qtype
        ) -> list[np.ndarray]:
            gtype = GGMLQuantizationType(qtype)
            return [gguf_dequantize(raw, gtype).reshape(shape) for raw, shape in tensors]

        equal = all(np.array_equal(a, b) for a, b in zip(ours(), reference(), strict=True))
        t_ours, t_ref = best_seconds(ours, args.repeats), best_seconds(reference, args.repeats)
        rows.append((kind, len(tensors), numel, t_ours, t_ref, equal))
    print("| format | tensors | weights | ours (s) | gguf.quants (s) | ours faster by | equal |")
    print("|---|---|---|---|---|---|---|")
    for kind, count, numel, t_ours, t_ref, equal in rows:
        print(f"| {kind} | {count} | {numel:,} | {t_ours:.3f} | {t_ref:.3f} | {t_ref / t_ours:.2f}x | {equal} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
