"""Backends by name: ``create_backend(settings)`` builds the one ``settings.backend`` names.

Built-in backends are imported lazily (``transformers`` and ``native`` pull in torch; ``openai`` does not).
Other code may add its own with :func:`register_backend`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from app.serving.backends.base import Backend

if TYPE_CHECKING:
    from app.settings import Settings

BackendFactory = Callable[["Settings"], Backend]

_BUILTIN: dict[str, str] = {
    "native": "app.serving.backends.native:NativeBackend",
    "transformers": "app.serving.backends.transformers_backend:TransformersBackend",
    "vllm": "app.serving.backends.vllm:VLLMBackend",
    "openai": "app.serving.backends.openai_proxy:OpenAIProxyBackend",
}
_REGISTERED: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``factory(settings)`` available as backend ``name`` (replacing any earlier one)."""
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"a backend name must be letters, digits, '-' or '_', not {name!r}")
    _REGISTERED[name] = factory


def available_backends() -> list[str]:
    return sorted({*_BUILTIN, *_REGISTERED})


def get_backend_factory(name: str) -> BackendFactory:
    if name in _REGISTERED:
        return _REGISTERED[name]
    target = _BUILTIN.get(name)
    if target is None:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(available_backends())}")
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    factory: BackendFactory = cls.from_settings
    return factory


def create_backend(settings: Settings, name: str | None = None) -> Backend:
    """The backend ``name`` (default: ``settings.backend``), configured from ``settings``; not yet started."""
    return get_backend_factory(name or settings.backend)(settings)
