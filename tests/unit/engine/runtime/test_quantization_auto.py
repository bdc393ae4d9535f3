"""Quantization unset ("auto"): a GGUF model keeps the file's blocks (Q4 layers, Q8_0 head) beside its float32
or bfloat16 weights; steps of few rows run on the blocks (as ``quantization="gguf"``), larger ones on the float
weights (as ``quantization="none"``; beside float32 weights on a CPU with VNNI, as int8 products of them), token
for token. Runs on every CPU class with the C kernels (AVX2 and VNNI
both run the qblock kernel, and bfloat16 weights run everywhere: natively on AVX512-BF16, where they are the
default)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import app.engine.kernels.library as library
from app.engine import LLMEngine, SamplingParams
from app.engine.kernels.matmul import bf16_matmul_supported
from app.engine.kernels.qblock import qblock_isa
from app.engine.models.layers import Linear
from app.engine.models.quantization import (
    AUTO_BLOCK_ROWS,
    AUTO_BLOCK_ROWS_BF16,
    auto_block_rows,
    auto_int8_products,
    check_quantization,
)
from tests.support.engine_runtime import random_prompts

gguf = pytest.importorskip("gguf")
from tests.support.gguf_files import write_q4  # noqa: E402

pytestmark = pytest.mark.skipif(not library.available(), reason="auto keeps blocks only where the C kernels run")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_q4(tmp_path_factory.mktemp("q4_auto"), gguf.GGMLQuantizationType.Q4_1)


def engine(path: Path, tmp: Path, quantization: str | None, dtype: str = "float32") -> LLMEngine:
    return LLMEngine(path, quantization=quantization, dtype=dtype, model_cache_dir=tmp, seed=0,
                     kv_cache_memory_bytes=1 << 22)


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_the_rows_per_cpu_class() -> None:
    assert auto_block_rows("avx2") == AUTO_BLOCK_ROWS["avx2"] == 16 and auto_block_rows("vnni") == 24
    assert auto_block_rows(None) is None
    # beside bfloat16 weights that the CPU multiplies natively, the blocks serve fewer rows
    assert auto_block_rows("vnni", bf16_products=True) == AUTO_BLOCK_ROWS_BF16 == 4
    assert auto_block_rows("avx2", bf16_products=True) == 4 and auto_block_rows(None, bf16_products=True) is None
    for accepted in (None, "none", "int8", "gguf"):
        check_quantization(accepted)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_keeps_both_and_each_step_size_runs_on_its_own(q4_file: Path, tmp_path: Path, dtype: str) -> None:
    auto = engine(q4_file, tmp_path, None, dtype)
    rows = auto_block_rows(qblock_isa(), dtype == "bfloat16" and bf16_matmul_supported())
    assert rows is not None
    model = auto.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.qweight is not None]
    assert linears and all(m.weight.dtype == getattr(torch, dtype) and m.block_rows == rows for m in linears)
    assert model.block_rows == rows
    assert model.lm_head_blocks is not None  # the file's head too, for the same steps
    assert model.lm_head_weight().dtype == getattr(torch, dtype)  # ... and the float one for the others
    # prefill and decode steps within the rows: the blocks
    few = random_prompts(2, 2, 6, seed=1) if rows >= 12 else random_prompts(1, 2, rows, seed=1)
    blocks = engine(q4_file, tmp_path, "gguf", dtype)
    assert tokens(auto.generate(few, GREEDY)) == tokens(blocks.generate(few, GREEDY))
    many = random_prompts(rows + 4, 2, 6, seed=2)  # every step over the rows: the float weights
    plain = engine(q4_file, tmp_path, "none", dtype)
    int8 = dtype == "float32" and auto_int8_products(qblock_isa())
    # ... which, beside float32 weights on a CPU with VNNI, run as int8 products of those weights
    assert all((m.int8 is not None) == int8 for m in linears)
    if int8:  # the same int8 copies (and calibrated channels) on the plain model
        plain_linears = [m for m in plain.runner.model.modules() if isinstance(m, Linear)]
        for ours, theirs in zip([m for m in model.modules() if isinstance(m, Linear)], plain_linears, strict=True):
            assert ours.int8 is not None and ours.int8.outliers is not None  # calibrated at load
            theirs.int8 = ours.int8
        assert model.lm_head_int8 is not None and model.lm_head_int8.outliers is not None  # the head's too
        plain.runner.model.lm_head_int8 = model.lm_head_int8
    assert tokens(auto.generate(many, GREEDY)) == tokens(plain.generate(many, GREEDY))


def test_int8_products_only_where_the_cpu_has_vnni() -> None:
    assert auto_int8_products("vnni") and not auto_int8_products("avx2") and not auto_int8_products(None)


def test_none_keeps_the_float_weights_alone(q4_file: Path, tmp_path: Path) -> None:
    plain = engine(q4_file, tmp_path, "none")
    model = plain.runner.model
    assert model.block_rows is None and model.lm_head_blocks is None
    assert all(m.qweight is None and m.int8 is None for m in model.modules() if isinstance(m, Linear))


def test_an_hf_folder_stays_float(tmp_path: Path) -> None:
    from tests.support.server_helpers import build_tiny_llama

    model = engine(build_tiny_llama(tmp_path / "tiny"), tmp_path, None).runner.model
    assert all(m.qweight is None for m in model.modules() if isinstance(m, Linear))
