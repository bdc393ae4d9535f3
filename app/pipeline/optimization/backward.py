"""Backward for LLM calls: feedback to the prompt input, and parameter feedback for a learnable system prompt."""

from __future__ import annotations

from typing import Any

from app.pipeline.optimization.types import BackwardContext, BackwardResult

_QUOTE_LIMIT = 1000


def _truncate(text: Any, limit: int = _QUOTE_LIMIT) -> str:
    s = str(getattr(text, "payload", text))
    return s if len(s) <= limit else s[:limit] + f"... [{len(s) - limit} more characters]"


async def llm_backward(module: Any, feedback: Any, ctx: BackwardContext) -> BackwardResult:
    result = BackwardResult(input_feedback={name: feedback for name in ctx.input_names()})
    param = module.system_prompt
    if param is not None and param.requires_grad:
        score = getattr(feedback, "score", None)
        content = getattr(feedback, "content", feedback)
        prompt_input = next(iter(ctx.inputs.values()), None)
        result.parameter_feedback[param.name or "system_prompt"] = (
            f"Parameter: {param.name}\n"
            f"Description: {param.description}\n"
            f"Current value: {_truncate(param.value)}\n"
            f"Input: {_truncate(prompt_input)}\n"
            f"Output: {_truncate(ctx.output)}\n"
            f"Score: {score if score is not None else 'n/a'}\n"
            f"Feedback: {_truncate(content)}"
        )
    return result
