"""A scripted backend for fast tests: characters are tokens (id = code point), replies come from a function."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from app.serving.backends.base import (
    Backend,
    ClosingStream,
    EngineStats,
    GenerationChunk,
    GenerationRequest,
    HealthStatus,
    InvalidRequestError,
    QueueFullError,
    SequenceDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from app.serving.backends.local import StopStringMatcher

EOS = 0


def default_reply(request: GenerationRequest, index: int) -> str:
    """Deterministic: echoes the prompt's last 12 characters; with a seed, a seeded random word per sample."""
    if request.params.seed is not None:
        rng = random.Random(request.params.seed * 1000 + index)
        return "".join(rng.choice("abcdefgh ") for _ in range(20))
    source = request.messages[-1]["content"] if request.messages else request.prompt
    text = source if isinstance(source, str) else "".join(map(chr, source))
    return f"echo: {text[-12:]}"


class FakeBackend(Backend):
    name = "fake"

    def __init__(
        self,
        reply: Callable[[GenerationRequest, int], str] = default_reply,
        *,
        served_model_name: str = "fake-model",
        max_model_len: int = 4096,
        token_delay: float = 0.0,
        max_in_flight: int | None = None,
    ) -> None:
        super().__init__(served_model_name=served_model_name, max_model_len=max_model_len)
        self.reply = reply
        self.token_delay = token_delay
        self.max_in_flight = max_in_flight
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.requests: list[GenerationRequest] = []
        self.healthy = HealthStatus(True)
        self.started = self.stopped = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    async def health(self) -> HealthStatus:
        return self.healthy

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.active),
            kv_cache_usage_perc=0.25,
            prefix_cache_queries=10,
            prefix_cache_hits=4,
        )

    async def tokenize(
        self,
        *,
        prompt: str | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        text = prompt if messages is None else "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return [ord(c) for c in text or ""]

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        if any(not 0 <= t < 0x110000 for t in token_ids):
            raise InvalidRequestError("token id out of range", param="tokens")
        return "".join(map(chr, token_ids))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if request.prompt == "" or request.prompt == []:
            raise InvalidRequestError(
                "the prompt is empty: it must contain at least one token", param="prompt"
            )
        if isinstance(request.prompt, list) and any(not 0 <= t < 0x110000 for t in request.prompt):
            # as the local backends check ids against their vocabulary (here: the code points)
            raise InvalidRequestError("prompt token id out of range", param="prompt")
        if self.max_in_flight is not None and len(self.active) >= self.max_in_flight:
            raise QueueFullError("the fake backend is full; retry later")
        self.requests.append(request)
        self.active.add(request.request_id)
        return ClosingStream(self._stream(request), lambda: self._closed(request.request_id))

    def _closed(self, request_id: str) -> None:
        if request_id in self.active:  # closed before it finished (maybe before it ever ran)
            self.active.discard(request_id)
            self.aborted.append(request_id)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        p = request.params
        rid = request.request_id
        if isinstance(request.prompt, list):
            prompt_tokens = len(request.prompt)
        else:
            prompt_tokens = len(await self.tokenize(prompt=request.prompt, messages=request.messages))
        total = 0
        finished = False
        try:
            yield GenerationChunk(rid, [], num_prompt_tokens=prompt_tokens, queue_time=0.0)
            for index in range(p.n):
                text = self.reply(request, index)
                matcher = StopStringMatcher(p.stop_strings, p.include_stop_str_in_output)
                limit = p.max_tokens if p.max_tokens is not None else self.max_model_len
                count = 0
                for ch in text:
                    if count >= limit:
                        break
                    if self.token_delay:
                        await asyncio.sleep(self.token_delay)
                    else:
                        await asyncio.sleep(0)
                    count += 1
                    out = matcher.feed(ch)
                    logprobs = None
                    if p.logprobs is not None:
                        top = tuple(
                            TopLogprob(chr(ord(ch) + j), -0.1 * (j + 1), ord(ch) + j)
                            for j in range(p.logprobs)
                        )
                        logprobs = [TokenLogprob(ch, -0.5, ord(ch), top)]
                    reason = "stop" if matcher.stopped is not None else ("length" if count >= limit else None)
                    if reason == "length":
                        out += matcher.flush()
                    yield GenerationChunk(rid, [SequenceDelta(index, out, [ord(ch)], logprobs, reason)])
                    if reason:
                        break
                else:
                    count += 1  # the eos token
                    yield GenerationChunk(rid, [SequenceDelta(index, matcher.flush(), [EOS], None, "stop")])
                total += count
            finished = True
            yield GenerationChunk(rid, [], finished=True, usage=Usage(prompt_tokens, total))
        finally:
            if finished:
                self.active.discard(rid)
            else:
                self._closed(rid)
