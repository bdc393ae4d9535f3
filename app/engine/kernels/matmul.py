"""``x @ weight.T (+ bias)`` for a few rows: the products of decoding, by the C kernel ``small_matmul.c``."""

from __future__ import annotations

import torch

from app.engine.kernels import library

# Up to this many rows the kernel beats MKL on a 2-core AVX2 machine (even at 32; beyond, MKL's GEMM wins).
MAX_ROWS = library.POOL_MAX_TOKENS


def small_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``x @ weight.T + bias`` by the C kernel, or None when it does not apply (then use ``F.linear``).

    Applies to CPU float32 with ``x`` ``[rows <= MAX_ROWS, in]`` (unit column stride), ``weight`` ``[out, in]``
    stored column-major (``weight.t()`` contiguous) and ``bias`` ``[out]`` contiguous or None.
    """
    if x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS:
        return None
    lib = library.get()
    if lib is None:
        return None
    w_t = weight.t()
    if (
        x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or not w_t.is_contiguous()
        or x.shape[1] != w_t.shape[0]
        or x.requires_grad
    ):
        return None
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = w_t.shape[1]
    out = torch.empty(rows, n, dtype=torch.float32)
    threads = torch.get_num_threads()
    scratch = library.scratch((threads - 1) * rows * n)
    lib.small_matmul(
        x.data_ptr(),
        x.stride(0),
        w_t.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        rows,
        k,
        n,
        scratch.data_ptr(),
        threads,
        library.use_pool(rows),
    )
    return out


def check_small_matmul() -> bool:
    """The kernel against ``torch.addmm`` on a few shapes (tails, several rows, one thread's worth of K)."""
    gen = torch.Generator().manual_seed(0)
    for rows, k, n in ((1, 200, 37), (3, 130, 1000), (MAX_ROWS, 64, 8)):
        x = torch.randn(rows, k, generator=gen)
        w = torch.randn(k, n, generator=gen).t()  # column-major [n, k]
        b = torch.randn(n, generator=gen)
        got = small_matmul(x, w, b)
        if got is None or not torch.allclose(got, torch.addmm(b, x, w.t()), rtol=1e-4, atol=1e-4):
            return False
    return True


library.self_checks.append(check_small_matmul)
