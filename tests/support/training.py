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


FEWSHOT_TRAIN = [
    {"input": f"{word} product number {i}", "target": "positive" if word in ("Great", "Lovely") else "negative"}
    for i, word in enumerate(["Great", "Awful", "Lovely", "Broken"] * 3)
]
FEWSHOT_VALIDATION = [
    {"input": f"{word} item, validation {i}", "target": "positive" if word in ("Great", "Lovely") else "negative"}
    for i, word in enumerate(["Lovely", "Broken", "Great", "Awful"])
]
WEAK_PROMPT = "You read product reviews carefully."


def scripted_fewshot(alias: str, request: LLMRequest) -> str:
    """The classifier answers with a bare label once it is shown a demonstration, else with a sentence; the
    updater proposes a rewrite that does not help (so only demonstrations can win)."""
    if alias == "assistant":
        turns = request.prompt if isinstance(request.prompt, list) else [{"role": "user", "content": request.prompt}]
        text = str(turns[-1]["content"])
        label = "positive" if any(w in text for w in ("Great", "Lovely")) else "negative"
        return label if len(turns) > 1 else f"I think this review is {label}, overall."
    if alias == "optimizer/updater":
        return WEAK_PROMPT
    if alias == "optimizer/aggregator":
        return "Reply with the label only."
    raise AssertionError(f"unexpected alias {alias}")
