"""Small pipeline Modules with trainable prompts, shared by the optimization tests."""

from __future__ import annotations

from typing import Any

from app.pipeline import LLMInference, Module, Parameter


def prompt(value: str, what: str) -> Parameter:
    """A trainable system prompt: ``value``, described as ``what``."""
    return Parameter(value, description=what)


class Join(Module):
    """Two texts joined by `` | ``."""

    def forward(self, a: str, b: str) -> str:
        return f"{a} | {b}"


class FanOut(Module):
    """One draft read by two critics, whose notes are joined."""

    def __init__(self) -> None:
        super().__init__()
        self.draft = LLMInference("fast", system_prompt=prompt("Draft.", "drafting"))
        self.style = LLMInference("fast", system_prompt=prompt("Style?", "style critic"))
        self.facts = LLMInference("fast", system_prompt=prompt("Facts?", "fact critic"))
        self.join = Join()

    def forward(self, x: Any) -> Any:
        d = self.draft(x)
        return self.join(self.style(d), self.facts(d))
