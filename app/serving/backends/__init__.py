"""Pluggable generation backends behind one interface: native (our engine), transformers, vllm, openai.

``create_backend(settings)`` builds the one ``settings.backend`` names; see ``base.Backend`` for the contract.
"""

from app.serving.backends.base import (
    Backend,
    BackendError,
    BackendUnavailableError,
    ClosingStream,
    EngineStats,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
    InvalidRequestError,
    ModelCard,
    QueueFullError,
    SequenceDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from app.serving.backends.registry import available_backends, create_backend, register_backend

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailableError",
    "ClosingStream",
    "EngineStats",
    "GenerationChunk",
    "GenerationRequest",
    "HealthStatus",
    "InvalidRequestError",
    "ModelCard",
    "QueueFullError",
    "SequenceDelta",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "available_backends",
    "create_backend",
    "register_backend",
]
