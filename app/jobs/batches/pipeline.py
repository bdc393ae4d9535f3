"""The pipelines OpenAI Batch API lines run as: one LLM call with the line's request body (chat and completion
lines), or one embeddings call (``/v1/embeddings`` lines, :class:`BatchEmbeddingRequest`).

A line becomes an item with keyword inputs ``messages`` (the chat messages; a ``/v1/completions`` prompt is sent
as one user message) and ``options`` (the other body fields: temperature, max_tokens, seed, ...). The call goes
to the endpoint alias :data:`BATCH_ALIAS`, which the jobs runtime maps to the server's own model when no
resources file is configured (define the alias in the file otherwise). The output keeps the response text and
its metadata (model, finish reason, token counts, and ``tool_calls`` when the model called a tool), from which
the batch's output file is written. A line's ``response_format`` and ``tools`` / ``tool_choice`` travel with its
other fields: the model decodes under them, the text is the JSON it wrote, the calls are OpenAI's.

An embeddings line becomes an item with keyword inputs ``input`` (OpenAI's: texts or token ids), ``dimensions``,
``encoding_format`` and ``options`` (its other fields, e.g. ``user``); the call goes to the same alias, which the
server maps to its ``/v1/embeddings`` (its embedding model, else its chat model's pooling). The output keeps the
vectors (floats: the output file encodes them as the line asked) and their metadata (model, token count).
"""

from __future__ import annotations

from typing import Any

import app.pipeline.functional as F
from app.pipeline import Embedding, LLMInference, Module

#: the endpoint alias batch lines call
BATCH_ALIAS = "batch"

#: the pipeline name batch jobs are registered under (an import path the job registry resolves)
BATCH_PIPELINE = "app.jobs.batches.pipeline:BatchRequest"
#: the pipeline ``/v1/embeddings`` batch jobs are registered under
BATCH_EMBEDDING_PIPELINE = "app.jobs.batches.pipeline:BatchEmbeddingRequest"


class BatchRequest(Module):
    """One request of a batch file, sent to the configured model."""

    def __init__(self) -> None:
        super().__init__()
        self.llm = LLMInference(BATCH_ALIAS)

    def forward(self, messages: Any, options: Any = None) -> dict[str, Any]:
        # the body's own fields travel as extra_body, which both the HTTP and the in-process clients apply last,
        # so the line's temperature, max_tokens, seed, stop, ... win over the module's defaults
        response = self.llm(messages, extra_body=options if options is not None else {})
        return {"text": response, "meta": F.extract_meta(response)}


class BatchEmbeddingRequest(Module):
    """One ``/v1/embeddings`` request of a batch file, sent to the configured embedding model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = Embedding(BATCH_ALIAS)

    def forward(self, input: Any, dimensions: Any = None, encoding_format: Any = "float",
                options: Any = None) -> dict[str, Any]:
        vectors = self.embed(input, dimensions=dimensions, extra_body=options if options is not None else {})
        return {"embeddings": vectors, "meta": F.extract_meta(vectors), "encoding_format": encoding_format}
