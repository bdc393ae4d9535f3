"""Tools and tool turns in a local model's prompt: through its chat template when the template knows tools,
else through a documented text fallback.

A template "knows tools" when its source mentions ``tools`` (as transformers and vLLM decide). It then gets
``tools=[...]`` (OpenAI's definitions) and the history as OpenAI sends it, except that each call's
``arguments`` JSON string becomes an object, which is what Hugging Face templates iterate over.

The fallback (SmolLM2's template, and any plain chat template) renders everything as ordinary messages:

* the tools: a system-prompt section (``TOOL_PROMPT``) appended to the first system message, or a new first
  system message, listing each function as a JSON schema and asking for
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the format the structural tag enforces
  and ``ToolCallParser`` reads);
* an assistant turn with ``tool_calls``: its content followed by one such block per call;
* tool results: a ``user`` turn (every template accepts that role) holding one
  ``<tool_response>...</tool_response>`` block per result, consecutive results merged into one turn.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from app.serving.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

__all__ = ["TOOL_PROMPT", "fallback_messages", "messages_for_template", "template_supports_tools"]

TOOL_PROMPT = """# Tools
You can call these functions, given as JSON schemas:
<tools>
{tools}
</tools>
To call one, reply with <tool_call>{{"name": "<function name>", "arguments": {{...}}}}</tool_call> \
(one block per call); results come back in <tool_response></tool_response>. Otherwise answer normally."""

_TOOLS_WORD = re.compile(r"\btools\b")


def template_supports_tools(source: str | None) -> bool:
    return bool(source) and _TOOLS_WORD.search(str(source)) is not None


def _has_tool_turns(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def messages_for_template(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, supports_tools: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages to render and the extra template variables (``tools``), for a template that does or does
    not know tools. Without tools or tool turns, the messages are returned as they are."""
    if not tools and not _has_tool_turns(messages):
        return [dict(m) for m in messages], {}
    if not supports_tools:
        return fallback_messages(messages, tools), {}
    out = []
    for m in messages:
        item = dict(m)
        if item.get("tool_calls"):
            item["tool_calls"] = [_with_object_arguments(c) for c in item["tool_calls"]]
        out.append(item)
    return out, ({"tools": [dict(t) for t in tools]} if tools else {})


def _object_arguments(arguments: Any) -> Any:
    """A JSON string of arguments as the object it holds (left as sent when it is not JSON)."""
    if isinstance(arguments, str):
        try:
            return orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    return arguments


def _with_object_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    fn["arguments"] = _object_arguments(fn.get("arguments", {}))
    return {**call, "function": fn}


def _call_block(call: Mapping[str, Any]) -> str:
    fn = call.get("function") or {}
    arguments = _object_arguments(fn.get("arguments", {}))
    body = orjson.dumps({"name": fn.get("name", ""), "arguments": arguments}).decode()
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def tool_section(tools: Sequence[Mapping[str, Any]]) -> str:
    listed = "\n".join(orjson.dumps(dict(t)).decode() for t in tools)
    return TOOL_PROMPT.format(tools=listed)


def fallback_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """Tools, tool calls and tool results as plain system, assistant and user text (see the module doc)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        content = m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        item = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        item["content"] = content
        if m.get("tool_calls"):
            blocks = [_call_block(c) for c in m["tool_calls"]]
            item["content"] = "\n".join([content, *blocks] if content else blocks)
        out.append(item)
    for item in out:
        item.pop("_tool_results", None)
    if tools:
        section = tool_section(tools)
        if out and out[0].get("role") == "system":
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{first}\n\n{section}" if first else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
