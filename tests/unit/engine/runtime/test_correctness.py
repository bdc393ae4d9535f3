"""Token-exact agreement: with transformers, and across batching, prefix caching, preemption and chunking."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from app.engine import LLMEngine, SamplingParams
from tests.support.engine_models import TINY_NAMES, hf_greedy
from tests.support.engine_runtime import random_prompts, with_and_without_prefix_cache

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", TINY_NAMES)
def test_greedy_matches_transformers(name: str, tiny: dict[str, tuple[Path, Any]]) -> None:
    folder, hf = tiny[name]
    engine = LLMEngine(model=str(folder), kv_cache_memory_bytes=1 << 22)  # the public constructor path
    prompts = random_prompts(5, 3, 40, seed=1)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in outputs] == prompts  # input order
    for prompt, output in zip(prompts, outputs, strict=True):
        ref, _ = hf_greedy(hf, prompt, NEW_TOKENS)
        assert output.outputs[0].token_ids == ref
        assert output.outputs[0].finish_reason == "length"
        assert output.finished
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_text_prompt_and_logprob_match_transformers(
    tiny: dict[str, tuple[Path, Any]], make_engine: Callable[..., LLMEngine]
) -> None:
    _, hf = tiny["llama_gqa_llama3"]
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    [out] = engine.generate("the quick brown fox", params)
    prompt = engine.tokenizer.encode("the quick brown fox")
    assert out.prompt == "the quick brown fox" and out.prompt_token_ids == prompt
    ref, _ = hf_greedy(hf, prompt, 8)
    completion = out.outputs[0]
    assert completion.token_ids == ref
    assert completion.text == engine.tokenizer.decode(ref)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)
    assert completion.logprobs is not None and len(completion.logprobs) == 8
    first = completion.logprobs[0]
    assert next(iter(first)) == ref[0] and len(first) == 3  # greedy: the sampled token is the top one
    top3 = expected.topk(3)
    for token_id, value in zip(top3.indices.tolist(), top3.values.tolist(), strict=True):
        assert first[token_id] == pytest.approx(value, abs=1e-4)
    total = sum(entry[t] for entry, t in zip(completion.logprobs, completion.token_ids, strict=True))
    assert completion.cumulative_logprob == pytest.approx(total)


@pytest.mark.parametrize("name", ["llama_gqa_llama3", "gpt2"])
def test_batch_invariance(name: str, make_engine: Callable[..., LLMEngine]) -> None:
    prompts = random_prompts(16, 2, 60, seed=2)
    target = prompts[5]
    alone = make_engine(name).generate([target], GREEDY)
    batch = make_engine(name).generate(prompts, GREEDY)
    assert tokens(alone)[0] == tokens(batch)[5]


def test_prefix_caching_same_tokens_and_hits(make_engine: Callable[..., LLMEngine]) -> None:
    with_cache, without, cached, plain = with_and_without_prefix_cache(make_engine, GREEDY)
    assert tokens(with_cache) == tokens(without)
    stats = cached.get_stats()
    assert stats.prefix_cache_hits >= 5 * 40  # every later request reuses the 5 full blocks of the prefix
    assert stats.prefix_cache_queries >= stats.prefix_cache_hits
    assert all(o.num_cached_tokens == 40 for o in with_cache[1:])
    assert plain.get_stats().prefix_cache_hits == 0


def test_preemption_gives_same_tokens(make_engine: Callable[..., LLMEngine]) -> None:
    prompts = random_prompts(8, 8, 20, seed=5)
    roomy = make_engine(block_size=4)
    # 24 blocks of 4 tokens: 8 sequences of up to 52 tokens cannot all stay resident.
    cfg = roomy.model_config
    per_block = 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    tight = make_engine(block_size=4, kv_cache_memory_bytes=24 * per_block)
    assert tight.block_manager.num_blocks == 24
    assert tokens(tight.generate(prompts, GREEDY)) == tokens(roomy.generate(prompts, GREEDY))
    assert tight.get_stats().num_preemptions > 0
    assert tight.block_manager.num_free_blocks == 24


@pytest.mark.parametrize("options", [dict(max_num_batched_tokens=7), dict(enable_chunked_prefill=False)])
def test_chunked_and_unchunked_prefill_same_tokens(
    options: dict[str, Any], make_engine: Callable[..., LLMEngine]
) -> None:
    prompts = random_prompts(6, 10, 50, seed=6)
    reference = tokens(make_engine().generate(prompts, GREEDY))
    assert tokens(make_engine(**options).generate(prompts, GREEDY)) == reference


def test_priority_policy_same_tokens(make_engine: Callable[..., LLMEngine]) -> None:
    prompts = random_prompts(6, 5, 30, seed=7)
    reference = tokens(make_engine().generate(prompts, GREEDY))
    engine = make_engine(scheduling_policy="priority", max_num_seqs=2)
    outputs = engine.generate(prompts, GREEDY, priority=[5, 4, 3, 2, 1, 0])
    assert tokens(outputs) == reference
    # The highest priority (lowest value) was served first: it finished before the lowest.
    first, last = outputs[5].metrics, outputs[0].metrics
    assert first is not None and last is not None
    assert first.finished_time is not None and last.finished_time is not None
    assert first.finished_time < last.finished_time


def test_preemption_with_n_and_seeded_sampling(make_engine: Callable[..., LLMEngine]) -> None:
    prompts = random_prompts(6, 10, 30, seed=8)
    params = SamplingParams(n=3, temperature=0.9, top_k=40, seed=5, max_tokens=24, ignore_eos=True)
    roomy = make_engine(block_size=4)
    cfg = roomy.model_config
    per_block = 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    tight = make_engine(block_size=4, kv_cache_memory_bytes=40 * per_block)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params)]
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params)]
    assert got == expected
    assert tight.get_stats().num_preemptions > 0
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks
