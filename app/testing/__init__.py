"""Test helpers that ship with the package: a scriptable OpenAI-compatible fake server.

Names are loaded lazily so that ``python -m app.testing.fake_llm_server`` does not import the module twice.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.testing.fake_llm_server import (
        FakeBehaviour,
        FakeLLMServer,
        build_app,
        start_fake_server_process,
        stop_fake_server_process,
    )

__all__ = [
    "FakeBehaviour",
    "FakeLLMServer",
    "build_app",
    "start_fake_server_process",
    "stop_fake_server_process",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("app.testing.fake_llm_server"), name)
    raise AttributeError(f"module 'app.testing' has no attribute {name!r}")
