"""``inf-engine worker``, ``inf-engine beat`` and ``inf-engine flower``: the distributed side, on Celery and Redis.

Each starts its Celery program for our app (``workers.celery_app``) through Celery's Python API, so that a
deployment runs the same ``inf-engine`` commands everywhere (deploy/). Celery is imported only when one of these
commands runs.
"""

from __future__ import annotations

import logging
import os
from typing import Annotated, Any

import typer

from app.cli.console import EXIT_FAILED, fail
from app.cli.requirements import require_engine, require_flower

log = logging.getLogger("inf_engine.cli")

POOLS = ("prefork", "threads", "solo")


def _settings() -> Any:
    from pydantic import ValidationError

    from app.settings import get_settings, settings_error_message

    try:
        settings = get_settings()
    except ValidationError as exc:  # checked by the root command already; here for callers of the function
        raise fail(settings_error_message(exc) or f"invalid settings: {exc}") from None
    if not settings.redis_url:
        raise fail(
            "no Redis configured: set INF_ENGINE_REDIS_URL (e.g. redis://127.0.0.1:6379/0); without it, "
            "`inf-engine serve` runs jobs on its in-process queue and needs no worker"
        )
    from app.jobs.registry import RegistryError, configure_registry

    try:  # the operator's pipeline modules import now, not at a worker's first task
        configure_registry(settings.pipeline_modules)
    except RegistryError as exc:
        raise fail(str(exc)) from None
    return settings


def worker_queues(requested: list[str] | None, engine: bool, prefix: str) -> list[str]:
    """The queues a worker consumes: ``--queues`` (kinds or full names, repeated or comma-separated), the engine
    queue with ``--engine``, and by default the plain-Python and remote-LLM queues."""
    from app.jobs.distributed.transport.queues import Queues

    queues = Queues.from_prefix(prefix)
    names = [queues.resolve(n.strip()) for value in requested or [] for n in value.split(",") if n.strip()]
    if engine and queues.engine not in names:
        names.append(queues.engine)
    if not names:
        names = [queues.cpu, queues.llm]
    return list(dict.fromkeys(names))


def worker_command(
    queues: Annotated[
        list[str] | None,
        typer.Option(
            "--queues",
            "-Q",
            help="Queues to consume: cpu, llm, engine or full names; repeat or comma-separate "
            "(default: cpu and llm; --engine adds engine)",
        ),
    ] = None,
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency",
            "-c",
            min=1,
            help="Tasks at once (default: settings.worker_concurrency or one per CPU; with --engine "
            "settings.engine_worker_concurrency)",
        ),
    ] = None,
    engine: Annotated[
        bool,
        typer.Option(
            "--engine",
            help="Consume the engine queue and host one in-process engine, fed by all task threads",
        ),
    ] = False,
    pool: Annotated[
        str | None,
        typer.Option(help="prefork, threads or solo (default: threads with --engine, else prefork)"),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option("--name", "-n", help="Node name (default: settings.worker_name or <role>.<pid>@<host>)"),
    ] = None,
    loglevel: Annotated[str | None, typer.Option(help="Log level (default: settings.log_level)")] = None,
) -> None:
    """Start a Celery worker for inf-engine's queues (INF_ENGINE_REDIS_URL)."""
    settings = _settings()
    if pool is not None and pool not in POOLS:
        raise fail(f"--pool must be one of {', '.join(POOLS)}, not {pool!r}")
    names = worker_queues(queues, engine, settings.celery_queue_prefix)
    if engine:
        require_engine("worker --engine")
    _json_logs(loglevel or settings.log_level, "worker")
    if engine:
        from workers.engine_host import setup_engine_worker

        setup_engine_worker(settings)
        pool = pool or "threads"  # one process, so one engine that every task shares
        concurrency = concurrency or settings.engine_worker_concurrency
    pool = pool or "prefork"
    concurrency = concurrency or settings.worker_concurrency
    role = "engine" if engine else "worker"
    argv = [
        "worker",
        f"--queues={','.join(names)}",
        f"--pool={pool}",
        f"--loglevel={loglevel or settings.log_level}",
        f"--hostname={name or settings.worker_name or f'{role}.{os.getpid()}@%h'}",
    ]
    if settings.celery_task_events:
        argv.append("--task-events")
    if concurrency is not None:
        argv.append(f"--concurrency={concurrency}")
    from workers.celery_app import app as celery
    from workers.observability import announce_queues

    slots = concurrency or (os.cpu_count() or 1)  # Celery's default: one process per CPU
    # what beat and /health read to find the sweeper's consumers, and the dispatch windows their size
    announce_queues(settings, names, slots)
    _serve_metrics(settings, role=role, pool=pool, queues=names, slots=slots)
    sweeper = _sweeper_queue(settings)
    if sweeper not in names:
        log.warning("this worker does not consume %s (the sweeper's queue): start another worker that does", sweeper)
    log.info("worker consuming %s (%s, concurrency %s)", ", ".join(names), pool, concurrency or "per CPU")
    celery.worker_main(argv)


def _serve_metrics(settings: Any, *, role: str, pool: str, queues: list[str], slots: int) -> None:
    """The worker's own /metrics (INF_ENGINE_WORKER_METRICS_PORT): its engine's vllm:* series and its tasks'."""
    from workers.observability import serve_metrics

    where = f"{settings.worker_metrics_address}:{settings.worker_metrics_port}"
    try:
        server = serve_metrics(settings, role=role, pool=pool, queues=queues, slots=slots)
    except OSError as exc:
        raise fail(f"cannot serve the worker's /metrics on {where} (INF_ENGINE_WORKER_METRICS_PORT): {exc}") from None
    if server is not None:
        log.info("worker metrics on http://%s/metrics", where)
        if pool == "prefork":
            log.warning("--pool prefork: the tasks run in child processes, whose task series /metrics does not see "
                        "(the thread pool counts them)")


def _json_logs(level: str, service: str) -> None:
    from app.logs import configure_logging

    configure_logging(level, service)


def _sweeper_queue(settings: Any) -> str:
    from app.jobs.distributed.presence import sweeper_queue

    return sweeper_queue(settings.celery_queue_prefix)


def beat_command(
    loglevel: Annotated[str | None, typer.Option(help="Log level (default: settings.log_level)")] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Liveness probe: exit 0 when a beat in this data dir (running or standing by) beat within "
            "the last 120 s, else 1",
        ),
    ] = False,
) -> None:
    """Start Celery beat (periodic tasks); one instance runs, others stand by on a Redis lock."""
    if check:
        _check_beat()
        return
    settings = _settings()
    _json_logs(loglevel or settings.log_level, "beat")
    from workers.beat import run_beat
    from workers.celery_app import app as celery

    run_beat(celery, settings, loglevel=loglevel or settings.log_level, say=log.info)


def _check_beat() -> None:
    from app.settings import get_settings
    from workers.beat import HEARTBEAT_MAX_AGE_S, heartbeat_age, heartbeat_file

    settings = get_settings()
    age = heartbeat_age(settings)
    if age is None:
        raise fail(f"beat has not beaten: no {heartbeat_file(settings)}", EXIT_FAILED)
    if age > HEARTBEAT_MAX_AGE_S:
        raise fail(f"beat's last heartbeat is {age:.0f} s old (over {HEARTBEAT_MAX_AGE_S:.0f} s)", EXIT_FAILED)
    typer.echo(f"beat alive: last heartbeat {age:.0f} s ago")


def flower_command(
    port: Annotated[
        int | None, typer.Option(min=1, max=65535, help="Port (default: settings.flower_port)")
    ] = None,
    address: Annotated[
        str | None, typer.Option(help="Address to bind (default: settings.flower_address)")
    ] = None,
) -> None:
    """Start Flower (the Celery monitor) against the broker, with basic auth from settings."""
    require_flower()
    settings = _settings()
    if not settings.flower_password:
        raise fail(
            "Flower needs a password: set INF_ENGINE_FLOWER_PASSWORD (and INF_ENGINE_FLOWER_USER, default "
            "'admin'); it can revoke tasks and shut workers down, so it never runs open"
        )
    if ":" in settings.flower_user or "," in settings.flower_user or "," in settings.flower_password:
        raise fail("flower_user may not contain ':' or ',', and flower_password may not contain ','")
    from workers.celery_app import app as celery

    bind, listen = address or settings.flower_address, port or settings.flower_port
    _json_logs(settings.log_level, "flower")
    log.info("Flower on http://%s:%s (user %r)", bind, listen, settings.flower_user)
    celery.start(
        [
            "flower",
            f"--address={bind}",
            f"--port={listen}",
            f"--basic-auth={settings.flower_user}:{settings.flower_password}",
            "--logging=none",  # tornado adds no handler of its own: our JSON handler on the root logs it all
        ]
    )


def register_worker_commands(app: typer.Typer) -> None:
    app.command("worker")(worker_command)
    app.command("beat")(beat_command)
    app.command("flower")(flower_command)
