"""Pipelines for the distributed tests (importable by the worker processes, which run from the repository root)."""

from __future__ import annotations

from app.pipeline import LLMInference, Module


class OneCall(Module):
    """A single LLM node per item: the shape of a plain batch of completions. Every answer is exactly 128 tokens
    (``ignore_eos``), so that decoding, not the platform, is what one item costs."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = LLMInference(alias="assistant", temperature=0.0, max_tokens=128)

    def forward(self, text: str) -> object:
        return self.answer(text, extra_body={"ignore_eos": True})
