"""Decode attention from the paged KV cache: how fast the C kernel reads the cache on this machine.

One call per layer of a decode step: ``--seqs`` sequences of ``--context`` cached positions each, SmolLM2's shape
(9 query heads, 3 kv heads, head_dim 64). Three placements of the sequences' blocks in a cache ``--layers``
times larger than one call reads (so that consecutive calls miss the CPU caches, as the layers of a real step
do): random blocks, consecutive blocks, and every sequence on the same blocks (cache-resident: the arithmetic
alone). Each row is printed for several block sizes, with the cache on 2 MB pages (as the engine allocates it)
and on 4 KB pages, with the bytes of K/V one call reads per second.

    .venv/bin/python scripts/bench_decode_attention.py
    .venv/bin/python scripts/bench_decode_attention.py --seqs 64 --context 96 --block-sizes 16,128
    .venv/bin/python scripts/bench_decode_attention.py --kv-dtype bfloat16   # a bfloat16 model's decode
    .venv/bin/python scripts/bench_decode_attention.py --seqs 128 --context 400 --pages huge,small

``--kv-dtype bfloat16`` reads a bfloat16 cache with bfloat16 query and output rows, as a bfloat16 model's
decode step runs (AVX512-BF16 products: the kernel's mode 2).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.attention import zeroed_mapping
from app.engine.kernels import available
from app.engine.kernels.attention import paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def time_calls(cache: torch.Tensor, tables: list[torch.Tensor], context: int, repeats: int) -> float:
    seqs = tables[0].shape[0]
    bf16 = cache.dtype == torch.bfloat16
    query = torch.randn(seqs, HEADS, HEAD_DIM, dtype=cache.dtype)
    out = torch.empty(seqs, HEADS * HEAD_DIM, dtype=cache.dtype)
    lens = torch.full((seqs,), context, dtype=torch.int64)
    scale = HEAD_DIM**-0.5
    call = (query, cache, tables[0], lens, context, None, scale, out)
    if not paged_decode_attention(*call, bf16_values=bf16):
        raise SystemExit("the C kernel does not apply here (a built kernel library; AVX512-BF16 for bfloat16)")
    start = time.perf_counter()
    for i in range(repeats):
        table = tables[i % len(tables)]
        paged_decode_attention(query, cache, table, lens, context, None, scale, out, bf16_values=bf16)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=66)
    parser.add_argument("--context", type=int, default=332)
    parser.add_argument("--layers", type=int, default=30, help="distinct block sets cycled through")
    parser.add_argument("--block-sizes", default="16,64,128")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--kv-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--pages", default="huge,small", help="the cache on 2 MB pages as the engine asks for them (huge), on 4 KB "
        "pages (small), or both, comma-separated"
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.kv_dtype)
    torch.set_num_threads(args.threads)
    if not available():
        raise SystemExit("the kernel library is not built here (it needs a C compiler with AVX2)")
    read = args.seqs * args.context * KV_HEADS * HEAD_DIM * dtype.itemsize * 2
    print(
        f"{args.seqs} sequences x {args.context} positions, {HEADS}/{KV_HEADS} heads x {HEAD_DIM}, "
        f"{args.threads} threads, {args.kv_dtype}: {read / 1e6:.1f} MB of K/V per call"
    )
    print(f"{'block size':>10} {'pages':>6} {'placement':>12} {'us/call':>10} {'GB/s':>7}")
    pages = [p.strip() for p in args.pages.split(",") if p.strip()]
    if not pages or set(pages) - {"huge", "small"}:
        raise SystemExit(f"--pages takes huge, small or both, got {args.pages!r}")
    for block_size, page in ((int(b), p) for b in args.block_sizes.split(",") if b.strip() for p in pages):
        per_seq = -(-args.context // block_size)
        per_call = args.seqs * per_seq
        num_blocks = per_call * args.layers
        shape = (2, num_blocks, block_size, KV_HEADS, HEAD_DIM)
        cache = zeroed_mapping(shape, dtype, huge_pages=page == "huge")
        cache.copy_(torch.randn(shape))
        order = torch.randperm(num_blocks)
        placements = {
            "random": [order[i * per_call : (i + 1) * per_call].view(args.seqs, per_seq).contiguous()
                       for i in range(args.layers)],
            "consecutive": [torch.arange(i * per_call, (i + 1) * per_call).view(args.seqs, per_seq).contiguous()
                            for i in range(args.layers)],
            "cached": [torch.arange(per_seq).repeat(args.seqs, 1).contiguous()],
        }
        for name, tables in placements.items():
            seconds = time_calls(cache, tables, args.context, args.repeats)
            print(f"{block_size:>10} {page:>6} {name:>12} {seconds * 1e6:>10.1f} {read / seconds / 1e9:>7.1f}")
        del cache


if __name__ == "__main__":
    main()
