"""Exception handlers: every error leaves as an OpenAI error body with its HTTP status."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.engine.backends.base import BackendError
from app.jobs.errors import JobError
from app.serving.errors import APIError, error_body, from_validation_errors

log = logging.getLogger(__name__)

_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error"}


def api_error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


_JOB_STATUS = {"invalid_request": 400, "too_large": 413, "not_found": 404, "conflict": 409}


def job_api_error(exc: JobError) -> APIError:
    """The job layer's domain errors as HTTP: bad input 400, too large 413, unknown job 404, wrong state 409."""
    status = _JOB_STATUS.get(exc.kind, 400)
    code = exc.code or ("payload_too_large" if status == 413 else None)
    return APIError(status, exc.message, param=exc.param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(BackendError)
    async def _backend_error(request: Request, exc: BackendError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("backend error: %s", exc.message, extra={"request_id": _rid(request)})
        return api_error_response(APIError.from_backend(exc))

    @app.exception_handler(JobError)
    async def _job_error(request: Request, exc: JobError) -> JSONResponse:
        return api_error_response(job_api_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return api_error_response(from_validation_errors(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"There is no route {request.method} {request.url.path} on this server."
        body = error_body(message, type=_TYPES.get(exc.status_code, "invalid_request_error"))
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = _rid(request)
        log.exception("unhandled error", extra={"request_id": rid})
        body = error_body(
            f"The server failed on this request ({type(exc).__name__}); its log has the details under request id {rid}.",
            type="internal_server_error",
        )
        return JSONResponse(body, status_code=500)


def _rid(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")
