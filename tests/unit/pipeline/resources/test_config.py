"""EndpointConfig and ResourceConfig: construction, validation, API keys and files."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from app.pipeline.resources import ConfigurationError, EndpointConfig, ResourceConfig

pytestmark = pytest.mark.timeout(15)


def test_positional_and_keyword_construction_are_equal() -> None:
    a = EndpointConfig("openai", "gpt-4o")
    b = EndpointConfig(provider="openai", model="gpt-4o")
    assert a == b
    assert a.max_retries == 3 and a.timeout == 300.0 and a.rate_limit is None
    c = EndpointConfig("vllm", "llama", base_url="http://127.0.0.1:8000/v1/", max_concurrent=4, rate_limit=60)
    assert c.base_url == "http://127.0.0.1:8000/v1"  # trailing slash dropped
    assert c.max_concurrent == 4 and c.rate_limit == 60


def test_provider_is_checked_and_normalised() -> None:
    assert EndpointConfig("Anthropic", "claude").provider == "anthropic"
    with pytest.raises(ValueError, match="openai, vllm, native, anthropic"):
        EndpointConfig("bedrock", "x")


def test_duplicate_positional_and_keyword_is_an_error() -> None:
    with pytest.raises(TypeError, match="provider"):
        EndpointConfig("openai", provider="vllm", model="m")  # type: ignore[misc]


@pytest.mark.parametrize(
    "field,value",
    [("max_concurrent", 0), ("rate_limit", 0), ("timeout", 0), ("max_retries", -1), ("input_cost_per_1m", -1)],
)
def test_bad_numbers_are_rejected(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        EndpointConfig("openai", "m", **{field: value})


def test_unknown_field_and_bad_url_are_rejected() -> None:
    with pytest.raises(ValueError, match="rate_limt"):
        EndpointConfig("openai", "m", rate_limt=10)
    with pytest.raises(ValueError, match="http://"):
        EndpointConfig("vllm", "m", base_url="localhost:8000")


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_TEST_API_KEY", "sk-secret")
    for ref in ("MY_TEST_API_KEY", "$MY_TEST_API_KEY", "${MY_TEST_API_KEY}", "env:MY_TEST_API_KEY"):
        assert EndpointConfig("openai", "m", api_key=ref).resolved_api_key() == "sk-secret"


def test_api_key_unset_variable_tells_the_user_to_export_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MISSING_TEST_KEY", raising=False)
    for ref in ("MISSING_TEST_KEY", "$MISSING_TEST_KEY", "env:MISSING_TEST_KEY"):
        with pytest.raises(ConfigurationError, match="export MISSING_TEST_KEY"):
            EndpointConfig("openai", "m", api_key=ref).resolved_api_key()


def test_api_key_literal_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMPTY", raising=False)
    assert EndpointConfig("openai", "m", api_key="sk-abc123").resolved_api_key() == "sk-abc123"
    assert EndpointConfig("vllm", "m", api_key="EMPTY").resolved_api_key() == "EMPTY"  # vLLM's dummy key
    assert EndpointConfig("openai", "m").resolved_api_key() is None
    assert "sk-abc123" not in repr(EndpointConfig("openai", "m", api_key="sk-abc123"))


def test_resource_config_is_a_read_only_mapping_of_lists() -> None:
    cfg = ResourceConfig(
        {
            "fast": EndpointConfig("openai", "gpt-4o-mini"),
            "pool": [{"model": "a", "base_url": "http://h1/v1"}, EndpointConfig("vllm", "b", base_url="http://h2/v1")],
        }
    )
    assert isinstance(cfg, Mapping)
    assert list(cfg) == ["fast", "pool"] and len(cfg) == 2
    assert cfg["fast"] == [EndpointConfig("openai", "gpt-4o-mini")]
    assert [e.provider for e in cfg["pool"]] == ["openai", "vllm"]  # dicts default to openai
    cfg["pool"].clear()  # a copy: the configuration is unchanged
    assert len(cfg["pool"]) == 2
    assert not hasattr(cfg, "__setitem__")
    assert cfg.load_balancing == "round_robin"


def test_resource_config_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="round_robin, least_loaded, random"):
        ResourceConfig({}, load_balancing="fastest")
    with pytest.raises(ConfigurationError, match="empty endpoint list"):
        ResourceConfig({"a": []})
    with pytest.raises(ConfigurationError, match="alias 'a'"):
        ResourceConfig({"a": {"provider": "nope", "model": "m"}})
    with pytest.raises(ConfigurationError, match="'a'"):
        ResourceConfig({"a": 42})  # type: ignore[dict-item]


def test_from_dict_with_and_without_endpoints_key() -> None:
    a = ResourceConfig.from_dict({"endpoints": {"x": {"model": "m"}}, "load_balancing": "random"})
    b = ResourceConfig.from_dict({"x": {"model": "m"}, "load_balancing": "random"})
    assert a == b and a.load_balancing == b.load_balancing == "random"
    with pytest.raises(ConfigurationError, match="unknown top-level keys"):
        ResourceConfig.from_dict({"endpoints": {}, "extra": 1})
    assert ResourceConfig.from_dict(a.to_dict()) == a


def test_from_toml_tables_and_arrays(tmp_path: Path) -> None:
    path = tmp_path / "resources.toml"
    path.write_text(
        """
load_balancing = "least_loaded"

[endpoints.fast]
provider = "openai"
model = "gpt-4o-mini"
api_key = "OPENAI_API_KEY"
rate_limit = 500

[[endpoints.local]]
provider = "vllm"
model = "llama"
base_url = "http://127.0.0.1:8000/v1"
max_concurrent = 8

[[endpoints.local]]
provider = "vllm"
model = "llama"
base_url = "http://127.0.0.1:8001/v1"
"""
    )
    cfg = ResourceConfig.from_file(path)
    assert cfg.load_balancing == "least_loaded"
    assert cfg["fast"][0].rate_limit == 500 and cfg["fast"][0].api_key == "OPENAI_API_KEY"
    assert [e.base_url for e in cfg["local"]] == ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1"]


def test_from_yaml_top_level_aliases(tmp_path: Path) -> None:
    path = tmp_path / "resources.yml"
    path.write_text(
        "fast:\n  model: gpt-4o-mini\npool:\n  - {provider: vllm, model: a, base_url: 'http://h1/v1'}\n"
        "  - {provider: vllm, model: b, base_url: 'http://h2/v1'}\n"
    )
    cfg = ResourceConfig.from_file(str(path))
    assert cfg["fast"][0].provider == "openai"
    assert [e.model for e in cfg["pool"]] == ["a", "b"]


def test_from_file_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"\.toml, \*\.yaml"):
        ResourceConfig.from_file(tmp_path / "resources.json")
    with pytest.raises(ConfigurationError, match="does not exist"):
        ResourceConfig.from_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[endpoints.x\nmodel=")
    with pytest.raises(ConfigurationError, match="cannot parse"):
        ResourceConfig.from_file(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert len(ResourceConfig.from_file(empty)) == 0
