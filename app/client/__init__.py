"""The Python client of inf-engine's REST API: jobs, files, batches, trainings, evaluations and their schedules,
pipelines and their parameter versions, human feedback.

    from app.client import Client, NotFoundError

    with Client("http://127.0.0.1:8000", api_key="sk-...") as client:
        job = client.jobs.submit("review-compare", [{"input": {"review": "great"}}])
        job = client.jobs.wait(job.id)

``AsyncClient`` has the same methods as coroutines. Answers are the pydantic models of ``app.client.types`` (the
ones the server's OpenAPI document names). Errors carry the server's OpenAI-style body (``app.client.errors``).
The files and batches routes have OpenAI's shapes, so the ``openai`` package works against them too
(``OpenAI(base_url=".../v1", api_key=...)``)."""

from app.client import types
from app.client._core import DEFAULT_BASE_URL
from app.client._sync import SyncStream
from app.client.client import AsyncClient, Client, settings_defaults
from app.client.errors import (
    APIConnectionError,
    APIError,
    APIResponseValidationError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InfEngineError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    UnprocessableEntityError,
)

__all__ = [
    "DEFAULT_BASE_URL",
    "APIConnectionError",
    "APIError",
    "APIResponseValidationError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "ConflictError",
    "InfEngineError",
    "InternalServerError",
    "NotFoundError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "RateLimitError",
    "SyncStream",
    "UnprocessableEntityError",
    "settings_defaults",
    "types",
]
