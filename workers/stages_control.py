"""``inf_stages``: a remote-control command that answers this worker's per-stage node timers
(:mod:`app.jobs.distributed.stages`), read by ``scripts/bench_platform.py`` before and after a run."""

from __future__ import annotations

from typing import Any

from celery.signals import worker_ready
from celery.worker.control import inspect_command

from app.jobs.distributed.stages import clock


@inspect_command()
def inf_stages(state: Any) -> dict[str, Any]:
    """This worker process's stage totals, its threads' CPU time and its peak RSS."""
    return clock.snapshot()


@worker_ready.connect(weak=False)
def _name_consumer(**_: Any) -> None:
    # worker_ready fires on the consumer's thread (the main one): it receives, decodes and acks messages
    clock.name_thread("consumer")
