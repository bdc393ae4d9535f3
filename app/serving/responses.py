"""Pieces of OpenAI response bodies and SSE events shared by chat and completions: logprobs, usage, choices."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from app.serving.backends.base import GenerationChunk, TokenLogprob, Usage
from app.serving.tool_calls import merge_tool_call_deltas

__all__ = [
    "DONE",
    "Choice",
    "UsageTally",
    "aclose",
    "chat_logprobs",
    "collect",
    "completion_logprobs",
    "sse",
    "usage_body",
]

DONE = b"data: [DONE]\n\n"
_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def _lp(value: float) -> float:
    return value if value > _MIN_LOGPROB else _MIN_LOGPROB


async def aclose(stream: AsyncIterator[Any]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": _lp(e.logprob),
                "bytes": list(e.token.encode("utf-8")),
                "top_logprobs": [
                    {"token": t.token, "logprob": _lp(t.logprob), "bytes": list(t.token.encode("utf-8"))}
                    for t in e.top
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: Sequence[TokenLogprob], start_offset: int) -> tuple[dict[str, Any], int]:
    """The legacy completions logprobs object, and the text offset after its tokens."""
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    offset = start_offset
    for e in entries:
        tokens.append(e.token)
        values.append(_lp(e.logprob))
        tops.append({t.token: _lp(t.logprob) for t in e.top})
        offsets.append(offset)
        offset += len(e.token)
    body = {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
    return body, offset


def usage_body(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


@dataclass
class Choice:
    """One choice's output, collected for a non-streaming response."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # an upstream's, merged from its deltas


def collect(choices: list[Choice], chunk: GenerationChunk, base: int) -> None:
    for d in chunk.deltas:
        c = choices[base + d.index]
        if d.text:
            c.text.append(d.text)
        if d.logprobs:
            c.logprobs.extend(d.logprobs)
        if d.tool_calls:
            merge_tool_call_deltas(c.tool_calls, d.tool_calls)
        c.num_tokens += len(d.token_ids)
        if d.finish_reason:
            c.finish_reason = d.finish_reason


class UsageTally:
    """Usage over several prompts' streams: the backend's final usage, else what the chunks showed."""

    def __init__(self, num_prompts: int) -> None:
        self.prompt = [0] * num_prompts
        self.completion = [0] * num_prompts
        self.final: dict[int, Usage] = {}

    def add(self, p: int, chunk: GenerationChunk) -> None:
        if chunk.num_prompt_tokens is not None:
            self.prompt[p] = chunk.num_prompt_tokens
        for d in chunk.deltas:
            self.completion[p] += len(d.token_ids)
        if chunk.usage is not None:
            self.final[p] = chunk.usage

    def total(self) -> Usage:
        prompt = completion = 0
        for p in range(len(self.prompt)):
            u = self.final.get(p)
            prompt += u.prompt_tokens if u else self.prompt[p]
            completion += u.completion_tokens if u else self.completion[p]
        return Usage(prompt, completion)
