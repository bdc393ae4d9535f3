"""int8 products for batched steps (issue 32): do VNNI int8 products beat float32 where there is no BF16?

    .venv/bin/python scripts/bench_int8_matmul.py                      # SmolLM2's shapes, 8-256 rows, 2 threads
    .venv/bin/python scripts/bench_int8_matmul.py --rows 16,64 --repeats 9

Per shape and row count, milliseconds per product with the weights streamed from memory (enough copies to
overflow the caches, called in turn), side by side:

* ``float32``: what a model without BF16 runs for batched steps today (``layers.linear``: oneDNN on a packed
  copy);
* ``W8A8``: ``matmul.w8a8_linear`` as quantization "auto" runs it: the activations rounded to int8 per row
  (absmax / 127), the weight to int8 per output channel, the product by ``torch._int_mm`` (int32 sums; oneDNN's
  s8s8 product, VNNI where the CPU has it), scaled back to float32, plus the float32 product of the
  ``W8A8_OUTLIERS`` input channels kept out of the rounding: every step of it is timed.

The last columns are the speed-up of W8A8 over float32, and its error against the float32 product (max abs error
over max abs value of the output).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.engine.kernels.matmul import w8a8_linear
from app.engine.models.layers import linear
from app.engine.models.quantization import W8A8_OUTLIERS

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))  # (out, in): q/o, k/v, up, down, head
STREAM_BYTES = 96 << 20


def best_ms(fn: Callable[[int], object], copies: int, repeats: int) -> float:
    fn(0)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(copies):
            fn(i)
        best = min(best, (time.perf_counter() - start) / copies)
    return best * 1e3


def _float32(x: torch.Tensor, weights: list[torch.Tensor], i: int) -> torch.Tensor:
    return linear(x, weights[i])


def _int8(x: torch.Tensor, quantized: list[tuple], i: int) -> torch.Tensor:  # type: ignore[type-arg]
    codes, scale, outliers, keep = quantized[i]
    return w8a8_linear(x, codes, scale, None, outliers, keep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,16,32,64,128,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads {args.threads}; ms per product, weights streamed from memory")
    print(f"{'shape (out x in)':>18} {'rows':>5} {'float32':>9} {'W8A8':>9} {'speed-up':>9} {'rel. error':>11}")
    for out_f, in_f in SHAPES:
        copies = max(2, STREAM_BYTES // (out_f * in_f * 4))
        weights = [torch.randn(out_f, in_f) * 0.05 for _ in range(copies)]
        channels = torch.arange(W8A8_OUTLIERS) * (in_f // W8A8_OUTLIERS)  # the channels kept in float32
        quantized = []
        for w in weights:
            scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            codes = torch.round(w / scale[:, None]).to(torch.int8).t().contiguous()
            codes[channels] = 0
            keep = torch.ones(in_f).index_fill_(0, channels, 0.0)
            quantized.append((codes, scale, (channels, w[:, channels].t().contiguous()), keep))
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_f)
            f32 = best_ms(partial(_float32, x, weights), copies, args.repeats)
            i8 = best_ms(partial(_int8, x, quantized), copies, args.repeats)
            ref = linear(x, weights[0])
            err = (_int8(x, quantized, 0) - ref).abs().max() / ref.abs().max()
            print(f"{out_f:>8} x {in_f:<7} {rows:>5} {f32:>9.3f} {i8:>9.3f} {f32 / i8:>8.2f}x {err.item():>11.4f}")


if __name__ == "__main__":
    main()
