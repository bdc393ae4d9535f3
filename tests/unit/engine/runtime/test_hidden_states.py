"""Activation capture and interventions inside continuous batching, against Hugging Face on a tiny random Llama:
captured layers equal ``output_hidden_states``; an ``add`` intervention gives the tokens of a forward hook adding
the same vector; ``zero_heads`` those of a hook zeroing the heads' slices before ``o_proj``; other requests of the
batch and the prefix cache are untouched."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from app.engine import LLMEngine, SamplingParams
from tests.support.engine_models import build_hf_model, hf_greedy, save_hf_model
from tests.support.engine_runtime import random_prompts

NAME = "llama_mqa_tied_linear"  # 3 layers, 4 heads of 12, tied embeddings, attention biases
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = build_hf_model(NAME).eval()
    folder = save_hf_model(hf, tmp_path_factory.mktemp("hidden") / NAME)
    return hf, folder


@pytest.fixture(scope="module")
def engine(tiny: tuple[Any, Path]) -> LLMEngine:
    return LLMEngine(tiny[1], dtype="float32", seed=0, kv_cache_memory_bytes=1 << 22)


def greedy(**extra: Any) -> SamplingParams:
    return SamplingParams(**{**GREEDY, **extra})


@contextmanager
def hooked(module: Any, hook: Callable[..., Any], pre: bool = False) -> Iterator[None]:
    handle = module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def test_captured_layers_equal_hugging_face(tiny: tuple[Any, Path], engine: LLMEngine) -> None:
    hf, _ = tiny
    prompt = random_prompts(1, 9, 9, seed=3)[0]
    layers = list(range(hf.config.num_hidden_layers))
    [out] = engine.generate([prompt], greedy(max_tokens=1, capture={"layers": layers, "positions": "all"}))
    with torch.no_grad():
        reference = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    assert out.hidden_positions == list(range(len(prompt)))
    assert out.hidden_states is not None and sorted(out.hidden_states) == layers
    for layer in layers:
        ours, theirs = out.hidden_states[layer], reference[layer + 1][0]
        assert ours.shape == theirs.shape and ours.dtype == torch.float32
        assert (ours - theirs).abs().max() <= 1e-4 * max(1.0, float(theirs.abs().max()))
    [last] = engine.generate([prompt], greedy(max_tokens=1, capture={"layers": [1], "positions": "last"}))
    assert last.hidden_positions == [len(prompt) - 1]
    assert torch.allclose(last.hidden_states[1][0], out.hidden_states[1][-1], atol=1e-5)


def test_generated_positions_are_captured_too(engine: LLMEngine) -> None:
    prompt = random_prompts(1, 5, 5, seed=4)[0]
    [out] = engine.generate([prompt], greedy(max_tokens=4, capture={"layers": [0], "positions": "all"}))
    # the prompt's 5 positions and the first 3 generated tokens (the 4th is sampled, never fed back)
    assert out.hidden_positions == list(range(8)) and out.hidden_states[0].shape == (8, 48)
    [some] = engine.generate([prompt], greedy(max_tokens=4, capture={"layers": [0], "positions": [1, 6]}))
    assert some.hidden_positions == [1, 6]
    assert torch.allclose(some.hidden_states[0], out.hidden_states[0][[1, 6]], atol=1e-5)


def test_an_add_intervention_matches_a_forward_hook(tiny: tuple[Any, Path], engine: LLMEngine) -> None:
    hf, _ = tiny
    prompt = random_prompts(1, 6, 6, seed=5)[0]
    vector = torch.randn(hf.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 4
    layer = 1

    def add(_module: Any, _args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden + vector
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    with hooked(hf.model.layers[layer], add):
        expected, _ = hf_greedy(hf, prompt, 8)
    plain, _ = hf_greedy(hf, prompt, 8)
    assert expected != plain  # the vector changes the greedy tokens
    intervention = [{"layer": layer, "op": "add", "vector": vector.tolist(), "positions": "all"}]
    [steered] = engine.generate([prompt], greedy(interventions=intervention))
    assert steered.outputs[0].token_ids == expected


def test_zero_heads_matches_zeroing_them_before_o_proj(tiny: tuple[Any, Path], engine: LLMEngine) -> None:
    hf, _ = tiny
    prompt = random_prompts(1, 6, 6, seed=6)[0]
    head_dim = hf.config.hidden_size // hf.config.num_attention_heads

    def zero(_module: Any, args: Any) -> Any:
        x = args[0].clone()
        for head in (0, 2):
            x[..., head * head_dim:(head + 1) * head_dim] = 0
        return (x, *args[1:])

    with hooked(hf.model.layers[0].self_attn.o_proj, zero, pre=True):
        expected, _ = hf_greedy(hf, prompt, 8)
    [ours] = engine.generate([prompt], greedy(interventions=[{"layer": 0, "op": "zero_heads", "heads": [2, 0]}]))
    assert ours.outputs[0].token_ids == expected


def test_other_requests_and_the_prefix_cache_are_untouched(tiny: tuple[Any, Path], engine: LLMEngine) -> None:
    hf, _ = tiny
    prompts = random_prompts(6, 20, 36, seed=7)  # several blocks each: the prefix cache has something to share
    clean = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy())]
    vector = [5.0] * hf.config.hidden_size
    params = [greedy()] * 6
    params[2] = greedy(interventions=[{"layer": 0, "op": "add", "vector": vector}],
                       capture={"layers": [2], "positions": "last"})
    mixed = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for i, o in enumerate(mixed) if i != 2] == clean[:2] + clean[3:]
    assert mixed[2].outputs[0].token_ids != clean[2] and mixed[2].hidden_states is not None
    assert all(o.hidden_states is None for i, o in enumerate(mixed) if i != 2)
    again = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy())]  # cached blocks stay clean
    assert again == clean


@pytest.mark.parametrize(("extra", "message"), [
    ({"capture": {"layers": [3]}}, "capture.layers: layer 3 is out of range; the model has 3 layers"),
    ({"interventions": [{"layer": 0, "op": "add", "vector": [1.0]}]}, "vector has 1 values; the model's hidden"),
    ({"interventions": [{"layer": 0, "op": "zero_heads", "heads": [4]}]}, "head 4 is out of range"),
    ({"interventions": [{"layer": 0, "op": "scale"}]}, "op must be 'add' or 'zero_heads'"),
    ({"capture": {"layers": [0], "positions": list(range(5000))}}, "at most 4096"),
])
def test_what_the_model_does_not_have_is_refused(engine: LLMEngine, extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt_token_ids=[5, 6, 7], sampling_params=greedy(**extra))
    assert not engine.has_unfinished_requests()


def test_an_intervened_request_never_serves_its_blocks_to_clean_ones(tiny: tuple[Any, Path],
                                                                     engine: LLMEngine) -> None:
    hf, folder = tiny
    prompts = random_prompts(3, 40, 40, seed=8)
    clean = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy())]
    fresh = LLMEngine(folder, dtype="float32", seed=0, kv_cache_memory_bytes=1 << 22)
    steer = [{"layer": 0, "op": "add", "vector": [3.0] * hf.config.hidden_size}]
    [steered] = fresh.generate([prompts[0]], greedy(interventions=steer))  # its blocks are cached first
    assert steered.outputs[0].token_ids != clean[0]
    assert [o.outputs[0].token_ids for o in fresh.generate(prompts, greedy())] == clean
    [again] = fresh.generate([prompts[0]], greedy(interventions=steer))  # the same intervention shares them
    assert again.outputs[0].token_ids == steered.outputs[0].token_ids and again.num_cached_tokens > 0
