"""The scripted classifier, optimizer and dataset that the training tests share."""

from __future__ import annotations

from app.pipeline.resources.types import LLMRequest

GOOD_PROMPT = "Answer with exactly one word: positive or negative."
DATASET = [
    {"input": "Great phone, I love it", "target": "positive"},
    {"input": "Broke after a day, awful", "target": "negative"},
    {"input": "Lovely screen and great battery", "target": "positive"},
    {"input": "Awful support, never again", "target": "negative"},
]


def scripted(alias: str, request: LLMRequest) -> str:
    """The classifier answers with a label only once its system prompt asks for one word; the optimizer's
    updater always proposes GOOD_PROMPT; a rubric judge is never asked in these tests."""
    if alias == "assistant":
        label = "positive" if any(w in str(request.prompt) for w in ("Great", "Lovely")) else "negative"
        if "one word" in str(request.system_prompt or ""):
            return label
        return f"I think this review is {label}, overall."
    if alias == "optimizer/updater":
        return GOOD_PROMPT
    if alias == "optimizer/aggregator":
        return "Reply with the label only."
    raise AssertionError(f"unexpected alias {alias}")
