"""The FastAPI application: ``create_app(settings=None, backend=None)``.

The backend (from ``settings.backend`` unless given) is started in the app's lifespan and stopped at shutdown.
Routes: /v1/models, /v1/completions, /v1/chat/completions (Bearer keys from ``settings.api_keys``),
/tokenize, /detokenize, /health and /metrics (open).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from api.errors import install_error_handlers
from api.middleware import RequestContextMiddleware
from api.routes import ops
from api.routes.openai import extras, v1
from app.engine.backends import Backend, create_backend
from app.serving import OpenAIServing, ServingMetrics
from app.settings import Settings, get_settings


def create_app(settings: Settings | None = None, backend: Backend | None = None) -> FastAPI:
    settings = settings or get_settings()
    backend = backend or create_backend(settings)
    metrics = ServingMetrics(backend.served_model_name, backend.stats)
    serving = OpenAIServing(backend, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        try:
            yield
        finally:
            await backend.stop()

    app = FastAPI(title="inf-engine", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.serving = serving
    app.state.backend = backend
    install_error_handlers(app)
    app.include_router(v1)
    app.include_router(extras)
    app.include_router(ops.router)
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
