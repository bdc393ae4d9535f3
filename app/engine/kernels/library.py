"""The process-wide kernel library: built and loaded once, checked against PyTorch, switchable off."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Iterator

import torch

from app.engine.kernels.build import load_kernel

log = logging.getLogger(__name__)

LIBRARY = "engine_kernels"
SOURCES = (
    "threadpool.c",
    "small_matmul.c",
    "paged_attention.c",
    "prefill_attention.c",
    "elementwise.c",
    "qblock_matmul.c",
    "decode_layer.c",
    "bf16_matmul.c",
    "bf16_gemm.c",
)
_ABI = {
    "small_matmul_abi_version": 2,
    "paged_attention_abi_version": 8,
    "prefill_attention_abi_version": 5,
    "elementwise_abi_version": 10,
    "qblock_matmul_abi_version": 1,
    "decode_layer_abi_version": 6,
    "bf16_matmul_abi_version": 2,
    "bf16_gemm_abi_version": 3,
}

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
# Every kernel ends with (threads, use_pool): see use_pool() below.
_SIGNATURES: dict[str, list[type]] = {
    "small_matmul": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _int, _int],
    "paged_decode_attention": [
        *(_ptr, _i64, _ptr, _ptr, _int, _int, _int),  # q, q_ld, k, v, kv_bf16, bf16_values, io_bf16
        *(_ptr, _i64, _ptr, _ptr),  # tables, bt_stride, ctx, rows
        *(_i64, _i64, _i64, _i64, _i64, _f32),  # seqs, heads, kv_heads, head_dim, block_size, scale
        *(_ptr, _i64, _ptr, _i64, _i64, _int, _int),  # out, out_ld, scratch, per_thread, max_context, ...
    ],
    "paged_prefill_attention": [
        *(_ptr, _i64, _ptr, _ptr, _int, _int),  # q, q_ld, k, v, kv_bf16, io_bf16
        *(_ptr, _i64, _ptr, _ptr, _ptr),  # tables, bt_stride, ctx, qstart, qlen
        *(_i64, _i64, _i64, _i64, _i64, _f32),  # seqs, heads, kv_heads, head_dim, block_size, scale
        *(
            _ptr,
            _i64,
            _ptr,
            _ptr,
            _i64,
            _int,
            _int,
            _int,
        ),  # out, out_ld, kv_scratch, scratch, per_thread, avx512, ...
    ],
    # x, x_ld, residual, res_ld, flags, weight, eps, out, out_ld, rows, dim, ...
    "add_rms_norm": [_ptr, _i64, _ptr, _i64, _int, _ptr, _f32, _ptr, _i64, _i64, _i64, _int, _int],
    # x, x_ld, keep, out, scales, rows, dim, ...
    "quantize_rows_i8": [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _int, _int],
    # acc, scales, col_scales, rows, cols, ...
    "dequantize_i32": [_ptr, _ptr, _ptr, _i64, _i64, _int, _int],
    "silu_mul": [
        _ptr,
        _i64,
        _ptr,
        _i64,
        _i64,
        _i64,
        _int,
        _int,
        _int,
    ],  # gu, ld, out, ld, rows, inter, bf16, ...
    # k, k_ld, v, v_ld, slots, tokens, row, k_cache, v_cache, bf16, src_bf16, ...
    "write_kv": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _int, _int, _int, _int],
    # x, x_ld, cos, sin, cs_ld, rows, heads, head_dim, bf16, ...
    "rope_inplace": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _int, _int, _int],
    "qblock_scratch_bytes": [_i64, _i64],
    "amx_request": [],
    "elementwise_use_avx512": [_int],
    "argmax_rows": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _int, _int],  # x, ld, rows, cols, out, ties, ...
    "decode_layer": [_ptr, _ptr, _ptr, _ptr, _int, _ptr],  # layer, step, x, residual, has_residual, out
    # x, ldx, w, ldw, y, ldy, M, K, N, out_f32, ...
    "bf16_matmul": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _int, _int, _int],
    "bf16_gemm_packed_size": [_i64, _i64],  # N, K
    "bf16_gemm_pack": [_ptr, _i64, _i64, _i64, _ptr],  # w, ldw, N, K, out
    "bf16_gemm_pack_swiglu": [_ptr, _i64, _i64, _i64, _ptr],  # w, ldw, inter, K, out
    # x, ldx, packed, K, inter, M, y, ldy, ...
    "bf16_gemm_swiglu": [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _int, _int],
    # x, ldx, packed, K, N, M, y, ldy, out_f32, ...
    "bf16_gemm": [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _int, _int, _int],
    "qblock_matmul": [
        *(_ptr, _i64, _i64, _i64),  # x, ldx, M, K
        *(_ptr, _ptr, _ptr, _int, _int, _int, _i64),  # codes, d, m, bits, offset, has_min, N
        *(_ptr, _ptr, _i64, _ptr, _int, _int, _int),  # bias, out, ldo, scratch, isa, ...
    ],
}
_RESTYPES: dict[str, type] = {
    "paged_prefill_attention": _int,
    "qblock_matmul": _int,
    "decode_layer": _int,
    "amx_request": _int,
    "qblock_scratch_bytes": _i64,
    "bf16_gemm_packed_size": _i64,
}  # the others return nothing
# A step of at most this many tokens runs its products in small_matmul too (see matmul.MAX_ROWS), so every
# kernel of it uses the kernels' own thread pool; larger steps run their products on oneDNN (or MKL) and every
# kernel of theirs on OpenMP's threads, so that two spinning thread pools never fight over the cores.
POOL_MAX_TOKENS = 2


def use_pool(tokens: int) -> int:
    """The last argument of every kernel: 1 for the kernels' thread pool, 0 for OpenMP (threadpool.h)."""
    if getattr(_openmp, "only", False):
        return 0
    return int(tokens <= POOL_MAX_TOKENS)


@contextlib.contextmanager
def openmp_only(on: bool) -> Iterator[None]:
    """Within the block, in the calling thread: every kernel runs on OpenMP's threads, whatever the step size.
    A model whose few-row products run on oneDNN or torch's int8 kernel (bfloat16 or quantized weights)
    already uses OpenMP there, and a second spinning pool between those products costs more than it saves.
    Scoped, not sticky: after it the thread is back to the pool for small steps, which (unlike libgomp)
    also works in a process forked after OpenMP ran."""
    before = getattr(_openmp, "only", False)
    _openmp.only = on
    try:
        yield
    finally:
        _openmp.only = before


_openmp = threading.local()

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_loaded = False
_enabled = True
_scratch = threading.local()  # per thread: engines in different threads must not share scratch memory
# Run once after loading, with the library in place; a False from any of them disables it.
self_checks: list[Callable[[], bool]] = []


def get() -> ctypes.CDLL | None:
    """The loaded library, or None when it is switched off or could not be built."""
    if not _enabled:
        return None
    return _lib if _loaded else _load()


def _load() -> ctypes.CDLL | None:
    global _lib, _loaded
    with _lock:
        if _loaded:
            return _lib
        _loaded = True
        lib = load_kernel(LIBRARY, SOURCES)
        if lib is None:
            return None
        try:
            for name, version in _ABI.items():
                if getattr(lib, name)() != version:
                    raise OSError(f"{name} is not {version}: a stale library")
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes = argtypes
                fn.restype = _RESTYPES.get(name)
        except (OSError, AttributeError) as exc:
            log.warning("C kernels not used: %s", exc)
            return None
        _lib = lib
        for check in self_checks:
            if not check():
                log.warning("C kernel check %s disagrees with PyTorch; kernels not used", check.__name__)
                _lib = None
                break
        return _lib


def available() -> bool:
    """Whether the kernels are built, loaded and enabled (builds them on the first call)."""
    return get() is not None


def enable(on: bool = True) -> None:
    """Use the kernels where they apply (the default) or always fall back to PyTorch."""
    global _enabled
    _enabled = on


def scratch(numel: int) -> torch.Tensor:
    """A float32 scratch buffer of at least ``numel`` elements, owned by the calling thread."""
    buf: torch.Tensor | None = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel + numel // 4, 1 << 16), dtype=torch.float32)
        _scratch.buf = buf
    return buf
