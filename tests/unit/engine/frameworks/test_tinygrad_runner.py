"""The tinygrad runner (app.engine.frameworks.tinygrad) on the engine's shared core: token-exact with Hugging Face on
the tiny models (alone and batched, with prefix caching and chunked prefill), logits within 1e-3, bounded TinyJit
captures, and SmolLM2 equal to the torch framework.

tinygrad compiles every kernel with clang on first use, so the engines are built once per module and the prompts are
chosen to share step shapes (buckets): most tests replay captures an earlier one made.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

if importlib.util.find_spec("tinygrad") is None:
    pytest.skip("tinygrad is not installed (pip install 'inf-engine[tinygrad]')", allow_module_level=True)
if shutil.which("clang") is None:
    pytest.skip("tinygrad's CPU device needs clang", allow_module_level=True)

from app.engine import LLMEngine, SamplingParams
from tests.support.engine_models import TINY_NAMES, hf_greedy
from tests.support.engine_runtime import random_prompts

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
KV_BYTES = 1 << 22


@pytest.fixture(scope="module")
def engines(tiny: dict[str, tuple[Path, Any]]) -> dict[str, LLMEngine]:
    """One tinygrad engine per tiny model, through the public constructor (warmup off: the tests compile what they
    use)."""
    return {
        name: LLMEngine(str(folder), framework="tinygrad", kv_cache_memory_bytes=KV_BYTES, seed=0, warmup=False)
        for name, (folder, _) in tiny.items()
    }


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", TINY_NAMES)
def test_greedy_matches_transformers(name: str, tiny: dict[str, tuple[Path, Any]], engines: dict[str, LLMEngine]) -> None:
    _, hf = tiny[name]
    engine = engines[name]
    assert engine.framework == "tinygrad" and engine.runner.framework == "tinygrad"
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    [alone] = engine.generate([random_prompts(1, 13, 13, seed=11)[0]], params)
    batch_prompts = random_prompts(4, 3, 20, seed=12)  # mixed lengths, prefilled together then decoded together
    batch = engine.generate(batch_prompts, params)
    for output in [alone, *batch]:
        prompt = output.prompt_token_ids
        ref, _ = hf_greedy(hf, prompt, NEW_TOKENS)
        assert output.outputs[0].token_ids == ref
        # the engine's logprob of its first token: float32 logits within 1e-3 of transformers'
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
        first = output.outputs[0].logprobs[0]
        assert first[ref[0]] == pytest.approx(float(expected[ref[0]]), abs=1e-3)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("name", TINY_NAMES)
def test_layer_outputs_match_transformers(name: str, tiny: dict[str, tuple[Path, Any]], engines: dict[str, LLMEngine]) -> None:
    from app.engine.frameworks.tinygrad.runner import layer_outputs

    _, hf = tiny[name]
    engine = engines[name]
    ids = random_prompts(1, 16, 16, seed=13)[0]
    ours = layer_outputs(engine.model, engine.model_config, ids)
    layers = engine.model_config.num_layers
    assert set(ours) == {"embeddings", *(f"block.{i}" for i in range(layers)), "final_norm", "logits"}
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    # hidden_states: the embeddings, each block's output, and (last) the final norm of the last block's
    np.testing.assert_allclose(ours["embeddings"], ref.hidden_states[0][0].numpy(), atol=1e-5)
    for i in range(layers - 1):
        np.testing.assert_allclose(ours[f"block.{i}"], ref.hidden_states[i + 1][0].numpy(), atol=1e-4)
    np.testing.assert_allclose(ours["final_norm"], ref.hidden_states[layers][0].numpy(), atol=1e-4)
    assert ours["logits"].dtype == np.float32 and ours["logits"].shape == (16, engine.model_config.vocab_size)
    np.testing.assert_allclose(ours["logits"], ref.logits[0].numpy(), atol=1e-3)


def test_prefix_caching_reuses_blocks_and_keeps_tokens(
    tiny: dict[str, tuple[Path, Any]], engines: dict[str, LLMEngine]
) -> None:
    """Two prompts share a 40-token prefix: the second starts from the first's two full blocks (16 tokens each),
    and both give transformers' tokens (which computes every prompt from scratch)."""
    _, hf = tiny["llama_gqa_llama3"]
    engine = engines["llama_gqa_llama3"]
    shared = random_prompts(1, 40, 40, seed=14)[0]
    first, second = (shared + tail for tail in random_prompts(2, 5, 9, seed=15))
    hits = engine.get_stats().prefix_cache_hits
    [out1] = engine.generate([first], GREEDY)
    [out2] = engine.generate([second], GREEDY)
    assert out2.num_cached_tokens == 32
    assert engine.get_stats().prefix_cache_hits - hits >= 32
    assert tokens([out1, out2]) == [hf_greedy(hf, p, NEW_TOKENS)[0] for p in (first, second)]


def test_chunked_prefill_gives_the_same_tokens(tiny: dict[str, tuple[Path, Any]]) -> None:
    """A step budget of 16 tokens: prompts of 20-40 tokens are prefilled in chunks, beside other sequences'
    decodes."""
    folder, hf = tiny["llama_mqa_tied_linear"]
    engine = LLMEngine(
        str(folder), framework="tinygrad", kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=16, warmup=False
    )
    prompts = random_prompts(3, 20, 40, seed=16)
    outputs = engine.generate(prompts, GREEDY)
    assert tokens(outputs) == [hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]
    assert engine.runner.timings.num_steps > NEW_TOKENS + 3  # the prompts took several steps


def test_compilations_stay_bounded_across_batch_sizes(engines: dict[str, LLMEngine]) -> None:
    """Batches of 1..12 one-token prompts: their step shapes fall in power-of-two buckets, so the captures are a
    handful, and a second pass over the same sizes captures nothing."""
    engine = engines["gpt2"]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def run_all() -> None:
        for n in range(1, 13):
            outputs = engine.generate([[5 + i] for i in range(n)], params)
            assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)

    before = engine.runner.num_compilations
    run_all()
    first_pass = engine.runner.num_compilations - before
    # row buckets 1, 2, 4, 8 and 16, four captures each at most (embeddings, two layers, head)
    assert 0 < first_pass <= 4 * 5
    run_all()
    assert engine.runner.num_compilations - before == first_pass


@pytest.mark.slow
def test_smollm2_greedy_matches_the_torch_framework() -> None:
    """Six chats at once: their prefill and their decodes are split between the runner's two threads (where the
    machine has two cores), and every token equals the torch framework's."""
    from app.engine.loading import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    questions = [
        [{"role": "user", "content": q}]
        for q in (
            "What is the capital of France?",
            "Name three colors.",
            "Write a haiku about the sea.",
            "What is 12 times 12?",
            "Give me a synonym for happy.",
            "Who wrote Hamlet?",
        )
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tiny_engine = LLMEngine(framework="tinygrad", max_model_len=512, warmup=False)
    ours = tokens(tiny_engine.chat(questions, params))
    assert len(tiny_engine.runner.shards) == 1 or tiny_engine.runner.num_split_steps > 0
    del tiny_engine
    # float32 without quantization: the torch framework's precision that is token-exact with transformers
    reference = tokens(LLMEngine(dtype="float32", quantization="none", max_model_len=512).chat(questions, params))
    assert ours == reference


def test_the_compile_cache_works_from_any_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tinygrad's SQLite compile cache, opened on one thread, stays usable on another (the engine compiles on its
    thread after a test or the server's main thread opened the cache)."""
    import threading

    from tinygrad import helpers

    from app.engine.frameworks.tinygrad import tuning

    tuning.configure()
    monkeypatch.setattr(helpers, "CACHEDB", str(tmp_path / "cache.db"))
    errors: list[BaseException] = []
    found: list[Any] = []
    written, done = threading.Event(), threading.Event()

    def put() -> None:  # stays alive until the reader is done, so the two threads have different ids
        try:
            helpers.diskcache_put("inf_engine_test", "k", 41)
        except BaseException as err:  # reported by the assertion below
            errors.append(err)
        written.set()
        done.wait(60)

    def get() -> None:
        try:
            found.append(helpers.diskcache_get("inf_engine_test", "k"))
        except BaseException as err:
            errors.append(err)
        finally:
            done.set()

    writer = threading.Thread(target=put)
    writer.start()
    written.wait(60)
    reader = threading.Thread(target=get)
    reader.start()
    reader.join()
    writer.join()
    assert errors == []
    assert found == [41]
