"""Endpoints for jobs when no resources file is configured: the server's own model.

Inside ``inf-engine serve`` every alias a pipeline calls goes to the backend the server already runs (native,
transformers, vllm or an upstream OpenAI server), through the same client and request checks as the in-process
engine of ``inf-engine run``: the jobs and the OpenAI routes share one engine (one copy of the weights, one
continuous batch).
"""

from __future__ import annotations

from typing import Any

from app.pipeline.resources import EndpointConfig, LLMClient, ResourceConfig, ResourceManager


class _RunningBackend:
    """What the in-process client expects of an engine, for a backend the server started and will stop."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    async def backend(self) -> Any:
        return self._backend

    def acquire(self) -> None:
        """The server owns the backend's lifetime: clients do not count."""

    async def release(self) -> None:
        """Nothing to stop: the server stops the backend at shutdown."""


class BackendResourceManager(ResourceManager):
    """A ResourceManager whose every alias is served by ``backend`` (a started ``app.engine`` Backend)."""

    def __init__(self, aliases: list[str], backend: Any) -> None:
        model = str(getattr(backend, "served_model_name", None) or "default")
        super().__init__(ResourceConfig({alias: EndpointConfig("native", model) for alias in aliases}))
        self._engine = _RunningBackend(backend)

    def _client(self, ep: Any) -> LLMClient:
        if ep.client is None:
            from app.serving.embedded import EmbeddedEngineClient

            ep.client = EmbeddedEngineClient(ep.config, engine=self._engine, alias=ep.alias)  # type: ignore[arg-type]
        client: LLMClient = ep.client
        return client
