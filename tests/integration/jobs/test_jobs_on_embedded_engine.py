"""Without a resources file, a job's aliases go to the in-process engine (here a tiny random Llama, so the test
is fast; by default it is SmolLM2)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.jobs.runtime import JobsRuntime
from app.jobs.service import describe_job, results_page
from app.jobs.submission import JobRequest, submit_job
from app.settings import Settings

pytest.importorskip("torch")


@pytest.mark.slow
async def test_job_runs_on_the_in_process_engine(committed: Engine, tmp_path: Path) -> None:
    from tests.support.server_helpers import build_tiny_llama

    model = build_tiny_llama(tmp_path / "tiny-llama")
    config = Settings(database_url=committed.url.render_as_string(hide_password=False), model=str(model),
                      num_threads=1, jobs_poll_interval=0.05)
    runtime = JobsRuntime(config)
    await runtime.ensure_started()
    try:
        def submit() -> str:
            with runtime.session() as session:
                inputs = [{"custom_id": f"e{i}", "input": f"review {i}"} for i in range(2)]
                return submit_job(session, JobRequest("review-compare", inputs=inputs))[0].id

        job_id = await asyncio.to_thread(submit)
        runtime.wake()
        for _ in range(1200):
            with runtime.session() as session:
                view = describe_job(session, job_id)
            if view["status"] in {"completed", "failed"}:
                break
            await asyncio.sleep(0.05)
        assert view["status"] == "completed", view
        assert view["usage"]["llm_calls"] == 6 and view["usage"]["output_tokens"] > 0
        with runtime.session() as session:
            lines = results_page(session, job_id).lines
        assert {line["custom_id"] for line in lines} == {"e0", "e1"}
        assert all(isinstance(line["output"]["verdict"], str) for line in lines)
    finally:
        await runtime.stop()
