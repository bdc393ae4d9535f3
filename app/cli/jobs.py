"""``inf-engine submit``, ``inf-engine jobs`` (list, get, cancel, trace) and ``inf-engine results``: the job
commands, which talk to a running server through :class:`app.client.Client` (``Settings.api_url`` and
``Settings.api_key``; ``--url``/``--api-key`` override)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from app.cli.console import err, fail
from app.cli.remote import JsonOption, KeyOption, UrlOption, connect, inherited, print_json, when
from app.client import Client
from app.client.types import Job

JobArgument = Annotated[str, typer.Argument(metavar="JOB", help="The job id (from submit or jobs)")]
StatusOption = Annotated[str | None, typer.Option(help="Only these statuses, e.g. running or queued,running")]
LimitOption = Annotated[int, typer.Option(min=1, max=100, help="How many (newest first)")]

jobs_app = typer.Typer(add_completion=False, help="Your jobs on the server: list them (the default), or get, "
                       "cancel or trace one. Submit with `inf-engine submit`, read results with `inf-engine results`.")


def submit_command(
    pipeline: Annotated[str, typer.Argument(help="A registered pipeline: an example's name or see INF_ENGINE_PIPELINE_MODULES")],
    input: Annotated[Path, typer.Option("--input", "-i", help="JSONL file: one item per line")],
    priority: Annotated[int, typer.Option(help="Lower values run first (default 0)")] = 0,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Stream the results until the job ends")] = False,
    idempotency_key: Annotated[str | None, typer.Option(help="Submitting again with it returns the same job")] = None,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """Submit a job to the server: PIPELINE over every line of a JSONL file; prints the job id.

    With --follow it streams the results as NDJSON instead, with a progress bar on stderr."""
    if not input.is_file():
        raise fail(f"input file {input} does not exist")
    try:
        text = input.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise fail(f"input file {input} is not UTF-8 text") from None
    with connect(url, api_key) as client:
        job = client.jobs.submit(pipeline, text, priority=priority, idempotency_key=idempotency_key)
        if not follow:
            typer.echo(job.id)
            err.print(f"submitted {job.id}: {job.counts.total} items of {pipeline}", highlight=False, soft_wrap=True)
            return
        err.print(f"submitted {job.id}", highlight=False, soft_wrap=True)
        failed = _stream_results(client, job, sys.stdout, cursor=0, follow=True)
    if failed:
        raise typer.Exit(1)


@jobs_app.callback(invoke_without_command=True)
def jobs_command(
    ctx: typer.Context,
    status: StatusOption = None,
    limit: LimitOption = 20,
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """List your jobs on the server, newest first (or: jobs get|cancel|trace JOB)."""
    if ctx.invoked_subcommand is None:
        _list_jobs(status, limit, as_json, url, api_key)


@jobs_app.command("list")
def list_command(
    ctx: typer.Context,
    status: StatusOption = None,
    limit: LimitOption = 20,
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """List your jobs on the server, newest first."""
    _list_jobs(status, limit, as_json, *inherited(ctx, url, api_key))


def _list_jobs(status: str | None, limit: int, as_json: bool, url: str | None, api_key: str | None) -> None:
    with connect(url, api_key) as client:
        page = client.jobs.list(status=status, limit=limit)
    if as_json:
        print_json(page)
        return
    table = Table(show_edge=False, header_style="bold")
    for column in ("ID", "PIPELINE", "STATUS", "DONE", "FAILED", "CREATED"):
        table.add_column(column, no_wrap=column in {"ID", "STATUS"})
    for job in page.data:
        counts = job.counts
        done = counts.completed + counts.failed + counts.cancelled
        table.add_row(job.id, job.pipeline, job.status, f"{done}/{counts.total}", str(counts.failed),
                      when(job.created_at))
    Console().print(table)
    if not page.data:
        err.print("no jobs" + (f" with status {status}" if status else ""))


@jobs_app.command("get")
def get_command(ctx: typer.Context, job_id: JobArgument, url: UrlOption = None, api_key: KeyOption = None) -> None:
    """Print a job as the API's JSON: status, counts, usage, timestamps."""
    with connect(*inherited(ctx, url, api_key)) as client:
        print_json(client.jobs.get(job_id))


@jobs_app.command("cancel")
def cancel_command(
    ctx: typer.Context,
    job_id: JobArgument,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the job has stopped")] = False,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """Cancel a job: its pending items are cancelled, running nodes finish first. Prints the job's JSON."""
    with connect(*inherited(ctx, url, api_key)) as client:
        job = client.jobs.cancel(job_id)
        if wait:
            job = client.jobs.wait(job.id, poll_interval=0.2)
    print_json(job)
    err.print(f"{job.id}: {job.status}, {_counts_line(job)}", highlight=False, soft_wrap=True)


@jobs_app.command("trace")
def trace_command(
    ctx: typer.Context,
    job_id: JobArgument,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the trace here (default stdout)")] = None,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """Print a job's Chrome Trace Event JSON (open it in https://ui.perfetto.dev); live while the job runs."""
    with connect(*inherited(ctx, url, api_key)) as client:
        trace = client.jobs.trace(job_id)
    if output is None:
        print_json(trace, indent=None)
        return
    output.write_text(json.dumps(trace), encoding="utf-8")
    events = trace.get("traceEvents", [])
    err.print(f"{job_id}: {len(events)} trace events written to {output}; open it in https://ui.perfetto.dev",
              highlight=False, soft_wrap=True)


def results_command(
    job_id: JobArgument,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep streaming until the job ends")] = False,
    cursor: Annotated[int, typer.Option(min=0, help="Skip the first CURSOR results (already read)")] = 0,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write NDJSON here (default stdout)")] = None,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """Print a job's results as NDJSON in completion order, with a progress bar on stderr."""
    sink: IO[str] = output.open("a" if cursor else "w") if output is not None else sys.stdout
    try:
        with connect(url, api_key) as client:
            job = client.jobs.get(job_id)
            failed = _stream_results(client, job, sink, cursor=cursor, follow=follow)
    finally:
        if output is not None:
            sink.close()
    if failed:
        raise typer.Exit(1)


def _stream_results(client: Client, job: Job, sink: IO[str], *, cursor: int, follow: bool) -> int:
    """Write result lines as they arrive; returns how many items failed."""
    failed = 0
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=False) as progress:
        bar = progress.add_task(job.id, total=job.counts.total, completed=cursor)
        with client.jobs.results(job.id, cursor=cursor, follow=follow) as results:
            for result in results:
                line = result.model_dump(mode="json", exclude_unset=True)
                sink.write(json.dumps(line, ensure_ascii=False) + "\n")
                sink.flush()
                if not result.ok:
                    failed += 1
                progress.advance(bar)
    final = client.jobs.get(job.id)
    err.print(f"{final.id}: {final.status}, {_counts_line(final)}", highlight=False, soft_wrap=True)
    return failed


def _counts_line(job: Job) -> str:
    counts = job.counts
    return (f"{counts.completed}/{counts.total} completed"
            + (f", {counts.failed} failed" if counts.failed else "")
            + (f", {counts.cancelled} cancelled" if counts.cancelled else ""))


def register_job_commands(app: typer.Typer) -> None:
    app.command("submit")(submit_command)
    app.add_typer(jobs_app, name="jobs")
    app.command("results")(results_command)
