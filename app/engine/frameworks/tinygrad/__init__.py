"""The tinygrad framework: the engine's models on tinygrad Tensors (float32, CPU, kernels compiled by clang).

``layers`` (linear layers on panel weights, norms, RoPE, paged attention, the KV write kernel), ``models`` (Llama
family and GPT-2 over weights converted from the loaded PyTorch model), ``runner`` (:func:`runner.make_runner`, the
paged KV cache, bucketed TinyJit steps, :func:`runner.layer_outputs`), ``tuning`` (the code-generation settings it
sets in code: tinygrad's default device is pinned to the CPU and ``DMC=1``; see that module).

Importing this package does not import tinygrad; :mod:`.runner` does (``app.engine.frameworks.build_runner`` imports
it only for ``framework="tinygrad"``).
"""

from app.engine.frameworks.tinygrad.tuning import set_environment

set_environment()  # before any module here imports tinygrad
