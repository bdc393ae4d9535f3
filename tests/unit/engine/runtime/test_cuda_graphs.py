"""Decode steps from fixed-shape buffers and CUDA graphs (app.engine.cuda_graphs).

On CPU the padded static forward runs eagerly and is checked against the runner's own path; the CUDA tests
(skipped without a GPU) check that replayed graphs give the eager engine's tokens, batch invariance and
prefix-cache equality, in bfloat16 and float32."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from app.engine import LLMEngine, SamplingParams
from app.engine.attention import AttentionMetadata, allocate_kv_cache
from app.engine.cuda_graphs import DecodeGraphRunner, batch_buckets, width_buckets
from app.engine.loading import load_model
from app.engine.model_runner import ModelRunner, StepBatch
from tests.support.engine_runtime import random_prompts, with_and_without_prefix_cache

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def needs_cuda(test: Any) -> Any:
    return pytest.mark.gpu(
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test)
    )


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert width_buckets(5) == [1, 2, 4, 5]


def _decode_batch(contexts: list[int], block_size: int, device: str = "cpu") -> StepBatch:
    """One decode token per sequence; sequence i owns blocks [10 * i, 10 * i + n) (disjoint)."""
    tables = [[10 * i + b for b in range(-(-c // block_size))] for i, c in enumerate(contexts)]
    meta = AttentionMetadata.build([1] * len(contexts), contexts, tables, block_size, device=device)
    ids = torch.tensor([(7 * i + 3) % 300 + 3 for i in range(len(contexts))], device=device)
    positions = torch.tensor([c - 1 for c in contexts], device=device)
    return StepBatch(ids, positions, meta, None, [])


# (device, dtype, logits/K-V tolerance): bfloat16 rounds each product to 8 bits, and a padded batch or a
# wider masked context may pick other GPU kernels, so values move by a few bfloat16 steps
_STATIC_CASES = [
    pytest.param("cpu", "float32", 1e-4, id="cpu-float32"),
    pytest.param("cuda", "float32", 1e-4, id="cuda-float32", marks=pytest.mark.gpu),
    pytest.param("cuda", "bfloat16", 1e-1, id="cuda-bfloat16", marks=pytest.mark.gpu),
]
_BS, _NUM_BLOCKS = 4, 80
_CONTEXTS = [5, 17, 36, 1, 30]  # 5 rows -> bucket 8; 36 tokens = 9 blocks -> width 16


def _prefilled_runner(model: Any, device: str) -> ModelRunner:
    """An eager runner whose blocks hold the K/V of real prefills (sequence i: blocks 10i..10i+8)."""
    runner = ModelRunner(
        model, num_blocks=_NUM_BLOCKS, block_size=_BS, dtype=model.compute_dtype, device=device
    )
    for i in range(7):
        prompt = torch.tensor(random_prompts(1, 36, 36, seed=i)[0], device=device)
        meta = AttentionMetadata.build([36], [36], [[10 * i + b for b in range(9)]], _BS, device=device)
        runner.run(StepBatch(prompt, torch.arange(36, device=device), meta, None, []))
    return runner


@pytest.mark.parametrize(("device", "dtype", "tol"), _STATIC_CASES)
@pytest.mark.parametrize("name", ["llama_gqa_llama3", "llama_mqa_tied_linear", "gpt2"])
def test_static_decode_matches_the_runner(
    tiny: dict[str, tuple[Path, Any]], name: str, device: str, dtype: str, tol: float
) -> None:
    """The padded fixed-shape forward (batch padded to a bucket, context to a width bucket, padding rows
    writing to the scratch block; a replayed CUDA graph on a GPU) gives the runner's eager logits, and leaves
    the real sequences' cache as the runner's own step leaves it. In bfloat16 both are also held to the
    float32 model's logits."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model, _, config = load_model(tiny[name][0], dtype=getattr(torch, dtype), device=device)
    runner = _prefilled_runner(model, device)
    caches = allocate_kv_cache(config, _NUM_BLOCKS + 1, _BS, dtype=model.compute_dtype, device=device)
    for mine, theirs in zip(caches, runner.kv_caches, strict=True):
        mine[:, :_NUM_BLOCKS].copy_(theirs)  # the cache as it was before the decode step
    expected = runner.run(_decode_batch(_CONTEXTS, _BS, device)).float()
    cache_after = [c.clone() for c in runner.kv_caches]

    model.bind_kv_cache(caches)
    static = DecodeGraphRunner(
        model, block_size=_BS, max_batch=8, max_blocks=16, sink_block=_NUM_BLOCKS, use_graphs=device == "cuda"
    )
    batch = _decode_batch(_CONTEXTS, _BS, device)
    assert static.fits(batch.attn)
    got = static.run(batch.input_ids, batch.positions, batch.attn).float()
    assert static.num_graphs == (1 if device == "cuda" else 0)
    assert got.shape == expected.shape
    if dtype != "float32":
        exact, _, _ = load_model(tiny[name][0], dtype=torch.float32, device=device)
        ref = _prefilled_runner(exact, device).run(_decode_batch(_CONTEXTS, _BS, device))
        errors = {k: (v - ref).abs().amax(-1).tolist() for k, v in (("eager", expected), ("graph", got))}
        assert all(e < 4 * tol for row in errors.values() for e in row), errors
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol  # rows whose best token is not a near tie
    assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
    for mine, theirs in zip(caches, cache_after, strict=True):
        torch.testing.assert_close(mine[:, :_NUM_BLOCKS], theirs, rtol=tol, atol=tol)


def test_fits_only_decode_steps_within_the_shapes(tiny: dict[str, tuple[Path, Any]]) -> None:
    model, _, _ = load_model(tiny["llama_gqa_llama3"][0])
    static = DecodeGraphRunner(model, block_size=4, max_batch=4, max_blocks=8, sink_block=0, use_graphs=False)
    assert static.fits(_decode_batch([3, 9], 4).attn)
    assert not static.fits(_decode_batch([3] * 5, 4).attn)  # more rows than the largest capture
    assert not static.fits(_decode_batch([33], 4).attn)  # 9 blocks of context > 8
    assert not static.fits(AttentionMetadata.build([3], [3], [[0]], 4))  # a prefill


def test_enforce_eager_reaches_the_runner(
    make_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine asks its runner for graphs unless ``enforce_eager``; the setting maps onto it. (On CPU the
    runner then has none: there is nothing to replay.)"""
    import app.engine.llm_engine as llm_engine
    from app.settings import Settings

    asked: list[bool] = []

    class Recording(ModelRunner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            asked.append(kwargs["cuda_graphs"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(llm_engine, "ModelRunner", Recording)
    assert make_engine().runner.graphs is None
    make_engine(enforce_eager=True)
    assert asked == [True, False]
    assert Settings(enforce_eager=True).enforce_eager is True and Settings().enforce_eager is False


# ---- on a GPU -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_loaded(tiny: dict[str, tuple[Path, Any]]) -> dict[tuple[str, str], tuple[Any, Any, Any]]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    out = {}
    for name in ("llama_gqa_llama3", "gpt2"):
        for dtype in ("bfloat16", "float32"):
            out[(name, dtype)] = load_model(tiny[name][0], device="cuda", dtype=getattr(torch, dtype))
    return out


def _cuda_engine(loaded: dict, name: str, dtype: str, **kwargs: Any) -> LLMEngine:
    kwargs.setdefault("kv_cache_memory_bytes", 1 << 24)
    kwargs.setdefault("seed", 0)
    kwargs.setdefault("max_num_seqs", 32)
    return LLMEngine.from_loaded(*loaded[(name, dtype)], **kwargs)


@needs_cuda
@pytest.mark.parametrize("name", ["llama_gqa_llama3", "gpt2"])
def test_graphs_give_the_eager_tokens(cuda_loaded: dict, name: str) -> None:
    """Token-exact in float32 (bfloat16 is checked step by step above: a padded batch may pick other
    kernels, and one bfloat16 step of difference flips a tiny random model's near ties)."""
    dtype = "float32"
    prompts = random_prompts(24, 3, 60, seed=11)
    graphed = _cuda_engine(cuda_loaded, name, dtype)
    eager = _cuda_engine(cuda_loaded, name, dtype, enforce_eager=True)
    got = tokens(graphed.generate(prompts, GREEDY))
    assert got == tokens(eager.generate(prompts, GREEDY))
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.num_graphs >= 2 and graphs.replays >= GREEDY.max_tokens - 1


@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_graphs_are_batch_invariant(cuda_loaded: dict, dtype: str) -> None:
    prompts = random_prompts(9, 4, 40, seed=12)
    engine = _cuda_engine(cuda_loaded, "llama_gqa_llama3", dtype)
    together = tokens(engine.generate(prompts, GREEDY))
    alone = [tokens(engine.generate([p], GREEDY))[0] for p in prompts]
    assert together == alone


@needs_cuda
def test_graphs_with_and_without_prefix_cache(cuda_loaded: dict) -> None:
    def make(**kwargs: Any) -> LLMEngine:
        return _cuda_engine(cuda_loaded, "llama_gqa_llama3", "bfloat16", **kwargs)

    with_cache, without, _, _ = with_and_without_prefix_cache(make, GREEDY)
    assert tokens(with_cache) == tokens(without)
    assert all(o.num_cached_tokens == 40 for o in with_cache[1:])


@needs_cuda
def test_graphs_follow_the_engine_through_preemption(cuda_loaded: dict) -> None:
    """A cache too small for the batch forces preemption and recompute; tokens still match eager."""
    prompts = random_prompts(12, 20, 40, seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    small = {"kv_cache_memory_bytes": 1 << 18, "block_size": 8}
    graphed = _cuda_engine(cuda_loaded, "llama_gqa_llama3", "float32", **small)
    eager = _cuda_engine(cuda_loaded, "llama_gqa_llama3", "float32", enforce_eager=True, **small)
    assert tokens(graphed.generate(prompts, params)) == tokens(eager.generate(prompts, params))
