"""``quantization="gguf"``: a GGUF file's own Q4_0/Q4_1 blocks run by the qblock kernel (or, without the C
kernels, PyTorch's int4 CPU matmul), never widened to float: the blocks reproduce the file's values, the model stays close to its float load, and batch invariance and
prefix caching are exact within the mode. Wrong uses are clear errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import app.engine.kernels as kernels
from app.engine import LLMEngine, SamplingParams
from app.engine.loading import apply_quantization, load_model
from app.engine.loading.dequant import Q4_0, Q4_1, dequantize, q4_groups
from app.engine.models.layers import Linear
from tests.support.engine_models import VOCAB, PagedRunner
from tests.support.engine_runtime import random_prompts, with_and_without_prefix_cache

gguf = pytest.importorskip("gguf")
from gguf.quants import quantize  # noqa: E402

from tests.support.gguf_files import Q4_MODEL, write_q4  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=["Q4_0", "Q4_1"])
def q4_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_q4(tmp_path_factory.mktemp(f"q4_{request.param}"), gguf.GGMLQuantizationType[request.param])


@pytest.fixture
def make_q4(q4_file: Path, tmp_path: Path) -> Callable[..., LLMEngine]:
    def make(**kwargs: Any) -> LLMEngine:
        kwargs.setdefault("kv_cache_memory_bytes", 1 << 22)
        return LLMEngine(q4_file, quantization="gguf", model_cache_dir=tmp_path, seed=0, **kwargs)

    return make


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1])
def test_blocks_hold_the_files_values(qtype: int) -> None:
    weights = np.random.default_rng(0).normal(size=(48, 96)).astype(np.float32)
    raw = quantize(weights, gguf.GGMLQuantizationType(qtype))
    codes, scale, zero = q4_groups(raw, qtype, (48, 96))
    assert codes.dtype == np.uint8 and codes.max() <= 15 and scale.shape == zero.shape == (48, 3)
    rebuilt = (codes.astype(np.float32) - 8) * np.repeat(scale, 32, axis=1) + np.repeat(zero, 32, axis=1)
    np.testing.assert_allclose(rebuilt, dequantize(raw, qtype, (48, 96)), rtol=0, atol=1e-6)


@pytest.fixture(params=["qblock", "int4pack"])
def product_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The C qblock kernel (where it builds), or PyTorch's int4 matmul (the path without the C kernels)."""
    if request.param == "qblock" and not kernels.available():
        pytest.skip("the C kernels are not built on this machine")
    kernels.enable(request.param == "qblock")
    try:
        yield request.param
    finally:
        kernels.enable(True)


def test_every_projection_runs_packed_4_bit_close_to_the_float_load(
    q4_file: Path, tmp_path: Path, product_path: str
) -> None:
    float_model, _, config = load_model(q4_file, cache_dir=tmp_path)
    model, _, _ = load_model(q4_file, cache_dir=tmp_path)
    assert apply_quantization(model, "gguf", q4_file) == 4 * config.num_layers
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    qkv = model.layers[0].self_attn.qkv_proj  # type: ignore[index,union-attr]
    if product_path == "qblock":
        assert all(m.weight.dtype == torch.uint8 and m.qweight is not None for m in layers)
        assert qkv.qweight.codes.shape == (qkv.qweight.out_features, 64 // 2)  # two codes per byte
        head = model.lm_head_blocks  # the tiny file's (tied) embedding is in 4-bit blocks too
        assert head is not None and (head.out_features, head.bits) == (VOCAB, 4)
    else:
        assert all(m.weight.dtype == torch.uint8 and m.group_size == 32 for m in layers)
        assert qkv.weight.shape == (qkv.scales.shape[1], 64 // 2)  # [out, in / 2]: two codes per byte
    prompt = torch.randint(3, VOCAB, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = PagedRunner(model, block_size=8).step([(0, prompt)])
    reference = PagedRunner(float_model, block_size=8).step([(0, prompt)])
    # rounded activations are the only difference from the float load of the same blocks: int8 per block of 32
    # (llama.cpp's Q8_1, 7 bits below each block's largest value) or bfloat16 (8 bits of every value)
    tolerance = 0.05 if product_path == "qblock" else 0.02
    assert (ours - reference).abs().max() <= tolerance * reference.abs().max()
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_batch_invariance_and_prefix_caching_are_exact(
    make_q4: Callable[..., LLMEngine], product_path: str
) -> None:
    prompts = random_prompts(8, 2, 40, seed=2)
    batch = tokens(make_q4().generate(prompts, GREEDY))
    alone = [tokens(make_q4().generate([p], GREEDY))[0] for p in prompts[2:5]]
    assert batch[2:5] == alone

    with_cache, without, _, _ = with_and_without_prefix_cache(make_q4, GREEDY, tails=4)
    assert tokens(with_cache) == tokens(without)


def test_an_hf_folder_or_an_already_loaded_model_is_a_clear_error(
    make_engine: Callable[..., LLMEngine], tiny: dict[str, tuple[Path, Any]]
) -> None:
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a \.gguf model file"):
        LLMEngine(tiny[Q4_MODEL][0], quantization="gguf")
    with pytest.raises(ValueError, match=r"load the model from the \.gguf file"):
        make_engine(quantization="gguf")


def test_a_file_without_4_bit_matrices_is_a_clear_error(tmp_path: Path) -> None:
    path = write_q4(tmp_path, gguf.GGMLQuantizationType.F16)
    with pytest.raises(ValueError, match=r"found no Q4_0/Q4_1 matrices it can run in tiny-F16\.gguf"):
        LLMEngine(path, quantization="gguf", model_cache_dir=tmp_path)
