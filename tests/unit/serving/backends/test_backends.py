"""Backend plumbing without a model: registry, settings, stop strings, heartbeat rule, proxy payloads."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from app.cli import app as cli
from app.engine.core.sampling_params import SamplingParams
from app.serving.backends import available_backends, create_backend, register_backend
from app.serving.backends.base import GenerationRequest, heartbeat_health
from app.serving.backends.local import StopStringMatcher, default_served_name
from app.serving.backends.openai_proxy import OpenAIProxyBackend, _upstream_error
from app.settings import Settings
from tests.support.serving_fakes import FakeBackend


def test_registry_builds_by_name_and_reports_unknown_names() -> None:
    assert {"native", "transformers", "vllm", "openai"} <= set(available_backends())
    register_backend("fake", lambda settings: FakeBackend(served_model_name="from-registry"))
    assert create_backend(Settings(), "fake").served_model_name == "from-registry"
    with pytest.raises(ValueError, match="unknown backend 'nope'; choose one of"):
        create_backend(Settings(), "nope")
    with pytest.raises(ValueError, match="backend name"):
        register_backend("bad name", lambda s: FakeBackend())


def test_backends_that_miss_settings_say_which() -> None:
    with pytest.raises(ValueError, match="INF_ENGINE_OPENAI_BASE_URL"):
        create_backend(Settings(backend="openai"))
    with pytest.raises(ValueError, match="INF_ENGINE_VLLM_PYTHON"):
        create_backend(Settings(backend="vllm"))
    proxy = create_backend(Settings(backend="openai", openai_base_url="http://h:1/v1/", openai_model="m"))
    assert isinstance(proxy, OpenAIProxyBackend) and proxy.base_url == "http://h:1/v1"
    assert proxy.root_url == "http://h:1" and proxy.served_model_name == "m"


def test_server_settings_are_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = Settings()
    assert (s.serve_host, s.serve_port, s.backend, s.max_waiting) == ("127.0.0.1", 8000, "native", 256)
    for bad, field in (
        ({"serve_port": 70000}, "serve_port"),
        ({"backend": "tgi"}, "backend"),
        ({"max_waiting": 0}, "max_waiting"),
        ({"num_threads": 0}, "num_threads"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"cors_origins": ["ui.example"]}, "cors_origins"),
        ({"openai_base_url": "api.openai.com"}, "openai_base_url"),
        ({"vllm_python": tmp_path / "nope"}, "vllm_python"),
    ):
        with pytest.raises(ValidationError, match=field):
            Settings(**bad)
    monkeypatch.setenv("INF_ENGINE_CORS_ORIGINS", '["http://a.example"]')
    monkeypatch.setenv("INF_ENGINE_BACKEND", "transformers")
    s = Settings()
    assert s.cors_origins == ["http://a.example"] and s.backend == "transformers"


def test_served_names() -> None:
    assert default_served_name("/models/tiny-llama") == "tiny-llama"
    assert default_served_name("/models/SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"
    assert default_served_name("/x", "alias") == "alias"
    assert default_served_name(None) == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize(
    ("stops", "include", "pieces", "emitted", "stopped"),
    [
        (["END"], False, ["abc E", "N", "D tail"], ["abc ", "", ""], "END"),
        (["END"], True, ["abc EN", "D tail"], ["abc ", "END"], "END"),
        (["END"], False, ["abc EN", "X"], ["abc ", "ENX"], None),
        (["ab", "b"], False, ["xxb"], ["xx"], "b"),
        ([], False, ["a", "b"], ["a", "b"], None),
    ],
)
def test_stop_string_matcher(
    stops: list[str], include: bool, pieces: list[str], emitted: list[str], stopped: str | None
) -> None:
    m = StopStringMatcher(stops, include)
    assert [m.feed(p) for p in pieces] == emitted
    assert m.stopped == stopped


def test_stop_string_matcher_flushes_held_text() -> None:
    m = StopStringMatcher(["END"])
    assert m.feed("abc EN") == "abc "
    assert m.flush() == "EN"


def test_heartbeat_rule() -> None:
    assert heartbeat_health(alive=False, has_work=False, last_step=None, stall_seconds=5).ok is False
    assert heartbeat_health(alive=True, has_work=False, last_step=0.0, stall_seconds=5, now=100).ok
    stalled = heartbeat_health(alive=True, has_work=True, last_step=0.0, stall_seconds=5, now=100)
    assert not stalled.ok and "no step" in stalled.detail
    assert heartbeat_health(alive=True, has_work=True, last_step=98.0, stall_seconds=5, now=100).ok


def test_heartbeat_rule_counts_from_the_work_when_no_step_came_since() -> None:
    # never stepped: the clock runs from the work's arrival
    never = heartbeat_health(alive=True, has_work=True, last_step=None, work_since=90.0, stall_seconds=5, now=100)
    assert not never.ok and "no step for 10.0s since its work arrived" in never.detail
    assert "INF_ENGINE_HEALTH_STALL_SECONDS" in never.detail
    assert heartbeat_health(alive=True, has_work=True, last_step=None, work_since=97.0, stall_seconds=5, now=100).ok
    # idle for long, then work arrived a moment ago: not a stall yet
    assert heartbeat_health(alive=True, has_work=True, last_step=0.0, work_since=99.0, stall_seconds=5, now=100).ok
    # steps since the work arrived count
    assert heartbeat_health(alive=True, has_work=True, last_step=99.0, work_since=0.0, stall_seconds=5, now=100).ok
    # no work, no stall however old the marks
    assert heartbeat_health(alive=True, has_work=False, last_step=None, work_since=0.0, stall_seconds=5, now=100).ok


async def test_transformers_backend_health_counts_from_its_first_request() -> None:
    from app.serving.backends.transformers_backend import TransformersBackend

    backend = TransformersBackend(health_stall_seconds=5)
    backend._executor = executor = ThreadPoolExecutor(max_workers=1)  # started, without loading a model
    try:
        assert (await backend.health()).ok  # idle since it was built
        backend._waiting, backend._busy_since = 1, time.monotonic() - 10  # a request waited 10 s, no step yet
        stalled = await backend.health()
        assert not stalled.ok and "since its work arrived" in stalled.detail
        backend._last_step = time.monotonic()
        assert (await backend.health()).ok
    finally:
        executor.shutdown()


def test_generation_request_needs_one_input() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        GenerationRequest("r", SamplingParams())
    with pytest.raises(ValueError, match="exactly one"):
        GenerationRequest("r", SamplingParams(), prompt="a", messages=[])


def test_proxy_payload_sends_vllm_extras_only_when_set() -> None:
    proxy = OpenAIProxyBackend(base_url="http://h/v1", upstream_model="up")
    path, body = proxy.payload(GenerationRequest("r", SamplingParams(max_tokens=5), prompt="hi"))
    assert path == "/completions"
    assert body == {
        "model": "up", "stream": True, "stream_options": {"include_usage": True}, "prompt": "hi",
        "max_tokens": 5, "n": 1, "temperature": 1.0, "top_p": 1.0,
    }  # fmt: skip
    params = SamplingParams(max_tokens=3, top_k=5, min_tokens=1, ignore_eos=True, logprobs=2, stop=["x"], seed=1)
    path, body = proxy.payload(GenerationRequest("r", params, messages=[{"role": "user", "content": "q"}], priority=2))
    assert path == "/chat/completions" and body["max_completion_tokens"] == 3
    assert (body["top_k"], body["min_tokens"], body["ignore_eos"], body["priority"]) == (5, 1, True, 2)
    assert (body["logprobs"], body["top_logprobs"], body["stop"], body["seed"]) == (True, 2, ["x"], 1)


def test_upstream_errors_map_to_our_statuses() -> None:
    body = b'{"error": {"message": "bad top_p", "type": "invalid_request_error", "param": "top_p", "code": null}}'
    err = _upstream_error(400, body, "http://h/v1")
    assert (err.status, err.param, err.message) == (400, "top_p", "bad top_p")
    assert _upstream_error(429, b"slow down", "u").status == 429
    auth = _upstream_error(401, b"{}", "http://h/v1")
    assert auth.status == 502 and "INF_ENGINE_OPENAI_API_KEY" in auth.message
    assert _upstream_error(503, b"", "u").status == 502


def test_cli_serve_help_and_bad_model() -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["serve", "--help"])
    assert result.exit_code == 0 and "--backend" in result.output and "--model" in result.output
    result = runner.invoke(cli, ["serve", "--model", "/does/not/exist"])
    assert result.exit_code == 2 and "does not exist" in result.output
    result = runner.invoke(cli, ["serve", "--backend", "tgi"])
    assert result.exit_code == 2 and "backend" in result.output
