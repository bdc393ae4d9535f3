"""``AsyncClient`` and ``Client``: the REST API of an inf-engine server, resource by resource."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from app.client._core import DEFAULT_BASE_URL, DEFAULT_TIMEOUT, HTTPCore
from app.client._sync import LoopThread
from app.client.resources.files import AsyncBatches, AsyncFiles, Batches, Files
from app.client.resources.jobs import AsyncJobs, Jobs
from app.client.resources.learning import (
    AsyncEvaluations,
    AsyncFeedback,
    AsyncPipelines,
    AsyncSchedules,
    AsyncTrainings,
    Evaluations,
    Feedback,
    Pipelines,
    Schedules,
    Trainings,
)

if TYPE_CHECKING:
    from app.settings import Settings


def settings_defaults(settings: Settings) -> dict[str, Any]:
    """The server and key the CLI talks to by default: ``api_url`` (else ``http://serve_host:serve_port``) and
    ``api_key`` (else the first of ``api_keys``, as a server on this machine accepts it)."""
    url = settings.api_url or f"http://{settings.serve_host}:{settings.serve_port}"
    key = settings.api_key or (settings.api_keys[0] if settings.api_keys else None)
    return {"base_url": url, "api_key": key}


class AsyncClient:
    """The REST API of an inf-engine server, for asyncio code::

        async with AsyncClient("http://127.0.0.1:8000", api_key="sk-...") as client:
            job = await client.jobs.submit("review-compare", [{"input": {"review": "great"}}])
            async for result in client.jobs.results(job.id, follow=True):
                print(result.custom_id, result.output)

    ``base_url`` is the server's root (a trailing ``/v1`` is accepted); ``api_key`` is sent as a Bearer token and
    decides the tenant: every resource belongs to the tenant of the key that made it, and other tenants' are not
    found. Errors raise the classes of :mod:`app.client.errors`. ``transport`` replaces httpx's (tests).
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._core = HTTPCore(base_url or DEFAULT_BASE_URL, api_key, timeout=timeout, headers=headers,
                              transport=transport)
        self.jobs = AsyncJobs(self._core)
        self.files = AsyncFiles(self._core)
        self.batches = AsyncBatches(self._core)
        self.trainings = AsyncTrainings(self._core)
        self.evaluations = AsyncEvaluations(self._core)
        self.schedules = AsyncSchedules(self._core)
        self.pipelines = AsyncPipelines(self._core)
        self.feedback = AsyncFeedback(self._core)

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> AsyncClient:
        """A client for the server the settings name (see :func:`settings_defaults`); ``overrides`` that are not
        None win (``base_url=``, ``api_key=``, ``timeout=``...)."""
        return cls(**{**settings_defaults(settings), **{k: v for k, v in overrides.items() if v is not None}})

    @property
    def base_url(self) -> str:
        return self._core.base_url

    async def aclose(self) -> None:
        await self._core.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class Client:
    """The REST API of an inf-engine server, blocking::

        with Client("http://127.0.0.1:8000", api_key="sk-...") as client:
            job = client.jobs.submit("review-compare", [{"input": {"review": "great"}}])
            for result in client.jobs.results(job.id, follow=True):
                print(result.custom_id, result.output)

    The same methods as :class:`AsyncClient` (it runs them on an event loop of its own thread), returning their
    results instead of coroutines; streams are iterators. Close it (or use ``with``) to stop that thread.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._runner = LoopThread()
        self._async = AsyncClient(base_url, api_key, timeout=timeout, headers=headers, transport=transport)
        self.jobs = Jobs(self._runner, self._async.jobs)
        self.files = Files(self._runner, self._async.files)
        self.batches = Batches(self._runner, self._async.batches)
        self.trainings = Trainings(self._runner, self._async.trainings)
        self.evaluations = Evaluations(self._runner, self._async.evaluations)
        self.schedules = Schedules(self._runner, self._async.schedules)
        self.pipelines = Pipelines(self._runner, self._async.pipelines)
        self.feedback = Feedback(self._runner, self._async.feedback)

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> Client:
        """A client for the server the settings name (see :func:`settings_defaults`); ``overrides`` that are not
        None win (``base_url=``, ``api_key=``, ``timeout=``...)."""
        return cls(**{**settings_defaults(settings), **{k: v for k, v in overrides.items() if v is not None}})

    @property
    def base_url(self) -> str:
        return self._async.base_url

    def close(self) -> None:
        try:
            self._runner.run(self._async.aclose())
        finally:
            self._runner.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
