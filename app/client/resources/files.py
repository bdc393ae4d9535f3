"""``/v1/files`` and ``/v1/batches``, in OpenAI's shapes (the ``openai`` package works against them too)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from app.client._core import body, path, query
from app.client._sync import SyncResource, sync_method
from app.client.resources.base import AsyncResource
from app.client.types import Batch, BatchList, DeletedFile, FileList, FileObject

FileInput = str | os.PathLike[str] | bytes | IO[bytes]


class AsyncFiles(AsyncResource):
    async def upload(self, file: FileInput, *, purpose: str = "batch", filename: str | None = None) -> FileObject:
        """Upload a JSONL file: a path, its bytes or a binary file object. ``purpose`` is ``batch`` (Batch API
        requests) or ``user_data`` (job inputs, ``jobs.submit(input_file_id=...)``)."""
        name, content = await asyncio.to_thread(_read, file)
        files = {"file": (filename or name, content, "application/jsonl")}
        return await self._core.call(FileObject, "POST", "/v1/files", files=files, data={"purpose": purpose})

    async def list(
        self,
        *,
        purpose: str | None = None,
        after: str | None = None,
        limit: int | None = None,
        order: str | None = None,
    ) -> FileList:
        """The caller's files, newest first (``order="asc"`` for oldest first)."""
        params = query(purpose=purpose, after=after, limit=limit, order=order)
        return await self._core.call(FileList, "GET", "/v1/files", params=params)

    async def get(self, file_id: str) -> FileObject:
        return await self._core.call(FileObject, "GET", path("/v1/files/{}", file_id))

    async def content(self, file_id: str) -> bytes:
        """The file's bytes (a batch's output and error files too)."""
        response = await self._core.send("GET", path("/v1/files/{}/content", file_id))
        return response.content

    async def delete(self, file_id: str) -> DeletedFile:
        return await self._core.call(DeletedFile, "DELETE", path("/v1/files/{}", file_id))


class Files(SyncResource[AsyncFiles]):
    upload = sync_method(AsyncFiles.upload)
    list = sync_method(AsyncFiles.list)
    get = sync_method(AsyncFiles.get)
    content = sync_method(AsyncFiles.content)
    delete = sync_method(AsyncFiles.delete)


class AsyncBatches(AsyncResource):
    async def create(
        self,
        input_file_id: str,
        *,
        endpoint: str = "/v1/chat/completions",
        completion_window: str = "24h",
        metadata: Mapping[str, str] | None = None,
    ) -> Batch:
        """Run every request of an uploaded ``purpose="batch"`` file against ``endpoint``."""
        payload = body(input_file_id=input_file_id, endpoint=endpoint, completion_window=completion_window,
                       metadata=None if metadata is None else dict(metadata))
        return await self._core.call(Batch, "POST", "/v1/batches", json=payload)

    async def get(self, batch_id: str) -> Batch:
        return await self._core.call(Batch, "GET", path("/v1/batches/{}", batch_id))

    async def list(self, *, after: str | None = None, limit: int | None = None) -> BatchList:
        return await self._core.call(BatchList, "GET", "/v1/batches", params=query(after=after, limit=limit))

    async def cancel(self, batch_id: str) -> Batch:
        return await self._core.call(Batch, "POST", path("/v1/batches/{}/cancel", batch_id))


class Batches(SyncResource[AsyncBatches]):
    create = sync_method(AsyncBatches.create)
    get = sync_method(AsyncBatches.get)
    list = sync_method(AsyncBatches.list)
    cancel = sync_method(AsyncBatches.cancel)


def _read(file: FileInput) -> tuple[str, bytes]:
    if isinstance(file, bytes):
        return "upload.jsonl", file
    if isinstance(file, str | os.PathLike):
        source = Path(file)
        return source.name, source.read_bytes()
    content = file.read()
    name = getattr(file, "name", None)
    return (Path(name).name if isinstance(name, str) else "upload.jsonl"), content
