"""Weight-only int8 (``quantization="int8"``): per-channel scales, close to float32, and batch invariance,
prefix caching and preemption exact within the mode."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from app.engine import LLMEngine, SamplingParams
from app.engine.loading import load_model
from app.engine.models.layers import Linear
from app.engine.models.quantization import quantize_model
from tests.support.engine_runtime import random_prompts, with_and_without_prefix_cache

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def int8_loaded(tiny: dict[str, tuple[Path, Any]]) -> tuple[Any, Any, Any]:
    folder, _ = tiny["llama_gqa_llama3"]
    model, tokenizer, config = load_model(folder)
    assert quantize_model(model, "int8") == 4 * config.num_layers
    assert quantize_model(model, "int8") == 0  # idempotent
    return model, tokenizer, config


@pytest.fixture
def make_int8(int8_loaded: tuple[Any, Any, Any]) -> Callable[..., LLMEngine]:
    def make(**kwargs: Any) -> LLMEngine:
        kwargs.setdefault("kv_cache_memory_bytes", 1 << 22)
        kwargs.setdefault("seed", 0)
        return LLMEngine.from_loaded(*int8_loaded, quantization="int8", **kwargs)

    return make


def test_weights_are_int8_with_per_channel_scales(int8_loaded: tuple[Any, Any, Any]) -> None:
    model = int8_loaded[0]
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.weight.dtype == torch.int8 and m.scales is not None for m in layers)
    first = layers[0]
    assert first.scales.shape == (first.weight.shape[0],)
    assert int(first.weight.abs().max()) == 127  # each row uses the full range


def test_product_matches_the_dequantized_weight(tiny: dict[str, tuple[Path, Any]]) -> None:
    layer = Linear(64, 48, bias=True)
    gen = torch.Generator().manual_seed(0)
    layer.weight = torch.nn.Parameter(torch.randn(48, 64, generator=gen), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(48, generator=gen), requires_grad=False)
    reference_weight = layer.weight.clone()
    x = torch.randn(5, 64, generator=gen)
    exact = x @ reference_weight.T + layer.bias
    quantize_model(layer, "int8")
    dequantized = layer.weight.float() * layer.scales.float()[:, None]
    got = layer(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.bfloat16().float() @ dequantized.T + layer.bias, rtol=2e-2, atol=2e-2)
    assert torch.nn.functional.cosine_similarity(got.flatten(), exact.flatten(), dim=0) > 0.999


def test_close_to_float32_and_exact_within_the_mode(
    make_int8: Callable[..., LLMEngine], make_engine: Callable[..., LLMEngine]
) -> None:
    prompts = random_prompts(16, 2, 60, seed=2)
    batch = tokens(make_int8().generate(prompts, GREEDY))
    alone = [tokens(make_int8().generate([p], GREEDY))[0] for p in prompts[4:7]]
    assert batch[4:7] == alone  # batch invariance
    exact = tokens(make_engine().generate(prompts, GREEDY))
    assert sum(a[0] == b[0] for a, b in zip(batch, exact, strict=True)) >= 12

    with_cache, without, _, _ = with_and_without_prefix_cache(make_int8, GREEDY)
    assert tokens(with_cache) == tokens(without)


def test_unknown_quantization_is_a_value_error() -> None:
    from app.engine.llm_engine import EngineConfig

    with pytest.raises(ValueError, match=r"quantization must be None, 'none' or one of \['int8', 'gguf'\], got 'awq'"):
        EngineConfig(quantization="awq")


def test_openmp_only_is_scoped_to_the_step(make_int8: Callable[..., LLMEngine]) -> None:
    """The int8 model runs its kernels on OpenMP during a step; afterwards small kernels use the pool again
    (libgomp does not survive a fork, the pool does)."""
    from app.engine.kernels import library

    engine = make_int8()
    assert engine.runner.openmp_only
    engine.generate(random_prompts(1, 4, 4, seed=9), GREEDY)
    assert library.use_pool(1) == 1
    with library.openmp_only(True):
        assert library.use_pool(1) == 0
    assert library.use_pool(1) == 1
