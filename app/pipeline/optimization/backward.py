"""Backward for LLM calls: feedback to the prompt input, and parameter feedback for a learnable system prompt."""

from __future__ import annotations

from typing import Any

from app.pipeline.backward import BackwardContext, BackwardResult

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
        text = (
            f"Parameter: {param.name}\n"
            f"Description: {param.description}\n"
            f"Current value: {_truncate(param.value)}\n"
            f"Input: {_truncate(prompt_input)}\n"
            f"Output: {_truncate(ctx.output)}\n"
            f"Score: {score if score is not None else 'n/a'}\n"
            f"Feedback: {_truncate(content)}"
        )
        if ctx.reasoning_llm is not None:
            analysis = await _analyse(ctx.reasoning_llm, text)
            if analysis:
                text += f"\nAnalysis: {analysis}"
        result.parameter_feedback[param.name or "system_prompt"] = text
    return result


async def _analyse(reasoning_llm: Any, evidence: str) -> str:
    """Ask the optimizer's reasoning LLM what in the system prompt caused the feedback. Optional: an unusable
    answer leaves the plain evidence, which the optimizer can still act on."""
    from app.pipeline.optimization.llm import JudgeResponseError, non_empty

    prompt = (
        f"{evidence}\n\nWhich part of the parameter's current value most likely led to this output and feedback, "
        "and what specific change to it would help? Answer in at most three sentences."
    )
    ask = getattr(reasoning_llm, "ask", None)
    try:
        if ask is not None:
            return str(await ask(prompt, non_empty, attempts=2, what="an analysis"))
        return str(await reasoning_llm(prompt)).strip()
    except JudgeResponseError:
        return ""
