"""Tool calling: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` → a :class:`ToolPlan`.

The plan says what the prompt shows (the tool definitions, rendered by ``tool_prompt``), what constrains
decoding on a backend with structured outputs, and how the output is read back (``tool_calls.ToolCallParser``):

* ``none``: no constraint, no parsing; the tools are left out of the prompt (the history's calls and results
  are still rendered).
* ``auto`` (the default with tools): a ``structural_tag``: the model writes text, and once it writes the
  trigger ``<tool_call>`` it must go on with ``{"name": "<a tool>", "arguments": `` + JSON under that tool's
  parameters schema + ``}</tool_call>``; so it chooses between answering and calling, and every call parses.
* ``required``: JSON under ``{"anyOf": [{"name": const, "arguments": <parameters>}, ...]}``, an array of
  those (``minItems`` 1) unless ``parallel_tool_calls`` is false.
* a named function: JSON under that function's parameters schema (the arguments object itself).

A function's ``strict`` flag is accepted and changes nothing: on a backend with structured outputs a forced
call always conforms. Without structured outputs (transformers), ``auto`` is parsed from free text and a
forced call is a 400 naming ``tool_choice``.

A backend whose upstream server does tools itself (``parses_tool_calls``: vLLM, an OpenAI-compatible proxy)
gets the fields as sent and reports ``tool_calls`` itself: the plan then neither constrains nor parses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from app.serving.errors import bad_request
from app.serving.schemas import ChatCompletionRequest
from app.serving.structured import Structure, check_json_schema, structure
from app.serving.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCallParser

__all__ = [
    "ToolPlan",
    "combined_structure",
    "forced_schema",
    "plan_tools",
    "structural_tag",
    "upstream_tool_fields",
]

Mode = Literal["none", "auto", "required", "named"]
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    functions: dict[str, dict[str, Any]]  # name -> parameters schema (checked)
    prompt_tools: list[dict[str, Any]] = field(default_factory=list)  # for the chat template
    named: str | None = None
    parallel: bool = True
    structure: Structure | None = None
    parse: bool = True  # read tool calls out of the text (False: the upstream reports them)

    def parser(self) -> ToolCallParser | None:
        if not self.parse or self.mode == "none":
            return None
        return ToolCallParser(self.mode, self.named, self.parallel)


def call_begin(name: str) -> str:
    """What the structural tag forces after the trigger, up to the arguments (the fallback prompt's format)."""
    return f'{TOOL_CALL_OPEN}{{"name": {orjson.dumps(name).decode()}, "arguments": '


def structural_tag(functions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "triggers": [TOOL_CALL_OPEN],
        "structures": [
            {"begin": call_begin(name), "schema": params, "end": "}" + TOOL_CALL_CLOSE}
            for name, params in functions.items()
        ],
    }


def forced_schema(functions: dict[str, dict[str, Any]], named: str | None, parallel: bool) -> dict[str, Any]:
    """The JSON schema a forced call is decoded under (see the module doc)."""
    if named is not None:
        return functions[named]
    options = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, params in functions.items()
    ]
    one: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


def _functions(req: ChatCompletionRequest) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    functions: dict[str, dict[str, Any]] = {}
    prompt_tools: list[dict[str, Any]] = []
    for i, tool in enumerate(req.tools or ()):
        if tool.type != "function":
            raise bad_request(
                f"tools[{i}] has type {tool.type!r}: only function tools ({{'type': 'function', 'function': "
                "{...}}) are supported by this server",
                f"tools[{i}].type",
            )
        fn = tool.function
        if fn is None:
            raise bad_request(f"tools[{i}] needs a 'function' object", f"tools[{i}].function")
        if fn.name in functions:
            raise bad_request(f"tools[{i}] repeats the function name {fn.name!r}", f"tools[{i}].function.name")
        where = f"tools[{i}].function.parameters"
        params = _NO_ARGUMENTS if fn.parameters is None else check_json_schema(fn.parameters, where)
        functions[fn.name] = params
        definition: dict[str, Any] = {"name": fn.name}
        if fn.description:
            definition["description"] = fn.description
        definition["parameters"] = params
        prompt_tools.append({"type": "function", "function": definition})
    return functions, prompt_tools


def _choice(req: ChatCompletionRequest, functions: dict[str, dict[str, Any]]) -> tuple[Mode, str | None]:
    choice = req.tool_choice
    if choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(choice, str):
        if choice == "required" and not functions:
            raise bad_request("tool_choice 'required' needs at least one tool in 'tools'", "tool_choice")
        return choice, None
    if choice.type != "function" or choice.function is None:
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if choice.function.name not in functions:
        known = ", ".join(functions) or "none"
        raise bad_request(
            f"tool_choice names the function {choice.function.name!r}, which is not in 'tools' (they are: {known})",
            "tool_choice",
        )
    return "named", choice.function.name


def plan_tools(req: ChatCompletionRequest, *, upstream: bool, constrain: bool) -> ToolPlan | None:
    """The request's tool plan, or None when it has no tools; a 400 naming the field for a bad one.

    ``upstream``: the backend forwards tools and reports calls itself. ``constrain``: it can decode under a
    structured-output constraint (without it, ``auto`` is parsed unconstrained and a forced call is refused).
    """
    functions, prompt_tools = _functions(req)
    mode, named = _choice(req, functions)
    if not functions:
        return None
    parallel = req.parallel_tool_calls is not False
    if upstream:
        return ToolPlan(mode, functions, prompt_tools, named, parallel, parse=False)
    if mode == "none":
        return ToolPlan(mode, functions, [], parse=False)
    if mode != "auto" and not constrain:
        raise bad_request(
            f"tool_choice {req.tool_choice if isinstance(req.tool_choice, str) else 'naming a function'} "
            "forces a call, which needs structured outputs: serve with the native or vllm backend",
            "tool_choice",
        )
    constraint = None
    if constrain:
        constraint = (
            structure("tools", structural_tag=structural_tag(functions))
            if mode == "auto"
            else structure("tools", json=forced_schema(functions, named, parallel))
        )
    return ToolPlan(mode, functions, prompt_tools, named, parallel, constraint)


def combined_structure(plan: ToolPlan | None, requested: Structure | None) -> Structure | None:
    """The one constraint to decode under: the tools' or the request's own; a 400 when both would apply."""
    if plan is None or plan.structure is None:
        return requested
    if requested is not None:
        raise bad_request(
            f"{requested.param} cannot be combined with tools on this backend unless tool_choice is 'none': "
            "the tool calls already constrain the output",
            requested.param,
        )
    return plan.structure


def upstream_tool_fields(req: ChatCompletionRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as the client sent them (for a proxy backend)."""
    out: dict[str, Any] = {}
    if req.tools is not None:
        out["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        out["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)
    if req.parallel_tool_calls is not None:
        out["parallel_tool_calls"] = req.parallel_tool_calls
    return out
