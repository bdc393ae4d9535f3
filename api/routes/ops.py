"""Open operational routes: /health (200, or 503 when the engine is dead or stalled) and /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from api.deps import get_serving
from api.responses import JSONBytes
from app.serving import OpenAIServing
from app.serving.errors import error_body
from app.serving.metrics import CONTENT_TYPE_LATEST

router = APIRouter()


@router.get("/health")
async def health(serving: OpenAIServing = Depends(get_serving)) -> Response:
    status = await serving.health()
    if status.ok:
        return JSONBytes({"status": "ok"})
    body = error_body(status.detail, type="service_unavailable", code="engine_unhealthy")
    return JSONBytes(body, status_code=503)


@router.get("/metrics")
async def metrics(serving: OpenAIServing = Depends(get_serving)) -> Response:
    return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)
