"""The FastAPI application: ``create_app(settings=None, backend=None)``.

The backend (from ``settings.backend`` unless given) is started in the app's lifespan and stopped at shutdown.
Routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/jobs, /v1/files, /v1/batches (Bearer keys from
``settings.api_keys``),
/tokenize, /detokenize, /health (liveness), /ready (readiness: the database at the schema's head), /version and
/metrics (open); /v1/engines is a deprecated alias of /v1/models. The jobs runtime (database, in-process queue) starts in
the lifespan when a database is configured or already exists, otherwise on the first jobs request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from api.docs import mount_docs
from api.errors import install_error_handlers
from api.middleware import RequestContextMiddleware, RequestGuardMiddleware
from api.platform import jobs_dispatcher, platform_collector, platform_health_probe
from api.routes import batches as batches_routes
from api.routes import evaluations as evaluations_routes
from api.routes import files as files_routes
from api.routes import jobs as jobs_routes
from api.routes import ops
from api.routes import trainings as trainings_routes
from api.routes.console import mount_console
from api.routes.openai import extras, v1
from app.jobs.learning.runtime import LearningRuntime
from app.jobs.registry import configure_registry
from app.jobs.runtime import JobsRuntime
from app.jobs.runtime.readiness import Readiness
from app.serving import OpenAIServing, ServingMetrics
from app.serving.backends import Backend, create_backend
from app.serving.embeddings import EmbeddingService
from app.settings import Settings, get_settings
from app.version import version

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None, backend: Backend | None = None, jobs: JobsRuntime | None = None
) -> FastAPI:
    settings = settings or get_settings()
    configure_registry(settings.pipeline_modules)  # what requests may name; a broken module fails here
    backend = backend or create_backend(settings)
    # jobs: the database and the in-process queue start only once jobs are used (or exist to be resumed)
    # (without a resources file, the jobs' pipelines call this server's own backend)
    # with Redis configured, jobs run on Celery workers and this process only dispatches them (api/platform.py)
    jobs = jobs or JobsRuntime(settings, backend=backend, dispatcher=jobs_dispatcher(settings))
    learning = LearningRuntime(jobs)  # trainings and evaluations, on the jobs' database and endpoints
    readiness = Readiness(jobs)  # /ready: the jobs database reachable and at the schema's head
    metrics = ServingMetrics(backend.served_model_name, backend.stats)
    platform = platform_collector(settings, jobs)  # inf_engine_* (jobs, queues, workers), from one replica
    metrics.registry.register(platform)
    embeddings = (EmbeddingService(settings.embedding_model, num_threads=settings.num_threads,
                                   dtype=settings.embedding_dtype)
                  if settings.embedding_model else None)
    if settings.pooler_config is not None and not backend.supports_hidden_states:
        raise ValueError(f"pooler_config pools our engine's hidden states: it needs the native backend, not "
                         f"{backend.name}")
    serving = OpenAIServing(backend, metrics, embeddings, settings.pooler_config)
    jobs.resources_for.serve_embeddings(serving.embed)  # the jobs' Embedding calls: this server's /v1/embeddings

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await backend.start()
        except ValueError as exc:  # a setting the backend refuses (max_model_len, dtype): one line before uvicorn's
            log.error("the %s backend cannot start: %s", backend.name, exc)
            raise
        try:
            if embeddings is not None:
                await embeddings.start()
            await jobs.start_if_configured()
            await learning.start_if_configured()
            yield
        finally:
            platform.close()  # another replica exports the cluster-wide series from its next scrape
            await readiness.stop()
            await learning.stop()
            await jobs.stop()
            if embeddings is not None:
                await embeddings.stop()
            await backend.stop()

    app = FastAPI(title="inf-engine", version=version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.platform_health = platform_health_probe(settings)  # /health: who consumes the sweeper's queue
    app.state.serving = serving
    app.state.backend = backend
    app.state.jobs = jobs
    app.state.learning = learning
    app.state.readiness = readiness
    install_error_handlers(app)
    app.include_router(v1)
    app.include_router(extras)
    app.include_router(jobs_routes.router)
    app.include_router(files_routes.router)
    app.include_router(batches_routes.router)
    app.include_router(trainings_routes.router)
    app.include_router(evaluations_routes.router)
    app.include_router(ops.router)
    mount_console(app)  # /console: the browser console (static pages over the /v1 API)
    mount_docs(app)  # /docs and /redoc, from the console's vendored bundles (nothing fetched elsewhere)
    # innermost first: the guard's 413s and 400s still pass CORS and get a request id and an access-log line
    app.add_middleware(RequestGuardMiddleware, max_bytes=settings.max_request_bytes)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-ID"],
        )
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    return app
