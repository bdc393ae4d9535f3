"""The native inference engine: ``from app.engine import LLMEngine, SamplingParams``.

Heavy modules (torch, the model code) load on first use of a name, so importing the package stays cheap
for code that only needs, say, ``SamplingParams``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.engine.async_engine import AsyncEngine, EngineDeadError
    from app.engine.core.sampling_params import SamplingParams, StructuredOutputsParams
    from app.engine.llm_engine import EngineConfig, EngineQueueFullError, LLMEngine
    from app.engine.metrics import EngineStats, RequestMetrics
    from app.engine.outputs import CompletionOutput, RequestOutput
    from app.engine.spec_decode import SpeculativeConfig

_EXPORTS: dict[str, str] = {
    "AsyncEngine": "app.engine.async_engine",
    "EngineDeadError": "app.engine.async_engine",
    "EngineConfig": "app.engine.llm_engine",
    "EngineQueueFullError": "app.engine.llm_engine",
    "LLMEngine": "app.engine.llm_engine",
    "EngineStats": "app.engine.metrics",
    "RequestMetrics": "app.engine.metrics",
    "CompletionOutput": "app.engine.outputs",
    "RequestOutput": "app.engine.outputs",
    "SamplingParams": "app.engine.core.sampling_params",
    "SpeculativeConfig": "app.engine.spec_decode",
    "StructuredOutputsParams": "app.engine.core.sampling_params",
}

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineQueueFullError",
    "EngineStats",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SpeculativeConfig",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'app.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
