"""The native engine's eviction policy, prefix-cache TTL and batching strategy through the server: chosen by
``INF_ENGINE_*`` settings, and the prefix cache's hits, misses and evictions on ``/metrics`` per policy."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from api.main import create_app
from app.serving.backends.base import EngineStats
from app.serving.backends.native import NativeBackend
from app.serving.metrics import ServingMetrics
from app.settings import Settings, settings_error_message
from tests.support.server_helpers import build_tiny_llama, make_backend

LABELS = 'engine="0",model_name="m"'


def test_settings_choose_the_policies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    defaults = Settings()
    assert (defaults.kv_cache_eviction_policy, defaults.prefix_cache_ttl_s) == ("lru", None)
    assert (defaults.batching_strategy, defaults.batching_bucket_size) == ("continuous", 128)
    monkeypatch.setenv("INF_ENGINE_KV_CACHE_EVICTION_POLICY", "lfu")
    monkeypatch.setenv("INF_ENGINE_PREFIX_CACHE_TTL_S", "300")
    monkeypatch.setenv("INF_ENGINE_BATCHING_STRATEGY", "memory_aware")
    monkeypatch.setenv("INF_ENGINE_BATCHING_BUCKET_SIZE", "64")
    monkeypatch.setenv("INF_ENGINE_DTYPE", "bfloat16")
    monkeypatch.setenv("INF_ENGINE_KV_CACHE_DTYPE", "float32")
    monkeypatch.setenv("INF_ENGINE_QUANTIZATION", "int8")
    monkeypatch.setenv("INF_ENGINE_ENFORCE_EAGER", "true")
    monkeypatch.setenv("INF_ENGINE_MAX_MODEL_LEN", "2K")  # vLLM's shorthand: 2048
    monkeypatch.setenv("INF_ENGINE_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("INF_ENGINE_MAX_NUM_BATCHED_TOKENS", "512")
    monkeypatch.setenv("INF_ENGINE_BLOCK_SIZE", "32")
    monkeypatch.setenv("INF_ENGINE_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("INF_ENGINE_SEED", "3")
    monkeypatch.setenv("INF_ENGINE_CHAT_TEMPLATE", "{{ messages[0]['content'] }}")
    backend = NativeBackend.from_settings(Settings())
    assert backend.chat_template == "{{ messages[0]['content'] }}"
    assert backend.engine_kwargs == {
        "kv_cache_eviction_policy": "lfu",
        "prefix_cache_ttl_s": 300.0,
        "batching_strategy": "memory_aware",
        "batching_bucket_size": 64,
        "dtype": "bfloat16",
        "kv_cache_dtype": "float32",
        "quantization": "int8",
        "enforce_eager": True,
        "framework": "torch",
        "max_model_len": 2048,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "block_size": 32,
        "enable_prefix_caching": False,
        "seed": 3,
    }


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("INF_ENGINE_KV_CACHE_EVICTION_POLICY", "random"),
        ("INF_ENGINE_PREFIX_CACHE_TTL_S", "0"),
        ("INF_ENGINE_BATCHING_STRATEGY", "static"),
        ("INF_ENGINE_DTYPE", "float64"),
        ("INF_ENGINE_QUANTIZATION", "awq"),
    ],
)
def test_bad_settings_name_the_variable(
    variable: str, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(variable, value)
    with pytest.raises(Exception) as info:
        Settings()
    assert variable in settings_error_message(info.value)


def test_metrics_export_prefix_cache_counts_per_policy() -> None:
    stats = EngineStats(
        prefix_cache_queries=100,
        prefix_cache_hits=64,
        eviction_policy="fifo",
        prefix_cache_evictions=7,
        prefix_cache_expirations=2,
    )
    text = generate_latest(ServingMetrics("m", lambda: stats).registry).decode()
    by_policy = f'{LABELS},policy="fifo"'
    assert f"inf_engine_prefix_cache_queries_total{{{by_policy}}} 100.0" in text
    assert f"inf_engine_prefix_cache_hits_total{{{by_policy}}} 64.0" in text
    assert f"inf_engine_prefix_cache_misses_total{{{by_policy}}} 36.0" in text
    assert f'inf_engine_prefix_cache_evictions_total{{{by_policy},reason="capacity"}} 7.0' in text
    assert f'inf_engine_prefix_cache_evictions_total{{{by_policy},reason="ttl"}} 2.0' in text
    # A backend that does not report a policy (vLLM, transformers) exports none of these series.
    off = generate_latest(ServingMetrics("m", EngineStats).registry).decode()
    assert "inf_engine_prefix_cache" not in off


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the one series of ``name`` whose labels include ``labels``."""
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.startswith(name + "{") and all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"no {name} {labels} in /metrics")


@pytest.mark.parametrize("policy", ["lfu", "fifo"])
def test_native_server_reports_hits_and_evictions_of_its_policy(policy: str, tmp_path: Path) -> None:
    folder = build_tiny_llama(tmp_path / "tiny")
    # 12 blocks of 4 tokens (the tiny Llama's KV is 2 KiB a block): too few to keep every prefix cached.
    backend = make_backend(
        "native",
        folder,
        kv_cache_memory_bytes=12 * 2048,
        block_size=4,
        num_threads=1,
        kv_cache_eviction_policy=policy,
    )
    prefixes = [list(range(10 + 16 * i, 26 + 16 * i)) for i in range(3)]
    with TestClient(create_app(Settings(), backend=backend)) as client:
        for i, which in enumerate((0, 0, 1, 1, 2, 2, 0, 0, 1)):  # repeats hit, switching evicts
            body = {"prompt": [*prefixes[which], 300 + i], "max_tokens": 2, "ignore_eos": True}
            assert client.post("/v1/completions", json=body).status_code == 200
        text = client.get("/metrics").text
    queries = metric(text, "inf_engine_prefix_cache_queries_total", policy=policy)
    hits = metric(text, "inf_engine_prefix_cache_hits_total", policy=policy)
    misses = metric(text, "inf_engine_prefix_cache_misses_total", policy=policy)
    evicted = metric(text, "inf_engine_prefix_cache_evictions_total", policy=policy, reason="capacity")
    assert queries == 9 * 17 and hits + misses == queries
    assert hits == metric(text, "vllm:prefix_cache_hits_total") and hits > 0
    assert evicted > 0
    assert metric(text, "inf_engine_prefix_cache_evictions_total", policy=policy, reason="ttl") == 0
    assert 'policy="lru"' not in text


def test_vllm_gets_the_engine_flags_under_its_own_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.serving.backends.vllm import vllm_engine_args

    monkeypatch.chdir(tmp_path)
    assert vllm_engine_args(Settings()) == []  # vLLM keeps its own defaults
    chosen = Settings(dtype="half", max_model_len="4k", max_num_seqs=8, max_num_batched_tokens=1024, block_size=32,
                      enable_prefix_caching=False, chat_template="t.jinja", seed=1, enforce_eager=True,
                      kv_cache_dtype="bfloat16", quantization="int8")
    assert vllm_engine_args(chosen) == [
        "--dtype", "float16", "--kv-cache-dtype", "bfloat16", "--max-model-len", "4000",
        "--max-num-batched-tokens", "1024", "--seed", "1", "--max-num-seqs", "8", "--block-size", "32",
        "--no-enable-prefix-caching", "--chat-template", "t.jinja", "--enforce-eager"]
