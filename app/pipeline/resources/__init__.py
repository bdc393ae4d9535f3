"""Resources: endpoint configuration, LLM clients, rate limiting and the resource manager."""

from app.pipeline.resources.client import (
    EmbeddingClient,
    LLMClient,
    OpenAICompatibleClient,
    chat_payload,
    create_client,
    embeddings_payload,
    parse_embeddings,
    register_client_factory,
)
from app.pipeline.resources.config import EndpointConfig, ResourceConfig
from app.pipeline.resources.errors import (
    ConfigurationError,
    RateLimitError,
    ResourceError,
    TransientError,
)
from app.pipeline.resources.manager import ResourceManager, ResourceMetrics
from app.pipeline.resources.rate_limit import RateLimiter, RateLimiterStats
from app.pipeline.resources.types import EmbeddingRequest, EmbeddingResponse, LLMRequest, LLMResponse

__all__ = [
    "ConfigurationError",
    "EmbeddingClient",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EndpointConfig",
    "LLMClient",
    "LLMRequest",
    "LLMResponse",
    "OpenAICompatibleClient",
    "RateLimitError",
    "RateLimiter",
    "RateLimiterStats",
    "ResourceConfig",
    "ResourceError",
    "ResourceManager",
    "ResourceMetrics",
    "TransientError",
    "chat_payload",
    "create_client",
    "embeddings_payload",
    "parse_embeddings",
    "register_client_factory",
]
