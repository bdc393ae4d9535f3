"""Exception handlers: every error leaves as an OpenAI error body with its HTTP status.

Hostile input is a 4xx, never a 5xx, and it is mapped here rather than in each route: values the database
refuses (a NUL character, a number out of range), input nested too deeply for the parsers, an oversized body
(raised by ``api.middleware.RequestGuardMiddleware``). A 500 is left for real bugs only.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.middleware import RequestTooLarge, too_large_response
from app.db.input_errors import CANDIDATE_TYPES, first_line, refused_input
from app.jobs.errors import JobError, QuotaExceeded
from app.serving.backends.base import BackendError
from app.serving.errors import APIError, bad_request, error_body, from_validation_errors, too_deep

log = logging.getLogger(__name__)

_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error"}


def api_error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


_JOB_STATUS = {"invalid_request": 400, "too_large": 413, "not_found": 404, "conflict": 409, "quota_exceeded": 429}


def job_api_error(exc: JobError) -> APIError:
    """The job layer's domain errors as HTTP: bad input 400, too large 413, unknown job 404, wrong state 409, a
    tenant's quota 429 (type ``quota_exceeded``, with ``Retry-After`` as OpenAI's 429s have)."""
    status = _JOB_STATUS.get(exc.kind, 400)
    code = exc.code or ("payload_too_large" if status == 413 else None)
    if isinstance(exc, QuotaExceeded):
        return APIError(status, exc.message, type="quota_exceeded", param=exc.param, code=code,
                        headers={"Retry-After": str(exc.retry_after_s)})
    return APIError(status, exc.message, param=exc.param, code=code)


def hostile_input_error(exc: BaseException) -> APIError | None:
    """The 400 for an exception that bad input causes wherever it is first noticed (often only by the database:
    a NUL in text, a number out of range; see ``app.db.input_errors``), or None for anything else."""
    if isinstance(exc, RecursionError):  # input nested deeper than some parser or encoder recurses
        return too_deep()
    refused = refused_input(exc)
    return None if refused is None else bad_request(refused.message, code=refused.code)


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

    @app.exception_handler(RequestTooLarge)
    async def _too_large(request: Request, exc: RequestTooLarge) -> JSONResponse:
        return too_large_response(exc)

    # the classes whose instances may be bad input: the others are re-raised, to the 500 below
    for kind in (*CANDIDATE_TYPES, RecursionError):
        app.add_exception_handler(kind, _hostile)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):  # FastAPI's body parsing
            return api_error_response(too_deep())
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


async def _hostile(request: Request, exc: Exception) -> JSONResponse:
    error = hostile_input_error(exc)
    if error is None:
        raise exc
    log.warning("bad input refused with %d: %s: %s", error.status, type(exc).__name__, first_line(exc),
                extra={"request_id": _rid(request)})
    return api_error_response(error)


def _rid(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")
