"""The training example: a one-call review classifier whose system prompt is learnable.

Its starting prompt does not say how to answer, so a chat model replies with a sentence; trained with a verifier
that wants exactly the label, ``positive`` or ``negative`` (``inf-engine train sentiment ...``,
``metric: "exact"``), the optimizer searches the prompt and few-shot demonstrations. Its labelled data ships
beside it: ``"dataset": "sentiment:train"`` (and ``:validation``, ``:test``; see ``app.examples.datasets``).
"""

from __future__ import annotations

from app.pipeline import LLMInference, Module, Parameter


class SentimentLabel(Module):
    """Label a product review as positive or negative with one LLM call."""

    def __init__(self) -> None:
        super().__init__()
        self.classify = LLMInference(
            alias="assistant",
            system_prompt=Parameter(
                "You read product reviews.",
                description="System prompt of the review classifier; the answer must be exactly one word, "
                            "positive or negative",
            ),
            temperature=0.0,
            max_tokens=8,
        )

    def forward(self, review: str) -> object:
        return self.classify(review)
