"""Paged decode attention against a float64 reference, on this machine's device (CUDA when present).

    python scripts/check_decode_attention.py

Prints, per dtype, the largest error of each sequence's output for the eager decode path (decode groups) and
the fixed-shape path that CUDA graphs replay (``StaticDecode``); then, in bfloat16, for each SDPA backend with an
additive mask in the query's dtype and in float32. On an H100 (torch 2.11) it showed that a float32 mask under
bfloat16 queries gave wrong outputs (errors of 1-3) in the default and cuDNN backends; the engine's decode
groups pass a bool mask since.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.attention import AttentionMetadata, StaticDecode, paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS, BLOCKS, KV_HEADS, HEADS, HEAD_DIM = 4, 80, 2, 4, 16
CONTEXTS = [5, 17, 36, 1, 30]
TABLES = [[10 * i + b for b in range(-(-c // BS))] for i, c in enumerate(CONTEXTS)]
SCALE = HEAD_DIM**-0.5


def reference(query: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Each sequence's attention over its context, in float64."""
    rows = []
    for i, c in enumerate(CONTEXTS):
        kv = cache[:, TABLES[i]].reshape(2, -1, KV_HEADS, HEAD_DIM)[:, :c].double()
        q = query[i].double().view(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        p = (torch.einsum("kgd,tkd->kgt", q, kv[0]) * SCALE).softmax(-1)
        rows.append(torch.einsum("kgt,tkd->kgd", p, kv[1]).reshape(-1))
    return torch.stack(rows).float()


def padded_tables() -> torch.Tensor:
    padded = torch.full((len(CONTEXTS), 16), BLOCKS, dtype=torch.long, device=DEVICE)
    for i, t in enumerate(TABLES):
        padded[i, : len(t)] = torch.tensor(t)
    return padded


def engine_paths(dtype: torch.dtype) -> None:
    cache = torch.randn(2, BLOCKS + 1, BS, KV_HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    q, k, v = (torch.randn(5, h, HEAD_DIM, device=DEVICE).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    eager_cache, static_cache = cache.clone(), cache.clone()
    meta = AttentionMetadata.build([1] * 5, CONTEXTS, TABLES, BS, device=DEVICE)
    eager = paged_attention(q, k, v, eager_cache, meta, SCALE).float()
    meta = AttentionMetadata.build([1] * 5, CONTEXTS, TABLES, BS, device=DEVICE)
    meta.static_decode = StaticDecode(padded_tables(), torch.tensor(CONTEXTS, device=DEVICE), 64)
    static = paged_attention(q, k, v, static_cache, meta, SCALE).float()
    ref = reference(q, eager_cache)
    print(dtype, "eager decode groups", [round(x, 5) for x in (eager - ref).abs().amax(-1).tolist()])
    print(dtype, "static (CUDA graphs)", [round(x, 5) for x in (static - ref).abs().amax(-1).tolist()])


def additive_mask_sdpa(query: torch.Tensor, cache: torch.Tensor, mask_dtype: torch.dtype) -> torch.Tensor:
    """The fixed-shape attention with an additive mask of ``mask_dtype``."""
    n, width = query.shape[0], 64
    ids = padded_tables().reshape(-1)
    k = cache[0].view(BLOCKS + 1, -1).index_select(0, ids).view(n, width, KV_HEADS, HEAD_DIM)
    v = cache[1].view(BLOCKS + 1, -1).index_select(0, ids).view(n, width, KV_HEADS, HEAD_DIM)
    keep = torch.arange(width, device=DEVICE)[None, :] < torch.tensor(CONTEXTS, device=DEVICE)[:, None]
    mask = torch.zeros(n, 1, 1, width, dtype=mask_dtype, device=DEVICE)
    mask.masked_fill_(~keep[:, None, None, :], float("-inf"))
    q = query.reshape(n, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=SCALE)
    return out.reshape(n, HEADS * HEAD_DIM)


def sdpa_backends() -> None:
    cache = torch.randn(2, BLOCKS + 1, BS, KV_HEADS, HEAD_DIM, device=DEVICE).to(torch.bfloat16)
    q = torch.randn(5, HEADS, HEAD_DIM, device=DEVICE).to(torch.bfloat16)
    ref = reference(q, cache)
    backends = [("default", None), ("math", SDPBackend.MATH), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    backends.append(("cudnn", SDPBackend.CUDNN_ATTENTION))
    for name, backend in backends:
        for mask_dtype in (torch.bfloat16, torch.float32):
            try:
                if backend is None:
                    out = additive_mask_sdpa(q, cache, mask_dtype)
                else:
                    with sdpa_kernel([backend]):
                        out = additive_mask_sdpa(q, cache, mask_dtype)
                errors = [round(x, 4) for x in (out.float() - ref).abs().amax(-1).tolist()]
                print("bfloat16 queries, SDPA", name, "mask", mask_dtype, errors)
            except RuntimeError as exc:
                print(
                    "bfloat16 queries, SDPA",
                    name,
                    "mask",
                    mask_dtype,
                    "unavailable:",
                    str(exc).splitlines()[0][:100],
                )


def main() -> None:
    torch.manual_seed(0)
    print("device:", torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu")
    for dtype in (torch.float32, torch.bfloat16):
        engine_paths(dtype)
    sdpa_backends()


if __name__ == "__main__":
    main()
