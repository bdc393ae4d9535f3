"""``inf-engine submit``, ``inf-engine jobs`` and ``inf-engine results``: the job commands, which talk to a
running server over HTTP (``Settings.api_url`` and ``Settings.api_key``; ``--url``/``--api-key`` override)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from app.cli.console import EXIT_BAD_INPUT, EXIT_FAILED, CommandError, err, fail

UrlOption = Annotated[str | None, typer.Option("--url", help="Server URL (default: settings.api_url)")]
KeyOption = Annotated[str | None, typer.Option("--api-key", help="Bearer key (default: settings.api_key)")]


class JobsClient:
    """The few HTTP calls the commands make, with errors turned into one readable line."""

    def __init__(self, url: str | None = None, api_key: str | None = None, timeout: float = 60.0) -> None:
        from app.settings import get_settings

        settings = get_settings()
        self.url = (url or settings.api_url or f"http://{settings.serve_host}:{settings.serve_port}").rstrip("/")
        key = api_key or settings.api_key or (settings.api_keys[0] if settings.api_keys else None)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, read=None))

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        self._check(response)
        return response.json()

    @contextmanager
    def stream_lines(self, path: str, params: dict[str, Any]) -> Iterator[Iterator[str]]:
        try:
            with self.http.stream("GET", path, params=params) as response:
                if response.status_code >= 400:
                    response.read()
                    self._check(response)
                yield (line for line in response.iter_lines() if line.strip())
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None

    def _unreachable(self, exc: Exception) -> CommandError:
        return CommandError(
            f"cannot reach the inf-engine server at {self.url} ({type(exc).__name__}): start it with "
            "`inf-engine serve`, or point INF_ENGINE_API_URL (or --url) at it", code=1,
        )

    @staticmethod
    def _check(response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:500] or response.reason_phrase
        hint = " (set INF_ENGINE_API_KEY or --api-key)" if response.status_code == 401 else ""
        code = EXIT_BAD_INPUT if response.status_code < 500 else EXIT_FAILED
        raise CommandError(f"HTTP {response.status_code}: {message}{hint}", code=code)


@contextmanager
def _client(url: str | None, api_key: str | None) -> Iterator[JobsClient]:
    client = JobsClient(url, api_key)
    try:
        yield client
    except CommandError as exc:
        raise fail(str(exc), exc.code) from None
    finally:
        client.close()


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
    body: dict[str, Any] = {"pipeline": pipeline, "inputs": text, "priority": priority}
    if idempotency_key:
        body["idempotency_key"] = idempotency_key
    with _client(url, api_key) as client:
        job = client.request("POST", "/v1/jobs", json=body)
        if not follow:
            typer.echo(job["id"])
            err.print(f"submitted {job['id']}: {job['counts']['total']} items of {pipeline}", highlight=False, soft_wrap=True)
            return
        err.print(f"submitted {job['id']}", highlight=False, soft_wrap=True)
        failed = _stream_results(client, job, sys.stdout, cursor=0, follow=True)
    if failed:
        raise typer.Exit(1)


def jobs_command(
    status: Annotated[str | None, typer.Option(help="Only these statuses, e.g. running or queued,running")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100, help="How many (newest first)")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of a table")] = False,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """List your jobs on the server, newest first."""
    params: dict[str, Any] = {"limit": limit}
    if status:
        params["status"] = status
    with _client(url, api_key) as client:
        page = client.request("GET", "/v1/jobs", params=params)
    if as_json:
        typer.echo(json.dumps(page, indent=2))
        return
    table = Table(show_edge=False, header_style="bold")
    for column in ("ID", "PIPELINE", "STATUS", "DONE", "FAILED", "CREATED"):
        table.add_column(column, no_wrap=column in {"ID", "STATUS"})
    for job in page["data"]:
        counts = job["counts"]
        done = counts["completed"] + counts["failed"] + counts["cancelled"]
        created = datetime.fromtimestamp(job["created_at"]).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(job["id"], job["pipeline"], job["status"], f"{done}/{counts['total']}",
                      str(counts["failed"]), created)
    Console().print(table)
    if not page["data"]:
        err.print("no jobs" + (f" with status {status}" if status else ""))


def results_command(
    job_id: Annotated[str, typer.Argument(metavar="JOB", help="The job id (from submit or jobs)")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep streaming until the job ends")] = False,
    cursor: Annotated[int, typer.Option(min=0, help="Skip the first CURSOR results (already read)")] = 0,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write NDJSON here (default stdout)")] = None,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """Print a job's results as NDJSON in completion order, with a progress bar on stderr."""
    sink: IO[str] = output.open("a" if cursor else "w") if output is not None else sys.stdout
    try:
        with _client(url, api_key) as client:
            job = client.request("GET", f"/v1/jobs/{job_id}")
            failed = _stream_results(client, job, sink, cursor=cursor, follow=follow)
    finally:
        if output is not None:
            sink.close()
    if failed:
        raise typer.Exit(1)


def _stream_results(client: JobsClient, job: dict[str, Any], sink: IO[str], *, cursor: int, follow: bool) -> int:
    """Write result lines as they arrive; returns how many items failed."""
    failed = 0
    total = job["counts"]["total"]
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=False) as progress:
        bar = progress.add_task(job["id"], total=total, completed=cursor)
        with client.stream_lines(f"/v1/jobs/{job['id']}/results", {"cursor": cursor, "follow": follow}) as lines:
            for line in lines:
                sink.write(line + "\n")
                sink.flush()
                if json.loads(line).get("status") != "completed":
                    failed += 1
                progress.advance(bar)
    final = client.request("GET", f"/v1/jobs/{job['id']}")
    counts = final["counts"]
    err.print(
        f"{final['id']}: {final['status']}, {counts['completed']}/{counts['total']} completed"
        + (f", {counts['failed']} failed" if counts["failed"] else "")
        + (f", {counts['cancelled']} cancelled" if counts["cancelled"] else ""),
        highlight=False,
        soft_wrap=True,
    )
    return failed


def register_job_commands(app: typer.Typer) -> None:
    app.command("submit")(submit_command)
    app.command("jobs")(jobs_command)
    app.command("results")(results_command)
