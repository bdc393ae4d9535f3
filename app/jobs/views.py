"""The JSON shapes the API returns for jobs and result lines."""

from __future__ import annotations

from typing import Any

from app.db import Item, ItemStatus, Job, JobMetrics, to_unix


def job_view(job: Job, metrics: JobMetrics | None = None) -> dict[str, Any]:
    finished = job.completed_items + job.failed_items + job.cancelled_items
    view: dict[str, Any] = {
        "id": job.id,
        "object": "job",
        "pipeline": job.pipeline_name,
        "status": job.status,
        "priority": job.priority,
        "metadata": job.metadata_ or {},
        "idempotency_key": job.idempotency_key,
        "input_file_id": job.input_file_id,
        "counts": {
            "total": job.total_items,
            "completed": job.completed_items,
            "failed": job.failed_items,
            "cancelled": job.cancelled_items,
            "pending": max(job.total_items - finished, 0),
        },
        "error": job.error,
        "created_at": to_unix(job.created_at),
        "started_at": to_unix(job.started_at),
        "cancelling_at": to_unix(job.cancelling_at),
        "cancelled_at": to_unix(job.cancelled_at),
        "completed_at": to_unix(job.completed_at),
        "failed_at": to_unix(job.failed_at),
        "finished_at": to_unix(job.finished_at),
    }
    if metrics is not None:
        view["usage"] = metrics_view(metrics)
    return view


def metrics_view(metrics: JobMetrics) -> dict[str, Any]:
    calls = metrics.llm_calls
    return {
        "llm_calls": calls,
        "input_tokens": metrics.input_tokens,
        "output_tokens": metrics.output_tokens,
        "total_tokens": metrics.input_tokens + metrics.output_tokens,
        "cost": round(metrics.cost, 8),
        "latency_ms_avg": round(metrics.latency_ms_total / calls, 3) if calls else None,
        "latency_ms_max": round(metrics.latency_ms_max, 3) if calls else None,
    }


def result_line(item: Item) -> dict[str, Any]:
    """One NDJSON line of ``/v1/jobs/{id}/results``: the same shape ``inf-engine run`` writes."""
    line: dict[str, Any] = {"custom_id": item.custom_id, "status": item.status}
    if item.status == ItemStatus.COMPLETED:
        line["output"] = item.output
    else:
        line["error"] = item.error
    return line
