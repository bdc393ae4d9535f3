"""Endpoints for jobs when no resources file is configured: the server's own model, or this process's engine.

Inside ``inf-engine serve`` every alias a pipeline calls goes to the backend the server already runs (native,
transformers, vllm or an upstream OpenAI server), through the same client and request checks as the in-process
engine of ``inf-engine run``: the jobs and the OpenAI routes share one engine (one copy of the weights, one
continuous batch). An ``Embedding`` call goes to the server's ``/v1/embeddings`` function (its embedding model,
else its chat model's pooling), through the route's own checks.

Without a server (a Celery engine worker, a learning run), the aliases go to the in-process engine of
``settings.model``, and embeddings to :class:`~app.serving.embedding_client.LocalEmbeddings`.
"""

from __future__ import annotations

from typing import Any

from app.pipeline.resources import EndpointConfig, LLMClient, ResourceConfig, ResourceManager, create_client


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
    """A ResourceManager whose every alias is served by ``backend`` (a started ``app.engine`` Backend); ``embed``
    (``OpenAIServing.embed``) answers the aliases' embeddings requests (None: the server serves none)."""

    def __init__(self, aliases: list[str], backend: Any, embed: Any = None) -> None:
        model = str(getattr(backend, "served_model_name", None) or "default")
        super().__init__(ResourceConfig({alias: EndpointConfig("native", model) for alias in aliases}))
        self._engine = _RunningBackend(backend)
        self._embed = embed

    def _client(self, ep: Any) -> LLMClient:
        if ep.client is None:
            from app.serving.embedded import EmbeddedEngineClient
            from app.serving.embedding_client import ServedEmbeddings, WithEmbeddings

            chat = EmbeddedEngineClient(ep.config, engine=self._engine, alias=ep.alias)  # type: ignore[arg-type]
            embeddings = ServedEmbeddings(self._embed, label="the server", alias=ep.alias, timeout=ep.config.timeout)
            ep.client = WithEmbeddings(chat, embeddings)
        client: LLMClient = ep.client
        return client


class EngineResourceManager(ResourceManager):
    """A ResourceManager of in-process engine endpoints (``native`` without a URL) whose clients serve
    embeddings with ``local`` (a :class:`~app.serving.embedding_client.LocalEmbeddings`)."""

    def __init__(self, config: ResourceConfig, local: Any) -> None:
        super().__init__(config)
        self._local = local

    def _client(self, ep: Any) -> LLMClient:
        if ep.client is None:
            from app.serving.embedding_client import ServedEmbeddings, WithEmbeddings

            chat = create_client(ep.config, alias=ep.alias)
            embed = self._local.embed_fn(getattr(chat, "engine", None))
            embeddings = ServedEmbeddings(embed, label=f"the in-process engine ({ep.config.model})", alias=ep.alias,
                                          timeout=ep.config.timeout)
            ep.client = WithEmbeddings(chat, embeddings)
        client: LLMClient = ep.client
        return client
