"""Tool calls out of generated text, as OpenAI's ``tool_calls``: whole or streamed, one parser per choice.

Two shapes of output are parsed:

* ``auto``: free text in which each call is a block ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (the format the fallback tool prompt asks for and the structural tag enforces; Hermes/Qwen templates use
  it too, whitespace around the JSON allowed). Text outside the blocks is the message's ``content``.
* forced (``required`` or a named function): the whole output is JSON decoded under a schema: the
  arguments object of the named function, or ``{"name", "arguments"}`` (an array of them for parallel calls).

A block or forced output that does not parse (cut by ``max_tokens``, say) stays text: it is returned as
content, never as a call with broken arguments.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import orjson

log = logging.getLogger(__name__)

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ToolCallParser",
    "arguments_text",
    "merge_tool_call_deltas",
    "new_call_id",
    "tool_call",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
Mode = Literal["auto", "required", "named"]


def new_call_id() -> str:
    """OpenAI's shape: ``call_`` and 24 characters."""
    return "call_" + secrets.token_hex(12)


def arguments_text(arguments: Any) -> str:
    """Arguments as OpenAI sends them: a JSON string (a string given is kept as it is)."""
    if isinstance(arguments, str):
        return arguments
    return orjson.dumps(arguments if arguments is not None else {}).decode()


def tool_call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments_text(arguments)},
    }


def _call_of(obj: Any) -> dict[str, Any] | None:
    """``{"name": ..., "arguments": {...}}`` (``parameters`` is accepted for ``arguments``) as a tool call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return tool_call(obj["name"], arguments)


def _loads(text: str) -> Any:
    try:
        return orjson.loads(text.strip())
    except orjson.JSONDecodeError:
        return None


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (kept back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallParser:
    """Feeds on one choice's text deltas; returns the content that is safe to show and the calls completed.

    ``feed`` and ``finish`` return ``(content, calls)``; ``calls`` are OpenAI tool-call objects (``id``,
    ``type``, ``function``). ``calls_made`` counts every call returned so far.
    """

    def __init__(self, mode: Mode = "auto", name: str | None = None, parallel: bool = True) -> None:
        if mode == "named" and not name:
            raise ValueError("a named tool choice needs the function's name")
        self.mode = mode
        self.name = name
        self.parallel = parallel
        self.calls_made = 0
        self._text = ""  # auto: text not yet decided; forced: the whole output so far
        self._space = ""  # auto: whitespace after a call, held back
        self._in_call = False

    # ------------------------------------------------------------------------------------------ public
    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._text += text
        if self.mode != "auto":
            return "", []
        return self._scan(final=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self.mode != "auto":
            text, self._text = self._text, ""
            calls = self._forced(text)
            return ("", self._keep(calls)) if calls is not None else (text, [])
        return self._scan(final=True)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole output at once: ``(content, calls)``; with calls, content is stripped and None when empty
        (as OpenAI sends it)."""
        content, calls = self.feed(text)
        rest, more = self.finish()
        content, calls = content + rest, calls + more
        if calls:
            return content.strip() or None, calls
        return content, calls

    # ------------------------------------------------------------------------------------------ internals
    def _keep(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self.parallel and self.calls_made + len(calls) > 1:
            log.debug("parallel_tool_calls is false: keeping the first tool call only")
            calls = calls[: max(0, 1 - self.calls_made)]
        self.calls_made += len(calls)
        return calls

    def _forced(self, text: str) -> list[dict[str, Any]] | None:
        value = _loads(text)
        if self.mode == "named":
            return [tool_call(str(self.name), value)] if isinstance(value, dict) else None
        items = value if isinstance(value, list) else [value]
        calls = [_call_of(item) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]

    def _scan(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        out: list[str] = []
        calls: list[dict[str, Any]] = []
        buf = self._text
        while True:
            if self._in_call:
                end = buf.find(TOOL_CALL_CLOSE)
                if end < 0 and not final:
                    break
                body = buf if end < 0 else buf[:end]
                call = _call_of(_loads(body))
                if call is not None:
                    calls.extend(self._keep([call]))
                else:  # not a call after all: show it as the model wrote it
                    out.append(TOOL_CALL_OPEN + body + ("" if end < 0 else TOOL_CALL_CLOSE))
                buf = "" if end < 0 else buf[end + len(TOOL_CALL_CLOSE) :]
                self._in_call = False
                continue
            start = buf.find(TOOL_CALL_OPEN)
            if start >= 0:
                out.append(buf[:start])
                buf = buf[start + len(TOOL_CALL_OPEN) :]
                self._in_call = True
                continue
            keep = 0 if final else _held_prefix(buf, TOOL_CALL_OPEN)
            out.append(buf[: len(buf) - keep])
            buf = buf[len(buf) - keep :]
            break
        self._text = buf
        content = self._space + "".join(out)
        self._space = ""
        if self.calls_made and not content.strip():
            # Whitespace after a call is held until text follows it (then it is content) or the output ends.
            self._space, content = ("" if final else content), ""
        return content, calls


def merge_tool_call_deltas(
    calls: list[dict[str, Any]], deltas: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Accumulate streamed ``tool_calls`` deltas (an upstream's) into whole calls, by ``index``."""
    for delta in deltas:
        index = delta.get("index")
        index = index if isinstance(index, int) and index >= 0 else len(calls)
        while len(calls) <= index:
            calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        call = calls[index]
        if delta.get("id"):
            call["id"] = delta["id"]
        if delta.get("type"):
            call["type"] = delta["type"]
        fn = delta.get("function") or {}
        if isinstance(fn, Mapping):
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
    return calls
