"""Optional native kernels for the CPU hot path of decoding, with PyTorch as the always-available fallback.

* ``small_matmul``: ``x @ weight.T (+ bias)`` for up to :data:`MAX_ROWS` rows against a column-major weight
  (how the engine stores its matmul weights on CPU). Decoding one or a few sequences is a matrix-vector product
  bound by memory bandwidth, which MKL runs on one thread; the kernel streams the weights on every thread:
  about 1.8x faster for one row and 2-4x for 2-16 rows on a 2-core AVX2 machine.
* ``paged_decode_attention``: one query token per sequence attending to its context in place in the paged KV
  cache, instead of gathering the blocks and running one tiny SDPA per (sequence, head).
* ``paged_prefill_attention``: causal attention of prompts and chunks over the paged cache, tiled for AVX-512
  (an AVX2 build elsewhere), about 1.7x PyTorch's CPU flash attention at 512 tokens, and exact across chunking.

The C sources (``*.c`` here) are compiled on first use with the system compiler (``build.py``) and checked
against PyTorch once loaded; anything missing or wrong means the PyTorch path. ``enable(False)`` switches the
kernels off for the process.
"""

from __future__ import annotations

from app.engine.kernels.attention import paged_decode_attention, paged_prefill_attention
from app.engine.kernels.elementwise import add_rms_norm, rope_inplace, silu_mul, write_kv
from app.engine.kernels.library import available, enable
from app.engine.kernels.matmul import MAX_ROWS, small_matmul

__all__ = [
    "MAX_ROWS",
    "add_rms_norm",
    "available",
    "enable",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rope_inplace",
    "silu_mul",
    "small_matmul",
    "write_kv",
]
