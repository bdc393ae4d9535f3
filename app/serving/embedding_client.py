"""The pipeline's embeddings in process: an ``Embedding`` call answered by this process's models, without HTTP.

The pipeline reaches a model only through a client; this module gives the in-process clients an ``embed``
(``app.pipeline.resources.EmbeddingClient``) that takes the route's own path: the request is the
``/v1/embeddings`` body an HTTP client would send, checked by the route's schema, answered by the same function
(``OpenAIServing.embed`` inside ``inf-engine serve``: the embedding model beside the chat model, else the chat
model's pooling) and read back with the HTTP client's parser, so that a pipeline gets the same vectors in
process as over HTTP. Errors map to the scheduler's classes (a 400 fails the call, a 5xx is retried).

Without a server (a Celery engine worker, a learning run), :class:`LocalEmbeddings` plays the route's part: the
embedding model of ``settings.embedding_model``, loaded once per process, else the in-process chat engine's
pooling when ``settings.pooler_config`` is set.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from pydantic import ValidationError

from app.pipeline.resources import (
    EmbeddingRequest,
    EmbeddingResponse,
    LLMClient,
    LLMRequest,
    LLMResponse,
    RateLimitError,
    ResourceError,
    TransientError,
    embeddings_payload,
    parse_embeddings,
)
from app.serving.backends.base import Backend, BackendError, GenerationChunk, GenerationRequest
from app.serving.embeddings import EmbeddingService
from app.serving.errors import APIError, bad_request
from app.serving.schemas import EmbeddingRequest as EmbeddingBody

__all__ = ["EmbedFn", "LocalEmbeddings", "ServedEmbeddings", "WithEmbeddings"]

#: what answers a checked ``/v1/embeddings`` body with OpenAI's response (``OpenAIServing.embed``)
EmbedFn = Callable[[EmbeddingBody], Awaitable[dict[str, Any]]]

NO_EMBEDDINGS = (
    "serves no embeddings: start the server with --embedding-model all-MiniLM-L6-v2 (INF_ENGINE_EMBEDDING_MODEL), "
    "give the chat model a pooler (INF_ENGINE_POOLER_CONFIG), or map the alias to an HTTP endpoint with "
    "/v1/embeddings in a resources file"
)


class ServedEmbeddings:
    """``embed(EmbeddingRequest)`` answered by ``embed_fn`` in this process (None: this process has no
    embeddings, and every request is a 400 saying how to get them)."""

    def __init__(self, embed_fn: EmbedFn | None, *, label: str, alias: str | None = None,
                 timeout: float = 300.0) -> None:
        self.embed_fn = embed_fn
        self.label = label
        self.alias = alias
        self.timeout = timeout

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        if self.embed_fn is None:
            raise ResourceError(f"{self.label} {NO_EMBEDDINGS}", status=400, alias=self.alias)
        try:
            body = EmbeddingBody.model_validate(embeddings_payload(request))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "request"
            raise ResourceError(f"{self.label}: invalid request field {where}: {first['msg']}", status=400,
                                alias=self.alias) from None
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                answer = await self.embed_fn(body)
        except TimeoutError:
            raise TransientError(f"{self.label}: embeddings took longer than {self.timeout:g}s", alias=self.alias,
                                 status=504) from None
        except (APIError, BackendError) as exc:
            raise self._mapped(exc if isinstance(exc, APIError) else APIError.from_backend(exc)) from None
        return parse_embeddings(answer, len(request.inputs()), (time.perf_counter() - start) * 1000.0)

    def _mapped(self, exc: APIError) -> ResourceError:
        where = f" ({exc.param})" if exc.param else ""
        message = f"{self.label}: {exc.message}{where}"
        if exc.status == 429:
            return RateLimitError(message, alias=self.alias)
        if exc.status >= 500:
            return TransientError(message, status=exc.status, alias=self.alias)
        return ResourceError(message, status=exc.status, alias=self.alias)


class WithEmbeddings(LLMClient):
    """An in-process chat client (``EmbeddedEngineClient``) that serves embeddings too."""

    def __init__(self, chat: LLMClient, embeddings: ServedEmbeddings) -> None:
        self.chat = chat
        self.embeddings = embeddings

    def __repr__(self) -> str:
        return f"WithEmbeddings({self.chat!r})"

    async def complete(self, request: LLMRequest) -> LLMResponse:
        return await self.chat.complete(request)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        return await self.embeddings.embed(request)

    async def aclose(self) -> None:
        await self.chat.aclose()


class LocalEmbeddings:
    """A process's embeddings without a server: ``embedding_model`` (loaded once, on first use; one batching
    service per event loop) or, without one, the pooling of the in-process chat engine (``pooler_config``)."""

    def __init__(self, *, embedding_model: str | None = None, pooler_config: dict[str, Any] | None = None,
                 num_threads: int | None = None, dtype: str = "float32") -> None:
        self.embedding_model = embedding_model
        self.dtype = dtype
        self.pooler_config = pooler_config
        self.num_threads = num_threads
        self._model: Any = None
        self._load_lock = threading.Lock()
        self._services: dict[int, tuple[asyncio.AbstractEventLoop, EmbeddingService]] = {}

    @property
    def available(self) -> bool:
        return bool(self.embedding_model) or self.pooler_config is not None

    def embed_fn(self, engine: Any) -> EmbedFn | None:
        """What answers the embeddings of a client whose chats go to ``engine`` (an ``EmbeddedEngine``, whose
        ``backend()`` is the started chat backend); None when this process has no embeddings."""
        if not self.available:
            return None

        async def embed(body: EmbeddingBody) -> dict[str, Any]:
            if self.embedding_model:
                service = await self._service()
                return await service.embed(body)
            if engine is None or self.pooler_config is None:
                raise bad_request(f"the in-process engine {NO_EMBEDDINGS}", "model")
            from app.serving.pooling import DecoderPooling

            backend = await engine.backend()
            pooling = DecoderPooling(backend, _opener(backend), pooling_type=self.pooler_config["pooling_type"],
                                     normalize=self.pooler_config["normalize"])
            return await pooling.embed(body)

        return embed

    async def _service(self) -> EmbeddingService:
        loop = asyncio.get_running_loop()
        entry = self._services.get(id(loop))
        if entry is not None and entry[0] is loop:
            return entry[1]
        model = await asyncio.to_thread(self._load)
        entry = self._services.get(id(loop))  # another caller of this loop may have started one meanwhile
        if entry is not None and entry[0] is loop:
            return entry[1]
        for key, (old, _) in list(self._services.items()):
            if old.is_closed():
                del self._services[key]
        assert self.embedding_model is not None
        service = EmbeddingService(self.embedding_model, num_threads=self.num_threads, loaded=model, dtype=self.dtype)
        await service.start()  # its batching task lives on this loop, and ends with it
        self._services[id(loop)] = (loop, service)
        return service

    def _load(self) -> Any:
        with self._load_lock:
            if self._model is None:
                from app.engine.embedding import EmbeddingModel

                assert self.embedding_model is not None
                self._model = EmbeddingModel.load(self.embedding_model, num_threads=self.num_threads,
                                                  dtype=self.dtype)
            return self._model


Opener = Callable[[Sequence[GenerationRequest]], Awaitable[list[AsyncIterator[GenerationChunk]]]]


def _opener(backend: Backend) -> Opener:
    """What ``DecoderPooling`` opens its requests with: the backend's streams (closed again if one fails)."""

    async def open_streams(requests: Sequence[GenerationRequest]) -> list[AsyncIterator[GenerationChunk]]:
        streams: list[AsyncIterator[GenerationChunk]] = []
        try:
            for request in requests:
                streams.append(await backend.generate(request))
        except BaseException:
            for stream in streams:
                closer = getattr(stream, "aclose", None)
                if closer is not None:
                    await closer()
            raise
        return streams

    return open_streams
