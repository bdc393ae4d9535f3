"""Eviction policies, the prefix-cache time-to-live and batching strategies chosen in the engine's config:
validated, reaching the block manager and scheduler, reported in the stats, and never changing tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from app.engine import LLMEngine, RequestOutput, SamplingParams
from tests.support.engine_runtime import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def block_bytes(engine: LLMEngine, block_size: int) -> int:
    cfg = engine.model_config
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * 4


def shared_prefix_prompts() -> list[list[int]]:
    """Three 16-token prefixes, each reused by several requests with their own tails."""
    prefixes = random_prompts(3, 16, 16, seed=21)
    tails = random_prompts(12, 2, 6, seed=22)
    return [prefixes[i % 3 if i < 6 else 0] + tail for i, tail in enumerate(tails)]


def test_options_are_validated(make_engine: Callable[..., LLMEngine]) -> None:
    with pytest.raises(ValueError, match="kv_cache_eviction_policy must be one of 'lru', 'lfu', 'fifo'"):
        make_engine(kv_cache_eviction_policy="mru")
    with pytest.raises(ValueError, match="prefix_cache_ttl_s"):
        make_engine(prefix_cache_ttl_s=0.0)
    allowed = "'continuous', 'bucketed', 'memory_aware'"
    with pytest.raises(ValueError, match=f"batching_strategy must be one of {allowed}"):
        make_engine(batching_strategy="static")
    with pytest.raises(ValueError, match="batching_bucket_size"):
        make_engine(batching_bucket_size=0)


def test_defaults_are_todays_engine(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    assert engine.block_manager.eviction_policy == "lru" and engine.block_manager._expiry is None
    assert engine.scheduler.config.batching_strategy == "continuous"
    assert engine.get_stats().eviction_policy == "lru"


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo"])
def test_every_policy_gives_the_same_tokens_and_reports_evictions(
    policy: str, make_engine: Callable[..., LLMEngine]
) -> None:
    prompts = shared_prefix_prompts()
    plain = make_engine(block_size=4, enable_prefix_caching=False)
    # 12 blocks of 4 tokens: the cached prefixes cannot all stay, so blocks are evicted.
    engine = make_engine(
        block_size=4, kv_cache_memory_bytes=12 * block_bytes(plain, 4), kv_cache_eviction_policy=policy
    )
    assert engine.block_manager.num_blocks == 12 and engine.block_manager.eviction_policy == policy
    outputs = [engine.generate([p], GREEDY)[0] for p in prompts]  # one at a time: hits on earlier ones
    assert tokens(outputs) == tokens(plain.generate(prompts, GREEDY))
    stats = engine.get_stats()
    assert stats.eviction_policy == policy
    assert stats.prefix_cache_evictions > 0 and stats.prefix_cache_hits > 0
    assert stats.prefix_cache_expirations == 0


def test_ttl_expires_cached_prefixes(make_engine: Callable[..., LLMEngine]) -> None:
    prompts = shared_prefix_prompts()[0::3][:2]  # two requests on the same prefix
    keep = make_engine(block_size=4)
    expire = make_engine(block_size=4, prefix_cache_ttl_s=1.0)
    now = [0.0]
    assert expire.block_manager._expiry is not None
    expire.block_manager._expiry.clock = lambda: now[0]
    first = expire.generate(prompts[:1], GREEDY)
    now[0] = 5.0  # past the time-to-live: the second request finds nothing cached
    second = expire.generate(prompts[1:], GREEDY)
    assert second[0].num_cached_tokens == 0
    kept = keep.generate(prompts[:1], GREEDY) + keep.generate(prompts[1:], GREEDY)
    assert tokens(first + second) == tokens(kept) and kept[1].num_cached_tokens == 16
    stats = expire.get_stats()
    assert stats.prefix_cache_expirations > 0 and stats.prefix_cache_hits == 0
    assert keep.get_stats().prefix_cache_hits > 0


@pytest.mark.parametrize("strategy", ["bucketed", "memory_aware"])
def test_batching_strategies_give_the_same_tokens(
    strategy: str, make_engine: Callable[..., LLMEngine]
) -> None:
    prompts = random_prompts(8, 4, 40, seed=23)
    reference = tokens(make_engine().generate(prompts, GREEDY))
    probe = make_engine(block_size=4)
    engine = make_engine(
        block_size=4,
        kv_cache_memory_bytes=24 * block_bytes(probe, 4),
        batching_strategy=strategy,
        batching_bucket_size=16,
    )
    assert engine.scheduler.config.batching_strategy == strategy
    assert engine.scheduler.admission.name == strategy
    assert tokens(engine.generate(prompts, GREEDY)) == reference
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
