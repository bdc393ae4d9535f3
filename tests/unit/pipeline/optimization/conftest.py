"""Scripted LMs for the optimization tests: one answer function per alias, every request recorded."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

from app.pipeline.resources.types import LLMRequest, LLMResponse

Answer = Callable[[LLMRequest], "str | BaseException"]


class AliasLM:
    """A resource manager whose answers come from ``script[alias](request)``; ``latency`` is awaited per call
    and ``peak`` records the most calls in flight at once."""

    def __init__(self, script: dict[str, Answer] | None = None, latency: float = 0.0) -> None:
        self.script = dict(script or {})
        self.latency = latency
        self.requests: list[tuple[str, LLMRequest]] = []
        self.in_flight = 0
        self.peak = 0

    async def complete(self, alias: str, request: LLMRequest) -> LLMResponse:
        self.requests.append((alias, request))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.latency:
                await asyncio.sleep(self.latency)
            answer = self.script.get(alias, lambda r: f"{alias}({r.prompt})")(request)
        finally:
            self.in_flight -= 1
        if isinstance(answer, BaseException):
            raise answer
        return LLMResponse(content=answer, input_tokens=1, output_tokens=1, finish_reason="stop", model="fake")

    def prompts(self, alias: str) -> list[str]:
        return [str(r.prompt) for a, r in self.requests if a == alias]

    def max_retries(self, alias: str) -> int:
        return 0

    def endpoints(self, alias: str) -> list[Any]:
        return []

    async def aclose(self) -> None:
        pass


def current_value(request: LLMRequest) -> str:
    """The parameter value quoted in an updater prompt."""
    match = re.search(r"<current-value>\n(.*?)\n</current-value>", str(request.prompt), re.DOTALL)
    assert match, f"no current value in the updater prompt: {request.prompt!r}"
    return match.group(1)
