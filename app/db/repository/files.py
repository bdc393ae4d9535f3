"""Uploaded files (JSONL inputs for jobs and batches; output and error files of batches)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session, defer

from app.db.models import File


def create_file(
    session: Session, *, file_id: str, purpose: str, filename: str, content: bytes, owner: str = "anonymous"
) -> File:
    row = File(id=file_id, purpose=purpose, filename=filename, bytes=len(content), content=content, owner=owner)
    session.add(row)
    session.flush()
    return row


def get_file(session: Session, *, file_id: str, owner: str | None = None, with_content: bool = True) -> File | None:
    stmt = select(File).where(File.id == file_id)
    if owner is not None:
        stmt = stmt.where(File.owner == owner)
    if not with_content:
        stmt = stmt.options(defer(File.content))
    return session.scalars(stmt).one_or_none()


def list_files(
    session: Session,
    *,
    owner: str | None = None,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = 100,
    newest_first: bool = True,
) -> list[File]:
    """Newest first, or oldest first (ids are time ordered); ``after`` is the last id of the previous page."""
    order = File.id.desc() if newest_first else File.id.asc()
    stmt = select(File).options(defer(File.content)).order_by(order).limit(limit)
    if owner is not None:
        stmt = stmt.where(File.owner == owner)
    if purpose is not None:
        stmt = stmt.where(File.purpose == purpose)
    if after is not None:
        stmt = stmt.where(File.id < after if newest_first else File.id > after)
    return list(session.scalars(stmt))


def delete_file(session: Session, *, file_id: str, owner: str | None = None) -> bool:
    row = get_file(session, file_id=file_id, owner=owner, with_content=False)
    if row is None:
        return False
    session.delete(row)
    session.flush()
    return True
