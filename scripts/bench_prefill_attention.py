"""Prefill attention on this CPU: the C kernel's builds against PyTorch's SDPA, side by side.

One call per layer of a prefill: one prompt of ``--tokens`` new tokens after ``--cached`` cached ones (a
prefix-cache hit when > 0), SmolLM2's shape (9 query heads, 3 kv heads, head_dim 64). Columns:

* ``sdpa float32``: PyTorch's CPU flash attention on float32 q/k/v (what the engine ran before the kernel);
* ``sdpa bfloat16``: the same on bfloat16 q/k/v (what a bfloat16 model would get from torch alone);
* ``ours avx2`` / ``ours avx512``: the kernel's float32 builds, reading K/V from the paged cache;
* ``ours avx512_bf16``: its bfloat16-products build (scores by vdpbf16ps), a bfloat16 model's.

Each row gives milliseconds per call (best of ``--repeats`` rounds) and the speed-up over ``sdpa float32``; a
build this CPU lacks shows ``-``. The kernel also checks its answer against SDPA before timing.

    .venv/bin/python scripts/bench_prefill_attention.py
    .venv/bin/python scripts/bench_prefill_attention.py --tokens 128,512,1024 --cached 0,256
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.kernels import available
from app.engine.kernels.attention import PREFILL_ISAS, paged_prefill_attention
from app.engine.kernels.cpu_features import cpu_flags

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
NEEDS = {
    "avx2": set(),
    "avx512": {"avx512f"},
    "avx512_bf16": {"avx512f", "avx512_bf16"},
    "amx": {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"},
}


def best_ms(fn: Callable[[], object], repeats: int, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def row(tokens: int, cached: int, repeats: int) -> dict[str, float | None]:
    gen = torch.Generator().manual_seed(0)
    ctx = cached + tokens
    blocks = -(-ctx // BLOCK)
    cache = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    table = torch.arange(blocks).view(1, blocks)
    query = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    k = cache[0].reshape(-1, KV_HEADS, HEAD_DIM)[:ctx].transpose(0, 1).unsqueeze(0).contiguous()
    v = cache[1].reshape(-1, KV_HEADS, HEAD_DIM)[:ctx].transpose(0, 1).unsqueeze(0).contiguous()
    q = query.transpose(0, 1).unsqueeze(0).contiguous()
    qpos = torch.arange(cached, ctx)
    mask = None if cached == 0 else torch.arange(ctx)[None, :] <= qpos[:, None]

    def sdpa(dtype: torch.dtype) -> Callable[[], object]:
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        return lambda: F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=mask, is_causal=mask is None, scale=HEAD_DIM**-0.5, enable_gqa=True
        )

    figures: dict[str, float | None] = {
        "sdpa float32": best_ms(sdpa(torch.float32), repeats, 5),
        "sdpa bfloat16": best_ms(sdpa(torch.bfloat16), repeats, 5),
    }
    want = sdpa(torch.float32)()
    assert isinstance(want, torch.Tensor)
    want = want[0].transpose(0, 1).reshape(tokens, -1)
    out = torch.empty(tokens, HEADS * HEAD_DIM)
    for isa in PREFILL_ISAS:
        if not NEEDS[isa] <= cpu_flags():
            figures[f"ours {isa}"] = None
            continue

        def call(isa: str = isa) -> object:
            return paged_prefill_attention(
                query, cache, table, [ctx], [0], [tokens], HEAD_DIM**-0.5, out, isa=isa
            )

        call()
        tol = 2e-2 if isa in ("avx512_bf16", "amx") else 1e-4  # bfloat16 q/k/v against float32 SDPA
        if not torch.allclose(out, want, rtol=tol, atol=tol):
            raise SystemExit(f"ours {isa} disagrees with SDPA at {tokens} tokens after {cached}")
        figures[f"ours {isa}"] = best_ms(call, repeats, 5)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="128,512,1024", help="new tokens per prompt, comma-separated")
    parser.add_argument("--cached", default="0,256", help="cached prefix lengths, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not available():
        raise SystemExit("the C kernels are not built here (they need a C compiler and an AVX2 CPU)")
    torch.set_num_threads(args.threads)
    print(f"prefill attention, {HEADS}/{KV_HEADS} heads x {HEAD_DIM}, {args.threads} threads, ms per call")
    rows = []
    for cached in (int(c) for c in args.cached.split(",")):
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows.append(((tokens, cached), row(tokens, cached, args.repeats)))
    names = list(rows[0][1])
    print("| new tokens | cached | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for (tokens, cached), figures in rows:
        base = figures["sdpa float32"]
        cells = []
        for name in names:
            ms = figures[name]
            cells.append("-" if ms is None else f"{ms:.3f} ({base / ms:.2f}x)" if base else f"{ms:.3f}")
        print(f"| {tokens} | {cached} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
