"""How to speculate: :class:`SpeculativeConfig`, parsed from a dict, a JSON string or itself."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.engine.models.base import PagedCausalLM

__all__ = ["SPEC_METHODS", "SpeculativeConfig"]

SPEC_METHODS = ("ngram", "draft_model")
_METHOD_ALIASES = {"ngram": "ngram", "[ngram]": "ngram", "draft_model": "draft_model", "draft": "draft_model"}


@dataclass
class SpeculativeConfig:
    """How to speculate; vLLM's ``speculative_config`` keys.

    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}``, or
    ``{"method": "draft_model", "model": PATH_OR_LOADED_MODEL, "num_speculative_tokens": 4}``. The draft model
    must share the target's tokenizer (its vocabulary may be smaller, never larger). With a ``model`` and no
    ``method``, the method is ``draft_model``.
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    # n-gram: the longest and shortest suffix looked up (one given: both that value; none: 4 and 1)
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # draft_model: an HF folder, a .gguf file, or an already loaded engine model (the target itself works)
    model: str | Path | PagedCausalLM | None = None
    # No proposals while this many sequences or more are running (big batches are compute-bound already).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        method = self.method
        if method is None:
            if self.model is None:
                raise ValueError(
                    "speculative_config needs a 'method': 'ngram', or 'draft_model' with a 'model'"
                )
            method = "draft_model"
        resolved = _METHOD_ALIASES.get(str(method))
        if resolved is None:
            raise ValueError(f"speculative method {method!r} is not supported; use one of {SPEC_METHODS}")
        self.method = resolved
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1 or None, got {self.disable_by_batch_size}")
        if resolved == "ngram":
            if self.model is not None:
                raise ValueError("the ngram method takes no 'model'; use method 'draft_model' for a draft")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo, hi = 1, 4
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            assert lo is not None and hi is not None
            if lo < 1 or hi < lo:
                raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        elif self.model is None:
            raise ValueError("the draft_model method needs a 'model' (a path or a loaded model)")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from itself, a dict, or a JSON object string (the ``INF_ENGINE_SPECULATIVE_CONFIG``
        form); None, ``""`` and ``{}`` mean no speculation."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError(
                f"speculative_config must be a dict or a JSON object, got {type(value).__name__}"
            )
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(value))

    def describe(self) -> dict[str, Any]:
        """The settings as plain values (a loaded model shows as its name)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        model = out["model"]
        if model is not None and not isinstance(model, str | Path):
            out["model"] = getattr(getattr(model, "config", None), "name", "") or type(model).__name__
        elif isinstance(model, Path):
            out["model"] = str(model)
        return out
