"""The JAX framework: the engine's models as jitted JAX functions on the shared engine core.

``layers`` (norms, RoPE, MLPs, paged attention), ``models`` (Llama family and GPT-2 over a params pytree taken
from the loaded PyTorch model) and ``runner`` (:func:`~app.engine.frameworks.jax.runner.make_runner`, the paged
KV cache in JAX arrays, bucketed step shapes). Imported only when an engine asks for ``framework="jax"``.
"""
