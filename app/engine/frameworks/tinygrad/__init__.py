"""The tinygrad framework: the engine's models on tinygrad Tensors (float32, CPU, kernels compiled by clang).

``layers`` (linear layers on panel weights, norms, RoPE, paged attention, the KV write kernel), ``models`` (Llama
family and GPT-2 over weights converted from the loaded PyTorch model), ``runner`` (:func:`runner.make_runner`, the
paged KV cache, bucketed TinyJit steps, :func:`runner.layer_outputs`), ``kernels`` (its custom UOp kernels) and
``tuning`` (their tile sizes, and the one setting made in code: tinygrad's default device is pinned to the CPU).

Importing this package does not import tinygrad; :mod:`.runner` does (``app.engine.frameworks.build_runner`` imports
it only for ``framework="tinygrad"``).
"""
