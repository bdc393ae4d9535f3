"""Scripted fake LMs for fast unit tests (the DSPy approach): answers come from a function, not a model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from app.pipeline.resources.types import EmbeddingRequest, EmbeddingResponse, LLMRequest, LLMResponse
from app.testing.fake_llm_server import fake_embedding


class ScriptedLM:
    """Stands in for a ResourceManager. ``reply(alias, request)`` returns the text, or raises to simulate a
    failure; ``latency`` is awaited on each call. Records every call and the peak number in flight."""

    def __init__(
        self,
        reply: Callable[[str, LLMRequest], str] | None = None,
        latency: float = 0.0,
        max_retries: int = 0,
    ) -> None:
        self.reply = reply or (lambda alias, req: f"[{alias}] {req.prompt}")
        self.latency = latency
        self.calls: list[tuple[str, Any, str | None]] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self._max_retries = max_retries
        self.closed = False

    async def complete(self, alias: str, request: LLMRequest) -> LLMResponse:
        self.calls.append((alias, request.prompt, request.system_prompt))
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if self.latency:
                await asyncio.sleep(self.latency)
            text = self.reply(alias, request)
        finally:
            self.in_flight -= 1
        return LLMResponse(content=text, input_tokens=len(str(request.prompt).split()), output_tokens=len(text.split()))

    def prompts(self) -> list[Any]:
        return [prompt for _, prompt, _ in self.calls]

    def max_retries(self, alias: str) -> int:
        return self._max_retries

    def endpoints(self, alias: str) -> list[Any]:
        return []

    async def aclose(self) -> None:
        self.closed = True


Reply = Callable[[str, LLMRequest], "str | LLMResponse | BaseException"]
EmbedReply = Callable[[str, EmbeddingRequest], "list[list[float]] | EmbeddingResponse | BaseException"]


def fake_vector(item: str | list[int], dimensions: int | None = None) -> list[float]:
    """The vector the fake LLM server gives a text (token ids: joined with spaces), so scripted and HTTP agree."""
    return fake_embedding(item if isinstance(item, str) else " ".join(map(str, item)), dimensions)


def fake_embeddings(alias: str, request: EmbeddingRequest) -> list[list[float]]:
    return [fake_vector(item, request.dimensions) for item in request.inputs()]


class ScriptedResources:
    """Anything with ``async complete(alias, request)`` serves as a resource manager; this one answers from a
    script (default: ``"<alias>(<prompt>)"``) and records every request it was sent."""

    def __init__(self, reply: Reply | None = None, embed: EmbedReply | None = None) -> None:
        self.reply = reply or (lambda alias, request: f"{alias}({request.prompt})")
        self.embed_reply = embed or fake_embeddings
        self.requests: list[tuple[str, LLMRequest]] = []
        self.embed_requests: list[tuple[str, EmbeddingRequest]] = []
        self.closed = False

    async def embed(self, alias: str, request: EmbeddingRequest) -> EmbeddingResponse:
        """Vectors from the ``embed`` script (default :func:`fake_embeddings`), two tokens per input."""
        self.embed_requests.append((alias, request))
        answer = self.embed_reply(alias, request)
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, EmbeddingResponse):
            return answer
        return EmbeddingResponse(embeddings=answer, model="fake-embed", input_tokens=2 * len(request.inputs()))

    async def complete(self, alias: str, request: LLMRequest) -> LLMResponse:
        self.requests.append((alias, request))
        answer = self.reply(alias, request)
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, LLMResponse):
            return answer
        return LLMResponse(content=answer, input_tokens=3, output_tokens=5, finish_reason="stop", model="fake")

    def max_retries(self, alias: str) -> int:
        return 0

    def endpoints(self, alias: str) -> list[Any]:
        return []

    async def aclose(self) -> None:
        self.closed = True

    def prompts(self, alias: str | None = None) -> list[Any]:
        return [request.prompt for a, request in self.requests if alias is None or a == alias]
