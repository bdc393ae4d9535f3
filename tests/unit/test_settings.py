"""Settings: env prefix, an optional TOML file, and fail-fast validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import Settings, get_settings


def test_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    settings = Settings()
    assert settings.database_url is None and settings.redis_url is None
    assert settings.api_keys == [] and settings.log_level == "INFO"


def test_environment_overrides_toml_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "custom.toml"
    config.write_text('log_level = "debug"\nredis_url = "redis://127.0.0.1:6379/1"\napi_keys = ["a", "b"]\n')
    monkeypatch.setenv("INF_ENGINE_CONFIG_FILE", str(config))
    monkeypatch.setenv("INF_ENGINE_REDIS_URL", "redis://127.0.0.1:6379/2")
    settings = Settings()
    assert settings.log_level == "DEBUG"
    assert settings.redis_url == "redis://127.0.0.1:6379/2"
    assert settings.api_keys == ["a", "b"]


def test_toml_in_working_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inf-engine.toml").write_text("default_max_concurrent = 7\n")
    assert Settings().default_max_concurrent == 7


def test_bad_values_fail_fast_with_the_field_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("INF_ENGINE_LOG_LEVEL", "loud")
    with pytest.raises(ValidationError, match="log_level"):
        Settings()
    monkeypatch.delenv("INF_ENGINE_LOG_LEVEL")
    monkeypatch.setenv("INF_ENGINE_DEFAULT_MAX_CONCURRENT", "0")
    with pytest.raises(ValidationError, match="default_max_concurrent"):
        Settings()


def test_missing_named_config_file_is_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("INF_ENGINE_CONFIG_FILE", str(tmp_path / "nope.toml"))
    with pytest.raises(FileNotFoundError, match=r"nope\.toml"):
        Settings()


def test_get_settings_is_cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    get_settings.cache_clear()
    assert get_settings() is get_settings()
    get_settings.cache_clear()
