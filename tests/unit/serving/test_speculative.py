"""Speculative decoding through the server's configuration: ``INF_ENGINE_SPECULATIVE_CONFIG`` reaches the
native engine, and its acceptance counters reach ``/metrics`` under vLLM's names."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from app.engine.core.sampling_params import SamplingParams
from app.serving.backends.base import EngineStats, GenerationRequest
from app.serving.backends.native import NativeBackend
from app.serving.metrics import ServingMetrics
from app.settings import Settings
from tests.support.server_helpers import build_tiny_llama

LABELS = 'engine="0",model_name="m"'


def test_speculative_config_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert Settings().speculative_config is None
    monkeypatch.setenv(
        "INF_ENGINE_SPECULATIVE_CONFIG",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}',
    )
    settings = Settings()
    assert settings.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 2,
    }
    backend = NativeBackend.from_settings(settings)
    assert backend.speculative_config == settings.speculative_config


def test_metrics_export_spec_counters_only_when_on() -> None:
    stats = EngineStats(
        spec_decode_enabled=True,
        spec_decode_num_drafts=4,
        spec_decode_num_draft_tokens=12,
        spec_decode_num_accepted_tokens=7,
        spec_decode_num_accepted_tokens_per_pos=(4, 2, 1),
    )
    text = generate_latest(ServingMetrics("m", lambda: stats).registry).decode()
    assert f"vllm:spec_decode_num_drafts_total{{{LABELS}}} 4.0" in text
    assert f"vllm:spec_decode_num_draft_tokens_total{{{LABELS}}} 12.0" in text
    assert f"vllm:spec_decode_num_accepted_tokens_total{{{LABELS}}} 7.0" in text
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{LABELS},position="2"}} 1.0' in text
    off = generate_latest(ServingMetrics("m", EngineStats).registry).decode()
    assert "spec_decode" not in off


async def test_native_backend_speculates_and_reports(tmp_path: Path) -> None:
    folder = build_tiny_llama(tmp_path / "tiny")
    backend = NativeBackend(
        model=str(folder),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        engine_kwargs={"kv_cache_memory_bytes": 1 << 22, "warmup": False, "num_threads": 1},
    )
    await backend.start()
    try:
        assert backend.engine is not None
        assert backend.engine.engine.scheduler.config.num_lookahead_slots == 3
        prompt = list(range(10, 20)) * 4
        request = GenerationRequest(
            request_id="r1",
            params=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
            prompt=prompt,
        )
        tokens: list[int] = []
        async for chunk in await backend.generate(request):
            for delta in chunk.deltas:
                tokens.extend(delta.token_ids)
        assert len(tokens) == 16
        stats = backend.stats()
        assert stats is not None and stats.spec_decode_enabled
        assert stats.spec_decode_num_draft_tokens > 0
        assert len(stats.spec_decode_num_accepted_tokens_per_pos) == 3
    finally:
        await backend.stop()
