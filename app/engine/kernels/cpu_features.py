"""What this CPU can run, read at run time (machines differ: recent ones have AVX-512 with BF16 and VNNI,
older ones AVX2 only), so the engine picks the best path and falls back cleanly."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from app.settings import Settings

__all__ = ["avx512_enabled", "bf16_products_supported", "cpu_flags", "kernel_settings", "onednn_linear_op"]

CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none, e.g. not Linux)."""
    try:
        text = CPUINFO.read_text(encoding="ascii", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def kernel_settings() -> Settings:
    """The process settings, whose ``disable_*`` fields switch kernel paths off (``INF_ENGINE_DISABLE_AVX512``,
    ``INF_ENGINE_DISABLE_BF16``, ``INF_ENGINE_DISABLE_AMX``, ``INF_ENGINE_DISABLE_DECODE_LAYER``). The settings are
    cached: a test that changes one of those variables clears ``app.settings.get_settings``'s cache."""
    from app.settings import get_settings  # the one settings object, imported lazily to keep the engine light

    return get_settings()


def avx512_enabled() -> bool:
    """Whether the kernels run their AVX-512 builds: the CPU has AVX-512 F/DQ/BW and
    ``INF_ENGINE_DISABLE_AVX512`` is not set (``1`` tries the AVX2 builds on a machine that has both)."""
    if kernel_settings().disable_avx512:
        return False
    return {"avx512f", "avx512dq", "avx512bw"} <= cpu_flags()


def bf16_products_supported() -> bool:
    """bfloat16 matrix products run natively here: AVX512-BF16 (or AMX) dot products, through oneDNN.

    ``INF_ENGINE_DISABLE_BF16=1`` answers no (to try the float32 fallback on a machine that has them)."""
    if kernel_settings().disable_bf16:
        return False
    flags = cpu_flags()
    return onednn_linear_op() is not None and bool({"avx512_bf16", "amx_bf16"} & flags)


@functools.cache
def onednn_linear_op() -> Any:
    """torch's oneDNN linear (``torch.ops.mkldnn._linear_pointwise``) where this build has it and it runs on this
    CPU, else None."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return None
    try:  # a build whose oneDNN cannot run it (no AVX, say) fails here, once, not in a step
        x, w = torch.ones(3, 8), torch.ones(5, 8)
        if not torch.equal(op(x, w, None, "none", [], ""), torch.full((3, 5), 8.0)):
            return None
    except RuntimeError:
        return None
    return op
