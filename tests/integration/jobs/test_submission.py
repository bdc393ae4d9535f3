"""Submission and the job service on PostgreSQL: what is written, what is rejected (and then not written)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.db import GraphNode, Item, ItemStatus, Job, JobStatus, NodeResult, Pipeline, repository
from app.jobs.errors import InvalidJobInput, JobConflict, JobNotFound, PayloadTooLarge
from app.jobs.service import cancel_job, describe_job, list_job_views, results_page
from app.jobs.submission import JobRequest, Limits, submit_job

REVIEWS = [{"custom_id": f"r{i}", "input": {"review": f"review number {i}"}} for i in range(3)]


def _count(db: Session, model: Any) -> int:
    return int(db.scalar(select(func.count()).select_from(model)) or 0)


def _counts(db: Session) -> tuple[int, ...]:
    return tuple(_count(db, m) for m in (Job, Item, Pipeline, GraphNode))


def test_submit_writes_job_items_and_graph(db: Session) -> None:
    job, created = submit_job(db, JobRequest("review-compare", inputs=REVIEWS, priority=3, metadata={"team": "x"}))
    assert created
    assert job.id.startswith("job_") and job.status == JobStatus.QUEUED and job.total_items == 3
    items = db.scalars(select(Item).where(Item.job_id == job.id).order_by(Item.position)).all()
    assert [i.custom_id for i in items] == ["r0", "r1", "r2"]
    assert items[0].input == {"args": [], "kwargs": {"review": "review number 0"}}
    assert all(i.status == ItemStatus.PENDING and i.graph_hash for i in items)
    pipeline = db.get(Pipeline, job.pipeline_id)
    assert pipeline is not None and pipeline.import_path == "app.examples.review_compare:ReviewCompare"
    assert pipeline.graph_hash == items[0].graph_hash
    assert all("value" not in node for node in pipeline.graph["nodes"])  # the item's input is not in the graph
    nodes = repository.graph_nodes(db, pipeline_id=pipeline.id, graph_hash=pipeline.graph_hash)
    kinds = sorted(n.kind for n in nodes)
    assert kinds.count("llm") == 3 and "input" in kinds
    verdict = next(n for n in nodes if n.module_path == "verdict")
    assert verdict.alias == "assistant" and verdict.depth > 1 and len(verdict.dependencies) >= 1
    view = describe_job(db, job.id)
    assert view["status"] == "queued" and view["counts"]["total"] == 3 and view["metadata"] == {"team": "x"}
    assert view["priority"] == 3 and view["pipeline"] == "review-compare"


def test_jsonl_text_and_bare_values(db: Session) -> None:
    text = '{"custom_id": "a", "input": "first"}\n\n"second"\n'
    job, _ = submit_job(db, JobRequest("app.examples.review_compare:ReviewCompare", inputs=text))
    ids = db.scalars(select(Item.custom_id).where(Item.job_id == job.id).order_by(Item.position)).all()
    assert ids == ["a", "3"]  # a line without custom_id is named by its line number


def test_same_idempotency_key_returns_the_same_job(db: Session) -> None:
    first, created = submit_job(db, JobRequest("review-compare", inputs=REVIEWS, idempotency_key="k-1"))
    again, created_again = submit_job(db, JobRequest("review-compare", inputs=REVIEWS, idempotency_key="k-1"))
    assert created and not created_again and again.id == first.id
    assert _count(db, Job) == 1
    other_owner, created_other = submit_job(
        db, JobRequest("review-compare", inputs=REVIEWS, idempotency_key="k-1"), owner="someone-else"
    )
    assert created_other and other_owner.id != first.id
    with pytest.raises(JobConflict, match="already used"):
        submit_job(db, JobRequest("app.examples.review_compare:ReviewCompare", inputs=REVIEWS,
                                  idempotency_key="k-1"))


@pytest.mark.parametrize(
    ("request_", "error", "message"),
    [
        (JobRequest("no.such.module:Pipeline", inputs=REVIEWS), InvalidJobInput, "unknown pipeline"),
        (JobRequest("not-a-pipeline", inputs=REVIEWS), InvalidJobInput, "unknown pipeline"),
        (JobRequest("review-compare", inputs='{"input": "x"}\n{not json\n'), InvalidJobInput,
         "line 2 is not valid JSON"),
        (JobRequest("review-compare", inputs=[{"custom_id": "a", "input": "x"}, {"custom_id": "a", "input": "y"}]),
         InvalidJobInput, "duplicate custom_id 'a'"),
        (JobRequest("review-compare", inputs='{"custom_id": "a", "input": "x"}\n{"custom_id": "a", "input": "y"}'),
         InvalidJobInput, "line 2: duplicate custom_id"),
        (JobRequest("review-compare", inputs=[]), InvalidJobInput, "inputs has no items"),
        (JobRequest("review-compare"), InvalidJobInput, "exactly one"),
        (JobRequest("review-compare", inputs=REVIEWS, input_file_id="file-x"), InvalidJobInput, "exactly one"),
        (JobRequest("review-compare", input_file_id="file-missing"), InvalidJobInput, "no uploaded file"),
        (JobRequest("review-compare", inputs=[{"custom_id": "a", "input": {"text": "wrong keyword"}}]),
         InvalidJobInput, "does not fit pipeline"),
        (JobRequest("review-compare", inputs=REVIEWS), PayloadTooLarge, "at most 2"),
    ],
)
def test_bad_submissions_write_nothing(db: Session, request_: JobRequest, error: type, message: str) -> None:
    before = _counts(db)
    with pytest.raises(error, match=message):
        submit_job(db, request_, limits=Limits(max_items=2))
    db.rollback()
    assert _counts(db) == before


def test_submit_from_an_uploaded_file(db: Session) -> None:
    content = b'{"custom_id": "f1", "input": "one"}\n{"custom_id": "f2", "input": "two"}\n'
    repository.create_file(db, file_id="file-test1", purpose="batch", filename="in.jsonl", content=content)
    job, _ = submit_job(db, JobRequest("review-compare", input_file_id="file-test1"))
    assert job.total_items == 2 and job.input_file_id == "file-test1"
    with pytest.raises(PayloadTooLarge, match="bytes"):
        submit_job(db, JobRequest("review-compare", input_file_id="file-test1"), limits=Limits(max_bytes=10))
    with pytest.raises(InvalidJobInput, match="no uploaded file"):  # files are private to their owner
        submit_job(db, JobRequest("review-compare", input_file_id="file-test1"), owner="other")


def test_listing_filters_and_pages(db: Session) -> None:
    jobs = [submit_job(db, JobRequest("review-compare", inputs=REVIEWS))[0] for _ in range(5)]
    cancel_job(db, jobs[1].id)
    page = list_job_views(db, limit=2)
    assert [j["id"] for j in page["data"]] == [jobs[4].id, jobs[3].id] and page["has_more"]
    page2 = list_job_views(db, limit=2, after=page["last_id"])
    assert [j["id"] for j in page2["data"]] == [jobs[2].id, jobs[1].id]
    last = list_job_views(db, limit=2, after=page2["last_id"])
    assert [j["id"] for j in last["data"]] == [jobs[0].id] and not last["has_more"]
    cancelling = list_job_views(db, status="cancelling")
    assert [j["id"] for j in cancelling["data"]] == [jobs[1].id]
    assert len(list_job_views(db, status="queued,cancelling")["data"]) == 5
    with pytest.raises(InvalidJobInput, match="unknown status"):
        list_job_views(db, status="sleeping")
    assert list_job_views(db, owner="nobody")["data"] == []


def test_cancel_transitions(db: Session) -> None:
    job, _ = submit_job(db, JobRequest("review-compare", inputs=REVIEWS))
    cancelled = cancel_job(db, job.id)
    assert cancelled.status == JobStatus.CANCELLING and cancelled.cancelling_at is not None
    assert cancel_job(db, job.id).status == JobStatus.CANCELLING  # twice is harmless
    assert repository.finish_job(db, job_id=job.id, status=JobStatus.CANCELLED)
    with pytest.raises(JobConflict, match="already cancelled"):
        cancel_job(db, job.id)
    with pytest.raises(JobNotFound):
        cancel_job(db, "job_missing")
    with pytest.raises(JobNotFound):  # another owner's job does not exist for you
        describe_job(db, job.id, owner="other")


def test_results_in_completion_order_from_a_cursor(db: Session) -> None:
    job, _ = submit_job(db, JobRequest("review-compare", inputs=REVIEWS))
    items = {i.custom_id: i for i in db.scalars(select(Item).where(Item.job_id == job.id))}
    outcome = repository.ItemOutcome
    done = repository.finish_items(db, job_id=job.id, outcomes=[
        outcome(items["r2"].id, ItemStatus.COMPLETED, output={"verdict": "ok"}),
        outcome(items["r0"].id, ItemStatus.FAILED, error={"type": "E", "message": "boom"}),
    ])
    assert done == 2
    # a repeated outcome changes nothing
    assert repository.finish_items(db, job_id=job.id, outcomes=[outcome(items["r2"].id, ItemStatus.FAILED)]) == 0
    page = results_page(db, job.id)
    assert page.lines == [
        {"custom_id": "r2", "status": "completed", "output": {"verdict": "ok"}},
        {"custom_id": "r0", "status": "failed", "error": {"type": "E", "message": "boom"}},
    ]
    assert page.cursor == 2 and not page.finished
    repository.finish_items(db, job_id=job.id, outcomes=[outcome(items["r1"].id, ItemStatus.COMPLETED, output=1)])
    assert repository.finish_job(db, job_id=job.id, status=JobStatus.COMPLETED)
    rest = results_page(db, job.id, cursor=page.cursor)
    assert [line["custom_id"] for line in rest.lines] == ["r1"] and rest.cursor == 3 and rest.finished
    view = describe_job(db, job.id)
    assert view["counts"] == {"total": 3, "completed": 2, "failed": 1, "cancelled": 0, "pending": 0}
    assert view["status"] == "completed" and view["completed_at"] is not None


def test_node_results_are_inserted_once(db: Session) -> None:
    job, _ = submit_job(db, JobRequest("review-compare", inputs=REVIEWS))
    item = db.scalars(select(Item).where(Item.job_id == job.id)).first()
    assert item is not None
    row = {"job_id": job.id, "item_id": item.id, "node_id": "LLMInference_1", "value": {"v": 1},
           "duration_ms": 5.0, "attempt": 0}
    repository.insert_node_results(db, rows=[row])
    repository.insert_node_results(db, rows=[{**row, "value": {"v": 2}}])  # a re-run: ignored
    assert repository.node_values(db, item_ids=[item.id]) == {item.id: {"LLMInference_1": {"v": 1}}}
    assert _count(db, NodeResult) == 1


def test_parameter_versions(db: Session) -> None:
    pipeline = repository.get_or_create_pipeline(db, owner="anonymous", name="p", import_path="app.examples.review_compare:ReviewCompare")
    first = repository.add_parameter_version(db, pipeline_id=pipeline.id, state={"verdict.system_prompt": "a"})
    second = repository.add_parameter_version(db, pipeline_id=pipeline.id, state={"verdict.system_prompt": "b"},
                                              score=0.8)
    assert (first.version, second.version) == (1, 2)
    assert pipeline.parameter_state == {"verdict.system_prompt": "b"} and pipeline.parameter_version == 2
    assert [v.score for v in repository.parameter_versions(db, pipeline_id=pipeline.id)] == [None, 0.8]


def test_closing_a_jobs_open_items_at_once_continues_the_completion_order(db: Session) -> None:
    inputs = [{"custom_id": f"c{i}", "input": f"review {i}"} for i in range(6)]
    job, _ = submit_job(db, JobRequest("review-compare", inputs=inputs))
    items = {i.custom_id: i for i in db.scalars(select(Item).where(Item.job_id == job.id))}
    repository.finish_items(db, job_id=job.id, outcomes=[
        repository.ItemOutcome(items["c3"].id, ItemStatus.COMPLETED, output="done"),
    ])
    error = {"type": "Cancelled", "message": "the job was cancelled before this item finished"}
    assert repository.close_open_items(db, job_id=job.id, status=ItemStatus.CANCELLED, error=error) == 5
    assert repository.close_open_items(db, job_id=job.id, status=ItemStatus.CANCELLED, error=error) == 0
    db.expire_all()
    rows = {i.custom_id: i for i in db.scalars(select(Item).where(Item.job_id == job.id))}
    assert rows["c3"].status == "completed" and rows["c3"].result_seq == 1
    closed = sorted((r.result_seq, c) for c, r in rows.items() if c != "c3")
    assert closed == [(2, "c0"), (3, "c1"), (4, "c2"), (5, "c4"), (6, "c5")]  # input order after the finished one
    assert all(rows[c].status == "cancelled" and rows[c].error == error for _, c in closed)
    view = describe_job(db, job.id)
    assert view["counts"] == {"total": 6, "completed": 1, "failed": 0, "cancelled": 5, "pending": 0}
    assert [line["custom_id"] for line in results_page(db, job.id).lines] == ["c3", "c0", "c1", "c2", "c4", "c5"]
