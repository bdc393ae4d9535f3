"""The OpenAI-compatible routes (Bearer key on /v1/*) and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from api.deps import get_serving, require_api_key
from api.disconnect import ClientDisconnected, until_disconnect
from api.responses import JSONBytes
from app.serving import OpenAIServing
from app.serving.openai_serving import model_card
from app.serving.schemas import (
    ActivationsRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)

v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
extras = APIRouter()

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED = 499  # nginx's code for "client closed request"; nobody reads it but the access log


def _respond(result: dict[str, Any] | AsyncIterator[bytes]) -> Response:
    if isinstance(result, dict):
        return JSONBytes(result)
    return StreamingResponse(result, media_type="text/event-stream", headers=_SSE_HEADERS)


@v1.get("/models")
async def list_models(serving: OpenAIServing = Depends(get_serving)) -> Response:
    return JSONBytes(await serving.list_models())


@v1.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, serving: OpenAIServing = Depends(get_serving)) -> Response:
    return JSONBytes(model_card(await serving.list_models(), model_id))


# OpenAI's older Engines API: kept as deprecated aliases of /v1/models, marked in the OpenAPI document and by a
# Deprecation header (RFC 9745) with a Link to the successor
DEPRECATION_HEADERS = {"Deprecation": "true", "Link": '</v1/models>; rel="successor-version"'}


@v1.get("/engines", deprecated=True, summary="List models (deprecated: use /v1/models)")
async def list_engines(serving: OpenAIServing = Depends(get_serving)) -> Response:
    return JSONBytes(await serving.list_models(), headers=DEPRECATION_HEADERS)


@v1.get("/engines/{engine_id:path}", deprecated=True, summary="Retrieve a model (deprecated: use /v1/models/{id})")
async def retrieve_engine(engine_id: str, serving: OpenAIServing = Depends(get_serving)) -> Response:
    return JSONBytes(model_card(await serving.list_models(), engine_id), headers=DEPRECATION_HEADERS)


@v1.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, serving: OpenAIServing = Depends(get_serving)
) -> Response:
    try:
        return _respond(await until_disconnect(request, serving.chat(body)))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)


@v1.post("/completions")
async def completions(
    body: CompletionRequest, request: Request, serving: OpenAIServing = Depends(get_serving)
) -> Response:
    try:
        return _respond(await until_disconnect(request, serving.completion(body)))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)


@v1.post("/activations")
async def activations(body: ActivationsRequest, serving: OpenAIServing = Depends(get_serving)) -> Response:
    return JSONBytes(await serving.activations(body))


@v1.post("/embeddings")
async def embeddings(body: EmbeddingRequest, serving: OpenAIServing = Depends(get_serving)) -> Response:
    return JSONBytes(await serving.embed(body))


@extras.post("/tokenize")
async def tokenize(body: TokenizeRequest, serving: OpenAIServing = Depends(get_serving)) -> Response:
    return JSONBytes(await serving.tokenize(body))


@extras.post("/detokenize")
async def detokenize(body: DetokenizeRequest, serving: OpenAIServing = Depends(get_serving)) -> Response:
    return JSONBytes(await serving.detokenize(body))
