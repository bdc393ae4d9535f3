"""Reading and steering jobs: look-up, listing, cancel, result pages, traces, and the JSON shapes the API returns
for jobs and result lines. Functions take the session."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from app.db import JOB_TERMINAL, Item, ItemStatus, Job, JobMetrics, JobStatus, repository, to_unix
from app.jobs.errors import InvalidJobInput, JobConflict, JobNotFound

MAX_PAGE = 100


def load_job(session: Session, job_id: str, owner: str | None = None) -> Job:
    job = repository.get_job(session, job_id=job_id, owner=owner)
    if job is None:
        raise JobNotFound(f"no job {job_id!r}: list your jobs with GET /v1/jobs", param="job_id",
                          code="job_not_found")
    return job


def describe_job(session: Session, job_id: str, owner: str | None = None) -> dict[str, Any]:
    job = load_job(session, job_id, owner)
    return job_view(job, repository.get_job_metrics(session, job_id=job.id))


def list_job_views(
    session: Session,
    *,
    owner: str | None = None,
    status: str | None = None,
    after: str | None = None,
    limit: int = 20,
    kind: str | None = "pipeline",
    pipeline: str | None = None,
) -> dict[str, Any]:
    """A page of jobs, newest first: ``{"object": "list", "data", "first_id", "last_id", "has_more"}``, each
    job with its ``usage`` as in the single-job view. ``status`` may name several statuses separated by commas;
    ``pipeline`` is a pipeline name exactly as submitted; ``after`` is the previous page's ``last_id``."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidJobInput(f"limit must be between 1 and {MAX_PAGE}, not {limit}", param="limit")
    statuses = None
    if status:
        statuses = [s.strip() for s in status.split(",") if s.strip()]
        unknown = sorted(set(statuses) - {s.value for s in JobStatus})
        if unknown:
            raise InvalidJobInput(
                f"unknown status {', '.join(unknown)}; use one of {', '.join(s.value for s in JobStatus)}",
                param="status",
            )
    jobs = repository.list_jobs(session, owner=owner, statuses=statuses, after=after, limit=limit + 1, kind=kind,
                                pipeline=pipeline or None)
    page = jobs[:limit]
    metrics = repository.job_metrics_of(session, job_ids=[job.id for job in page])  # one query for the page
    return {
        "object": "list",
        "data": [job_view(job, metrics.get(job.id)) for job in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": len(jobs) > limit,
    }


def cancel_job(session: Session, job_id: str, owner: str | None = None) -> Job:
    """Ask for the job to stop: it becomes ``cancelling`` at once and ``cancelled`` once the executor has
    stopped its work. Results of items that finished stay. Cancelling twice is harmless."""
    job = load_job(session, job_id, owner)
    if job.status == JobStatus.CANCELLING:
        return job
    if job.status in JOB_TERMINAL:
        raise JobConflict(f"job {job_id} is already {job.status}; there is nothing to cancel",
                          param="job_id", code="job_finished")
    if not repository.request_cancel(session, job_id=job_id):  # it finished meanwhile
        job = load_job(session, job_id, owner)
        if job.status != JobStatus.CANCELLING:
            raise JobConflict(f"job {job_id} is already {job.status}; there is nothing to cancel",
                              param="job_id", code="job_finished")
        return job
    return load_job(session, job_id, owner)


@dataclass
class ResultsPage:
    lines: list[dict[str, Any]]
    cursor: int  # results delivered so far, counting this page: the cursor of the next request
    finished: bool  # the job is terminal and every result has been delivered


def results_page(
    session: Session, job_id: str, *, owner: str | None = None, cursor: int = 0, limit: int = 500
) -> ResultsPage:
    """Finished items in completion order, starting after the first ``cursor`` results."""
    if cursor < 0:
        raise InvalidJobInput(f"cursor must be 0 or more, not {cursor}", param="cursor")
    job = load_job(session, job_id, owner)
    terminal = job.status in JOB_TERMINAL
    items = repository.results_after(session, job_id=job_id, cursor=cursor, limit=limit)
    next_cursor = items[-1].result_seq if items else cursor
    assert next_cursor is not None
    return ResultsPage(
        [result_line(item) for item in items], next_cursor, terminal and next_cursor >= job.results_seq
    )


def stored_trace(session: Session, job_id: str, owner: str | None = None) -> dict[str, Any] | None:
    load_job(session, job_id, owner)
    metrics = repository.get_job_metrics(session, job_id=job_id)
    return metrics.trace if metrics is not None else None


# -- the JSON shapes ---------------------------------------------------------------------------------------------
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
