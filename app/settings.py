"""The one settings object of inf-engine.

Values come from, highest first: keyword arguments, environment variables prefixed ``INF_ENGINE_``, a TOML file
(``inf-engine.toml`` in the working directory, or the path in ``INF_ENGINE_CONFIG_FILE``), then the defaults.
Nothing else in the code base reads the environment for configuration.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

CONFIG_FILE_ENV = "INF_ENGINE_CONFIG_FILE"

BackendName = Literal["native", "transformers", "vllm", "openai"]
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

    # --- the OpenAI-compatible server (``inf-engine serve``) and its backend -------------------------------
    serve_host: str = Field(default="127.0.0.1", min_length=1, description="Address `inf-engine serve` binds")
    serve_port: int = Field(default=8000, ge=1, le=65535, description="Port `inf-engine serve` listens on")
    backend: BackendName = Field(default="native", description="native, transformers, vllm or openai")
    model: str | None = Field(
        default=None, description="HF folder or .gguf file to serve; unset = the default SmolLM2 model"
    )
    served_model_name: str | None = Field(
        default=None, description="The model id clients send and /v1/models lists (default: from the model)"
    )
    max_waiting: int = Field(default=256, ge=1, description="Requests queued beyond this answer HTTP 429")
    num_threads: int | None = Field(
        default=None, ge=1, description="torch threads of the in-process engines (native, transformers); unset = torch's"
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs", description="Native engine: 'priority' serves lower request priority values first"
    )
    speculative_config: dict[str, Any] | None = Field(
        default=None,
        description=(
            "Native engine speculative decoding, vLLM's keys as a JSON object, e.g. "
            '{"method": "ngram", "num_speculative_tokens": 4} or '
            '{"method": "draft_model", "model": "/path/to/draft", "num_speculative_tokens": 4}; unset = off '
            "(checked when the engine starts)"
        ),
    )
    cors_origins: list[str] = Field(default_factory=list, description="Origins allowed by CORS; empty = none")
    health_stall_seconds: float = Field(
        default=30.0, gt=0, description="/health answers 503 when the engine made no step this long with work"
    )
    vllm_python: Path | None = Field(
        default=None, description="Python executable of a venv with vLLM, for the vllm backend"
    )
    vllm_extra_args: list[str] = Field(default_factory=list, description="Extra `vllm serve` arguments")
    vllm_startup_timeout: float = Field(default=900.0, gt=0, description="Seconds to wait for vLLM's /health")
    openai_base_url: str | None = Field(
        default=None, description="Upstream OpenAI-compatible URL (with /v1) for the openai backend"
    )
    openai_api_key: str | None = Field(default=None, description="Bearer key sent to the upstream server")
    openai_model: str | None = Field(default=None, description="Model name the upstream server knows")
    upstream_timeout: float = Field(default=600.0, gt=0, description="Seconds per proxied upstream request")

    # --- jobs (``/v1/jobs``), the embedded executor, and the CLI that talks to a server ------------------------
    db_auto_upgrade: bool = Field(default=True, description="The server runs the database migrations at start")
    jobs_max_items: int = Field(default=100_000, ge=1, description="Items one job may hold (more answers 413)")
    jobs_max_bytes: int = Field(
        default=100 * 1024 * 1024, ge=1, description="Largest job request body / input file in bytes (413 beyond)"
    )
    jobs_max_running: int = Field(default=4, ge=1, description="Jobs the embedded executor runs at once")
    jobs_poll_interval: float = Field(
        default=1.0, gt=0, description="Seconds between the embedded executor's looks for new or cancelled jobs"
    )
    api_url: str | None = Field(
        default=None, description="Server the CLI's job commands talk to (default: http://serve_host:serve_port)"
    )
    api_key: str | None = Field(default=None, description="Bearer key the CLI sends to the server")

    # --- distributed execution: Celery on Redis, global endpoint limits, Flower (deploy/README.md says why) -----
    redis_prefix: str = Field(
        default="inf", pattern=r"^[A-Za-z0-9_.-]+$", description="Prefix of every Redis key we and Celery write"
    )
    celery_queue_prefix: str = Field(
        default="inf", pattern=r"^[A-Za-z0-9_-]+$", description="Queues are <prefix>.cpu, <prefix>.llm, <prefix>.engine"
    )
    celery_task_time_limit: float = Field(
        default=3600.0, gt=0, description="Seconds one task may run before its worker kills it (hard limit)"
    )
    celery_visibility_timeout: float = Field(
        default=7200.0, gt=0, description="Seconds before Redis re-delivers an unacknowledged task (> the time limit)"
    )
    celery_task_events: bool = Field(
        default=True,
        description="Workers send task events (what Flower shows); false saves a Redis publish per task state, "
        "and Flower then sees tasks only after its next enable_events broadcast",
    )
    worker_name: str | None = Field(
        default=None, min_length=1, description="Celery node name of `inf-engine worker` (default <role>.<pid>@<host>)"
    )
    worker_concurrency: int | None = Field(
        default=None, ge=1, description="Tasks a plain worker runs at once (default: one process per CPU)"
    )
    engine_worker_concurrency: int = Field(
        default=32, ge=1, description="Tasks an --engine worker feeds its one in-process engine at once (threads)"
    )
    flower_address: str = Field(default="127.0.0.1", min_length=1, description="Address `inf-engine flower` binds")
    flower_port: int = Field(default=5555, ge=1, le=65535, description="Port `inf-engine flower` listens on")
    flower_user: str = Field(default="admin", min_length=1, description="Flower basic-auth user")
    flower_password: str | None = Field(
        default=None, repr=False, description="Flower basic-auth password (required: Flower can revoke tasks)"
    )
    beat_lock_ttl: float = Field(
        default=30.0, ge=1, description="Seconds a dead beat's lock outlives it (then a standby beat takes over)"
    )
    evaluation_schedule_interval: float = Field(
        default=30.0, gt=0, description="Seconds between two looks of beat for due scheduled evaluations"
    )
    node_max_attempts: int = Field(
        default=5, ge=1, description="Deliveries that may start one node on workers before its item fails"
    )
    node_lease_seconds: float = Field(
        default=60.0, gt=0,
        description="Lease of a node a worker runs (renewed every third); once it lapses the sweeper re-queues it",
    )
    node_retry_delay: float = Field(
        default=1.0, ge=0, description="First backoff in seconds of a transient node failure (doubled per attempt)"
    )
    node_stale_seconds: float = Field(
        default=30.0, gt=0,
        description="A queued node not taken this long after it was due, with its queue empty, is sent again",
    )
    sweep_interval: float = Field(
        default=10.0, gt=0, description="Seconds between two runs of the sweeper (a beat task)"
    )

    @model_validator(mode="after")
    def _visibility_above_time_limit(self) -> Settings:
        # A task still running when the visibility timeout passes would be delivered a second time.
        if self.celery_visibility_timeout <= self.celery_task_time_limit:
            raise ValueError(
                f"celery_visibility_timeout ({self.celery_visibility_timeout:g} s) must be above "
                f"celery_task_time_limit ({self.celery_task_time_limit:g} s), or running tasks are re-delivered"
            )
        return self

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, not {value!r}")
        return level

    @field_validator("vllm_python")
    @classmethod
    def _executable(cls, value: Path | None) -> Path | None:
        if value is not None and not (value.is_file() and os.access(value, os.X_OK)):
            raise ValueError(f"vllm_python must be an executable Python with vLLM installed; {value} is not")
        return value

    @field_validator("openai_base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"openai_base_url must start with http:// or https://, not {value!r}")
        return value.rstrip("/")

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ValueError(f"cors_origins entries must be '*' or http(s)://host[:port], not {origin!r}")
        return value

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
