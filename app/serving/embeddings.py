"""``POST /v1/embeddings``: an embedding model served beside the chat model, its requests batched together.

Concurrent requests meet in one queue; a single worker takes everything waiting (up to ``max_batch_inputs``
inputs) and runs it as one call of the model, which groups the inputs by length itself, so many small requests
cost about what one large one does. Texts are tokenized in a worker thread (the Rust tokenizer releases the GIL)
and truncated to the model's input length as sentence-transformers does; token ids are used as given and must
fit it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.serving.errors import APIError, bad_request
from app.serving.schemas import EmbeddingRequest

if TYPE_CHECKING:  # numpy comes with the engine extra: a server without it still imports this module
    import numpy as np

log = logging.getLogger(__name__)

__all__ = ["EmbeddingService", "encode_embedding"]


@dataclass
class _Job:
    inputs: list[list[int]]
    done: asyncio.Future[Any] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class EmbeddingService:
    """One embedding model (an :class:`app.engine.embedding.EmbeddingModel`) and the worker that batches its
    requests."""

    def __init__(self, model: str, *, num_threads: int | None = None, max_batch_inputs: int = 256,
                 loaded: Any = None, dtype: str = "float32") -> None:
        self.spec = model
        self.num_threads = num_threads
        self.dtype = dtype
        self.max_batch_inputs = max_batch_inputs
        self.model: Any = loaded
        self._queue: asyncio.Queue[_Job] | None = None
        self._worker: asyncio.Task[None] | None = None
        self.created = int(time.time())

    # ------------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._worker is not None:
            return
        if self.model is None:
            from app.engine.embedding import EmbeddingModel

            self.model = await asyncio.to_thread(EmbeddingModel.load, self.spec, num_threads=self.num_threads,
                                                 dtype=self.dtype)
            log.info("embedding model %s ready: %d dimensions, %d input tokens, %s pooling%s", self.model.name,
                     self.model.dimensions, self.model.max_input_tokens, self.model.pooling,
                     ", normalised" if self.model.normalize else "")
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._run(), name="embeddings")

    async def stop(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker

    @property
    def name(self) -> str:
        return str(self.model.name) if self.model is not None else self.spec

    def card(self) -> dict[str, Any]:
        """The model's entry in ``/v1/models``."""
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "inf-engine",
                "root": self.name, "parent": None, "max_model_len": self.model.max_input_tokens}

    # ------------------------------------------------------------------------------------------ requests
    async def embed(self, req: EmbeddingRequest) -> dict[str, Any]:
        """The OpenAI response of one request (a 400 naming the field for input the model cannot take)."""
        model = self._require()
        dimensions = self._dimensions(req.dimensions)
        inputs = await self._token_ids(req.input)
        job = _Job(inputs)
        assert self._queue is not None
        await self._queue.put(job)
        vectors: np.ndarray = await job.done
        if dimensions != model.dimensions:  # a Matryoshka model: the leading dimensions, normalised again
            import numpy as np

            vectors = vectors[:, :dimensions]
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        tokens = sum(len(ids) for ids in inputs)
        data = [{"object": "embedding", "index": i, "embedding": encode_embedding(row, req.encoding_format)}
                for i, row in enumerate(vectors)]
        return {"object": "list", "data": data, "model": self.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _require(self) -> Any:
        if self.model is None or self._worker is None:
            raise APIError(503, "the embedding model is not loaded yet; retry shortly", type="server_error")
        return self.model

    def _dimensions(self, asked: int | None) -> int:
        model = self.model
        if asked is None or asked == model.dimensions:
            return int(model.dimensions)
        if not model.matryoshka:
            raise bad_request(f"model {self.name} gives {model.dimensions} dimensions and cannot shorten them; "
                              "leave 'dimensions' out", "dimensions")
        if asked > model.dimensions:
            raise bad_request(f"dimensions must be at most {model.dimensions} for {self.name}", "dimensions")
        return asked

    async def _token_ids(self, value: str | list[Any]) -> list[list[int]]:
        model = self.model
        if isinstance(value, str):
            value = [value]
        if isinstance(value[0], int):
            value = [value]
        if isinstance(value[0], str):
            return list(await asyncio.to_thread(model.tokenize, value))
        vocab = int(getattr(model, "vocab_size", 0) or getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
        for index, ids in enumerate(value):
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise bad_request("input must be a string, a list of strings, a list of token ids or a list of "
                                  "lists of token ids, not a mix", "input")
            if len(ids) > model.max_input_tokens:
                raise bad_request(f"input[{index}] has {len(ids)} tokens; {self.name} takes at most "
                                  f"{model.max_input_tokens}", "input")
            if vocab and max(ids) >= vocab:
                raise bad_request(f"input[{index}] holds token id {max(ids)}; {self.name}'s ids are below {vocab}",
                                  "input")
        return [list(ids) for ids in value]

    # ------------------------------------------------------------------------------------------ the worker
    async def _run(self) -> None:
        assert self._queue is not None
        while True:
            jobs = [await self._queue.get()]
            count = len(jobs[0].inputs)
            while not self._queue.empty() and count < self.max_batch_inputs:
                job = self._queue.get_nowait()
                jobs.append(job)
                count += len(job.inputs)
            live = [job for job in jobs if not job.done.cancelled()]
            if not live:
                continue
            try:
                vectors = await asyncio.to_thread(self._embed_all, [ids for job in live for ids in job.inputs])
            except Exception as exc:  # a failure is every waiting request's, not the worker's end
                log.exception("embedding a batch of %d inputs failed", count)
                for job in live:
                    if not job.done.done():
                        job.done.set_exception(APIError(500, f"embedding failed: {exc}", type="server_error"))
                continue
            start = 0
            for job in live:
                if not job.done.done():
                    job.done.set_result(vectors[start:start + len(job.inputs)])
                start += len(job.inputs)

    def _embed_all(self, inputs: list[list[int]]) -> np.ndarray:
        import numpy as np

        return np.ascontiguousarray(self.model.embed(inputs).float().numpy(), dtype=np.float32)


def encode_embedding(row: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's client decodes it
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in row]
