"""Endpoint and resource configuration: which model each alias means, and how to reach it.

Modules name an alias ("fast", "judge"); a :class:`ResourceConfig` maps each alias to one or more
:class:`EndpointConfig` entries at run time, so the same pipeline runs against OpenAI, a vLLM server
or our own engine without changing code.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, cast

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app.pipeline.resources.errors import ConfigurationError
from app.settings import environment_variable

PROVIDERS: tuple[str, ...] = ("openai", "vllm", "native", "anthropic")
LOAD_BALANCING: tuple[str, ...] = ("round_robin", "least_loaded", "random")
LoadBalancing = Literal["round_robin", "least_loaded", "random"]

# Only names with an underscore count as "obviously an env var" (OPENAI_API_KEY). A bare upper-case word such
# as "EMPTY" (vLLM's conventional dummy key) is taken literally unless such a variable is actually set.
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$")
_EXPLICIT_ENV = re.compile(r"^(?:env:|\$\{?)([A-Za-z_][A-Za-z0-9_]*)\}?$")


class EndpointConfig(BaseModel):
    """One concrete endpoint: a provider, a model and how to call it.

    ``EndpointConfig("openai", "gpt-4o")`` and ``EndpointConfig(provider="openai", model="gpt-4o")`` are the same.
    ``rate_limit`` is in requests per minute; costs are dollars per million tokens.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    provider: str
    model: str
    base_url: str | None = None
    api_key: str | None = Field(default=None, repr=False)
    max_concurrent: int | None = Field(default=None, ge=1)
    rate_limit: float | None = Field(default=None, gt=0)
    max_retries: int = Field(default=3, ge=0)
    timeout: float = Field(default=300.0, gt=0)
    input_cost_per_1m: float = Field(default=0.0, ge=0)
    output_cost_per_1m: float = Field(default=0.0, ge=0)

    def __init__(self, provider: str | None = None, model: str | None = None, /, **data: Any) -> None:
        # Positional construction for the common case; keywords still win validation as usual.
        if provider is not None:
            if "provider" in data:
                raise TypeError("EndpointConfig got 'provider' both positionally and as a keyword")
            data["provider"] = provider
        if model is not None:
            if "model" in data:
                raise TypeError("EndpointConfig got 'model' both positionally and as a keyword")
            data["model"] = model
        super().__init__(**data)

    @field_validator("provider", mode="before")
    @classmethod
    def _check_provider(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.strip().lower()
            if value in PROVIDERS:
                return value
        raise ValueError(f"unknown provider {value!r}; use one of: {', '.join(PROVIDERS)}")

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("model must be a non-empty model name, e.g. 'gpt-4o-mini'")
        return value

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip().rstrip("/")
        if not value.startswith(("http://", "https://")):
            raise ValueError(
                f"base_url {value!r} must start with http:// or https:// (e.g. 'http://127.0.0.1:8000/v1')"
            )
        return value

    def resolved_api_key(self) -> str | None:
        """The API key to send: the value of the environment variable ``api_key`` names, or the literal key.

        ``"OPENAI_API_KEY"``, ``"$OPENAI_API_KEY"``, ``"${OPENAI_API_KEY}"`` and ``"env:OPENAI_API_KEY"`` all read
        the variable; an explicit reference, or an UPPER_SNAKE name, that is unset is a ConfigurationError.
        """
        key = self.api_key
        if key is None or key == "":
            return None
        explicit = _EXPLICIT_ENV.match(key)
        name = explicit.group(1) if explicit else key
        value = environment_variable(name)
        if value is not None:
            return value
        if explicit or _ENV_NAME.match(key):
            raise ConfigurationError(
                f"api_key for {self.provider}/{self.model} names the environment variable {name}, which is "
                f"not set; export it (export {name}=...) or put the key itself in api_key"
            )
        return key


EndpointSpec = EndpointConfig | Mapping[str, Any]


def _to_endpoint(alias: str, spec: Any) -> EndpointConfig:
    if isinstance(spec, EndpointConfig):
        return spec
    if isinstance(spec, Mapping):
        data = dict(spec)
        data.setdefault("provider", "openai")
        try:
            return EndpointConfig(**data)
        except ValidationError as exc:
            raise ConfigurationError(f"endpoint for alias {alias!r} is invalid: {exc}") from exc
    raise ConfigurationError(
        f"endpoint for alias {alias!r} must be an EndpointConfig or a table/dict with at least 'model', "
        f"got {type(spec).__name__}"
    )


class ResourceConfig(Mapping[str, list[EndpointConfig]]):
    """A read-only mapping alias → endpoints; several endpoints under one alias are load-balanced."""

    def __init__(
        self,
        endpoints: Mapping[str, EndpointSpec | list[EndpointSpec]] | None = None,
        load_balancing: str = "round_robin",
    ) -> None:
        if load_balancing not in LOAD_BALANCING:
            raise ConfigurationError(
                f"unknown load_balancing {load_balancing!r}; use one of: {', '.join(LOAD_BALANCING)}"
            )
        self._load_balancing = cast(LoadBalancing, load_balancing)
        self._endpoints: dict[str, tuple[EndpointConfig, ...]] = {}
        for alias, spec in (endpoints or {}).items():
            if not isinstance(alias, str) or not alias:
                raise ConfigurationError(f"aliases must be non-empty strings, got {alias!r}")
            specs = list(spec) if isinstance(spec, list | tuple) else [spec]
            if not specs:
                raise ConfigurationError(f"alias {alias!r} has an empty endpoint list; give at least one")
            self._endpoints[alias] = tuple(_to_endpoint(alias, s) for s in specs)

    @property
    def load_balancing(self) -> LoadBalancing:
        return self._load_balancing

    def __getitem__(self, alias: str) -> list[EndpointConfig]:
        # A fresh list each time, so callers cannot edit the configuration by accident.
        return list(self._endpoints[alias])

    def __iter__(self) -> Iterator[str]:
        return iter(self._endpoints)

    def __len__(self) -> int:
        return len(self._endpoints)

    def __repr__(self) -> str:
        inner = ", ".join(f"{a!r}: {list(e)!r}" for a, e in self._endpoints.items())
        return f"ResourceConfig({{{inner}}}, load_balancing={self._load_balancing!r})"

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that :meth:`from_dict` reads back (API keys included as written, e.g. a variable name)."""
        return {
            "load_balancing": self._load_balancing,
            "endpoints": {
                alias: [e.model_dump(exclude_defaults=True) for e in eps]
                for alias, eps in self._endpoints.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResourceConfig:
        """Build from ``{"endpoints": {alias: {...} | [{...}, ...]}, "load_balancing": ...}``.

        When there is no ``"endpoints"`` key, every top-level key except ``load_balancing`` is an alias.
        """
        if not isinstance(data, Mapping):
            raise ConfigurationError(f"resource configuration must be a mapping, got {type(data).__name__}")
        data = dict(data)
        load_balancing = data.pop("load_balancing", "round_robin")
        if "endpoints" in data:
            endpoints = data.pop("endpoints")
            if data:
                raise ConfigurationError(
                    f"unknown top-level keys {sorted(data)} in resource configuration; "
                    "only 'endpoints' and 'load_balancing' are allowed there"
                )
        else:
            endpoints = data
        if not isinstance(endpoints, Mapping):
            raise ConfigurationError("'endpoints' must be a table mapping alias → endpoint(s)")
        return cls(endpoints, load_balancing=load_balancing)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ResourceConfig:
        """Load a TOML (``.toml``) or YAML (``.yaml``/``.yml``) file with ``[endpoints.<alias>]`` tables."""
        p = Path(path)
        suffix = p.suffix.lower()
        if suffix not in (".toml", ".yaml", ".yml"):
            raise ConfigurationError(
                f"cannot tell the format of {str(p)!r}: name it *.toml, *.yaml or *.yml"
            )
        if not p.is_file():
            raise ConfigurationError(f"resource configuration file {str(p)!r} does not exist")
        text = p.read_text(encoding="utf-8")
        try:
            data = tomllib.loads(text) if suffix == ".toml" else yaml.safe_load(text)
        except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
            raise ConfigurationError(f"cannot parse {str(p)!r}: {exc}") from exc
        if data is None:
            data = {}
        return cls.from_dict(data)
