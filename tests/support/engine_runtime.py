"""Workloads for the engine runtime tests: random prompts over the tiny models' vocabulary, and the shared-prefix
workload run with and without prefix caching."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from app.engine.llm_engine import LLMEngine
from tests.support.engine_models import VOCAB


def random_prompts(count: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of mixed lengths, avoiding the special ids (0-2) so nothing stops early."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def with_and_without_prefix_cache(
    make: Callable[..., LLMEngine], params: Any, tails: int = 6
) -> tuple[list[Any], list[Any], LLMEngine, LLMEngine]:
    """The shared-prefix workload (a 40-token prefix with short tails; the first request fills the cache, the
    others hit it) on an engine with prefix caching and on one without: both outputs, then both engines."""
    shared = random_prompts(1, 40, 40, seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(tails, 1, 12, seed=4)]
    cached = make(enable_prefix_caching=True, block_size=8)
    plain = make(enable_prefix_caching=False, block_size=8)
    with_cache = cached.generate(prompts[:1], params) + cached.generate(prompts[1:], params)
    without = plain.generate(prompts[:1], params) + plain.generate(prompts[1:], params)
    return with_cache, without, cached, plain
