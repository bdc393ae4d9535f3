"""Dependencies: the serving object of this app, the Bearer API-key check for /v1/*, the caller's tenant, the
jobs and learning runtimes, and a database session per request (``DbSession``).

Routes that touch the database are plain ``def`` functions taking a ``DbSession``: FastAPI runs them in its thread
pool, and the session commits when the route returns, before the response is sent (a failed commit is an error
response, never a success whose data is lost)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request

from app.db import Session
from app.jobs.learning.runtime import LearningRuntime
from app.jobs.runtime import JobsRuntime
from app.jobs.tenants import ANONYMOUS, KeyRing
from app.serving import OpenAIServing
from app.serving.errors import unauthorized


def get_serving(request: Request) -> OpenAIServing:
    serving: OpenAIServing = request.app.state.serving
    return serving


def key_ring(request: Request) -> KeyRing:
    ring: KeyRing | None = getattr(request.app.state, "key_ring", None)
    if ring is None:
        ring = request.app.state.key_ring = KeyRing(request.app.state.settings.api_keys)
    return ring


async def require_api_key(request: Request) -> None:
    """401 unless ``Authorization: Bearer <key>`` names one of ``settings.api_keys`` (none configured = open);
    the key's tenant is kept on the request for :func:`get_owner`."""
    ring = key_ring(request)
    if ring.open:
        request.state.tenant = ANONYMOUS
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthorized(
            "You didn't provide an API key. Send it in the Authorization header: 'Authorization: Bearer YOUR_KEY'."
        )
    tenant = ring.tenant_of(token.strip())
    if tenant is None:
        raise unauthorized(
            "Incorrect API key provided. Use one of the keys configured in INF_ENGINE_API_KEYS."
        )
    request.state.tenant = tenant


def get_owner(request: Request) -> str:
    """The tenant that owns what this request creates and the only one that may read it (app/jobs/tenants.py):
    the tenant a ``tenant:key`` entry names, a hash of a bare key (never the key itself), or "anonymous" on a
    server without keys."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:  # a route outside the keyed routers: authenticate here
        ring = key_ring(request)
        _, _, token = request.headers.get("authorization", "").partition(" ")
        tenant = ring.tenant_of(token.strip())
        if tenant is None:
            raise unauthorized("Incorrect API key provided. Use one of the keys configured in INF_ENGINE_API_KEYS.")
    return str(tenant)


Owner = Annotated[str, Depends(get_owner)]


async def jobs_runtime(request: Request) -> JobsRuntime:
    runtime: JobsRuntime = request.app.state.jobs
    await runtime.ensure_started()
    return runtime


async def learning_runtime(request: Request) -> LearningRuntime:
    runtime: LearningRuntime = request.app.state.learning
    await runtime.ensure_started()
    return runtime


Runtime = Annotated[JobsRuntime, Depends(jobs_runtime)]
Learning = Annotated[LearningRuntime, Depends(learning_runtime)]


def db_session(runtime: Runtime) -> Iterator[Session]:
    """One session per request; it commits as the route returns (rolls back if the route raised)."""
    with runtime.session() as session:
        yield session


DbSession = Annotated[Session, Depends(db_session, scope="function")]
