"""Per-step hooks on the residual stream, built by the model runner from the requests that ask for them
(``SamplingParams.capture`` / ``interventions``, see app.engine.core.hidden_states), and the store of what was
captured until the request finishes.

A step with hooks runs the Python layers (not the C decode layer, nor a CUDA graph); each hook touches only its
own request's rows of the flat batch, so the other requests of the step compute exactly what they would without
it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from app.engine.config import ModelConfig
from app.engine.core.hidden_states import wants
from app.engine.core.sampling_params import SamplingParams
from app.engine.core.sequence import Sequence

__all__ = ["CaptureStore", "StepHooks", "build_step_hooks", "check_hidden_state_params"]


def check_hidden_state_params(params: SamplingParams, config: ModelConfig, *, supported: bool) -> None:
    """ValueError (naming the field) for layers, vectors or heads the model does not have."""
    if params.capture is None and not params.interventions:
        return
    if not supported:
        raise ValueError("capture and interventions need a Llama-family model without speculative decoding")
    layers = config.num_layers
    if params.capture is not None and params.capture.layers[-1] >= layers:
        raise ValueError(f"capture.layers: layer {params.capture.layers[-1]} is out of range; the model has "
                         f"{layers} layers (0 to {layers - 1})")
    for i, item in enumerate(params.interventions or ()):
        if item.layer >= layers:
            raise ValueError(f"interventions[{i}].layer: layer {item.layer} is out of range; the model has {layers} "
                             f"layers (0 to {layers - 1})")
        if item.op == "add" and len(item.vector) != config.hidden_size:
            raise ValueError(f"interventions[{i}].vector has {len(item.vector)} values; the model's hidden size is "
                             f"{config.hidden_size}")
        if item.op == "zero_heads" and item.heads[-1] >= config.num_heads:
            raise ValueError(f"interventions[{i}].heads: head {item.heads[-1]} is out of range; the model has "
                             f"{config.num_heads} heads (0 to {config.num_heads - 1})")


@dataclass
class _Capture:
    request_id: str
    layers: tuple[int, ...]
    rows: torch.Tensor  # rows of the flat batch to keep
    positions: list[int]  # their token positions


@dataclass
class StepHooks:
    """What one step does to the residual stream, by layer; ``captured`` fills during the forward."""

    num_layers: int
    adds: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)  # rows, vector
    zero_heads: dict[int, list[tuple[torch.Tensor, list[int]]]] = field(default_factory=dict)  # rows, heads
    captures: list[_Capture] = field(default_factory=list)
    captured: list[tuple[str, int, list[int], torch.Tensor]] = field(default_factory=list)

    def after_block(self, layer: int, x: torch.Tensor, residual: torch.Tensor) -> None:
        """After block ``layer`` (the stream is ``x + residual``): add steering vectors to its rows (into the
        float32 residual), then keep the captured rows (the last block's are kept after the final norm)."""
        for rows, vector in self.adds.get(layer, ()):
            residual.index_add_(0, rows, vector.expand(rows.shape[0], -1))
        if layer == self.num_layers - 1:
            return
        for capture in self.captures:
            if layer in capture.layers:
                stream = x.index_select(0, capture.rows).float() + residual.index_select(0, capture.rows)
                self.captured.append((capture.request_id, layer, capture.positions, stream))

    def after_norm(self, hidden: torch.Tensor) -> None:
        last = self.num_layers - 1
        for capture in self.captures:
            if last in capture.layers:
                rows = hidden.index_select(0, capture.rows).float()
                self.captured.append((capture.request_id, last, capture.positions, rows))

    def attention_output(self, layer: int, out: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        """Zero the chosen heads' outputs in the chosen rows (before the output projection)."""
        for rows, chosen in self.zero_heads.get(layer, ()):
            view = out.view(out.shape[0], heads, head_dim)
            for head in chosen:
                view[rows, head] = 0
        return out


def build_step_hooks(seqs: list[Sequence], spans: list[tuple[int, int, int]], num_layers: int,
                     device: torch.device) -> StepHooks | None:
    """The hooks of one step. ``spans[i]`` is ``(first row, first position, rows)`` of ``seqs[i]``."""
    hooks: StepHooks | None = None
    for seq, (row0, pos0, count) in zip(seqs, spans, strict=True):
        params = seq.sampling_params
        if params.capture is None and not params.interventions:
            continue
        hooks = hooks or StepHooks(num_layers)
        prompt_len = len(seq.prompt_token_ids)
        positions = range(pos0, pos0 + count)
        for item in params.interventions or ():
            chosen = [row0 + p - pos0 for p in positions if item.op == "zero_heads" or wants(item.positions, p,
                                                                                          prompt_len)]
            if not chosen:
                continue
            rows = torch.tensor(chosen, dtype=torch.long, device=device)
            if item.op == "add":
                vector = torch.tensor(item.vector, dtype=torch.float32, device=device)
                hooks.adds.setdefault(item.layer, []).append((rows, vector))
            else:
                hooks.zero_heads.setdefault(item.layer, []).append((rows, list(item.heads)))
        capture = params.capture
        if capture is not None and seq.index == 0:
            keep = [p for p in positions if wants(capture.positions, p, prompt_len)]
            if keep:
                rows = torch.tensor([row0 + p - pos0 for p in keep], dtype=torch.long, device=device)
                hooks.captures.append(_Capture(seq.request_id, capture.layers, rows, keep))
    return hooks


class CaptureStore:
    """Captured rows per request, by layer and position, until the request's output takes them."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[int, dict[int, torch.Tensor]]] = {}

    def add(self, hooks: StepHooks) -> None:
        for request_id, layer, positions, rows in hooks.captured:
            by_position = self._rows.setdefault(request_id, {}).setdefault(layer, {})
            for position, row in zip(positions, rows.cpu(), strict=True):
                by_position[position] = row  # a recomputed position (after preemption) replaces the old row

    def pop(self, request_id: str) -> tuple[list[int], dict[int, torch.Tensor]] | None:
        """``(positions, {layer: [positions, hidden] float32})`` of a request, or None if it captured nothing."""
        layers = self._rows.pop(request_id, None)
        if not layers:
            return None
        positions = sorted({p for rows in layers.values() for p in rows})
        return positions, {layer: torch.stack([rows[p] for p in positions]) for layer, rows in sorted(layers.items())}

    def discard(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._rows)


def attach(output: Any, store: CaptureStore) -> None:
    """Move a finished request's captures onto its output (``hidden_states``, ``hidden_positions``)."""
    taken = store.pop(output.request_id)
    if taken is not None:
        output.hidden_positions, output.hidden_states = taken
