"""The bfloat16 engine on CPU: bfloat16 weights and products, float32 activations, a bfloat16 KV cache read by
the C attention kernel; batch invariance, prefix caching and preemption stay exact; how ``dtype="auto"`` and
``kv_cache_dtype`` resolve, with and without AVX512-BF16."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import app.engine.kernels.cpu_features as cpu_features
from app.engine import LLMEngine, SamplingParams
from app.engine.kernels.attention import bf16_attention_supported
from app.engine.loading import checkpoint_dtype, load_model
from tests.support.engine_runtime import random_prompts, with_and_without_prefix_cache

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

# Every test runs on every CPU: with AVX512-BF16 the products run in our kernels, elsewhere through PyTorch
# (oneDNN or its reference path), and the assertions hold on both paths.


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def bf16_loaded(tiny: dict[str, tuple[Path, Any]]) -> tuple[Any, Any, Any]:
    folder, _ = tiny["llama_gqa_llama3"]
    return load_model(folder, dtype=torch.bfloat16)


@pytest.fixture
def make_bf16(bf16_loaded: tuple[Any, Any, Any]) -> Callable[..., LLMEngine]:
    def make(**kwargs: Any) -> LLMEngine:
        kwargs.setdefault("kv_cache_memory_bytes", 1 << 22)
        kwargs.setdefault("seed", 0)
        kwargs.setdefault("kv_cache_dtype", "bfloat16")  # the harder case: new K/V rounded before attention
        return LLMEngine.from_loaded(*bf16_loaded, **kwargs)

    return make


def test_layout_and_cache_dtype(
    make_bf16: Callable[..., LLMEngine], make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_bf16(kv_cache_dtype="auto")
    model = engine.runner.model
    assert engine.dtype == torch.bfloat16 and model.compute_dtype == torch.float32
    # auto: bfloat16 where the attention reads bfloat16 values (AVX512-BF16), else the activations' dtype
    assert engine.kv_cache_dtype == (torch.bfloat16 if bf16_attention_supported() else torch.float32)
    kept = make_bf16(kv_cache_dtype="float32")
    assert kept.kv_cache_dtype == torch.float32
    halved = make_bf16(kv_cache_dtype="bfloat16")
    assert halved.kv_cache_dtype == torch.bfloat16 and halved.runner.kv_caches[0].dtype == torch.bfloat16
    # half the bytes per block: twice the blocks for the same budget
    assert halved.block_manager.num_blocks == 2 * make_engine().block_manager.num_blocks


def test_close_to_float32(make_bf16: Callable[..., LLMEngine], make_engine: Callable[..., LLMEngine]) -> None:
    prompts = random_prompts(8, 4, 40, seed=11)
    ours = tokens(make_bf16().generate(prompts, GREEDY))
    exact = tokens(make_engine().generate(prompts, GREEDY))
    first = [a[0] == b[0] for a, b in zip(ours, exact, strict=True)]
    assert sum(first) >= 6  # a random tiny model has near-ties; most first tokens still agree


def test_batch_invariance(make_bf16: Callable[..., LLMEngine]) -> None:
    prompts = random_prompts(16, 2, 60, seed=2)
    alone = [tokens(make_bf16().generate([p], GREEDY))[0] for p in prompts[4:7]]
    batch = tokens(make_bf16().generate(prompts, GREEDY))
    assert batch[4:7] == alone


def test_prefix_caching_and_preemption_same_tokens(make_bf16: Callable[..., LLMEngine]) -> None:
    with_cache, without, _, _ = with_and_without_prefix_cache(make_bf16, GREEDY)
    assert tokens(with_cache) == tokens(without)
    assert all(o.num_cached_tokens == 40 for o in with_cache[1:])

    roomy = make_bf16(block_size=4)
    cfg = roomy.model_config
    per_block = 2 * cfg.num_layers * 4 * cfg.num_kv_heads * cfg.head_dim * 2  # bfloat16
    tight = make_bf16(block_size=4, kv_cache_memory_bytes=24 * per_block)
    assert tight.block_manager.num_blocks == 24
    many = random_prompts(8, 8, 20, seed=5)
    assert tokens(tight.generate(many, GREEDY)) == tokens(roomy.generate(many, GREEDY))
    assert tight.get_stats().num_preemptions > 0


def test_auto_dtype_follows_checkpoint_and_cpu(
    tiny: dict[str, tuple[Path, Any]],
    monkeypatch: pytest.MonkeyPatch,
    settings_env: Callable[[str, str | None], None],
) -> None:
    from app.engine.llm_engine import EngineConfig

    folder, _ = tiny["llama_gqa_llama3"]
    cpu = torch.device("cpu")
    assert checkpoint_dtype(folder) == torch.float32  # the tiny checkpoints are saved in float32
    assert EngineConfig().resolve_dtype(cpu, torch.float32) == torch.float32
    assert checkpoint_dtype() == torch.bfloat16  # the default model is a GGUF file
    # a CPU with AVX512-BF16 (and torch's oneDNN) runs a 16-bit checkpoint in bfloat16, whatever this one has
    if cpu_features.onednn_linear_op() is not None:
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
        assert EngineConfig().resolve_dtype(cpu, torch.bfloat16) == torch.bfloat16
        assert EngineConfig().resolve_dtype(cpu, torch.float16) == torch.bfloat16
        assert EngineConfig(dtype="float32").resolve_dtype(cpu, torch.bfloat16) == torch.float32
    # an AVX2-only CPU (no AVX512-BF16 flag) falls back to float32
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert EngineConfig().resolve_dtype(cpu, torch.bfloat16) == torch.float32
    monkeypatch.undo()
    settings_env("INF_ENGINE_DISABLE_BF16", "1")  # the operator's switch to the float32 path
    assert EngineConfig().resolve_dtype(cpu, torch.bfloat16) == torch.float32


def test_kv_cache_dtype_is_validated() -> None:
    from app.engine.llm_engine import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto', 'float32' or 'bfloat16'"):
        EngineConfig(kv_cache_dtype="fp8")


def test_logits_are_float32_sums_the_same_for_a_row_in_any_batch(make_bf16: Callable[..., LLMEngine]) -> None:
    """With AVX512-BF16 the bfloat16 head runs in bf16_gemm.c at every row count and its logits keep float32
    sums (no bfloat16 rounding, so no ties to refine): a row's logits are the same bits alone and in a batch.
    Elsewhere the product comes from oneDNN in bfloat16 (only tied row maxima are refined to float32)."""
    from app.engine.kernels.matmul import bf16_gemm, bf16_matmul_supported

    model = make_bf16().runner.model
    head = model.lm_head_weight()
    hidden = torch.randn(12, head.shape[1], generator=torch.Generator().manual_seed(0))
    few = model.compute_logits(hidden[:2])
    many = model.compute_logits(hidden)
    assert few.dtype == many.dtype == torch.float32
    torch.testing.assert_close(few, many[:2], rtol=2e-2, atol=5e-2)
    if bf16_matmul_supported():
        assert torch.equal(few, many[:2])
        assert torch.equal(many, bf16_gemm(hidden.bfloat16(), head, out_f32=True))
        assert not torch.equal(many, many.bfloat16().float())
    else:
        assert (many == many.bfloat16().float()).float().mean() > 0.99
