"""Speculative decoding end to end on tiny random-weight models: greedy output identical with and without
it (n-gram and draft model; mixed batches, prefix caching, preemption), stops that land mid-step, logprobs,
the sampled distribution, and the acceptance statistics."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from app.engine import AsyncEngine, LLMEngine, RequestOutput, SamplingParams
from app.engine.spec_decode import SpeculativeConfig
from tests.support.engine_models import TINY_NAMES, VOCAB
from tests.support.engine_runtime import random_prompts

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase (what prompt lookup feeds on), mixed with plain random ones."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        phrase = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 8))]
        out.append(phrase * rng.randint(2, 5) if i % 3 else [rng.randrange(3, VOCAB) for _ in range(20)])
    return out


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def draft_config(loaded: dict[str, tuple[Any, Any, Any]], name: str, k: int = 4) -> dict[str, Any]:
    return {"method": "draft_model", "model": loaded[name][0], "num_speculative_tokens": k}


def is_idle(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    return not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


# ---- greedy: identical tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY_NAMES)
def test_ngram_greedy_identical_in_a_mixed_batch(name: str, make_engine: Callable[..., LLMEngine]) -> None:
    prompts = repetitive_prompts(9, seed=1)
    # Mixed lengths and options: some requests stop early, one uses penalties (which see the proposals as
    # history when verifying), one is sampled with a seed and rides along in the same steps.
    params = [GREEDY] * 6 + [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
    ]
    reference = make_engine(name).generate(prompts, params)
    engine = make_engine(name, speculative_config=NGRAM)
    outputs = engine.generate(prompts, params)
    assert tokens(outputs[:8]) == tokens(reference[:8])
    assert [o.outputs[0].text for o in outputs[:8]] == [o.outputs[0].text for o in reference[:8]]
    assert len(outputs[8].outputs[0].token_ids) == 12
    stats = engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0  # the repeated phrases were proposed from
    assert 0 <= stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert is_idle(engine)


@pytest.mark.parametrize("name", TINY_NAMES)
def test_draft_equal_to_target_is_always_accepted(
    name: str, make_engine: Callable[..., LLMEngine], loaded: dict[str, tuple[Any, Any, Any]]
) -> None:
    prompts = random_prompts(6, 3, 30, seed=2)
    reference = make_engine(name).generate(prompts, GREEDY)
    engine = make_engine(name, speculative_config=draft_config(loaded, name, k=3))
    assert tokens(engine.generate(prompts, GREEDY)) == tokens(reference)
    stats = engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_acceptance_rate == 1.0
    # Every verified draft yields its 3 proposals + 1 token, except where max_tokens cut the lookahead.
    assert stats.spec_decode_num_accepted_tokens_per_pos[0] == stats.spec_decode_num_drafts
    assert stats.num_steps < len(prompts) * NEW_TOKENS / 2  # far fewer steps than tokens
    assert is_idle(engine)


def test_smaller_draft_model_keeps_greedy_output(
    make_engine: Callable[..., LLMEngine], loaded: dict[str, tuple[Any, Any, Any]]
) -> None:
    prompts = repetitive_prompts(6, seed=3)
    reference = make_engine("llama_gqa_llama3").generate(prompts, GREEDY)
    # Another architecture and size sharing the vocabulary: it guesses badly, the output must not change.
    engine = make_engine("llama_gqa_llama3", speculative_config=draft_config(loaded, "llama_mqa_tied_linear"))
    assert tokens(engine.generate(prompts, GREEDY)) == tokens(reference)
    stats = engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_acceptance_rate < 1.0
    assert is_idle(engine)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_prefix_caching_with_speculation(
    method: str, make_engine: Callable[..., LLMEngine], loaded: dict[str, tuple[Any, Any, Any]]
) -> None:
    shared = random_prompts(1, 40, 40, seed=4)[0]
    prompts = [shared + tail for tail in random_prompts(4, 2, 6, seed=5)]
    reference = make_engine(enable_prefix_caching=False).generate(prompts, GREEDY)
    spec = NGRAM if method == "ngram" else draft_config(loaded, "llama_gqa_llama3")
    engine = make_engine(block_size=8, speculative_config=spec)
    first = engine.generate(prompts[:1], GREEDY)  # caches the shared prefix (and its outputs' blocks)
    rest = engine.generate(prompts[1:] + prompts[:1], GREEDY)
    assert tokens(first + rest[:-1]) == tokens(reference)
    assert tokens(rest[-1:]) == tokens(reference[:1])  # the same prompt again, now almost all cached
    assert engine.get_stats().prefix_cache_hits > 0
    assert is_idle(engine)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_preemption_with_speculation(
    method: str, make_engine: Callable[..., LLMEngine], loaded: dict[str, tuple[Any, Any, Any]]
) -> None:
    prompts = repetitive_prompts(8, seed=6)
    roomy = make_engine(block_size=4)
    cfg = roomy.model_config
    per_block = 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    spec = NGRAM if method == "ngram" else draft_config(loaded, "llama_gqa_llama3")
    tight = make_engine(block_size=4, kv_cache_memory_bytes=24 * per_block, speculative_config=spec)
    assert tokens(tight.generate(prompts, GREEDY)) == tokens(roomy.generate(prompts, GREEDY))
    assert tight.get_stats().num_preemptions > 0
    assert is_idle(tight)


# ---- stops when several tokens land at once -------------------------------------------------------------


@pytest.fixture
def fast_engine(make_engine: Callable[..., LLMEngine], loaded: dict[str, tuple[Any, Any, Any]]) -> LLMEngine:
    """Draft == target with 4 proposals: every step emits up to 5 tokens, so stops fall inside steps."""
    return make_engine(speculative_config=draft_config(loaded, "llama_gqa_llama3", k=4))


PROMPT = random_prompts(1, 12, 12, seed=11)[0]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_inside_a_step(
    include: bool, make_engine: Callable[..., LLMEngine], fast_engine: LLMEngine
) -> None:
    plain = make_engine()
    ref = plain.generate([PROMPT], GREEDY)[0].outputs[0]
    # Stop strings ending at several different tokens, so some land mid-step and some on a step's last token.
    detok = plain.tokenizer
    ends = [len(detok.decode(ref.token_ids[: i + 1])) for i in range(len(ref.token_ids))]
    lengths: set[int] = set()
    for i in range(3, 14):
        stop = ref.text[ends[i] - 2 : ends[i]]
        if len(stop) < 2 or ref.text.find(stop) != ends[i] - 2:
            continue  # want the first occurrence to end exactly at token i
        params = SamplingParams(
            temperature=0.0,
            max_tokens=NEW_TOKENS,
            ignore_eos=True,
            stop=[stop],
            include_stop_str_in_output=include,
        )
        expected = plain.generate([PROMPT], params)[0].outputs[0]
        got = fast_engine.generate([PROMPT], params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            expected.token_ids,
            expected.text,
            "stop",
            stop,
        )
        assert got.token_ids == ref.token_ids[: len(got.token_ids)]
        lengths.add(len(got.token_ids))
    assert len(lengths) >= 3  # the output ended at several different tokens
    assert is_idle(fast_engine)


def test_stop_token_and_max_tokens_inside_a_step(
    make_engine: Callable[..., LLMEngine], fast_engine: LLMEngine
) -> None:
    ref = make_engine().generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    i = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i] and i % 5 != 4)
    stop_tok = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=[ref[i]]
    )
    out = fast_engine.generate([PROMPT], stop_tok)[0].outputs[0]
    assert out.token_ids == ref[: i + 1] and out.finish_reason == "stop" and out.stop_reason == ref[i]
    for max_tokens in (1, 2, 3, 7, 11):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = fast_engine.generate([PROMPT], params)[0].outputs[0]
        assert out.token_ids == ref[:max_tokens] and out.finish_reason == "length"
    assert is_idle(fast_engine)


def test_eos_inside_a_step_and_streamed_outputs(
    make_engine: Callable[..., LLMEngine], fast_engine: LLMEngine
) -> None:
    plain = make_engine()
    ref = plain.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    eos = plain.eos_token_id
    assert eos is not None
    # Make eos the model's choice right after the 6th token: bias it only when the history allows, via
    # min_tokens (eos masked before) and a bias that makes it the argmax afterwards.
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=6, logit_bias={eos: 100.0})
    expected = plain.generate([PROMPT], params)[0].outputs[0]
    assert expected.token_ids[-1] == eos and len(expected.token_ids) == 7
    # Streaming (step by step) gives the same tokens, each step adding one or several.
    fast_engine.add_request("s", PROMPT, params)
    seen: list[list[int]] = []
    while fast_engine.has_unfinished_requests():
        for out in fast_engine.step():
            seen.append(list(out.outputs[0].token_ids))
    assert seen[-1] == expected.token_ids
    assert all(a == b[: len(a)] for a, b in itertools.pairwise(seen))
    assert ref[:6] == expected.token_ids[:6]


def test_logprobs_with_speculation(make_engine: Callable[..., LLMEngine], fast_engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    expected = make_engine().generate([PROMPT], params)[0].outputs[0]
    got = fast_engine.generate([PROMPT], params)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    assert got.logprobs is not None and expected.logprobs is not None
    for a, b in zip(got.logprobs, expected.logprobs, strict=True):
        assert set(a) == set(b)
        assert all(math.isclose(a[t], b[t], abs_tol=1e-4) for t in a)
    assert got.cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=1e-3)


# ---- sampling --------------------------------------------------------------------------------------------


def _marginals(outputs: list[RequestOutput], positions: int) -> list[Counter[int]]:
    out: list[Counter[int]] = [Counter() for _ in range(positions)]
    for o in outputs:
        for j, t in enumerate(o.outputs[0].token_ids[:positions]):
            out[j][t] += 1
    return out


def _homogeneous(a: Counter[int], b: Counter[int]) -> bool:
    """Chi-square test of homogeneity of two samples at p = 1e-4 (Wilson-Hilferty critical value)."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for key in keys:
        total = a[key] + b[key]
        for count, n in ((a[key], na), (b[key], nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    df = len(keys) - 1
    if df == 0:
        return True
    c = 2.0 / (9.0 * df)
    return stat < df * (1.0 - c + 3.719 * math.sqrt(c)) ** 3


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_tokens_keep_the_target_distribution(
    method: str, make_engine: Callable[..., LLMEngine], loaded: dict[str, tuple[Any, Any, Any]]
) -> None:
    # A random-weight model does not copy its context, so a logit bias makes one token likely (about 0.6
    # at each position): a repeated prompt of it then gives n-gram proposals that are accepted about as
    # often as rejected, exercising both branches. top_k = 3 keeps each position's vocabulary tiny. The
    # marginal distribution of each of the 6 tokens must be the same with and without speculation.
    token = 77
    prompt = [token] * 24
    count = 400
    params = [
        SamplingParams(
            temperature=1.0, top_k=3, seed=1000 + i, max_tokens=6, ignore_eos=True, logit_bias={token: 8.0}
        )
        for i in range(count)
    ]
    plain = make_engine().generate([prompt] * count, params)
    spec = NGRAM if method == "ngram" else draft_config(loaded, "llama_mqa_tied_linear", k=3)
    engine = make_engine(speculative_config=spec)
    speculative = engine.generate([prompt] * count, params)
    for j, (a, b) in enumerate(zip(_marginals(plain, 6), _marginals(speculative, 6), strict=True)):
        assert _homogeneous(a, b), (j, a, b)
    stats = engine.get_stats()
    assert 0.2 < stats.spec_decode_acceptance_rate < 0.9, stats
    assert stats.spec_decode_num_accepted_tokens_per_pos[1] > 0  # several proposals accepted in one step
    # Seeded: the same speculative run again gives the same samples, whatever the batch around them.
    again = make_engine(speculative_config=spec).generate([prompt] * 5 + [[7, 8, 9]], [*params[:5], GREEDY])
    assert tokens(again[:5]) == tokens(speculative[:5])


def test_same_model_draft_accepts_sampled_tokens(
    make_engine: Callable[..., LLMEngine], loaded: dict[str, tuple[Any, Any, Any]]
) -> None:
    engine = make_engine(speculative_config=draft_config(loaded, "llama_gqa_llama3", k=4))
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=24, ignore_eos=True, n=2)
    engine.generate(random_prompts(4, 5, 20, seed=10), params)
    # p == q up to rounding between the two passes: acceptance is essentially certain.
    assert engine.get_stats().spec_decode_acceptance_rate > 0.97
    assert is_idle(engine)


# ---- reporting and configuration ------------------------------------------------------------------------


def test_acceptance_reported_in_stats_and_prometheus(
    make_engine: Callable[..., LLMEngine], loaded: dict[str, tuple[Any, Any, Any]]
) -> None:
    engine = make_engine(speculative_config=draft_config(loaded, "llama_mqa_tied_linear", k=3))
    outputs = engine.generate(repetitive_prompts(4, seed=12), GREEDY)
    stats = engine.get_stats()
    assert stats.spec_decode_enabled and len(stats.spec_decode_num_accepted_tokens_per_pos) == 3
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_draft_tokens <= 3 * stats.spec_decode_num_drafts
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)  # position j+1 is accepted only after position j
    assert stats.spec_decode_acceptance_rate == pytest.approx(
        stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
    )
    assert stats.generation_tokens == sum(len(o.outputs[0].token_ids) for o in outputs)


def test_speculative_config_forms_and_errors(
    make_engine: Callable[..., LLMEngine], loaded: dict[str, tuple[Any, Any, Any]]
) -> None:
    engine = make_engine(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert isinstance(engine.config.speculative_config, SpeculativeConfig)
    assert engine.scheduler.config.num_lookahead_slots == 2
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": -1})
    # GPT-2's 256 learned positions cannot follow a target that runs to 512.
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(speculative_config=draft_config(loaded, "gpt2"))
    ok = make_engine(max_model_len=256, speculative_config=draft_config(loaded, "gpt2"))
    assert tokens(ok.generate([PROMPT], GREEDY)) == tokens(make_engine().generate([PROMPT], GREEDY))


def test_draft_model_from_a_path(make_engine: Callable[..., LLMEngine], tiny: dict[str, Any]) -> None:
    folder, _ = tiny["llama_mqa_tied_linear"]
    engine = make_engine(speculative_config={"model": str(folder), "num_speculative_tokens": 2})
    assert tokens(engine.generate([PROMPT], GREEDY)) == tokens(make_engine().generate([PROMPT], GREEDY))
    assert engine.get_stats().spec_decode_num_draft_tokens > 0


async def test_async_engine_streams_with_speculation(
    make_engine: Callable[..., LLMEngine], loaded: dict[str, tuple[Any, Any, Any]]
) -> None:
    expected = make_engine().generate([PROMPT], GREEDY)[0].outputs[0]
    engine = AsyncEngine(make_engine(speculative_config=draft_config(loaded, "llama_gqa_llama3")))
    try:
        last = None
        async for out in engine.generate(PROMPT, GREEDY):
            last = out
        assert last is not None and last.finished
        assert last.outputs[0].token_ids == expected.token_ids
        assert last.outputs[0].text == expected.text
        assert engine.get_stats().spec_decode_num_accepted_tokens > 0
    finally:
        await engine.shutdown()


# ---- the default model ----------------------------------------------------------------------------------

PASSAGE = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, the "
    "members agreed to fund the children's reading room, the digital archive and longer opening hours on "
    "weekends. The decision will be announced at the town hall next month."
)


@pytest.mark.slow
def test_smollm2_ngram_speculation_same_greedy_output() -> None:
    """SmolLM2 asked to repeat a passage: prompt lookup guesses most tokens, the output is unchanged, and
    the run takes far fewer engine steps (the time is printed; run with -s to see it)."""
    import time

    from app.engine.loading import default_model_path, load_model

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    model, tokenizer, config = load_model(None)  # through the default converted cache
    messages = [
        {"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"}
    ]
    params = SamplingParams(temperature=0.0, max_tokens=96)
    results = {}
    for label, spec in (("plain", None), ("ngram", NGRAM)):
        engine = LLMEngine.from_loaded(model, tokenizer, config, speculative_config=spec)
        start = time.perf_counter()
        [out] = engine.chat(messages, params)
        results[label] = (out.outputs[0], time.perf_counter() - start, engine.get_stats())
    plain, plain_s, plain_stats = results["plain"]
    spec_out, spec_s, stats = results["ngram"]
    assert spec_out.token_ids == plain.token_ids and spec_out.text == plain.text
    assert "children's reading room" in plain.text  # the model did repeat the passage
    assert stats.spec_decode_acceptance_rate > 0.5
    assert stats.num_steps < plain_stats.num_steps / 2
    n = len(plain.token_ids)
    print(
        f"\nSmolLM2 greedy, {n} tokens: plain {n / plain_s:.1f} tok/s ({plain_stats.num_steps} steps), "
        f"ngram k=4 {n / spec_s:.1f} tok/s ({stats.num_steps} steps), speed-up {plain_s / spec_s:.2f}x, "
        f"acceptance {stats.spec_decode_acceptance_rate:.2f}, "
        f"mean acceptance length {stats.spec_decode_mean_acceptance_length:.2f}"
    )
