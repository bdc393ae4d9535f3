"""The one settings object of inf-engine.

Values come from, highest first: keyword arguments, environment variables prefixed ``INF_ENGINE_``, a TOML file
(``inf-engine.toml`` in the working directory, or the path in ``INF_ENGINE_CONFIG_FILE``), then the defaults.
Nothing else in the code base reads the environment for configuration.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

CONFIG_FILE_ENV = "INF_ENGINE_CONFIG_FILE"
DEFAULT_CONFIG_FILE = "inf-engine.toml"


def _config_file() -> Path:
    return Path(os.environ.get(CONFIG_FILE_ENV, DEFAULT_CONFIG_FILE))


class Settings(BaseSettings):
    """Process-wide configuration; validated at start so a bad value fails fast with its name."""

    model_config = SettingsConfigDict(env_prefix="INF_ENGINE_", extra="ignore", validate_default=True)

    data_dir: Path = Field(default=Path(".inf-engine"), description="Where local state (checkpoints, caches) lives")
    log_level: str = "INFO"
    database_url: str | None = Field(default=None, description="SQLAlchemy URL; SQLite in data_dir when unset")
    redis_url: str | None = Field(default=None, description="Redis URL for Celery and global limits")
    api_keys: list[str] = Field(default_factory=list, description="Bearer keys accepted on /v1/*; empty = open")
    resources_file: Path | None = Field(default=None, description="Default ResourceConfig file (TOML or YAML)")
    default_max_concurrent: int = Field(default=100, ge=1)

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, not {value!r}")
        return level

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _config_file()
        if path.is_file():
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        elif CONFIG_FILE_ENV in os.environ:
            raise FileNotFoundError(f"{CONFIG_FILE_ENV} names {path}, which does not exist")
        return tuple(sources)


@lru_cache(maxsize=1)
def get_settings(**overrides: Any) -> Settings:
    """The cached process settings (tests call ``get_settings.cache_clear()`` after changing the environment)."""
    return Settings(**overrides)
