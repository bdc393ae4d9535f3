"""bfloat16 products (issue 16): our two kernels against oneDNN's packed bfloat16 product.

    .venv/bin/python scripts/bench_bf16_matmul.py                 # SmolLM2's shapes, 1-16 rows, 2 threads
    .venv/bin/python scripts/bench_bf16_matmul.py --rows 1,4 --repeats 9
    .venv/bin/python scripts/bench_bf16_matmul.py --rows 8,64,128   # batches: the packed kernel

Per shape and row count: milliseconds per product with the weights streamed from memory (as in a model's
steps: enough copies of the weight to overflow the caches, called in turn), and the weight bytes read per
second of the fastest. ``few-row`` is ``matmul.bf16_small_matmul`` (bf16_matmul.c, the weight as stored,
row-major; shown up to 16 rows), ``packed`` is ``matmul.bf16_gemm`` (bf16_gemm.c, on its packed copy), both run
here past the row limits that ``bf16_linear`` gives them, and ``oneDNN`` is oneDNN's product on its packed copy
(what a bfloat16 model ran before). ``BF16_MAX_ROWS`` in ``app/engine/kernels/matmul.py`` (few-row kernel up to
it, packed kernel beyond) is set from this table. Needs AVX512-BF16.
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

from app.engine.kernels import matmul

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))
STREAM_BYTES = 96 << 20  # more than any last-level cache here


def best_ms(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor], repeats: int) -> float:
    for w in weights[:2]:
        fn(w)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best * 1e3


FEW_ROW_SHOWN = 16  # the few-row kernel re-reads the weight for every 8 rows: not a contender beyond


def few_row_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    return matmul.bf16_small_matmul(x, w)


def packed_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    return matmul.bf16_gemm(x, w)


def onednn_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed product, even where bf16_linear would take our kernel."""
    op = matmul._ONEDNN_LINEAR
    packed = matmul._packed(w)
    return op(x, packed, None, "none", [], "")  # type: ignore[misc]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,3,4,6,8,16", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not matmul.bf16_matmul_supported():
        print("bench_bf16_matmul: this CPU has no AVX512-BF16; nothing to compare", file=sys.stderr)
        return 2
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        print(f"bench_bf16_matmul: --rows must be integers, got {args.rows!r}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    limit = matmul.BF16_MAX_ROWS
    print(f"threads {args.threads}; BF16_MAX_ROWS is {limit}")
    print("| out x in | rows | few-row ms | packed ms | oneDNN ms | best GB/s | oneDNN / best of ours |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    try:
        for n, k in SHAPES:
            copies = max(2, STREAM_BYTES // (n * k * 2))
            weights = [torch.randn(n, k, generator=gen).bfloat16() for _ in range(copies)]
            for rows in rows_list:
                x = torch.randn(rows, k, generator=gen).bfloat16()
                few = float("nan")
                if rows <= FEW_ROW_SHOWN:
                    matmul.BF16_MAX_ROWS = rows  # measure each kernel past its limit too
                    few = best_ms(partial(few_row_product, x), weights, args.repeats)
                matmul.BF16_MAX_ROWS = 0
                packed = best_ms(partial(packed_product, x), weights, args.repeats)
                theirs = best_ms(partial(onednn_product, x), weights, args.repeats)
                best = min(ms for ms in (few, packed) if ms == ms)
                print(
                    f"| {n} x {k} | {rows} | {few:.3f} | {packed:.3f} | {theirs:.3f} "
                    f"| {n * k * 2 / (min(best, theirs) * 1e-3) / 1e9:.1f} | {theirs / best:.2f}x |"
                )
    finally:
        matmul.BF16_MAX_ROWS = limit
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
