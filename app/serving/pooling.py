"""``/v1/embeddings`` from the chat model itself (vLLM's ``--pooler-config``): its final hidden states, pooled.

Each input runs in the engine's batch as a one-token greedy request that captures the residual stream after the
last block (after the final norm, Hugging Face's ``hidden_states[-1]``): at the prompt's last token for ``LAST``
pooling, at every prompt token for ``MEAN``. All inputs of a request are submitted at once, so the engine batches
them with each other and with the chat requests in flight. ``normalize`` scales each vector to unit length.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from app.engine.core.hidden_states import CaptureParams
from app.engine.core.sampling_params import SamplingParams
from app.serving.backends.base import Backend, GenerationChunk, GenerationRequest, InvalidRequestError
from app.serving.embeddings import encode_embedding
from app.serving.errors import bad_request
from app.serving.schemas import EmbeddingRequest

if TYPE_CHECKING:  # numpy comes with the engine extra: a server without it still imports this module
    import numpy as np

Opener = Callable[[Sequence[GenerationRequest]], Awaitable[list[AsyncIterator[GenerationChunk]]]]

__all__ = ["DecoderPooling"]


class DecoderPooling:
    """The chat model's embeddings: ``pooling_type`` LAST or MEAN over its final hidden states."""

    def __init__(self, backend: Backend, open_streams: Opener, *, pooling_type: str, normalize: bool) -> None:
        if pooling_type not in ("LAST", "MEAN"):
            raise ValueError(f"pooling_type must be LAST or MEAN, got {pooling_type!r}")
        self.backend = backend
        self.open_streams = open_streams
        self.pooling_type = pooling_type
        self.normalize = normalize

    @property
    def name(self) -> str:
        return self.backend.served_model_name

    async def embed(self, req: EmbeddingRequest) -> dict[str, Any]:
        layers = self.backend.num_hidden_layers
        if not self.backend.supports_hidden_states or not layers:
            raise bad_request(f"model {self.name} does not pool on the {self.backend.name} backend", "model")
        width = self.backend.hidden_size
        if req.dimensions is not None and req.dimensions != width:
            raise bad_request(f"model {self.name} gives {width} dimensions and cannot shorten them; leave "
                              "'dimensions' out", "dimensions")
        capture = CaptureParams((layers - 1,), "last" if self.pooling_type == "LAST" else "all")
        params = SamplingParams(max_tokens=1, temperature=0.0, capture=capture)
        prompts = _prompts(req.input)
        requests = [GenerationRequest(f"emb-{uuid.uuid4().hex}", params, prompt=p) for p in prompts]
        try:
            streams = await self.open_streams(requests)
        except InvalidRequestError as exc:  # a prompt too long, a model whose hidden states cannot be captured
            if exc.param in ("capture", "interventions"):
                raise bad_request(f"model {self.name} cannot pool: {exc}", "model") from None
            raise bad_request(str(exc), "input") from None
        vectors, tokens = [], 0
        for stream in streams:
            vector, count = await self._pooled(stream, layers - 1)
            vectors.append(vector)
            tokens += count
        data = [{"object": "embedding", "index": i, "embedding": encode_embedding(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": self.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _pooled(self, stream: AsyncIterator[GenerationChunk], layer: int) -> tuple[np.ndarray, int]:
        last: GenerationChunk | None = None
        prompt_tokens = 0
        async for chunk in stream:
            last = chunk
            prompt_tokens = chunk.num_prompt_tokens or prompt_tokens
        if last is None or last.hidden_states is None or layer not in last.hidden_states:
            raise bad_request(f"model {self.name} returned no hidden states to pool", "model")
        import numpy as np

        rows = last.hidden_states[layer].float().numpy()
        vector = rows[-1] if self.pooling_type == "LAST" else rows.mean(axis=0)
        if self.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return np.asarray(vector, dtype=np.float32), prompt_tokens


def _prompts(value: str | list[Any]) -> list[str | list[int]]:
    """Each input as a prompt: a string, or token ids used as given."""
    if isinstance(value, str):
        return [value]
    if isinstance(value[0], int):
        return [list(value)]
    if all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value):
        return list(value)
    raise bad_request("input must be a string, a list of strings, a list of token ids or a list of lists of token "
                      "ids, not a mix", "input")
