"""Registered pipelines, their traced graphs and their parameter versions."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import GraphNode, ParameterVersion, Pipeline
from app.db.repository._dialect import insert_ignoring_conflicts


def get_pipeline(session: Session, *, pipeline_id: int) -> Pipeline | None:
    return session.get(Pipeline, pipeline_id)


def get_pipeline_by_name(session: Session, *, owner: str, name: str) -> Pipeline | None:
    """The tenant's row of the pipeline ``name`` (its import path)."""
    stmt = select(Pipeline).where(Pipeline.owner == owner, Pipeline.name == name)
    return session.scalars(stmt).one_or_none()


def get_or_create_pipeline(session: Session, *, owner: str, name: str, import_path: str) -> Pipeline:
    """The tenant's row of the pipeline ``name``; two concurrent first submissions both end up with one row."""
    stmt = insert_ignoring_conflicts(session, Pipeline, ["owner", "name"]).values(
        owner=owner, name=name, import_path=import_path, parameter_state={}, parameter_version=0,
        created_at=utcnow(), updated_at=utcnow(),
    )
    session.execute(stmt)
    pipeline = get_pipeline_by_name(session, owner=owner, name=name)
    assert pipeline is not None
    if pipeline.import_path != import_path:
        pipeline.import_path = import_path
    return pipeline


def record_graph(
    session: Session, *, pipeline: Pipeline, graph_hash: str, graph: dict[str, Any], nodes: list[dict[str, Any]]
) -> None:
    """Make ``graph`` the pipeline's current graph and store its nodes once per graph hash."""
    if pipeline.graph_hash != graph_hash:
        pipeline.graph_hash = graph_hash
        pipeline.graph = graph
    if not nodes:
        return
    rows = [{**node, "pipeline_id": pipeline.id, "graph_hash": graph_hash} for node in nodes]
    stmt = insert_ignoring_conflicts(session, GraphNode, ["pipeline_id", "graph_hash", "node_id"])
    session.execute(stmt, rows)


def graph_nodes(session: Session, *, pipeline_id: int, graph_hash: str) -> list[GraphNode]:
    stmt = (
        select(GraphNode)
        .where(GraphNode.pipeline_id == pipeline_id, GraphNode.graph_hash == graph_hash)
        .order_by(GraphNode.depth, GraphNode.node_id)
    )
    return list(session.scalars(stmt))


def add_parameter_version(
    session: Session,
    *,
    pipeline_id: int,
    state: dict[str, Any],
    score: float | None = None,
    note: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> ParameterVersion:
    """Append the next version of the pipeline's parameters and make it the current state."""
    pipeline = session.get(Pipeline, pipeline_id, with_for_update=True)
    if pipeline is None:
        raise LookupError(f"no pipeline with id {pipeline_id}")
    latest = session.scalar(
        select(func.max(ParameterVersion.version)).where(ParameterVersion.pipeline_id == pipeline_id)
    )
    version = ParameterVersion(
        pipeline_id=pipeline_id, version=(latest or 0) + 1, state=state, score=score, note=note,
        metadata_=metadata or {},
    )
    session.add(version)
    pipeline.parameter_state = state
    pipeline.parameter_version = version.version
    session.flush()
    return version


def pipelines_with_versions(session: Session, *, owner: str) -> list[tuple[Pipeline, int]]:
    """The tenant's pipeline rows, each with how many parameter versions it has, in one query."""
    stmt = (
        select(Pipeline, func.count(ParameterVersion.id))
        .outerjoin(ParameterVersion, ParameterVersion.pipeline_id == Pipeline.id)
        .where(Pipeline.owner == owner)
        .group_by(Pipeline.id)
        .order_by(Pipeline.name)
    )
    return [(row[0], int(row[1])) for row in session.execute(stmt)]


def parameter_versions(session: Session, *, pipeline_id: int) -> list[ParameterVersion]:
    stmt = (
        select(ParameterVersion)
        .where(ParameterVersion.pipeline_id == pipeline_id)
        .order_by(ParameterVersion.version)
    )
    return list(session.scalars(stmt))
