"""What this CPU can run, read at run time (machines differ: recent ones have AVX-512 with BF16 and VNNI,
older ones AVX2 only), so the engine picks the best path and falls back cleanly."""

from __future__ import annotations

import functools
import os
from pathlib import Path

__all__ = ["avx512_enabled", "bf16_products_supported", "cpu_flags"]

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


def avx512_enabled() -> bool:
    """Whether the kernels run their AVX-512 builds: the CPU has AVX-512 F/DQ/BW and
    ``INF_ENGINE_DISABLE_AVX512`` is not set (``1`` tries the AVX2 builds on a machine that has both)."""
    if os.environ.get("INF_ENGINE_DISABLE_AVX512", "").strip().lower() in ("1", "true", "yes"):
        return False
    return {"avx512f", "avx512dq", "avx512bw"} <= cpu_flags()


def bf16_products_supported() -> bool:
    """bfloat16 matrix products run natively here: AVX512-BF16 (or AMX) dot products, through oneDNN.

    ``INF_ENGINE_DISABLE_BF16=1`` answers no (to try the float32 fallback on a machine that has them)."""
    if os.environ.get("INF_ENGINE_DISABLE_BF16", "").strip() in ("1", "true", "yes"):
        return False
    from app.engine.kernels.matmul import onednn_available

    flags = cpu_flags()
    return onednn_available() and bool({"avx512_bf16", "amx_bf16"} & flags)
