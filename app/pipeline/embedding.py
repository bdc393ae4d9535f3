"""Embedding: the module for one embeddings call (OpenAI's ``/v1/embeddings``), the leaf that the runtime turns
into a request, beside :class:`~app.pipeline.llm.LLMInference`.

It names an endpoint alias as an LLM call does, and its graph node is an endpoint call like theirs (kind ``llm``):
the alias's concurrency, adaptive rate limits, retries and the jobs' queues apply unchanged, in ``run()``, in
the server's embedded jobs and on Celery workers. ``graph_node_call`` tells the runner to send an embeddings
request instead of a chat.
"""

from __future__ import annotations

from typing import Any, ClassVar

from app.pipeline.module import Module
from app.pipeline.values import ValueKind


class Embedding(Module):
    """One embeddings call. ``alias`` is mapped to an endpoint by ``ResourceConfig`` at run time (OpenAI, vLLM,
    our server over HTTP, or the server's own embedding model for jobs on the server).

    ``await embed("a text")`` gives one vector (a list of floats); ``await embed(["a", "b"])`` a list of vectors,
    in input order (an empty list gives an empty list without a request). Token ids are taken too: a list of
    ints is one input, a list of such lists several. ``dimensions`` (here, or per call:
    ``embed(text, dimensions=256)``) asks a model that can shorten its vectors for the leading ones.

    The output is JSON data (``ValueKind.STRUCTURED``), so it travels through checkpoints, workers and job results
    unchanged; its meta carries ``model``, ``input_tokens`` (the endpoint's ``usage.prompt_tokens``),
    ``dimensions``, ``latency_ms`` and ``queue_time_ms``.
    """

    graph_node_kind: ClassVar[str] = "llm"  # an endpoint call: aliases, limits, retries and queues as for an LLM
    graph_node_call: ClassVar[str] = "embeddings"  # what the runner sends (an LLMInference's is a chat)

    is_leaf = True

    def __init__(self, alias: str, dimensions: int | None = None) -> None:
        super().__init__()
        if not alias or not isinstance(alias, str):
            raise ValueError("Embedding needs an alias (a key of your ResourceConfig), e.g. Embedding('embed')")
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or dimensions <= 0):
            raise ValueError(f"dimensions must be a positive integer, got {dimensions!r}")
        self.alias = alias
        self.dimensions = dimensions

    def node_config(self) -> dict[str, Any]:
        return {"alias": self.alias, "call": self.graph_node_call, "dimensions": self.dimensions}

    def output_kind(self) -> ValueKind:
        return ValueKind.STRUCTURED

    def forward(self, input: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "Embedding runs through the runtime, not forward(): bind resources (module.bind(resources=...)) or use "
            "`async with ExecutionSettings(resources=...)`, then `await module(text)`"
        )

    def __repr__(self) -> str:
        extra = f", dimensions={self.dimensions}" if self.dimensions is not None else ""
        return f"Embedding(alias={self.alias!r}{extra})"
