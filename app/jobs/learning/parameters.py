"""Parameter versions of a pipeline, per tenant: the history, the difference between two versions, and activating (rolling
back to) one, after which jobs, evaluations and trainings of the pipeline start from its values."""

from __future__ import annotations

import difflib
import json
from typing import Any

from sqlalchemy.orm import Session

from app.db import ParameterVersion, Pipeline, repository, to_unix
from app.db.repository import learning as repo
from app.jobs.errors import JobNotFound
from app.jobs.learning.common import find_pipeline
from app.jobs.registry import current_registry


def version_view(row: ParameterVersion, pipeline: Pipeline) -> dict[str, Any]:
    meta = row.metadata_ or {}
    return {
        "object": "parameter_version",
        "pipeline": pipeline.name,
        "version": row.version,
        "active": pipeline.parameter_version == row.version,
        "state": row.state,
        "score": row.score,
        "note": row.note,
        "source": meta.get("source"),
        "training_id": meta.get("training_id"),
        "step": meta.get("step"),
        "batch_score": meta.get("batch_score"),
        "updates": meta.get("updates") or [],
        "created_at": to_unix(row.created_at),
    }


def list_pipelines(session: Session, *, owner: str) -> dict[str, Any]:
    """The pipelines the operator registered (what a request may name), each with the tenant's active parameter
    version (null before any) and how many versions it has stored; another tenant's versions never show."""
    registry = current_registry()
    rows = {row.name: (row, count) for row, count in repository.pipelines_with_versions(session, owner=owner)}
    data = []
    for name in registry.pipeline_names():
        row, count = rows.get(registry.pipeline_path(name), (None, 0))
        data.append({"object": "pipeline", "name": name,
                     "active_version": (row.parameter_version or None) if row is not None else None,
                     "versions": count})
    return {"object": "list", "data": data}


def list_versions(session: Session, name: str, *, owner: str) -> dict[str, Any]:
    pipeline = find_pipeline(session, name, owner=owner)
    rows = repository.parameter_versions(session, pipeline_id=pipeline.id)
    return {
        "object": "list",
        "pipeline": pipeline.name,
        "active_version": pipeline.parameter_version or None,
        "data": [version_view(row, pipeline) for row in rows],
    }


def _version(session: Session, pipeline: Pipeline, version: int, param: str = "version") -> ParameterVersion:
    row = repo.get_parameter_version(session, pipeline_id=pipeline.id, version=version)
    if row is None:
        raise JobNotFound(f"pipeline {pipeline.name} has no parameter version {version}: list them with GET "
                          f"/v1/pipelines/{pipeline.name}/parameters/versions", param=param,
                          code="version_not_found")
    return row


def get_version(session: Session, name: str, version: int, *, owner: str) -> dict[str, Any]:
    pipeline = find_pipeline(session, name, owner=owner)
    return version_view(_version(session, pipeline, version), pipeline)


def diff_versions(session: Session, name: str, old: int, new: int, *, owner: str) -> dict[str, Any]:
    """Every parameter whose value differs between versions ``old`` and ``new``, with a unified diff of text."""
    pipeline = find_pipeline(session, name, owner=owner)
    before = _version(session, pipeline, old, "from").state or {}
    after = _version(session, pipeline, new, "to").state or {}
    changes = []
    for key in sorted(set(before) | set(after)):
        if before.get(key) == after.get(key):
            continue
        a, b = _text(before.get(key)), _text(after.get(key))
        diff = list(difflib.unified_diff(a.splitlines(), b.splitlines(), f"{key}@{old}", f"{key}@{new}", lineterm=""))
        changes.append({"name": key, "from": before.get(key), "to": after.get(key), "diff": "\n".join(diff)})
    return {
        "object": "parameter_diff",
        "pipeline": pipeline.name,
        "from": old,
        "to": new,
        "changes": changes,
        "unchanged": sorted(k for k in set(before) & set(after) if before[k] == after[k]),
    }


def activate_version(session: Session, name: str, version: int, *, owner: str) -> dict[str, Any]:
    """Make a stored version the tenant's active parameters (other tenants keep theirs)."""
    pipeline = find_pipeline(session, name, owner=owner)
    row = _version(session, pipeline, version)
    pipeline = repo.activate_parameter_version(session, pipeline_id=pipeline.id, version=version)
    return version_view(row, pipeline)


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True)
