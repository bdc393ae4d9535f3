"""The Celery tasks of scheduled evaluations. Thin: take primitive ids, call one function in ``app/``, return.

* ``inf.fire_evaluation_schedules`` (a beat periodic task): queue the due (schedule, fire time) evaluations and
  send each to a worker as ``inf.run_evaluation``;
* ``inf.run_evaluation(evaluation_id)``: claim and run one evaluation (a re-delivered or duplicate message finds
  it claimed or finished and does nothing).
"""

from __future__ import annotations

from celery import shared_task

from app.jobs.distributed.transport.queues import Queues
from app.settings import get_settings
from workers.runtime import learning_worker


@shared_task(name="inf.fire_evaluation_schedules")
def fire_evaluation_schedules() -> list[str]:
    settings = get_settings()
    worker = learning_worker(settings)
    ids = worker.fire()
    queue = Queues.from_prefix(settings.celery_queue_prefix).resolve(worker.queue_kind())
    for evaluation_id in ids:
        run_evaluation.apply_async(args=[evaluation_id], queue=queue)
    return ids


@shared_task(name="inf.run_evaluation")
def run_evaluation(evaluation_id: str) -> bool:
    return learning_worker(get_settings()).run(evaluation_id)
