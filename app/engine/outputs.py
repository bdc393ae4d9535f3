"""What the engine hands back per request, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.engine.metrics import RequestMetrics

__all__ = ["CompletionOutput", "RequestOutput"]


@dataclass
class CompletionOutput:
    """One of a request's ``n`` samples.

    ``token_ids`` includes a final eos / stop token id (as vLLM does); ``text`` never includes it, nor a
    matched stop string (unless ``include_stop_str_in_output``). ``logprobs`` is None unless the request
    asked for them; otherwise one dict per output token mapping the sampled token and the top
    ``logprobs`` alternatives to their log-probabilities.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step (cumulative: ``text`` is everything generated so far)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.capture, once finished: {layer: [positions, hidden] float32} at the token positions listed
    hidden_states: dict[int, Any] | None = field(default=None, repr=False)
    hidden_positions: list[int] | None = None

    @property
    def text(self) -> str:
        """Shortcut for the first sample's text (the common n=1 case)."""
        return self.outputs[0].text if self.outputs else ""
