"""Open operational routes: /health (liveness: 200, or 503 when the engine is dead or stalled), /ready (readiness:
503 also while the jobs database is unreachable or its schema is not at the Alembic head, with one line saying
why), /version and /metrics.

With Redis configured, /health also reports the platform's workers: which of them consume each queue, and the
problems a deployment cannot recover from (no worker on the sweeper's queue); they are reported, not failed on
(status 200 with ``"platform": {"status": "degraded", ...}``), so that an orchestrator does not restart API pods
for what only a worker can fix.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from starlette.concurrency import run_in_threadpool

from api.deps import get_serving
from api.responses import JSONBytes
from app.serving import OpenAIServing
from app.serving.errors import error_body
from app.serving.metrics import CONTENT_TYPE_LATEST
from app.version import version as installed_version

router = APIRouter()


def _unavailable(message: str, code: str | None) -> Response:
    return JSONBytes(error_body(message, type="service_unavailable", code=code), status_code=503)


async def _engine_down(serving: OpenAIServing) -> Response | None:
    status = await serving.health()
    return None if status.ok else _unavailable(status.detail, "engine_unhealthy")


@router.get("/health")
async def health(request: Request, serving: OpenAIServing = Depends(get_serving)) -> Response:
    if (down := await _engine_down(serving)) is not None:
        return down
    answer: dict[str, Any] = {"status": "ok"}
    probe = getattr(request.app.state, "platform_health", None)
    if probe is not None:
        answer["platform"] = await run_in_threadpool(probe)
    return JSONBytes(answer)


@router.get("/ready")
async def ready(request: Request, serving: OpenAIServing = Depends(get_serving)) -> Response:
    if (down := await _engine_down(serving)) is not None:
        return down
    report = await request.app.state.readiness.check()
    if not report.ok:
        return _unavailable(report.problem or "not ready", report.code)
    return JSONBytes({"status": "ready", "database": report.database})


@router.get("/version")
async def version() -> Response:
    return JSONBytes({"version": installed_version()})


@router.get("/metrics")
async def metrics(serving: OpenAIServing = Depends(get_serving)) -> Response:
    return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)
