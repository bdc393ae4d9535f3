"""LLMInference: the module for one LLM call, the leaf that the runtime turns into a request.

It sits above ``module`` (a Module like any other) and below the runtime and the optimizers: its backward is
the one ``app.pipeline.optimization`` installs with ``install_backward``.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from app.pipeline.demonstrations import Demonstrations
from app.pipeline.module import Module
from app.pipeline.parameter import Parameter
from app.pipeline.values import ValueKind

if TYPE_CHECKING:
    from app.pipeline.backward import BackwardContext, BackwardResult

#: ``backward(module, feedback, ctx)`` of an LLM call; installed by ``app.pipeline.optimization``
Backward = Callable[["LLMInference", Any, "BackwardContext"], Awaitable["BackwardResult"]]
_backward: Backward | None = None


def install_backward(backward: Backward) -> None:
    """Set the backward of every LLMInference (``app.pipeline.optimization`` installs ``llm_backward``)."""
    global _backward
    _backward = backward


#: ``tool_choice`` values that name no function
TOOL_CHOICE_MODES = ("none", "auto", "required")


def tool_definitions(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """``tools`` as OpenAI tool definitions: each one such a dict (``{"type": "function", "function": {"name",
    "description", "parameters"}}``), or a pydantic model class, which becomes a function of its name whose
    arguments are the model's fields (its docstring, if it has its own, is the description)."""
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if isinstance(tool, type) and issubclass(tool, BaseModel):
            function: dict[str, Any] = {"name": tool.__name__}
            if tool.__doc__ and "__doc__" in vars(tool):
                function["description"] = inspect.cleandoc(tool.__doc__)
            function["parameters"] = tool.model_json_schema()
            out.append({"type": "function", "function": function})
            continue
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(name, str) or not name:
            raise ValueError(
                f"tools[{i}] must be an OpenAI function tool ({{'type': 'function', 'function': {{'name': ..., "
                f"'parameters': {{...}}}}}}) or a pydantic model class, got {tool!r}"
            )
        out.append(dict(tool))
    names = [t["function"]["name"] for t in out]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"tools repeat the function name(s) {', '.join(map(repr, repeated))}")
    return out


def tool_choice_payload(choice: Any, tools: Sequence[dict[str, Any]] | None) -> Any:
    """``tool_choice`` in OpenAI's shape: ``"none"``, ``"auto"``, ``"required"``, or a named function, given as
    its name (or a pydantic tool class) or as ``{"type": "function", "function": {"name": ...}}``."""
    if choice is None or choice in TOOL_CHOICE_MODES:
        return choice
    if not tools:
        raise ValueError(f"tool_choice {choice!r} needs tools=[...]")
    if isinstance(choice, type):
        choice = choice.__name__
    if isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice}}
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    known = [t["function"]["name"] for t in tools]
    if name not in known:
        raise ValueError(
            f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or name one of the tools "
            f"({', '.join(known)}), got {choice!r}"
        )
    return choice


class LLMInference(Module):
    """One LLM call. ``alias`` is mapped to an endpoint by ``ResourceConfig`` at run time.

    Outputs, on every provider (the in-process engine, our server, vLLM, OpenAI):

    * plain: the response text (``ValueKind.RESPONSE``);
    * ``response_format=Model`` (a pydantic model, or any type pydantic can describe): the JSON schema is sent as
      OpenAI's ``json_schema`` response format (our engine and vLLM decode under it), the answer is validated
      with ``Model.model_validate_json`` and the output is the validated instance dumped to JSON
      (``model_dump(mode="json")``, ``ValueKind.STRUCTURED``), so that it travels through checkpoints, workers
      and job results unchanged: ``Model.model_validate(output)`` gives the instance back. An answer that does
      not validate is an error value naming the model and the finish reason;
    * ``tools=[...]`` (OpenAI function tools or pydantic model classes, see :func:`tool_definitions`), with an
      optional ``tool_choice`` (``"auto"``, ``"none"``, ``"required"`` or a tool's name): the output is
      ``{"content": <text, or None>, "tool_calls": [<OpenAI tool call>, ...]}`` (``ValueKind.STRUCTURED``), each
      call ``{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}`` as OpenAI returns it;
      ``tool_calls`` is empty when the model answered in text. With a ``response_format`` too, a text answer's
      content is the validated JSON (our engine refuses both at once unless ``tool_choice`` is ``"none"``).

    Every LLM output's meta carries the calls as ``tool_calls`` when there were any (so a plain call given
    ``tools`` at call time, as the Batch API does, still reports them).

    ``demos`` (a :class:`Demonstrations` parameter, or a plain list of ``{"input", "output"}`` dicts, which is
    frozen) are sent as user/assistant turns between the system prompt and the input, in order; an optimizer
    adds an empty learnable one to a call that has none with :meth:`attach_demos`.
    """

    graph_node_kind: ClassVar[str] = "llm"  # how a traced graph classifies its nodes
    attachable_parameters: ClassVar[frozenset[str]] = frozenset({"demos"})

    is_leaf = True
    demos: Demonstrations | None

    def __init__(
        self,
        alias: str,
        system_prompt: str | Parameter = "",
        temperature: float = 1.0,
        max_tokens: int | None = None,
        response_format: type | None = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = None,
        demos: Demonstrations | Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        if not alias or not isinstance(alias, str):
            raise ValueError("LLMInference needs an alias (a key of your ResourceConfig), e.g. alias='fast'")
        if max_tokens is not None and max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.alias = alias
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.response_format = response_format
        self.tools = tool_definitions(tools) if tools else None
        self.tool_choice = tool_choice_payload(tool_choice, self.tools)
        if isinstance(system_prompt, Parameter):
            self.system_prompt = system_prompt
        else:
            # frozen, but described, so that requires_grad_(True) can make it learnable like any other prompt
            self.system_prompt = Parameter(
                system_prompt, description=f"System prompt of the LLM call (alias {alias!r})", requires_grad=False
            )
        # like the system prompt: a Demonstrations is used as given, a plain list is frozen; None adds no parameter,
        # so the state of a call without demonstrations stays what it was
        if demos is None or isinstance(demos, Demonstrations):
            self.demos = demos
        else:
            self.demos = Demonstrations(demos, description=self._demos_description(), requires_grad=False)

    def _demos_description(self) -> str:
        where = f"{self._path()!r} " if self._parent is not None else ""
        return (
            f"Few-shot demonstrations of the LLM call {where}(alias {self.alias!r}): example inputs, each with "
            "the exact answer the call should give, shown to the model before its real input"
        )

    def attach_demos(self) -> Demonstrations:
        """This call's demonstrations, after adding an empty learnable list if it has none (what an optimizer
        searches on every call of a pipeline; stored as ``<path>.demos`` in the pipeline's state)."""
        if self.demos is None:
            self.demos = Demonstrations([], description=self._demos_description())
        return self.demos

    def attach_parameter(self, name: str) -> Parameter:
        if name == "demos":
            return self.attach_demos()
        return super().attach_parameter(name)

    def demo_messages(self) -> list[dict[str, str]]:
        """The chat turns the demonstrations add between the system prompt and the input (none without)."""
        return self.demos.messages() if self.demos is not None else []

    def node_config(self) -> dict[str, Any]:
        fmt = self.response_format
        config = {
            "alias": self.alias,
            "system_prompt": str(self.system_prompt.value),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "response_format": f"{fmt.__module__}:{fmt.__qualname__}" if fmt is not None else None,
        }
        # only when set: the graph hashes of calls without tools or demonstrations stay what they were
        if self.tools:
            config["tools"] = self.tools
        if self.demos is not None and self.demos.value:
            config["demos"] = self.demos.value
        if self.tool_choice is not None:
            config["tool_choice"] = self.tool_choice
        return config

    def output_kind(self) -> ValueKind:
        structured = self.response_format is not None or bool(self.tools)
        return ValueKind.STRUCTURED if structured else ValueKind.RESPONSE

    def forward(self, prompt: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "LLMInference runs through the runtime, not forward(): bind resources (module.bind(resources=...)) "
            "or use `async with ExecutionSettings(resources=...)`, then `await module(prompt)`"
        )

    async def backward(self, feedback: Any, ctx: BackwardContext) -> BackwardResult:
        """Feedback to the prompt input, and a parameter feedback for a learnable system prompt (the backward
        that ``app.pipeline.optimization`` installs)."""
        if _backward is None:
            raise RuntimeError("LLMInference.backward needs app.pipeline.optimization: import it first")
        return await _backward(self, feedback, ctx)
