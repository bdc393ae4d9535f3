"""What a request asks of the residual stream: activations to capture and interventions to apply (no torch here;
the model runner turns them into per-step hooks, see app.engine.hidden_states).

Layer ``L`` (0-based) is Hugging Face's ``hidden_states[L + 1]``: the residual stream after block ``L``, and for
the last block the value after the final norm. Positions are token positions in the sequence (the prompt's, then
the generated tokens' as they are fed back): ``"all"``, ``"last"`` (the prompt's last token) or a list.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_POSITIONS = 4096  # positions listed explicitly in one capture or intervention

Positions = str | tuple[int, ...]


def parse_positions(value: Any, name: str) -> Positions:
    if value in ("all", "last"):
        return str(value)
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        raise ValueError(f"{name} must be 'all', 'last' or a non-empty list of token positions")
    if len(value) > MAX_POSITIONS:
        raise ValueError(f"{name} lists {len(value)} positions; at most {MAX_POSITIONS}")
    if not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in value):
        raise ValueError(f"{name} must hold token positions: integers >= 0")
    return tuple(sorted(set(value)))


def _layers(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        raise ValueError(f"{name} must be a non-empty list of layer numbers (0-based)")
    if not all(isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0 for layer in value):
        raise ValueError(f"{name} must hold layer numbers: integers >= 0")
    return tuple(sorted(set(value)))


@dataclass(frozen=True)
class CaptureParams:
    """Capture the residual stream after ``layers`` at ``positions``; the output's ``hidden_states`` holds one
    ``[positions, hidden]`` float32 tensor per layer."""

    layers: tuple[int, ...]
    positions: Positions = "last"

    @classmethod
    def parse(cls, value: Any) -> CaptureParams:
        if isinstance(value, CaptureParams):
            return value
        if not isinstance(value, Mapping):
            raise ValueError("capture must be {'layers': [...], 'positions': 'last' | 'all' | [...]}")
        unknown = set(value) - {"layers", "positions"}
        if unknown:
            raise ValueError(f"capture has unknown fields {sorted(unknown)}")
        return cls(_layers(value.get("layers"), "capture.layers"),
                   parse_positions(value.get("positions", "last"), "capture.positions"))


@dataclass(frozen=True)
class Intervention:
    """``op == "add"``: add ``vector`` to the residual stream after block ``layer`` at ``positions``;
    ``op == "zero_heads"``: zero the outputs of attention ``heads`` of block ``layer`` (every position)."""

    layer: int
    op: str
    vector: tuple[float, ...] = ()
    positions: Positions = "all"
    heads: tuple[int, ...] = ()

    @classmethod
    def parse(cls, value: Any, index: int = 0) -> Intervention:
        if isinstance(value, Intervention):
            return value
        name = f"interventions[{index}]"
        if not isinstance(value, Mapping):
            raise ValueError(f"{name} must be an object such as {{'layer': 3, 'op': 'add', 'vector': [...]}}")
        layer = value.get("layer")
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise ValueError(f"{name}.layer must be a layer number (an integer >= 0)")
        op = value.get("op")
        if op == "add":
            vector = value.get("vector")
            if not isinstance(vector, Sequence) or isinstance(vector, str) or not vector or not all(
                    isinstance(v, int | float) and not isinstance(v, bool) for v in vector):
                raise ValueError(f"{name}.vector must be a non-empty list of numbers (the model's hidden size)")
            return cls(layer, op, tuple(float(v) for v in vector),
                       parse_positions(value.get("positions", "all"), f"{name}.positions"))
        if op == "zero_heads":
            heads = value.get("heads")
            if not isinstance(heads, Sequence) or isinstance(heads, str) or not heads or not all(
                    isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in heads):
                raise ValueError(f"{name}.heads must be a non-empty list of head numbers (integers >= 0)")
            return cls(layer, op, heads=tuple(sorted(set(heads))))
        raise ValueError(f"{name}.op must be 'add' or 'zero_heads', got {op!r}")


def parse_interventions(value: Any) -> tuple[Intervention, ...] | None:
    if value is None:
        return None
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise ValueError("interventions must be a list of {'layer', 'op', ...} objects")
    return tuple(Intervention.parse(item, i) for i, item in enumerate(value)) or None


def cache_salt(interventions: tuple[Intervention, ...] | None) -> bytes | None:
    """What keeps an intervened request's KV blocks apart in the prefix cache: their keys and values differ
    from the same tokens' without the intervention (requests with the same interventions still share)."""
    if not interventions:
        return None
    text = json.dumps([[i.layer, i.op, i.vector, i.positions, i.heads] for i in interventions])
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def wants(positions: Positions, position: int, prompt_len: int) -> bool:
    """Whether token ``position`` is among ``positions`` ("last" is the prompt's last token)."""
    if positions == "all":
        return True
    if positions == "last":
        return position == prompt_len - 1
    return position in positions
