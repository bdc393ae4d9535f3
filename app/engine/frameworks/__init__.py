"""Model runners in other frameworks, on the same engine core.

The scheduler, block manager, sequences, sampling and stop handling are shared; a framework brings only the
model code and a runner that turns one :class:`~app.engine.core.scheduler.SchedulerOutput` into the logits of the
sequences that sample (a torch tensor, so the engine's sampler, structured outputs and logprobs are the same for
every framework). PyTorch is the engine's own runner (:mod:`app.engine.model_runner`, models in
:mod:`app.engine.models`); ``jax`` and ``tinygrad`` live in their folders here, each with ``models``, ``layers``
and ``runner`` modules, and take their weights from the loaded PyTorch model, so GGUF files and Hugging Face
folders load the same way for all of them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Literal, Protocol, get_args

if TYPE_CHECKING:
    import torch

    from app.engine.config import ModelConfig
    from app.engine.core.scheduler import SchedulerOutput
    from app.engine.core.sequence import Sequence
    from app.engine.hidden_states import CaptureStore
    from app.engine.model_runner import RunnerTimings
    from app.engine.models.base import PagedCausalLM

__all__ = [
    "FRAMEWORKS",
    "FrameworkName",
    "FrameworkRunner",
    "FrameworkUnavailableError",
    "build_runner",
    "check_framework",
]

FrameworkName = Literal["torch", "jax", "tinygrad"]
FRAMEWORKS: tuple[str, ...] = get_args(FrameworkName)

#: the module of each non-torch framework's runner, and the package it needs
_RUNNERS = {
    "jax": ("app.engine.frameworks.jax.runner", "jax"),
    "tinygrad": ("app.engine.frameworks.tinygrad.runner", "tinygrad"),
}


class FrameworkUnavailableError(RuntimeError):
    """The framework's package is not installed (install the matching extra)."""


class FrameworkRunner(Protocol):
    """What the engine needs of a model runner in any framework."""

    framework: str
    timings: RunnerTimings
    captures: CaptureStore  # hidden states: stays empty where the framework does not capture them
    #: how many step functions were compiled (traced) so far: bucketed shapes keep this small
    num_compilations: int

    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one scheduler step: the logits ``[n, vocab]`` (float32, CPU) of the ``n`` sequences that sample
        in it, and those sequences in the same order."""
        ...

    def warmup(self) -> None:
        """Compile the common step shapes before the first request."""
        ...


def check_framework(name: str) -> str:
    if name not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}; got {name!r}")
    return name


def build_runner(
    framework: str,
    model: PagedCausalLM,
    model_config: ModelConfig,
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    bfloat16_products: bool = False,
) -> FrameworkRunner:
    """The ``jax`` or ``tinygrad`` runner for a loaded float32 PyTorch model (its weights are copied into the
    framework's arrays); raises :class:`FrameworkUnavailableError` when the package is missing.
    ``bfloat16_products``: the jax runner's bfloat16 products (see ``EngineConfig.bfloat16_products``)."""
    check_framework(framework)
    if framework == "torch":
        raise ValueError("the torch framework uses app.engine.model_runner.ModelRunner")
    module_name, package = _RUNNERS[framework]
    try:
        importlib.import_module(package)
    except ImportError:
        raise FrameworkUnavailableError(
            f"framework {framework!r} needs {package}: pip install 'inf-engine[{framework}]'"
        ) from None
    module = importlib.import_module(module_name)
    runner: FrameworkRunner = module.make_runner(
        model,
        model_config,
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        **({"bfloat16_products": True} if bfloat16_products else {}),
    )
    return runner
