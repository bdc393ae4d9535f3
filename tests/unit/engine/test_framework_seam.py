"""The framework option itself: its names, what it refuses, and the one-line error without the extra."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import typer

from app.cli import requirements
from app.engine import frameworks
from app.engine.llm_engine import EngineConfig


def test_the_names_and_a_bad_one() -> None:
    assert frameworks.FRAMEWORKS == ("torch", "jax", "tinygrad")
    with pytest.raises(ValueError, match="framework must be one of torch, jax, tinygrad; got 'mxnet'"):
        EngineConfig(framework="mxnet")


@pytest.mark.parametrize(("option", "message"), [
    ({"dtype": "float16"}, "runs in float32"),
    ({"kv_cache_dtype": "bfloat16"}, "float32 KV cache"),
    ({"quantization": "int8"}, "for the torch framework"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "torch framework only"),
])
def test_what_the_other_frameworks_refuse(option: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(framework="jax", **option)


def test_bfloat16_products_are_jax_only_and_need_the_cpu_for_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """jax's bfloat16 products are accepted where the CPU multiplies bfloat16 natively, refused in one line where
    it does not; tinygrad refuses them everywhere."""
    from app.engine.kernels import cpu_features

    monkeypatch.setattr(cpu_features, "bf16_products_supported", lambda: True)
    config = EngineConfig(framework="jax", dtype="bfloat16")
    assert config.bfloat16_products()
    assert str(config.resolve_dtype(config.resolve_device())) == "torch.float32"  # the weights it copies from
    assert not EngineConfig(framework="jax").bfloat16_products()
    with pytest.raises(ValueError, match="framework 'tinygrad' runs in float32"):
        EngineConfig(framework="tinygrad", dtype="bfloat16")
    monkeypatch.setattr(cpu_features, "bf16_products_supported", lambda: False)
    with pytest.raises(ValueError, match=r"only on a CPU with AVX512-BF16 or AMX.*give dtype 'float32'"):
        EngineConfig(framework="jax", dtype="bfloat16")


def test_float32_on_cpu_is_what_they_run() -> None:
    config = EngineConfig(framework="tinygrad", quantization="none")
    assert str(config.resolve_device()) == "cpu"
    assert str(config.resolve_dtype(config.resolve_device())) == "torch.float32"


def test_without_the_package_the_engine_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def missing(name: str, *args: Any) -> Any:
        if name == "jax":
            raise ImportError("No module named 'jax'")
        return real(name, *args)

    monkeypatch.setattr(frameworks.importlib, "import_module", missing)
    with pytest.raises(frameworks.FrameworkUnavailableError, match=r"pip install 'inf-engine\[jax\]'"):
        frameworks.build_runner("jax", None, None, num_blocks=1, block_size=16, max_model_len=16,  # type: ignore[arg-type]
                                max_num_seqs=1, max_num_batched_tokens=16)


def test_without_the_package_serve_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(requirements, "_installed", lambda module: module != "tinygrad")
    with pytest.raises(typer.Exit) as stopped:
        requirements.require_framework("tinygrad", "serve")
    assert stopped.value.exit_code == 2
    line = capsys.readouterr().err.strip()
    assert line.count("\n") == 0 and "pip install 'inf-engine[tinygrad]'" in line
