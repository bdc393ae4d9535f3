"""Shared helpers for the pipeline frontend tests: a scripted resource manager and small modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from app.pipeline.resources.types import LLMRequest, LLMResponse

Reply = Callable[[str, LLMRequest], "str | LLMResponse | BaseException"]


class ScriptedResources:
    """Anything with ``async complete(alias, request)`` serves as a resource manager; this one answers from a
    script (default: ``"<alias>(<prompt>)"``) and records every request it was sent."""

    def __init__(self, reply: Reply | None = None) -> None:
        self.reply = reply or (lambda alias, request: f"{alias}({request.prompt})")
        self.requests: list[tuple[str, LLMRequest]] = []
        self.closed = False

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


@pytest.fixture
def resources() -> ScriptedResources:
    return ScriptedResources()
