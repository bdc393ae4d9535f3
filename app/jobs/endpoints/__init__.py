"""Where a job's LLM calls go: one resolution of endpoint aliases for every process that runs nodes (the server's
in-process queue, node workers, learning runs, beat).

* ``resources`` given (a ResourceManager or a scripted stand-in, in tests): every alias goes there;
* a resources file: its endpoints, behind the global limits in Redis when Redis is configured (every process
  shares one rate and one concurrency per endpoint), else behind this process's own limits;
* no file: the server's running backend when there is one (embeddings: the server's ``/v1/embeddings``, given
  with :meth:`EndpointResolver.serve_embeddings`), else the in-process engine of ``settings.model`` (embeddings:
  ``settings.embedding_model`` loaded in this process, else the engine's pooling with ``settings.pooler_config``).

One manager per configuration is kept and shared by every job and thread of the process, so an endpoint's limits
hold across jobs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from app.jobs.endpoints.limited import GloballyLimitedResources, WaitHook
from app.settings import Settings

#: dollars for one call: (alias, model, input tokens, output tokens) -> cost
CostFn = Callable[[str, str | None, int, int], float]

NO_ENDPOINTS_HINT = (
    "set INF_ENGINE_RESOURCES_FILE to a ResourceConfig file that maps them to endpoints (without one, jobs use "
    "the in-process engine, which needs the engine extras and the default model)"
)

NO_EMBEDDINGS_HINT = (
    "this server serves no embeddings: start it with --embedding-model all-MiniLM-L6-v2 (INF_ENGINE_EMBEDDING_MODEL), "
    "give the chat model a pooler (INF_ENGINE_POOLER_CONFIG), or map the endpoints to an HTTP server with "
    "/v1/embeddings in a resources file (INF_ENGINE_RESOURCES_FILE)"
)

__all__ = ["NO_EMBEDDINGS_HINT", "NO_ENDPOINTS_HINT", "CostFn", "EndpointResolver", "WaitHook", "endpoint_cost"]


class EndpointResolver:
    """``resolver(aliases)``: the endpoints of a pipeline that calls ``aliases`` (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        *,
        resources: Any = None,
        backend: Any = None,
        on_wait: WaitHook | None = None,
        register_engine: bool = True,
    ) -> None:
        """``register_engine``: set up the in-process engine's client factory with ``settings.num_threads``
        (False where the process's engine host already did, with its own options: an engine worker)."""
        self.settings = settings
        self._register_engine = register_engine
        self._resources = resources
        self._backend = backend
        self._embed: Any = None
        self._on_wait = on_wait
        self._managers: dict[tuple[str, ...], Any] = {}
        self._lock = threading.Lock()

    def serve_embeddings(self, embed: Any) -> None:
        """Send the aliases' embeddings requests to ``embed`` (``OpenAIServing.embed``: the server's embedding
        model, else its chat model's pooling) where they go to the server's ``backend``."""
        self._embed = embed

    def __call__(self, aliases: list[str]) -> Any:
        if self._resources is not None:
            return self._resources
        key: tuple[str, ...] = ("file",) if self.settings.resources_file is not None else ("engine", *sorted(aliases))
        with self._lock:
            manager = self._managers.get(key)
            if manager is None:
                manager = self._managers[key] = self._build(sorted(aliases))
            return manager

    def embeddings_missing(self) -> str | None:
        """Why an ``Embedding`` call of a job cannot be answered here, or None when it can (or when the given
        resources or a resources file decide, which only a call can tell). Without them the calls go to the
        server's or the in-process engine's embeddings, which exist only with ``settings.embedding_model`` or
        ``settings.pooler_config`` (the same settings on the API server and on its workers)."""
        settings = self.settings
        if self._resources is not None or settings.resources_file is not None:
            return None
        if settings.embedding_model or settings.pooler_config is not None:
            return None
        return NO_EMBEDDINGS_HINT

    def defines(self, alias: str) -> bool | None:
        """Whether the given resources serve ``alias``; None when they cannot tell (a scripted stand-in) or none
        were given (a resources file is checked from its config; without one every alias goes to the engine)."""
        if self._resources is None:
            return None
        has_alias = getattr(self._resources, "has_alias", None)
        return bool(has_alias(alias)) if callable(has_alias) else None

    def _build(self, aliases: list[str]) -> Any:
        from app.pipeline.resources import ResourceConfig, ResourceManager

        settings = self.settings
        if settings.resources_file is not None:
            config = ResourceConfig.from_file(settings.resources_file)
            if not settings.redis_url:
                return ResourceManager(config)
            url = settings.redis_url
            from redis.asyncio import Redis as AsyncRedis

            return GloballyLimitedResources(
                config, lambda: AsyncRedis.from_url(url), prefix=settings.redis_prefix, on_wait=self._on_wait
            )
        if self._backend is not None:
            from app.jobs.endpoints.backend import BackendResourceManager

            return BackendResourceManager(aliases, self._backend, self._embed)
        # the engine extras are optional: import them only when a job needs the in-process engine
        from app.jobs.endpoints.backend import EngineResourceManager
        from app.serving.embedded import embedded_resources, register_embedded_engine
        from app.serving.embedding_client import LocalEmbeddings

        if self._register_engine:
            register_embedded_engine(num_threads=settings.num_threads)
        embeddings = LocalEmbeddings(embedding_model=settings.embedding_model, pooler_config=settings.pooler_config,
                                     num_threads=settings.num_threads, dtype=settings.embedding_dtype)
        return EngineResourceManager(embedded_resources(aliases, settings.model), embeddings)

    async def aclose(self) -> None:
        """Close the managers this resolver built (not the ``resources`` it was given)."""
        with self._lock:
            managers = list(self._managers.values())
            self._managers.clear()
        for manager in managers:
            await manager.aclose()


def endpoint_cost(resources: Any, alias: str, model: str | None, tokens_in: int, tokens_out: int) -> float:
    """Dollars for one call from the endpoint's per-1M token prices (0 when the resources do not say)."""
    endpoints = getattr(resources, "endpoints", None)
    if not callable(endpoints):
        return 0.0
    try:
        configs = list(endpoints(alias))
    except Exception:
        return 0.0
    config = next((c for c in configs if getattr(c, "model", None) == model), configs[0] if configs else None)
    if config is None:
        return 0.0
    prices = (getattr(config, "input_cost_per_1m", 0.0), getattr(config, "output_cost_per_1m", 0.0))
    return float(tokens_in * prices[0] + tokens_out * prices[1]) / 1_000_000
