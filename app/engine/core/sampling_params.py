"""Per-request sampling and stopping options, named and defaulted like vLLM's ``SamplingParams``."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SamplingParams"]

# Below this temperature a request is treated as greedy (argmax); dividing logits by ~0 would overflow.
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    After construction ``stop`` and ``stop_token_ids`` are always lists and ``top_k`` is ``-1`` when off,
    so consumers never have to handle the ``None``/``str``/``0`` spellings callers may use.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = -1  # -1, 0 or None: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16  # None: until the context length runs out
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token's
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.top_k is None or self.top_k == 0:
            self.top_k = -1
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self._validate()
        if self.is_greedy:
            # Greedy ignores the truncation knobs; resetting them lets the sampler skip that work.
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` with its normalised type, for type-checked callers."""
        return self.stop if isinstance(self.stop, list) else []

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or None (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (or None for no limit), got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be less than or equal to max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0 (or None), got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError("stop must not contain empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or ()):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")
        for token_id, bias in (self.logit_bias or {}).items():
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {token_id!r}")
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias for token {token_id} must be finite, got {bias}")
