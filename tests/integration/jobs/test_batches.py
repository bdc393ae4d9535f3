"""The batch service on PostgreSQL without an executor: what creation writes, finalisation by concurrent readers
(files written once), and expiry of a batch whose job never started."""

from __future__ import annotations

import json
import threading
from typing import Any

from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session

from app.db import (
    Batch,
    File,
    Item,
    ItemStatus,
    Job,
    JobStatus,
    make_session_factory,
    repository,
    session_scope,
    utcnow,
)
from app.db.repository import ItemOutcome
from app.jobs import files
from app.jobs.batches import service as batches
from app.jobs.distributed.settle import settle_job
from app.jobs.submission import Limits

LIMITS = Limits()


def _upload(session: Session, count: int) -> str:
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}], "seed": i}}
             for i in range(count)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return files.upload_file(session, filename="in.jsonl", purpose="batch", content=content, owner="me",
                             limits=LIMITS).id


def _create(committed: Engine, count: int = 3) -> dict[str, Any]:
    with Session(committed) as session:
        view = batches.create_batch(session, batches.BatchCreate(_upload(session, count), "/v1/chat/completions"),
                                    owner="me", limits=LIMITS)
        session.commit()
    return view


def _job_id(committed: Engine, batch_id: str) -> str:
    with Session(committed) as session:
        job_id = session.scalar(select(Batch.job_id).where(Batch.id == batch_id))
    assert job_id is not None
    return job_id


def test_creation_writes_a_batch_job_with_one_item_per_line(committed: Engine) -> None:
    view = _create(committed)
    assert view["status"] == "validating" and view["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    with Session(committed) as session:
        job = session.get(Job, _job_id(committed, view["id"]))
        assert job is not None and job.kind == "batch" and job.status == JobStatus.QUEUED
        assert job.input_file_id == view["input_file_id"] and job.metadata_ == {"batch_id": view["id"]}
        items = session.scalars(select(Item).where(Item.job_id == job.id).order_by(Item.position)).all()
        assert [i.custom_id for i in items] == ["q0", "q1", "q2"]
        assert items[2].input["kwargs"]["options"] == {"seed": 2}
        assert len({i.graph_hash for i in items}) == 1  # every line of this shape shares one traced graph


def test_concurrent_readers_finalise_once(committed: Engine) -> None:
    view = _create(committed)
    job_id = _job_id(committed, view["id"])
    with Session(committed) as session:  # what the executor does for this job
        repository.claim_next_job(session)
        ids = session.scalars(select(Item.id).where(Item.job_id == job_id).order_by(Item.position)).all()
        output = {"text": "fine", "meta": {"model": "m1", "input_tokens": 3, "output_tokens": 1}}
        repository.finish_items(session, job_id=job_id, outcomes=[
            ItemOutcome(ids[0], ItemStatus.COMPLETED, output),
            ItemOutcome(ids[1], ItemStatus.COMPLETED, output),
            ItemOutcome(ids[2], ItemStatus.FAILED, None, {"type": "TransientError", "message": "upstream 503"}),
        ])
        repository.finish_job(session, job_id=job_id, status=JobStatus.COMPLETED)
        session.commit()

    barrier = threading.Barrier(4)
    views: list[dict[str, Any]] = []

    def read() -> None:
        barrier.wait()
        with Session(committed) as session:
            views.append(batches.describe_batch(session, view["id"], "me"))
            session.commit()

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(views) == 4 and all(v == views[0] for v in views)
    done = views[0]
    assert done["status"] == "completed" and done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    with Session(committed) as session:
        assert session.scalar(select(func.count()).select_from(File)) == 3  # the input, one output, one error
        error = files.file_content(session, done["error_file_id"], "me").content
        (line,) = [json.loads(x) for x in error.splitlines()]
        assert line["custom_id"] == "q2" and line["error"] == {"code": "transient_error", "message": "upstream 503"}
        outputs = [json.loads(x) for x in files.file_content(session, done["output_file_id"], "me").content.splitlines()]
        assert [o["custom_id"] for o in outputs] == ["q0", "q1"]
        assert outputs[0]["response"]["body"]["model"] == "m1"
        assert outputs[0]["response"]["body"]["usage"] == {"prompt_tokens": 3, "completion_tokens": 1,
                                                           "total_tokens": 4}


def test_a_batch_past_its_window_expires(committed: Engine) -> None:
    view = _create(committed, count=2)
    with committed.begin() as connection:
        connection.execute(update(Batch).where(Batch.id == view["id"]).values(expires_at=utcnow()))
    with Session(committed) as session:
        stopping = batches.describe_batch(session, view["id"], "me")
        session.commit()
    assert stopping["status"] == "finalizing" and stopping["expired_at"] is None
    with session_scope(make_session_factory(committed)) as session:  # the dispatcher's next tick
        settle_job(session, _job_id(committed, view["id"]))
    with Session(committed) as session:
        done = batches.describe_batch(session, view["id"], "me")
        session.commit()
        assert done["status"] == "expired" and done["expired_at"] is not None and done["output_file_id"] is None
        assert done["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
        error = files.file_content(session, done["error_file_id"], "me").content
    assert [json.loads(x)["error"]["code"] for x in error.splitlines()] == ["batch_expired", "batch_expired"]

