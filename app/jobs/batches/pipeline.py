"""The pipeline every OpenAI Batch API line runs as: one LLM call with the line's request body.

A line becomes an item with keyword inputs ``messages`` (the chat messages; a ``/v1/completions`` prompt is sent
as one user message) and ``options`` (the other body fields: temperature, max_tokens, seed, ...). The call goes
to the endpoint alias :data:`BATCH_ALIAS`, which the jobs runtime maps to the server's own model when no
resources file is configured (define the alias in the file otherwise). The output keeps the response text and
its metadata (model, finish reason, token counts, and ``tool_calls`` when the model called a tool), from which
the batch's output file is written. A line's ``response_format`` and ``tools`` / ``tool_choice`` travel with its
other fields: the model decodes under them, the text is the JSON it wrote, the calls are OpenAI's.
"""

from __future__ import annotations

from typing import Any

import app.pipeline.functional as F
from app.pipeline import LLMInference, Module

#: the endpoint alias batch lines call
BATCH_ALIAS = "batch"

#: the pipeline name batch jobs are registered under (an import path the job registry resolves)
BATCH_PIPELINE = "app.jobs.batches.pipeline:BatchRequest"


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
