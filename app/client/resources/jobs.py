"""``/v1/jobs``: submit a pipeline over items, read, list, wait, cancel, stream the results, trace, items."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import httpx

from app.client._core import body, path, query
from app.client._sync import SyncResource, sync_method, sync_stream
from app.client.resources.base import AsyncResource, wait_terminal
from app.client.types import ItemList, Job, JobList, JobResult


class AsyncJobs(AsyncResource):
    async def submit(
        self,
        pipeline: str,
        inputs: Iterable[Any] | str | None = None,
        *,
        input_file_id: str | None = None,
        priority: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        """Run the registered ``pipeline`` over ``inputs`` (items: ``{"custom_id", "input"}`` objects or bare
        inputs, or JSONL text) or over an uploaded file (``input_file_id``). Lower ``priority`` runs first.
        Submitting again with the same ``idempotency_key`` returns the first job."""
        items = inputs if inputs is None or isinstance(inputs, str) else list(inputs)
        payload = body(pipeline=pipeline, inputs=items, input_file_id=input_file_id, priority=priority,
                       metadata=None if metadata is None else dict(metadata), idempotency_key=idempotency_key)
        return await self._core.call(Job, "POST", "/v1/jobs", json=payload)

    async def get(self, job_id: str) -> Job:
        return await self._core.call(Job, "GET", path("/v1/jobs/{}", job_id))

    async def list(
        self,
        *,
        status: str | Iterable[str] | None = None,
        pipeline: str | None = None,
        after: str | None = None,
        limit: int | None = None,
    ) -> JobList:
        """The caller's jobs, newest first (``after=page.last_id`` for the next page while ``page.has_more``)."""
        params = query(status=_csv(status), pipeline=pipeline, after=after, limit=limit)
        return await self._core.call(JobList, "GET", "/v1/jobs", params=params)

    async def cancel(self, job_id: str) -> Job:
        """Ask the job to stop: it is ``cancelling`` until its running nodes finish, then ``cancelled``."""
        return await self._core.call(Job, "POST", path("/v1/jobs/{}/cancel", job_id))

    async def wait(self, job_id: str, *, poll_interval: float = 0.5, timeout: float | None = None) -> Job:
        """The job once it is completed, failed or cancelled (TimeoutError after ``timeout`` seconds)."""
        return await wait_terminal(lambda: self.get(job_id), poll_interval, timeout)

    async def results(self, job_id: str, *, cursor: int = 0, follow: bool = False) -> AsyncIterator[JobResult]:
        """The finished items in completion order, as the server streams them (NDJSON). With ``follow`` the stream
        lasts until the job ends; ``cursor`` skips the results already read (resume with the count read)."""
        params = query(cursor=cursor, follow=follow)
        timeout = httpx.Timeout(self._core.http.timeout.connect, read=None) if follow else httpx.USE_CLIENT_DEFAULT
        async with self._core.stream("GET", path("/v1/jobs/{}/results", job_id), params=params,
                                     timeout=timeout) as response:
            async for line in response.aiter_lines():
                if line.strip():
                    yield JobResult.model_validate_json(line)

    async def trace(self, job_id: str) -> dict[str, Any]:
        """The job's Chrome Trace Event JSON (open it in Perfetto); NotFoundError before the job starts."""
        trace: dict[str, Any] = await self._core.json("GET", path("/v1/jobs/{}/trace", job_id))
        return trace

    async def items(
        self,
        job_id: str,
        *,
        status: str | Iterable[str] | None = None,
        q: str | None = None,
        order: str | None = None,
        offset: int | None = None,
        limit: int | None = None,
    ) -> ItemList:
        """A page of the job's items (input, output or error, status, latency); ``order`` is ``position`` or
        ``failures_first``, ``q`` searches custom ids, inputs, outputs and errors."""
        params = query(status=_csv(status), q=q, order=order, offset=offset, limit=limit)
        return await self._core.call(ItemList, "GET", path("/v1/jobs/{}/items", job_id), params=params)

    async def export(
        self,
        job_id: str,
        *,
        format: str = "jsonl",
        status: str | Iterable[str] | None = None,
        q: str | None = None,
        order: str | None = None,
    ) -> bytes:
        """Every matching item as one download: JSON Lines (``format="jsonl"``) or CSV (``"csv"``)."""
        params = query(format=format, status=_csv(status), q=q, order=order)
        response = await self._core.send("GET", path("/v1/jobs/{}/items/export", job_id), params=params)
        return response.content


class Jobs(SyncResource[AsyncJobs]):
    submit = sync_method(AsyncJobs.submit)
    get = sync_method(AsyncJobs.get)
    list = sync_method(AsyncJobs.list)
    cancel = sync_method(AsyncJobs.cancel)
    wait = sync_method(AsyncJobs.wait)
    results = sync_stream(AsyncJobs.results)
    trace = sync_method(AsyncJobs.trace)
    items = sync_method(AsyncJobs.items)
    export = sync_method(AsyncJobs.export)


def _csv(value: str | Iterable[str] | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return ",".join(value)
