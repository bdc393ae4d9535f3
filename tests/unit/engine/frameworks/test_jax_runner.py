"""The JAX runner on the engine's shared core: token-exact with transformers (and the torch runner on the default
model), float32 logits within 1e-3, prefix caching, chunked prefill, preemption, and bounded compilations."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("jax")

from app.engine import LLMEngine, SamplingParams
from app.engine.frameworks.jax.runner import (
    JaxRunner,
    StepBuilder,
    bucket,
    decode_rows,
    layer_group,
    layer_outputs,
)
from app.engine.kernels.cpu_features import bf16_products_supported
from tests.support.engine_models import TINY_NAMES, hf_greedy
from tests.support.engine_runtime import random_prompts, with_and_without_prefix_cache

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture
def make_engine(make_engine: Callable[..., LLMEngine]) -> Callable[..., LLMEngine]:
    """``make_engine(name="llama_gqa_llama3", **options)``: a jax engine with its own KV cache."""
    return functools.partial(make_engine, framework="jax")


@pytest.mark.parametrize("name", TINY_NAMES)
def test_greedy_matches_transformers(name: str, tiny: dict[str, tuple[Path, Any]]) -> None:
    folder, hf = tiny[name]
    engine = LLMEngine(str(folder), framework="jax", kv_cache_memory_bytes=1 << 22)  # the public path
    assert isinstance(engine.runner, JaxRunner) and engine.runner.framework == "jax"
    prompts = random_prompts(6, 2, 40, seed=1)
    alone = engine.generate(prompts[:1], GREEDY)
    batch = engine.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in batch] == prompts  # input order
    references = [hf_greedy(hf, prompt, NEW_TOKENS)[0] for prompt in prompts]
    assert tokens(alone) == references[:1]
    assert tokens(batch) == references
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("name", TINY_NAMES)
def test_logits_within_1e3_of_transformers(
    name: str, tiny: dict[str, tuple[Path, Any]], loaded: dict[str, tuple[Any, Any, Any]], make_engine: Any
) -> None:
    _, hf = tiny[name]
    model, _, config = loaded[name]
    prompt = random_prompts(1, 30, 30, seed=9)[0]
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0].float().numpy()
    points = layer_outputs(model, config, prompt)
    assert points["logits"].shape == reference.shape and points["logits"].dtype == np.float32
    assert np.abs(points["logits"] - reference).max() < 1e-3
    assert [k for k in points if k.startswith("block.")] == [f"block.{i}" for i in range(config.num_layers)]
    for key in ("embeddings", "final_norm", *(f"block.{i}" for i in range(config.num_layers))):
        assert points[key].shape == (len(prompt), config.hidden_size)
    # the paged runner's logits, through the engine's logprobs of the first sampled token
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    [out] = make_engine(name).generate([prompt], params)
    expected = torch.log_softmax(torch.from_numpy(reference[-1]), -1)
    first = out.outputs[0].logprobs[0]
    for token_id, value in first.items():
        assert abs(value - float(expected[token_id])) < 1e-3


def test_prefix_caching_same_tokens_and_hits(make_engine: Callable[..., LLMEngine]) -> None:
    with_cache, without, cached, plain = with_and_without_prefix_cache(make_engine, GREEDY)
    assert tokens(with_cache) == tokens(without)
    assert cached.get_stats().prefix_cache_hits >= 5 * 40  # later requests reuse the prefix's 5 full blocks
    assert all(o.num_cached_tokens == 40 for o in with_cache[1:])
    assert plain.get_stats().prefix_cache_hits == 0


def test_chunked_prefill_and_preemption_same_tokens(make_engine: Callable[..., LLMEngine]) -> None:
    name = "llama_mqa_tied_linear"  # MQA, tied head, biases: the other tests cover the GQA llama and GPT-2
    prompts = random_prompts(8, 8, 30, seed=5)
    reference = tokens(make_engine(name, block_size=4).generate(prompts, GREEDY))
    chunked = make_engine(name, block_size=4, max_num_batched_tokens=7)
    assert tokens(chunked.generate(prompts, GREEDY)) == reference
    runner = chunked.runner
    assert isinstance(runner, JaxRunner)
    assert {"mixed", "mixed_mirror"} <= {key[0] for key in runner.step_shapes}  # chunks beside decodes
    cfg = chunked.model_config
    per_block = 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 4
    tight = make_engine(name, block_size=4, kv_cache_memory_bytes=24 * per_block)  # 8 x 54 tokens do not fit
    assert tokens(tight.generate(prompts, GREEDY)) == reference
    assert tight.get_stats().num_preemptions > 0
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks


def test_paged_decode_path_same_tokens(make_engine: Callable[..., LLMEngine]) -> None:
    """Without the decode mirror (no room for it) every decode reads the paged cache: the same tokens."""
    prompts = random_prompts(5, 3, 40, seed=11)
    reference = tokens(make_engine().generate(prompts, GREEDY))
    engine = make_engine()
    runner = engine.runner
    assert isinstance(runner, JaxRunner)
    runner.mirror.max_bytes = 0
    runner.mirror.release()
    assert tokens(engine.generate(prompts, GREEDY)) == reference
    assert runner.mirror.arrays is None and any(key[0] == "decode" for key in runner.step_shapes)


def test_mirror_width_follows_the_context_without_refilling(make_engine: Callable[..., LLMEngine]) -> None:
    """The mirror widens in 1.5x/2x steps as contexts grow and narrows when a shorter batch follows, keeping every
    row's keys (no refill from the paged cache after a row's first fill): the same tokens as the paged path."""
    prompts = random_prompts(4, 3, 6, seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    reference = make_engine(block_size=4)
    reference.runner.mirror.max_bytes = 0  # type: ignore[attr-defined]
    expected = tokens(reference.generate(prompts, params))
    engine = make_engine(block_size=4)
    runner = engine.runner
    assert isinstance(runner, JaxRunner)
    widths: list[int] = []
    refills: list[int] = []
    plan, refill = runner.mirror.plan, runner.mirror._refill

    def watched_plan(*args: Any) -> Any:
        result = plan(*args)
        if not widths or widths[-1] != runner.mirror.width:
            widths.append(runner.mirror.width)
        return result

    def counted_refill(seqs: list[Any], *args: Any) -> None:
        refills.append(len(seqs))
        refill(seqs, *args)

    runner.mirror.plan, runner.mirror._refill = watched_plan, counted_refill  # type: ignore[method-assign]
    assert tokens(engine.generate(prompts, params)) == expected
    assert widths == [16, 24, 32]  # blocks of 4 tokens: contexts up to 64, 96 and 128 tokens (106 here)
    assert sum(refills) == len(prompts)  # each row filled once, when its sequence joined
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert tokens(engine.generate(prompts, short)) == [t[:4] for t in expected]
    assert widths[-1] == 16  # narrowed back for the short batch


def test_compilations_stay_bounded(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine("llama_mqa_tied_linear", max_num_seqs=32)
    runner = engine.runner
    assert isinstance(runner, JaxRunner)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    batches = [random_prompts(size, 4, 12, seed=size) for size in range(1, 21)]
    for prompts in batches:  # 20 batch sizes, each a prefill step then decodes
        engine.generate(prompts, params)
    shapes = len(runner.step_shapes)
    assert shapes <= 16, sorted(runner.step_shapes)
    # each shape compiles its pieces (embeddings, one block, logits; fewer where an earlier shape shares them),
    # plus the mirror's refills
    assert runner.num_compilations <= 3 * shapes + 8
    before = runner.num_compilations
    for size in (3, 11, 17):  # shapes already seen (the prompts are shorter than a block: nothing cached)
        engine.generate(batches[size - 1], params)
    assert runner.num_compilations == before


def test_step_widths_and_the_learned_positions_limit() -> None:
    """Tables take power-of-two widths, the decode mirror 1.5x/2x steps; both refuse a position past GPT-2's
    learned ones (blocks of 16 tokens: a 4-block minimum)."""
    builder = StepBuilder(block_size=16, scratch_block=99, max_positions=200)
    assert [builder.width(n) for n in (1, 65, 100, 129, 200)] == [4, 8, 8, 16, 16]
    assert [builder.mirror_width(n) for n in (1, 65, 100, 129, 200)] == [4, 6, 8, 12, 16]
    for width in (builder.width, builder.mirror_width):
        with pytest.raises(ValueError, match="position 200 beyond the model's 200 learned positions"):
            width(201)


def test_layer_group_divides_the_layers() -> None:
    """Layers per compiled call: the largest divisor up to 6, so every call has one shape (SmolLM2's 30 run 5 calls
    of 6; a prime count runs one layer a call)."""
    assert [layer_group(n) for n in (1, 2, 4, 7, 12, 24, 30, 32)] == [1, 2, 4, 1, 6, 6, 6, 4]
    assert layer_group(30, most=1) == 1 and layer_group(30, most=10) == 10


def test_bucket() -> None:
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert bucket(3, 8) == 8 and bucket(0, 1) == 1
    # a lone float32 decode runs one row; bfloat16 products pad it to 8 (their one-row product is the slow one)
    assert [decode_rows(n) for n in (1, 2, 9, 64)] == [1, 8, 16, 64]
    assert [decode_rows(n, single_row=False) for n in (1, 2, 9)] == [8, 8, 16]


@pytest.mark.slow
def test_default_model_same_tokens_as_torch() -> None:
    from app.engine.loading import default_model_path, load_model

    try:
        source = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    model, tokenizer, config = load_model(source)
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options: dict[str, Any] = dict(kv_cache_memory_bytes=1 << 27, max_model_len=512, seed=0)
    torch_engine = LLMEngine.from_loaded(model, tokenizer, config, quantization="none", **options)
    expected = tokens(torch_engine.chat(conversations, params))
    jax_engine = LLMEngine.from_loaded(model, tokenizer, config, framework="jax", **options)
    outputs = jax_engine.chat(conversations, params)
    assert tokens(outputs) == expected
    assert "Paris" in outputs[0].outputs[0].text


@pytest.mark.skipif(not bf16_products_supported(), reason="bfloat16 products need AVX512-BF16 or AMX (the refusal "
                    "elsewhere: tests/unit/engine/test_framework_seam.py)")
def test_bfloat16_products_keep_the_default_models_greedy_text() -> None:
    """dtype bfloat16 rounds only the product weights (the rest stays float32), and SmolLM2's greedy chat answers
    start as float32's do (measured here: all 24 tokens the same; the bound is the first 8, as bfloat16's rounding may
    flip a later near-tie on another CPU's summation order)."""
    from app.engine.frameworks.jax.models import PRODUCT_WEIGHTS

    questions = [[{"role": "user", "content": "What is the capital of France?"}],
                 [{"role": "user", "content": "Write a haiku about the sea."}]]
    answers = {}
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(framework="jax", dtype=dtype, max_model_len=512, kv_cache_memory_bytes=1 << 28)
        assert isinstance(engine.runner, JaxRunner)
        assert engine.runner.builder.single_row is (dtype == "float32")
        params = engine.runner.params
        layer = params["layers"][0]
        expected = "bfloat16" if dtype == "bfloat16" else "float32"
        assert {str(layer[k].dtype) for k in layer if k in PRODUCT_WEIGHTS} == {expected}
        assert str(params["head"].dtype) == expected
        assert str(params["embed"].dtype) == str(layer["ln1"].dtype) == "float32"
        answers[dtype] = tokens(engine.chat(questions, GREEDY))
    assert [a[:8] for a in answers["bfloat16"]] == [a[:8] for a in answers["float32"]]
    assert all(len(a) == NEW_TOKENS for a in answers["bfloat16"])


def test_keep_freed_buffers_takes_on_glibc() -> None:
    """The runner has glibc keep freed buffers for reuse (its mirror resizes and per-step logits otherwise page-fault
    fresh mappings); elsewhere it declines without failing."""
    import platform
    import sys

    from app.engine.frameworks.jax.mirror import keep_freed_buffers

    glibc = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_buffers() is glibc
    assert keep_freed_buffers() is glibc  # once per process (cached), the same answer
