"""Per-request sampling and stopping options, named and defaulted like vLLM's ``SamplingParams``, and the
structured-output (guided decoding) spec, vLLM's ``StructuredOutputsParams``.

Only the spec lives here (plain data, checked on construction); compiling it and masking tokens is done by
``app.engine.guided``, outside the torch-free core.
"""

from __future__ import annotations

import json as jsonlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from app.engine.core.hidden_states import CaptureParams, Intervention, parse_interventions

__all__ = ["SamplingParams", "StructuredOutputsParams"]

# Below this temperature a request is treated as greedy (argmax); dividing logits by ~0 would overflow.
_GREEDY_EPS = 1e-5

_STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")



@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a grammar: set exactly one field.

    ``json``: a JSON schema (a dict, or its JSON text); ``regex``: a regular expression the whole output
    matches; ``choice``: the output is one of these strings; ``grammar``: an EBNF grammar in xgrammar's GBNF
    dialect (``root ::= ...``); ``json_object``: any JSON object; ``structural_tag``: free text until one of
    ``triggers`` appears, then the structure whose ``begin`` it starts, its ``schema`` as JSON, and its
    ``end``. Missing, doubled or malformed fields raise ValueError naming them; whether a schema, regex or
    grammar compiles (and its size limit) is checked when the request is added to an engine.
    """

    json: dict[str, Any] | str | None = None  # a JSON schema (object or JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # an EBNF grammar (xgrammar's GBNF dialect)
    json_object: bool = False  # any JSON object
    # {"triggers": ["<tool_call>"], "structures": [{"begin": "<tool_call>", "schema": {...},
    # "end": "</tool_call>"}]}: free text until a trigger, then the structure's schema
    structural_tag: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_FIELDS)}; "
                f"got {' and '.join(given) if given else 'none'}"
            )
        self._check(given[0])

    def _given(self) -> list[str]:
        return [
            f
            for f in _STRUCTURED_FIELDS
            if (self.json_object is True if f == "json_object" else getattr(self, f) is not None)
        ]

    @property
    def kind(self) -> str:
        """The name of the field that is set."""
        return self._given()[0]

    @property
    def value(self) -> Any:
        """The value of the field that is set (a JSON schema given as text stays text)."""
        return getattr(self, self.kind)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> StructuredOutputsParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(value))

    def _check(self, kind: str) -> None:
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = jsonlib.loads(schema)
                except jsonlib.JSONDecodeError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError(
                    f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}"
                )
        elif kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        elif kind == "choice":
            choice = self.choice
            if (
                not isinstance(choice, list | tuple)
                or not choice
                or any(not isinstance(c, str) or not c for c in choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            self.choice = list(choice)
        elif kind == "structural_tag":
            _check_structural_tag(self.structural_tag)


def _check_structural_tag(tag: Any) -> None:
    name = "structured_outputs.structural_tag"
    if not isinstance(tag, Mapping):
        raise ValueError(f"{name} must be an object")
    if tag.get("type") == "structural_tag":
        return  # xgrammar's own structural-tag format: checked when compiled
    triggers, structures = tag.get("triggers"), tag.get("structures")
    if (
        not isinstance(triggers, list)
        or not triggers
        or any(not isinstance(t, str) or not t for t in triggers)
    ):
        raise ValueError(f"{name}.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"{name}.structures must be a non-empty list")
    for i, s in enumerate(structures):
        if not isinstance(s, Mapping) or not all(
            isinstance(s.get(k), str) and s.get(k) for k in ("begin", "end")
        ):
            raise ValueError(f"{name}.structures[{i}] needs non-empty string 'begin' and 'end'")
        if not isinstance(s.get("schema"), dict | bool):
            raise ValueError(f"{name}.structures[{i}].schema must be a JSON schema object")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"{name}.structures[{i}].begin {s['begin']!r} starts with none of the triggers")


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
    # Guided decoding: the output follows this grammar (see StructuredOutputsParams); a dict is converted.
    structured_outputs: StructuredOutputsParams | None = None
    # Sample best_of candidates (sharing the prompt's KV blocks) and return the n with the highest
    # cumulative logprob; None: n. Needs random sampling; the output comes once every candidate finished.
    best_of: int | None = None
    # Hidden states (app.engine.core.hidden_states): capture the residual stream after some layers (the output's
    # hidden_states), and interventions on it (steering vectors, zeroed attention heads); this request only.
    capture: CaptureParams | None = None
    interventions: tuple[Intervention, ...] | None = None

    def __post_init__(self) -> None:
        if self.capture is not None:
            self.capture = CaptureParams.parse(self.capture)
        self.interventions = parse_interventions(self.interventions)
        if isinstance(self.structured_outputs, Mapping):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
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
    def num_candidates(self) -> int:
        """Sequences sampled for the request: ``best_of`` when given, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_sample_logprob(self) -> bool:
        """Whether the sampler must report the sampled token's logprob: asked for, or to rank best_of."""
        return self.logprobs is not None or self.num_candidates > self.n

    def check_streamable(self) -> None:
        """Raise ValueError if the request cannot be streamed (for servers, when ``stream`` is true): with
        ``best_of > n`` the returned sequences are only known once every candidate finished."""
        if self.num_candidates > self.n:
            raise ValueError(f"best_of ({self.best_of}) > n ({self.n}) cannot be streamed; set stream=false")

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
        if self.best_of is not None:
            if isinstance(self.best_of, bool) or not isinstance(self.best_of, int) or self.best_of < self.n:
                raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
            if self.best_of > 1 and self.is_greedy:
                raise ValueError(
                    f"best_of must be 1 when using greedy sampling (temperature 0), got {self.best_of}"
                )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams or a dict, "
                f"got {type(self.structured_outputs).__name__}"
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
