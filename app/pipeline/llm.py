"""LLMInference: the module for one LLM call, the leaf that the runtime turns into a request.

It sits above ``module`` (a Module like any other) and below the runtime and the optimizers: its backward is
the one ``app.pipeline.optimization`` installs with ``install_backward``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from app.pipeline.module import Module
from app.pipeline.parameter import Parameter
from app.pipeline.values import ValueKind

if TYPE_CHECKING:
    from app.pipeline.optimization.types import BackwardContext, BackwardResult

#: ``backward(module, feedback, ctx)`` of an LLM call; installed by ``app.pipeline.optimization``
Backward = Callable[["LLMInference", Any, "BackwardContext"], Awaitable["BackwardResult"]]
_backward: Backward | None = None


def install_backward(backward: Backward) -> None:
    """Set the backward of every LLMInference (``app.pipeline.optimization`` installs ``llm_backward``)."""
    global _backward
    _backward = backward


class LLMInference(Module):
    """One LLM call. ``alias`` is mapped to an endpoint by ``ResourceConfig`` at run time."""

    is_leaf = True

    def __init__(
        self,
        alias: str,
        system_prompt: str | Parameter = "",
        temperature: float = 1.0,
        max_tokens: int | None = None,
        response_format: type | None = None,
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
        if isinstance(system_prompt, Parameter):
            self.system_prompt = system_prompt
        else:
            # frozen, but described, so that requires_grad_(True) can make it learnable like any other prompt
            self.system_prompt = Parameter(
                system_prompt, description=f"System prompt of the LLM call (alias {alias!r})", requires_grad=False
            )

    def node_config(self) -> dict[str, Any]:
        fmt = self.response_format
        return {
            "alias": self.alias,
            "system_prompt": str(self.system_prompt.value),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "response_format": f"{fmt.__module__}:{fmt.__qualname__}" if fmt is not None else None,
        }

    def output_kind(self) -> ValueKind:
        return ValueKind.STRUCTURED if self.response_format is not None else ValueKind.RESPONSE

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
