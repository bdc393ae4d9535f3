"""Big jobs written straight through the repository functions, for the item table's tests and timings: a job of
``count`` items of the ``sentiment`` pipeline, most completed, some failed, some cancelled, the rest pending."""

from __future__ import annotations

from sqlalchemy import Engine

from app.db import ItemStatus, make_session_factory, repository, session_scope
from app.db.repository.items import ItemOutcome
from app.jobs.encoding import encode_item_input
from app.jobs.ids import new_job_id
from app.jobs.inputs import BatchItem

PIPELINE, IMPORT_PATH = "sentiment", "app.examples.sentiment:SentimentLabel"


def status_of(position: int) -> ItemStatus:
    """Every 10th item failed, every 25th (not failed) cancelled, the last 100 pending, the others completed."""
    if position % 10 == 3:
        return ItemStatus.FAILED
    if position % 25 == 7:
        return ItemStatus.CANCELLED
    return ItemStatus.COMPLETED


def seed_job(engine: Engine, count: int, *, owner: str = "anonymous", pending: int = 100) -> str:
    """A job of ``count`` items (``review {i}``, custom_id ``r{i}``) with the statuses of :func:`status_of`,
    except the last ``pending`` items, which are still pending; returns its id."""
    sessions = make_session_factory(engine)
    job_id = new_job_id()
    with session_scope(sessions) as session:
        pipeline = repository.get_or_create_pipeline(session, owner=owner, name=IMPORT_PATH, import_path=IMPORT_PATH)
        repository.create_job(session, job_id=job_id, pipeline_id=pipeline.id, pipeline_name=PIPELINE,
                              total_items=count, owner=owner)
        rows = [{"custom_id": f"r{i}", "position": i,
                 "input": encode_item_input(BatchItem(f"r{i}", (f"review {i}",)))} for i in range(count)]
        repository.add_items(session, job_id=job_id, rows=rows)
    with session_scope(sessions) as session:
        ids = repository.open_item_ids(session, job_id=job_id)
        outcomes = [_outcome(item_id, position) for position, item_id in enumerate(ids[:count - pending])]
        repository.finish_items(session, job_id=job_id, outcomes=outcomes)
    return job_id


def _outcome(item_id: int, position: int) -> ItemOutcome:
    status = status_of(position)
    if status == ItemStatus.COMPLETED:
        return ItemOutcome(item_id, status, output="positive" if position % 2 else "negative")
    return ItemOutcome(item_id, status, error={"type": "ValueError", "message": f"review {position} failed"})
