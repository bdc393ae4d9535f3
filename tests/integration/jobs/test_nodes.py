"""Node-at-a-time execution (what a distributed worker calls), and its interplay with the embedded mode."""

from __future__ import annotations

import asyncio

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from app.db import Item, repository
from app.jobs.distributed.nodes import (
    ItemGraph,
    execute_node,
    item_outcome,
    load_item_graph,
    store_node_result,
)
from app.jobs.runtime import JobsRuntime
from app.jobs.service import describe_job, results_page
from app.jobs.submission import JobRequest, submit_job
from app.settings import Settings
from tests.support.fakes import ScriptedLM


def ready_nodes(item: ItemGraph) -> list[str]:
    """Nodes not yet stored whose dependencies all are (input nodes count as stored): what a dispatcher would send."""
    known = set(item.values) | set(item.graph.input_ids)
    return [
        node_id for node_id, node in item.graph.nodes.items()
        if node_id not in known and all(dep in known for dep in node.dependencies)
    ]


def _one_item_job(db: Session) -> int:
    job, _ = submit_job(db, JobRequest("review-compare", inputs=[{"custom_id": "n1", "input": "a fine review"}]))
    item_id = db.scalar(select(Item.id).where(Item.job_id == job.id))
    assert item_id is not None
    return item_id


async def test_nodes_one_at_a_time_until_the_item_is_done(db: Session) -> None:
    item_id = _one_item_job(db)
    lm = ScriptedLM()
    waves: list[list[str]] = []
    while True:
        item = load_item_graph(db, item_id=item_id)  # each step starts from the database, like a task would
        outcome = item_outcome(item)
        if outcome is not None:
            break
        ready = ready_nodes(item)
        assert ready, "nothing ready but the item is not done"
        waves.append(sorted(ready))
        for node_id in ready:
            result = await execute_node(item, node_id, lm)
            assert store_node_result(db, item, result)
    assert len(waves[0]) == 2  # praise and complaints are ready together; the verdict waits for both
    assert len(lm.calls) == 3
    assert outcome.output is not None and set(outcome.output) == {"liked", "disliked", "verdict"}
    # a re-delivered task finds the result stored: nothing changes, the stored value wins
    item = load_item_graph(db, item_id=item_id)
    node_id = waves[0][0]
    again = await execute_node(item, node_id, ScriptedLM(reply=lambda alias, req: "different"))
    assert not store_node_result(db, item, again)
    assert item.values[node_id].payload != "different"


async def test_embedded_executor_continues_what_node_tasks_started(committed: Engine) -> None:
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), jobs_poll_interval=0.05)
    lm = ScriptedLM()
    runtime = JobsRuntime(config, resources=lm)
    await runtime.ensure_started()
    try:
        def prepare() -> str:
            with runtime.session() as session:
                item_id = _one_item_job(session)
                job_id = repository.get_item_by_id(session, item_id=item_id).job_id  # type: ignore[union-attr]
                item = load_item_graph(session, item_id=item_id)
                for node_id in ready_nodes(item):  # a worker ran the first wave, then vanished
                    result = asyncio.run(execute_node(item, node_id, ScriptedLM()))
                    store_node_result(session, item, result)
                return job_id

        job_id = await asyncio.to_thread(prepare)
        runtime.wake()
        for _ in range(200):
            with runtime.session() as session:
                view = describe_job(session, job_id)
            if view["status"] == "completed":
                break
            await asyncio.sleep(0.05)
        assert view["status"] == "completed"
        assert len(lm.calls) == 1  # only the verdict was left to run
        with runtime.session() as session:
            assert results_page(session, job_id).lines[0]["status"] == "completed"
    finally:
        await runtime.stop()
