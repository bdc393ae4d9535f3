"""``inf-engine files`` (list, get, upload, delete, content) and ``inf-engine batches`` (list, get, create, cancel):
the OpenAI-shaped files and Batch API of a running server, through :class:`app.client.Client`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from app.cli.console import err, fail
from app.cli.remote import JsonOption, KeyOption, UrlOption, connect, print_json, when

FileArgument = Annotated[str, typer.Argument(metavar="FILE_ID", help="The file id (from upload or list)")]
BatchArgument = Annotated[str, typer.Argument(metavar="BATCH_ID", help="The batch id (from create or list)")]
LimitOption = Annotated[int, typer.Option(min=1, max=100, help="How many (newest first)")]

files_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="Your uploaded files on the server (OpenAI's /v1/files): list, get, upload, delete, content")
batches_app = typer.Typer(add_completion=False, no_args_is_help=True,
                          help="Your batches on the server (OpenAI's Batch API): list, get, create, cancel")


@files_app.command("list")
def list_files_command(
    purpose: Annotated[str | None, typer.Option(help="Only files with this purpose (batch, user_data...)")] = None,
    limit: LimitOption = 20,
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """List your files, newest first."""
    with connect(url, api_key) as client:
        page = client.files.list(purpose=purpose, limit=limit)
    if as_json:
        print_json(page)
        return
    table = Table(show_edge=False, header_style="bold")
    for column in ("ID", "FILENAME", "PURPOSE", "BYTES", "CREATED"):
        table.add_column(column, no_wrap=column != "FILENAME")
    for file in page.data:
        table.add_row(file.id, file.filename, file.purpose, str(file.bytes), when(file.created_at))
    Console().print(table)
    if not page.data:
        err.print("no files" + (f" with purpose {purpose}" if purpose else ""))


@files_app.command("get")
def get_file_command(file_id: FileArgument, url: UrlOption = None, api_key: KeyOption = None) -> None:
    """Print a file's object as the API's JSON (name, purpose, size, status)."""
    with connect(url, api_key) as client:
        print_json(client.files.get(file_id))


@files_app.command("upload")
def upload_command(
    path: Annotated[Path, typer.Argument(metavar="PATH", help="The JSONL file to upload")],
    purpose: Annotated[str, typer.Option(help="'batch' (Batch API requests) or 'user_data' (job inputs)")] = "batch",
    as_json: Annotated[bool, typer.Option("--json", help="Print the file's JSON instead of its id")] = False,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """Upload a JSONL file; prints its id (for batches create, or submit by file id)."""
    if not path.is_file():
        raise fail(f"file {path} does not exist")
    with connect(url, api_key) as client:
        uploaded = client.files.upload(path, purpose=purpose)
    if as_json:
        print_json(uploaded)
    else:
        typer.echo(uploaded.id)
    err.print(f"uploaded {uploaded.id}: {uploaded.filename}, {uploaded.bytes} bytes, purpose {uploaded.purpose}",
              highlight=False, soft_wrap=True)


@files_app.command("delete")
def delete_command(file_id: FileArgument, url: UrlOption = None, api_key: KeyOption = None) -> None:
    """Delete a file; prints the API's answer ({"id", "object", "deleted"})."""
    with connect(url, api_key) as client:
        print_json(client.files.delete(file_id))


@files_app.command("content")
def content_command(
    file_id: FileArgument,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write it here (default stdout)")] = None,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """Download a file's content (a batch's output and error files too)."""
    with connect(url, api_key) as client:
        content = client.files.content(file_id)
    if output is None:
        buffer = getattr(sys.stdout, "buffer", None)
        if buffer is not None:
            buffer.write(content)
            buffer.flush()
        else:  # a text-only stdout (a test runner's capture)
            sys.stdout.write(content.decode("utf-8", "replace"))
            sys.stdout.flush()
        return
    output.write_bytes(content)
    err.print(f"{file_id}: {len(content)} bytes written to {output}", highlight=False, soft_wrap=True)


@batches_app.command("list")
def list_batches_command(
    limit: LimitOption = 20,
    as_json: JsonOption = False,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """List your batches, newest first."""
    with connect(url, api_key) as client:
        page = client.batches.list(limit=limit)
    if as_json:
        print_json(page)
        return
    table = Table(show_edge=False, header_style="bold")
    for column in ("ID", "STATUS", "ENDPOINT", "DONE", "FAILED", "CREATED"):
        table.add_column(column, no_wrap=column in {"ID", "STATUS", "DONE"})
    for batch in page.data:
        counts = batch.request_counts
        table.add_row(batch.id, batch.status, batch.endpoint, f"{counts.completed + counts.failed}/{counts.total}",
                      str(counts.failed), when(batch.created_at))
    Console().print(table)
    if not page.data:
        err.print("no batches")


@batches_app.command("get")
def get_batch_command(batch_id: BatchArgument, url: UrlOption = None, api_key: KeyOption = None) -> None:
    """Print a batch as the API's JSON (status, request counts, output and error file ids)."""
    with connect(url, api_key) as client:
        print_json(client.batches.get(batch_id))


@batches_app.command("create")
def create_batch_command(
    input: Annotated[Path | None, typer.Option("--input", "-i", help="A JSONL file of requests: uploaded first")] = None,
    input_file_id: Annotated[str | None, typer.Option(help="An uploaded file of requests (purpose batch)")] = None,
    endpoint: Annotated[str, typer.Option(help="Where each request goes")] = "/v1/chat/completions",
    completion_window: Annotated[str, typer.Option(help="OpenAI's completion window")] = "24h",
    metadata: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the batch's JSON instead of its id")] = False,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """Create a batch from a JSONL file of requests (--input) or an uploaded file (--input-file-id); prints its id."""
    if (input is None) == (input_file_id is None):
        raise fail("give --input (a JSONL file of requests) or --input-file-id (an uploaded file), one of them")
    if input is not None and not input.is_file():
        raise fail(f"input file {input} does not exist")
    tags = _metadata(metadata or [])
    with connect(url, api_key) as client:
        if input is not None:
            input_file_id = client.files.upload(input, purpose="batch").id
            err.print(f"uploaded {input} as {input_file_id}", highlight=False, soft_wrap=True)
        assert input_file_id is not None
        batch = client.batches.create(input_file_id, endpoint=endpoint, completion_window=completion_window,
                                      metadata=tags or None)
    if as_json:
        print_json(batch)
    else:
        typer.echo(batch.id)
    err.print(f"created {batch.id}: {batch.status}, {batch.request_counts.total} requests to {batch.endpoint}",
              highlight=False, soft_wrap=True)


@batches_app.command("cancel")
def cancel_batch_command(batch_id: BatchArgument, url: UrlOption = None, api_key: KeyOption = None) -> None:
    """Cancel a batch (it is cancelling until its running requests finish); prints the batch's JSON."""
    with connect(url, api_key) as client:
        print_json(client.batches.cancel(batch_id))


def _metadata(pairs: list[str]) -> dict[str, str]:
    tags = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise fail(f"--metadata {pair!r} is not KEY=VALUE")
        tags[key] = value
    return tags


def register_file_commands(app: typer.Typer) -> None:
    app.add_typer(files_app, name="files")
    app.add_typer(batches_app, name="batches")
