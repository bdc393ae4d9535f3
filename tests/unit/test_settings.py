"""Settings: env prefix, an optional TOML file, and fail-fast validation."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import Settings, get_settings, settings_error_message


def test_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    settings = Settings()
    assert settings.database_url is None and settings.redis_url is None
    assert settings.api_keys == [] and settings.log_level == "INFO"
    assert settings.node_store_group_commit is True


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


@pytest.mark.parametrize(
    ("value", "keys"),
    [
        ("my-key", ["my-key"]),
        ("a,b", ["a", "b"]),
        ('["a", "b"]', ["a", "b"]),
        (" a , b ,, ", ["a", "b"]),
        ('[" a ", "", "b"]', ["a", "b"]),
        ("", []),
    ],
)
def test_list_settings_take_a_plain_value_a_comma_list_or_json(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str, keys: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("INF_ENGINE_API_KEYS", value)
    assert Settings().api_keys == keys


def test_every_list_setting_takes_a_plain_value(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    fields = [name for name, info in Settings.model_fields.items() if info.annotation == list[str]]
    assert {"api_keys", "cors_origins", "vllm_extra_args"} <= set(fields)
    for name in fields:
        monkeypatch.setenv(f"INF_ENGINE_{name.upper()}", "https://one")
    settings = Settings()
    assert all(getattr(settings, name) == ["https://one"] for name in fields)


def test_vllm_extra_args_are_shell_words(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("INF_ENGINE_VLLM_EXTRA_ARGS", "--max-model-len 4096 --chat-template-content-format 'a b,c'")
    assert Settings().vllm_extra_args == ["--max-model-len", "4096", "--chat-template-content-format", "a b,c"]
    monkeypatch.setenv("INF_ENGINE_VLLM_EXTRA_ARGS", '["--enforce-eager", "--seed=1"]')
    assert Settings().vllm_extra_args == ["--enforce-eager", "--seed=1"]


def test_toml_lists_and_strings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inf-engine.toml").write_text('api_keys = "a, b"\ncors_origins = ["http://x"]\n')
    settings = Settings()
    assert settings.api_keys == ["a", "b"] and settings.cors_origins == ["http://x"]


def _message(**env: str) -> str:
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        with pytest.raises(Exception) as caught:
            Settings()
    message = settings_error_message(caught.value)
    assert message is not None and "\n" not in message
    return message


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"INF_ENGINE_SERVE_PORT": "abc"}, ["INF_ENGINE_SERVE_PORT", "'abc'", "e.g. INF_ENGINE_SERVE_PORT=8000"]),
        ({"INF_ENGINE_LOG_LEVEL": "LOUD"}, ["INF_ENGINE_LOG_LEVEL", "DEBUG, INFO", "e.g. INF_ENGINE_LOG_LEVEL=INFO"]),
        ({"INF_ENGINE_API_KEYS": "[oops"}, ["INF_ENGINE_API_KEYS is not valid JSON", "INF_ENGINE_API_KEYS=a,b"]),
        ({"INF_ENGINE_SPECULATIVE_CONFIG": "ngram"}, ["INF_ENGINE_SPECULATIVE_CONFIG", '{"method": "ngram"']),
        ({"INF_ENGINE_DB_AUTO_UPGRADE": "maybe"}, ["INF_ENGINE_DB_AUTO_UPGRADE", "=true"]),
        ({"INF_ENGINE_CELERY_VISIBILITY_TIMEOUT": "5"}, ["INF_ENGINE_CELERY_VISIBILITY_TIMEOUT"]),
        ({"INF_ENGINE_CONFIG_FILE": "/no/such/file.toml"}, ["INF_ENGINE_CONFIG_FILE", "unset it"]),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_variable_and_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], expected: list[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    message = _message(**env)
    assert all(part in message for part in expected), message


def test_secrets_are_not_repeated_in_the_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    message = _message(INF_ENGINE_OPENAI_BASE_URL="ftp://user:hunter2@host")
    assert "INF_ENGINE_OPENAI_BASE_URL" in message and message.count("hunter2") <= 1  # the validator's own text


def test_a_bad_toml_file_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inf-engine.toml").write_text('serve_port = "abc"\n')
    assert _message().startswith("serve_port in inf-engine.toml:")
    (tmp_path / "inf-engine.toml").write_text('log_level = "unterminated\n')
    assert "inf-engine.toml is not valid TOML" in _message()


def test_other_errors_are_not_settings_errors() -> None:
    assert settings_error_message(ValueError("x")) is None
    assert settings_error_message(FileNotFoundError("x")) is None
