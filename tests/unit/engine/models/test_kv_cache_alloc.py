"""The CPU KV cache is zeroed, private memory that costs RAM only where blocks are used."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import psutil
import torch

from app.engine.attention import allocate_kv_cache


def config(layers: int = 4) -> Any:
    return SimpleNamespace(num_layers=layers, num_kv_heads=3, head_dim=64)


def test_cache_is_zeroed_and_shaped_per_layer() -> None:
    caches = allocate_kv_cache(config(), num_blocks=10, block_size=16)
    assert len(caches) == 4
    assert all(c.shape == (2, 10, 16, 3, 64) and c.is_contiguous() for c in caches)
    assert all(float(c.abs().sum()) == 0.0 for c in caches)


def test_untouched_blocks_cost_no_memory() -> None:
    proc = psutil.Process()
    before = proc.memory_info().rss
    caches = allocate_kv_cache(config(8), num_blocks=11_000, block_size=16)  # ~0.5 GiB budget
    assert proc.memory_info().rss - before < 64 << 20
    caches[0][0, :10].fill_(1.0)  # a sequence writes a few blocks: only those pages become resident
    assert proc.memory_info().rss - before < 64 << 20
    assert float(caches[0][1].abs().sum()) == 0.0


def test_bfloat16_cache() -> None:
    [cache] = allocate_kv_cache(config(1), num_blocks=3, block_size=4, dtype=torch.bfloat16)
    assert cache.dtype == torch.bfloat16 and float(cache.float().abs().sum()) == 0.0
