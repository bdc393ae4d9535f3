"""scripts/engine_roofline.py's framework columns (issue 34): the same chain of products in each runner's library."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scripts import engine_roofline


def _weights() -> list[torch.Tensor]:
    """A Llama-like step of one layer (qkv wider than the hidden size, gate_up twice the down input) and a head."""
    g = torch.Generator().manual_seed(0)
    shapes = [(40, 16), (16, 16), (64, 16), (16, 32), (50, 16)]  # [out, in]
    return [torch.randn(shape, generator=g) * 0.1 for shape in shapes]


@pytest.mark.parametrize("framework", ["torch", "jax", "jax-bfloat16", "tinygrad"])
def test_every_framework_runs_the_step(framework: str) -> None:
    if framework != "torch":
        pytest.importorskip(framework.split("-")[0])
    step = engine_roofline.framework_step(framework, _weights(), rows=5, threads=2)
    assert engine_roofline.time_step(step, repeats=2) > 0


def test_fit_cuts_or_pads_to_the_next_input_width() -> None:
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.arange(12.0).reshape(3, 4)
    assert engine_roofline._fit(x, 2, jnp).tolist() == [[0, 1], [4, 5], [8, 9]]
    padded = engine_roofline._fit(x, 6, jnp)
    assert padded.shape == (3, 6) and padded[:, 4:].tolist() == [[0, 0]] * 3 and padded[:, :4].tolist() == x.tolist()
    tinygrad = pytest.importorskip("tinygrad")
    t = tinygrad.Tensor(x.tolist())
    assert engine_roofline._fit(t, 6, None).tolist() == padded.tolist()


def test_the_jax_step_chains_the_products_in_order() -> None:
    """Each product takes the previous output, cut or zero-padded to its input width: the same chain in torch."""
    pytest.importorskip("jax")
    weights = _weights()
    torch.manual_seed(1)  # jax_step draws its input with torch's generator
    got = torch.from_numpy(np.array(engine_roofline.jax_step(weights, 3, bfloat16=False)()))
    torch.manual_seed(1)
    x = torch.randn(3, weights[0].shape[1])
    for w in weights:
        have = x.shape[1]
        x = x[:, : w.shape[1]] if have >= w.shape[1] else torch.nn.functional.pad(x, (0, w.shape[1] - have))
        x = x @ w.T
    assert got.shape == (3, 50)
    assert torch.allclose(got, x, atol=1e-5)


def test_an_unknown_framework_is_refused() -> None:
    with pytest.raises(ValueError, match="framework must be one of"):
        engine_roofline.framework_step("mxnet", _weights(), rows=2, threads=1)
