"""Node results (the checkpoints): idempotent inserts and the completed values of items."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import NodeResult
from app.db.repository._dialect import insert_ignoring_conflicts


def insert_node_results(session: Session, *, rows: Sequence[dict[str, Any]]) -> None:
    """Store completed nodes (job_id, item_id, node_id, value, duration_ms, attempt) with
    ``INSERT ... ON CONFLICT DO NOTHING``: a node stored once is never overwritten by a re-run or a re-delivery."""
    if not rows:
        return
    now = utcnow()
    stmt = insert_ignoring_conflicts(session, NodeResult, ["job_id", "item_id", "node_id"])
    session.execute(stmt, [{"created_at": now, **row} for row in rows])


def stored_node_ids(session: Session, *, item_ids: Sequence[int]) -> dict[int, set[str]]:
    """``{item_id: {node_id, ...}}`` of the stored nodes of these items (only items that have some)."""
    out: dict[int, set[str]] = {}
    if not item_ids:
        return out
    stmt = select(NodeResult.item_id, NodeResult.node_id).where(NodeResult.item_id.in_(list(item_ids)))
    for item_id, node_id in session.execute(stmt):
        out.setdefault(item_id, set()).add(node_id)
    return out


def node_values(session: Session, *, item_ids: Sequence[int]) -> dict[int, dict[str, Any]]:
    """``{item_id: {node_id: encoded value}}`` of every stored node of these items."""
    out: dict[int, dict[str, Any]] = {item_id: {} for item_id in item_ids}
    if not item_ids:
        return out
    stmt = select(NodeResult.item_id, NodeResult.node_id, NodeResult.value).where(
        NodeResult.item_id.in_(list(item_ids))
    )
    for item_id, node_id, value in session.execute(stmt):
        out[item_id][node_id] = value
    return out


def get_node_result(session: Session, *, job_id: str, item_id: int, node_id: str) -> NodeResult | None:
    stmt = select(NodeResult).where(
        NodeResult.job_id == job_id, NodeResult.item_id == item_id, NodeResult.node_id == node_id
    )
    return session.scalars(stmt).one_or_none()


def count_node_results(session: Session, *, job_id: str) -> int:
    stmt = select(func.count()).select_from(NodeResult).where(NodeResult.job_id == job_id)
    return int(session.scalar(stmt) or 0)


def insert_node_result(
    session: Session, *, job_id: str, item_id: int, node_id: str, value: Any, duration_ms: float = 0.0,
    attempt: int = 0,
) -> bool:
    """Store one completed node; False when it was stored already (a re-run or a re-delivered task)."""
    stmt = (
        insert_ignoring_conflicts(session, NodeResult, ["job_id", "item_id", "node_id"])
        .values(job_id=job_id, item_id=item_id, node_id=node_id, value=value, duration_ms=duration_ms,
                attempt=attempt, created_at=utcnow())
        .returning(NodeResult.id)
    )
    return session.execute(stmt).scalar_one_or_none() is not None
