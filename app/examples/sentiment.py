"""The training example: a one-call review classifier whose system prompt is learnable.

Its starting prompt does not say how to answer, so a chat model replies with a sentence; trained with a verifier
that wants exactly the label, ``positive``, ``negative`` or ``neutral`` (``inf-engine train sentiment ...``,
``metric: "exact"``), the optimizer rewrites the prompt from the verifier's feedback. Its labelled data ships
beside it: ``"dataset": "sentiment:train"`` (and ``:validation``, ``:test``; see ``app.examples.datasets``).
"""

from __future__ import annotations

from app.pipeline import LLMInference, Module, Parameter


class SentimentLabel(Module):
    """Label a product review as positive, negative or neutral with one LLM call."""

    def __init__(self) -> None:
        super().__init__()
        self.classify = LLMInference(
            alias="assistant",
            system_prompt=Parameter(
                "You read product reviews.",
                description="System prompt of the review classifier; the answer must be exactly one word, "
                            "positive, negative or neutral",
            ),
            temperature=0.0,
            max_tokens=8,
        )

    def forward(self, review: str) -> object:
        return self.classify(review)
