"""Chat completions' messages in and ``chat.completion`` bodies / ``chat.completion.chunk`` events out,
tool calls included.

Tool calls reach a response in one of two ways: a :class:`~app.serving.tool_calls.ToolCallParser` per
choice reads them out of the generated text (in-process backends), or the upstream server reports them as
``tool_calls`` deltas that are passed on (proxy backends). Either way a choice that called a tool and stopped
finishes with ``"tool_calls"``, and its ``content`` is null when it said nothing else. Streamed, each parsed
call is one delta carrying the whole call (``index``, ``id``, ``type``, ``function.name`` and ``arguments``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from app.serving.backends.base import BackendError, GenerationChunk, SequenceDelta
from app.serving.errors import APIError, error_body
from app.serving.responses import DONE, Choice, UsageTally, aclose, chat_logprobs, sse, usage_body
from app.serving.schemas import ChatMessage
from app.serving.tool_calls import ToolCallParser, arguments_text, new_call_id

__all__ = ["chat_body", "chat_head", "chat_messages", "chat_sse"]

ParserFactory = Callable[[], ToolCallParser | None]


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as the backends take them: text content, plus tool calls and tool-call ids."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        bad = m.non_text_part()
        if bad is not None:
            raise APIError(
                400,
                "only text content parts ({'type': 'text', 'text': ...}) are supported by this server",
                param=f"messages[{i}].content[{bad}]",
            )
        if m.role == "function":
            raise APIError(
                400,
                "'function' messages are deprecated and not served here: send role 'tool' with a tool_call_id",
                param=f"messages[{i}].role",
            )
        if m.role == "tool" and not m.tool_call_id:
            raise APIError(
                400, "a tool message needs the tool_call_id of the call it answers", param=f"messages[{i}].tool_call_id"
            )
        item: dict[str, Any] = {"role": m.role, "content": m.text() or ""}
        if m.name is not None:
            item["name"] = m.name
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            item["content"] = m.text() or None
            item["tool_calls"] = _history_calls(m, i)
        out.append(item)
    return out


def _history_calls(m: ChatMessage, i: int) -> list[dict[str, Any]]:
    if m.role != "assistant":
        raise APIError(400, "only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
    calls = []
    for j, c in enumerate(m.tool_calls or ()):
        if c.type != "function":
            raise APIError(
                400, "only function tool calls are supported", param=f"messages[{i}].tool_calls[{j}].type"
            )
        function = {"name": c.function.name, "arguments": arguments_text(c.function.arguments)}
        calls.append({"id": c.id or new_call_id(), "type": "function", "function": function})
    return calls


def _finish(reason: str | None, called: bool) -> str:
    reason = reason or "stop"
    return "tool_calls" if called and reason == "stop" else reason


# ---------------------------------------------------------------------------------------------- whole
def chat_head(rid: str, created: int, model: str, obj: str = "chat.completion") -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model}


def chat_body(
    head: dict[str, Any], choices: list[Choice], usage: dict[str, int], want_logprobs: bool, parser: ParserFactory
) -> dict[str, Any]:
    out = []
    for i, c in enumerate(choices):
        text = "".join(c.text)
        calls = list(c.tool_calls)  # an upstream's
        content: str | None = text
        p = parser()
        if p is not None:
            content, parsed = p.parse(text)
            calls += parsed
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["content"] = content or None
            message["tool_calls"] = calls
        out.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(c.logprobs) if want_logprobs else None,
                "finish_reason": _finish(c.finish_reason, bool(calls) and p is not None),
            }
        )
    return {**head, "choices": out, "usage": usage, "system_fingerprint": None}


# ---------------------------------------------------------------------------------------------- streamed
class _DeltaShaper:
    """Backend deltas → ``choices`` entries of chat chunks, parsing tool calls per choice."""

    def __init__(self, n: int, want_logprobs: bool, parser: ParserFactory) -> None:
        self.want_logprobs = want_logprobs
        self.parsers = [parser() for _ in range(n)]
        self.emitted = [0] * n  # tool calls sent per choice (their ``index``)

    def choice(self, d: SequenceDelta) -> dict[str, Any] | None:
        entries = d.logprobs if self.want_logprobs else None
        content, calls = d.text, [dict(c) for c in d.tool_calls or ()]
        p = self.parsers[d.index] if d.index < len(self.parsers) else None
        if p is not None:
            content, parsed = p.feed(d.text)
            if d.finish_reason:
                rest, more = p.finish()
                content, parsed = content + rest, parsed + more
            for call in parsed:
                calls.append({"index": self.emitted[d.index], **call})
                self.emitted[d.index] += 1
        if not (content or calls or d.finish_reason or entries):
            return None
        delta: dict[str, Any] = {}
        if content or (entries and not calls):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        called = p is not None and p.calls_made > 0
        return {
            "index": d.index,
            "delta": delta,
            "logprobs": chat_logprobs(entries) if entries else None,
            "finish_reason": _finish(d.finish_reason, called) if d.finish_reason else None,
        }


async def chat_sse(
    head: dict[str, Any],
    stream: AsyncIterator[GenerationChunk],
    n: int,
    include_usage: bool,
    want_logprobs: bool,
    parser: ParserFactory,
) -> AsyncIterator[bytes]:
    head = {**head, "object": "chat.completion.chunk", "system_fingerprint": None}
    if include_usage:
        head["usage"] = None
    tally = UsageTally(1)
    shaper = _DeltaShaper(n, want_logprobs, parser)
    try:
        for i in range(n):
            role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield sse({**head, "choices": [role]})
        async for chunk in stream:
            tally.add(0, chunk)
            choices = [c for d in chunk.deltas if (c := shaper.choice(d)) is not None]
            if choices:
                yield sse({**head, "choices": choices})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage_body(tally.total())})
    except BackendError as exc:
        yield sse(error_body(exc.message, type=exc.type, param=exc.param, code=exc.code))
    finally:
        await aclose(stream)
    yield DONE
