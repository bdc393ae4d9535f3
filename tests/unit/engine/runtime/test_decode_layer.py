"""Few-token decode steps run layer by layer in C (app.engine.kernels.decode_layer): the same log-probabilities,
to the bit, as the Python layers, for float32 weights and GGUF blocks, and only where the Python layer would run
the same kernels."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import app.engine.kernels as kernels
from app.engine import LLMEngine, SamplingParams
from app.engine.kernels import decode_layer, matmul
from app.engine.kernels.attention import bf16_attention_supported
from app.engine.kernels.matmul import bf16_matmul_supported
from tests.support.engine_runtime import random_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)


@pytest.fixture
def c_layer_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The row count of every step that ran in C; the switch goes back to the settings' afterwards."""
    steps: list[int] = []
    run = decode_layer.DecodeStepBuffers.run

    def counted(self: decode_layer.DecodeStepBuffers, layers: Any, x: Any) -> Any:
        steps.append(x.shape[0])
        return run(self, layers, x)

    monkeypatch.setattr(decode_layer.DecodeStepBuffers, "run", counted)
    yield steps
    decode_layer.use_decode_layer(None)


def outputs(engine: LLMEngine, prompts: list[list[int]], in_c: bool) -> list[tuple[list[int], Any]]:
    decode_layer.use_decode_layer(in_c)
    done = engine.generate(prompts, PARAMS)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in done]


def assert_c_matches_python(engine: LLMEngine, prompts: list[list[int]], c_layer_steps: list[int]) -> None:
    """The Python layers (no step in C), then the C layer: the same tokens and log-probabilities."""
    c_layer_steps.clear()  # an engine's warm-up step may have run in C
    python = outputs(engine, prompts, in_c=False)
    assert c_layer_steps == []
    assert outputs(engine, prompts, in_c=True) == python


def test_the_setting_runs_the_python_layers(settings_env: Callable[[str, str | None], None]) -> None:
    """INF_ENGINE_DISABLE_DECODE_LAYER=1 (the settings' disable_decode_layer) turns the C layer off, unless a test
    chose with use_decode_layer."""
    settings_env("INF_ENGINE_DISABLE_DECODE_LAYER", "1")
    assert not decode_layer.decode_layer_enabled()
    decode_layer.use_decode_layer(True)
    try:
        assert decode_layer.decode_layer_enabled() == kernels.available()
    finally:
        decode_layer.use_decode_layer(None)
    settings_env("INF_ENGINE_DISABLE_DECODE_LAYER", None)
    assert decode_layer.decode_layer_enabled() == kernels.available()


@pytest.mark.parametrize("count", [1, 2])
def test_float32_steps_match_the_python_layers_bit_for_bit(
    make_engine: Callable[..., LLMEngine], c_layer_steps: list[int], count: int
) -> None:
    engine = make_engine(enable_prefix_caching=False)
    assert_c_matches_python(engine, random_prompts(count, 3, 20, seed=count), c_layer_steps)
    assert c_layer_steps and set(c_layer_steps) <= {1, 2}


def test_float32_steps_of_three_rows_stay_in_python(
    make_engine: Callable[..., LLMEngine], c_layer_steps: list[int]
) -> None:
    """From 3 rows on the Python layer runs oneDNN's products, which the C layer does not: not taken there."""
    engine = make_engine()
    outputs(engine, random_prompts(3, 3, 8, seed=5), in_c=True)
    assert 3 not in c_layer_steps


def test_int8_weights_and_switched_off_kernels_stay_in_python(
    make_engine: Callable[..., LLMEngine], c_layer_steps: list[int]
) -> None:
    prompts = random_prompts(1, 3, 8, seed=6)
    int8 = make_engine("llama_mqa_tied_linear", quantization="int8")
    outputs(int8, prompts, in_c=True)
    assert c_layer_steps == []
    engine = make_engine()
    c_layer_steps.clear()
    kernels.enable(False)
    try:
        outputs(engine, prompts, in_c=True)
    finally:
        kernels.enable(True)
    assert c_layer_steps == []


def test_engines_sharing_a_model_rebuild_the_layers_for_their_own_cache(
    make_engine: Callable[..., LLMEngine], c_layer_steps: list[int]
) -> None:
    """Two engines over one model, used in turns: each binds its own KV cache, and the structs follow it."""
    first, second = make_engine(), make_engine()
    prompts = random_prompts(2, 3, 10, seed=7)
    alone = outputs(make_engine(), prompts, in_c=False)
    for engine in (first, second, first):
        assert outputs(engine, prompts, in_c=True) == alone
    assert c_layer_steps


gguf = pytest.importorskip("gguf")
from tests.support.gguf_files import write_q4  # noqa: E402


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def q4_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    """The blocks under a float32 model, and under a bfloat16 one (bfloat16 KV cache and attention values)."""
    root = tmp_path_factory.mktemp("decode_layer_q4")
    path = write_q4(root, gguf.GGMLQuantizationType.Q4_1)
    return LLMEngine(
        path,
        quantization="gguf",
        dtype=request.param,
        device="cpu",
        model_cache_dir=root,
        seed=0,
        kv_cache_memory_bytes=1 << 22,
        enable_prefix_caching=False,
    )


@pytest.mark.parametrize("count", [1, 2, 5])
def test_gguf_block_steps_match_the_python_layers_bit_for_bit(
    q4_engine: LLMEngine, c_layer_steps: list[int], count: int
) -> None:
    """Blocks run the same kernel at any row count, so batches of a few sequences run in C too. Under a
    bfloat16 model the attention's bfloat16 products run in C only where the CPU has them (AVX512-BF16); the
    Python layer's other route (rounding the query in a copy) stays in Python."""
    if not kernels.available():
        pytest.skip("needs the C kernels")
    assert_c_matches_python(q4_engine, random_prompts(count, 3, 20, seed=10 + count), c_layer_steps)
    model = q4_engine.runner.model
    bf16 = q4_engine.runner.bf16_products
    first = next(iter(model.decode_plan.values()))[0][0]  # the plan of the first block count: (layers, all_blocks)
    expected = not bf16 or decode_layer.bf16_values_supported(first)
    assert (count in c_layer_steps) == expected


def test_a_struct_is_refused_where_a_kernel_would_not_run(tmp_path: Path) -> None:
    """What the Python wrappers check per call, checked once: here a head size the kernels lack."""
    import torch

    hidden, heads, head_dim = 64, 4, 24  # RoPE needs head_dim % 16 == 0
    lin = decode_layer.LayerWeights(torch.zeros(8, 8), None, None)
    layer = decode_layer.DecodeLayer.build(
        norms=(torch.ones(hidden), torch.ones(hidden)),
        eps=1e-5,
        projections=(lin, lin, lin, lin),
        kv_cache=torch.zeros(2, 4, 8, 2, head_dim),
        heads=heads,
        head_dim=head_dim,
        scale=0.2,
    )
    assert layer is None


@pytest.fixture(scope="module", params=[152, 160], ids=["mlp152", "mlp160-fused-swiglu"])
def bf16_engine(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> LLMEngine:
    """bfloat16 weights (packed, bf16_gemm.c), a bfloat16 KV cache and bfloat16 rows between the kernels;
    head_dim 32, which the bfloat16 attention products need. An MLP width of 152 (not a multiple of 32) runs
    the gate_up product, then SwiGLU; 160 runs them fused (bf16_gemm_swiglu)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from app.engine.loading import load_model
    from tests.support.engine_models import VOCAB, save_hf_model

    torch.manual_seed(4321)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=request.param,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    )
    folder = save_hf_model(LlamaForCausalLM(cfg).eval(), tmp_path_factory.mktemp(f"bf16_decode_layer_{request.param}"), None)
    return LLMEngine.from_loaded(
        *load_model(folder, dtype=torch.bfloat16),
        kv_cache_memory_bytes=1 << 22,
        seed=0,
        kv_cache_dtype="bfloat16",
        enable_prefix_caching=False,
    )


@pytest.mark.parametrize("count", [1, 2, 5, 17])
def test_bfloat16_steps_match_the_python_layers_bit_for_bit(
    bf16_engine: LLMEngine, c_layer_steps: list[int], count: int
) -> None:
    """At any batch size both run every product in bf16_gemm.c and keep the rows in bfloat16."""
    if not (kernels.available() and bf16_matmul_supported() and bf16_attention_supported()):
        pytest.skip("needs the C kernels and AVX512-BF16")
    assert_c_matches_python(bf16_engine, random_prompts(count, 3, 20, seed=20 + count), c_layer_steps)
    assert count in c_layer_steps


def test_bfloat16_steps_of_the_few_row_kernel_stay_in_python(
    bf16_engine: LLMEngine, c_layer_steps: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the few-row kernel is given the first rows (BF16_MAX_ROWS > 0), the Python layer runs it and the C
    layer, which runs bf16_gemm.c only, is not taken for those steps."""
    monkeypatch.setattr(matmul, "BF16_MAX_ROWS", 4)
    outputs(bf16_engine, random_prompts(3, 3, 8, seed=30), in_c=True)
    assert 3 not in c_layer_steps


def test_a_fused_gate_up_is_packed_once(bf16_engine: LLMEngine, c_layer_steps: list[int]) -> None:
    """With SwiGLU fused (an MLP width that is a multiple of 32) the C and Python layers share the gate_up
    weight's fused copy, and no plain packed copy of it is made besides."""
    if not (kernels.available() and bf16_matmul_supported() and bf16_attention_supported()):
        pytest.skip("needs the C kernels and AVX512-BF16")
    outputs(bf16_engine, random_prompts(6, 3, 8, seed=40), in_c=True)
    assert 6 in c_layer_steps
    model: Any = bf16_engine.runner.model
    mlp = model.layers[0].mlp
    fused = mlp.intermediate_size % 32 == 0
    assert hasattr(mlp.gate_up_proj.weight, "_inf_bf16_swiglu_packed") == fused
    assert hasattr(mlp.gate_up_proj.weight, "_inf_bf16_gemm_packed") != fused
