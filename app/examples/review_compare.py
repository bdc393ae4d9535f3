"""The fan-out example: two independent extractions from a product review, then one comparison."""

from __future__ import annotations

from app.pipeline import LLMInference, Module, Parameter


class ReviewCompare(Module):
    """Extract the praise and the complaints of a review in parallel, then weigh them in one verdict."""

    def __init__(self) -> None:
        super().__init__()
        self.praise = LLMInference(
            alias="assistant",
            system_prompt="List what the customer liked in this review, in one short sentence.",
            temperature=0.0,
            max_tokens=48,
        )
        self.complaints = LLMInference(
            alias="assistant",
            system_prompt="List what the customer disliked in this review, in one short sentence.",
            temperature=0.0,
            max_tokens=48,
        )
        self.verdict = LLMInference(
            alias="assistant",
            system_prompt=Parameter(
                "Given what a customer liked and disliked, answer with one word, positive or negative.",
                description="Instruction that turns extracted praise and complaints into a one-word verdict",
            ),
            temperature=0.0,
            max_tokens=8,
        )

    def forward(self, review: str) -> dict[str, object]:
        liked = self.praise(review)
        disliked = self.complaints(review)
        verdict = self.verdict(f"Liked: {liked}\nDisliked: {disliked}\nVerdict:")
        return {"liked": liked, "disliked": disliked, "verdict": verdict}
