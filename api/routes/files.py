"""``/v1/files`` as OpenAI has it: upload (multipart), read, download the content, list, delete.

Routes only parse, authorise and shape; the checks and storage are in ``app.jobs.files``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from starlette.datastructures import UploadFile

from api.deps import DbSession, Owner, Runtime, require_api_key
from api.responses import JSONBytes, content_disposition
from api.schemas import DeletedFile, FileList, FileObject, ok
from app.jobs import files
from app.jobs.errors import InvalidJobInput, PayloadTooLarge

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)], tags=["files"])

#: room for the multipart framing around the file when the declared length is compared with the size limit
MULTIPART_OVERHEAD = 64 * 1024


# the route reads its form itself (to bound its size first): the schema documents it
_UPLOAD_FORM = {"type": "object", "required": ["file", "purpose"], "properties": {
    "file": {"type": "string", "format": "binary", "description": "The JSONL file"},
    "purpose": {"type": "string", "description": "'batch' (Batch API requests) or 'user_data' (job inputs)"},
}}


@dataclass(frozen=True)
class Upload:
    filename: str
    purpose: str
    content: bytes


async def read_upload(request: Request, runtime: Runtime) -> Upload:
    """multipart/form-data with ``file`` (the JSONL) and ``purpose``, refused (413) as soon as it is too large."""
    limit = runtime.limits.max_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + MULTIPART_OVERHEAD:
        raise _too_large(f"the upload has {declared} bytes", limit)
    if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
        raise InvalidJobInput("send the file as multipart/form-data with the fields 'file' and 'purpose'",
                              param="file")
    async with request.form(max_files=1, max_fields=16) as form:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise InvalidJobInput("the form field 'file' (the file to upload) is missing", param="file")
        if not isinstance(purpose, str) or not purpose.strip():
            raise InvalidJobInput("the form field 'purpose' is missing: use 'batch' for Batch API requests",
                                  param="purpose")
        content = await upload.read(limit + 1)
        filename = upload.filename or ""
    if len(content) > limit:
        raise _too_large("the file has more bytes than that", limit)
    return Upload(filename, purpose.strip(), content)


@router.post("/files", responses=ok(FileObject), openapi_extra={"requestBody": {"required": True,
                                                      "content": {"multipart/form-data": {"schema": _UPLOAD_FORM}}}})
def upload_file(
    upload: Annotated[Upload, Depends(read_upload)], runtime: Runtime, session: DbSession, owner: Owner
) -> Response:
    """multipart/form-data with ``file`` (the JSONL) and ``purpose`` (``batch`` or ``user_data``)."""
    stored = files.upload_file(session, filename=upload.filename, purpose=upload.purpose, content=upload.content,
                               owner=owner, limits=runtime.limits)
    return JSONBytes(files.file_view(stored))


def _too_large(what: str, limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"{what}; files may have at most {limit} bytes (INF_ENGINE_JOBS_MAX_BYTES): split the "
                           "requests into several files", param="file")


@router.get("/files", responses=ok(FileList))
def list_files(
    session: DbSession,
    owner: Owner,
    purpose: Annotated[str | None, Query(description="Only files with this purpose")] = None,
    after: Annotated[str | None, Query(description="The last id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=files.MAX_LIST)] = files.MAX_LIST,
    order: Annotated[str, Query(pattern="^(asc|desc)$", description="By creation time")] = "desc",
) -> Response:
    return JSONBytes(files.list_file_views(session, owner=owner, purpose=purpose, after=after, limit=limit,
                                           order=order))


@router.get("/files/{file_id}", responses=ok(FileObject))
def get_file(file_id: str, session: DbSession, owner: Owner) -> Response:
    return JSONBytes(files.describe_file(session, file_id, owner))


@router.get("/files/{file_id}/content")
def file_content(file_id: str, session: DbSession, owner: Owner) -> Response:
    found = files.file_content(session, file_id, owner)
    return Response(found.content, media_type="application/octet-stream",
                    headers={"Content-Disposition": content_disposition(found.filename)})


@router.delete("/files/{file_id}", responses=ok(DeletedFile))
def delete_file(file_id: str, session: DbSession, owner: Owner) -> Response:
    return JSONBytes(files.delete_file(session, file_id, owner))
