"""The structured-output example: one call that turns a product review into a validated record.

``LLMInference(response_format=ReviewFacts)`` sends the model's JSON schema with the request; our engine (and
vLLM, and OpenAI) decode under it, and the answer is validated with ``ReviewFacts.model_validate_json``. Each
item's output is the record as JSON (``ReviewFacts.model_validate(output)`` gives the instance back):

    inf-engine run review-extract --input app/examples/reviews.jsonl

Labelled records ship beside it (``"dataset": "review-extract:train"``, ``:validation``, ``:test``), scored field by
field with ``metric: "fields"``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from app.pipeline import LLMInference, Module


class ReviewFacts(BaseModel):
    """What a product review says, as fields a program can use."""

    sentiment: Literal["positive", "negative", "mixed"]
    rating: int = Field(ge=1, le=5, description="The stars the reviewer would give, from 1 to 5")
    would_recommend: bool = Field(description="Whether the reviewer would recommend the product")


class Extract(Module):
    """Extract the sentiment, a 1-5 rating and whether the reviewer recommends the product."""

    def __init__(self) -> None:
        super().__init__()
        self.extract = LLMInference(
            "assistant",
            system_prompt=(
                "Read the product review and answer with JSON: its sentiment (positive, negative or mixed), "
                "the rating the reviewer would give from 1 to 5, and whether they would recommend the product."
            ),
            temperature=0.0,
            max_tokens=64,
            response_format=ReviewFacts,
        )

    def forward(self, review: str) -> object:
        return self.extract(review)
