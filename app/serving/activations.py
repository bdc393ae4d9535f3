"""``POST /v1/activations``: a prompt's residual stream after chosen layers, captured inside the engine's batch.

The prompt runs as a one-token greedy request whose ``SamplingParams.capture`` asks for the layers and positions;
the engine keeps only those rows (the other requests of its steps are untouched). ``activations`` is a nested
list, or with ``encoding_format: "base64"`` the little-endian float32 bytes in row-major order.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from app.engine.core.hidden_states import CaptureParams
from app.engine.core.sampling_params import SamplingParams
from app.serving.backends.base import Backend, GenerationChunk, GenerationRequest, InvalidRequestError
from app.serving.chat import chat_messages
from app.serving.errors import bad_request
from app.serving.schemas import ActivationsRequest

Opener = Callable[[Sequence[GenerationRequest]], Awaitable[list[AsyncIterator[GenerationChunk]]]]


async def prompt_activations(backend: Backend, open_streams: Opener, req: ActivationsRequest) -> dict[str, Any]:
    if not backend.supports_hidden_states:
        raise bad_request(f"activations need the native backend (our engine); this server runs the {backend.name} "
                          "backend", "model")
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of 'prompt' or 'messages'", "prompt")
    if isinstance(req.prompt, list | str) and not req.prompt:
        raise bad_request("prompt must not be empty", "prompt")
    try:
        capture = CaptureParams.parse({"layers": req.layers, "positions": req.positions})
        params = SamplingParams(max_tokens=1, temperature=0.0, capture=capture)
    except ValueError as exc:
        raise bad_request(str(exc).removeprefix("capture."), _field(str(exc))) from None
    rid = f"act-{uuid.uuid4().hex}"
    request = GenerationRequest(
        rid, params, prompt=req.prompt,
        messages=None if req.messages is None else chat_messages(req.messages),
        add_generation_prompt=req.add_generation_prompt,
    )
    try:
        (stream,) = await open_streams([request])
    except InvalidRequestError as exc:
        if exc.param not in ("capture", "interventions"):
            raise
        message = str(exc).removeprefix("capture.")
        raise bad_request(message, _field(message)) from None
    last: GenerationChunk | None = None
    prompt_len = 0
    async for chunk in stream:
        last = chunk
        prompt_len = chunk.num_prompt_tokens or prompt_len
    if isinstance(req.positions, list) and max(req.positions) >= prompt_len:
        raise bad_request(f"position {max(req.positions)} is past the prompt, which has {prompt_len} tokens "
                          f"(positions 0 to {prompt_len - 1})", "positions")
    if last is None or last.hidden_states is None or last.hidden_positions is None:
        raise bad_request("no position of the prompt is among 'positions'", "positions")
    positions = last.hidden_positions
    data = [_layer(layer, rows, req.encoding_format) for layer, rows in sorted(last.hidden_states.items())]
    return {"object": "list", "data": data, "positions": positions, "model": backend.served_model_name,
            "usage": {"prompt_tokens": prompt_len, "total_tokens": prompt_len}}


def _field(message: str) -> str:
    return "layers" if "layers" in message else "positions" if "positions" in message else "prompt"


def _layer(layer: int, rows: Any, encoding_format: str) -> dict[str, Any]:
    values = rows.float().contiguous()
    if encoding_format == "base64":
        payload: Any = base64.b64encode(values.numpy().astype("<f4").tobytes()).decode("ascii")
    else:
        payload = values.tolist()
    return {"object": "activations", "layer": layer, "shape": list(values.shape), "activations": payload}
