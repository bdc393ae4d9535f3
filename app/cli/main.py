"""The ``inf-engine`` command line."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import IO, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from app.cli.console import EXIT_BAD_INPUT, err, fail, say_error
from app.cli.requirements import missing_extra_message, require_engine

# --install-completion and --show-completion: bash, zsh, fish and PowerShell completion of commands and options
app = typer.Typer(no_args_is_help=True, help="inf-engine: LLM pipelines at scale")


def _print_version(value: bool) -> None:
    if value:
        from app.version import version

        typer.echo(f"inf-engine {version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit"),
    ] = False,
) -> None:
    """inf-engine: LLM pipelines, an inference engine and a job platform."""
    if "--help" in sys.argv[1:]:
        return  # help needs no settings
    from app.settings import exit_on_bad_settings, get_settings

    # Every command reads the settings first: a bad one stops it here, in one line, with exit status 2.
    with exit_on_bad_settings():
        get_settings()


def _load_resources(path: Path | None) -> Any:
    from app.pipeline import ResourceConfig
    from app.settings import get_settings

    path = path or get_settings().resources_file
    if path is None:
        return None
    if not Path(path).is_file():
        raise fail(f"resources file {path} does not exist")
    try:
        return ResourceConfig.from_file(path)
    except Exception as exc:
        raise fail(f"cannot read resources file {path}: {exc}") from None


def _pipeline_aliases(module: Any) -> list[str]:
    """Every endpoint alias the pipeline's modules name (LLMInference and anything else with an ``alias``)."""
    return sorted({m.alias for m in module.modules() if isinstance(getattr(m, "alias", None), str)})


def _embedded_resources(module: Any) -> Any:
    """Without a resources file, every alias runs on the in-process engine (Settings.model, else SmolLM2), and its
    Embedding calls on Settings.embedding_model loaded in this process (else the engine's pooler_config): a
    ResourceManager, which the run closes."""
    from app.jobs.endpoints.backend import EngineResourceManager
    from app.pipeline import ConfigurationError
    from app.serving.embedded import embedded_resources, register_embedded_engine
    from app.serving.embedding_client import LocalEmbeddings
    from app.settings import get_settings

    settings = get_settings()
    register_embedded_engine(num_threads=settings.num_threads)
    aliases = _pipeline_aliases(module)
    try:
        config = embedded_resources(aliases, settings.model)
    except ConfigurationError as exc:
        raise fail(f"{exc} (set INF_ENGINE_MODEL, or pass --resources)") from None
    if aliases:
        model = next(iter(config.values()))[0].model
        err.print(f"no --resources given: {', '.join(aliases)} → the in-process engine ({model})", highlight=False)
    embeddings = LocalEmbeddings(embedding_model=settings.embedding_model, pooler_config=settings.pooler_config,
                                 num_threads=settings.num_threads, dtype=settings.embedding_dtype)
    return EngineResourceManager(config, embeddings)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, bytes):
        return obj.decode("utf-8", "replace")
    return str(obj)


@app.command("run")
def run_command(
    pipeline: Annotated[str, typer.Argument(help="A 'package.module:Class' path or a shipped example's name")],
    input: Annotated[Path, typer.Option("--input", "-i", help="JSONL file: one item per line")],
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Results JSONL (default: stdout)")] = None,
    resources: Annotated[
        Path | None, typer.Option(help="ResourceConfig file (TOML or YAML); default: the in-process engine")
    ] = None,
    max_concurrent: Annotated[int, typer.Option(min=1, help="Requests in flight at once")] = 64,
    checkpoint_dir: Annotated[Path | None, typer.Option(help="Resume from / write checkpoints here")] = None,
    execution_id: Annotated[str | None, typer.Option(help="Name of the run (reuse it to resume)")] = None,
    profile: Annotated[Path | None, typer.Option(help="Write a Chrome trace (Perfetto) to this file")] = None,
) -> None:
    """Run a pipeline over every line of a JSONL file and write one result per line, as items finish."""
    from app.jobs.inputs import InputFileError, read_jsonl
    from app.jobs.registry import UnknownPipelineError, load_local_pipeline

    try:
        items = read_jsonl(input)
        module = load_local_pipeline(pipeline)
    except (InputFileError, UnknownPipelineError) as exc:
        raise fail(str(exc)) from None
    resource_config = _load_resources(resources)
    if resource_config is None:
        require_engine("run")  # without --resources, the model runs in this process
        resource_config = _embedded_resources(module)
    if checkpoint_dir is not None and execution_id is None:
        execution_id = f"{Path(input).stem}-{type(module).__name__}"
    sink: IO[str] = output.open("w") if output is not None else sys.stdout
    try:
        failed = asyncio.run(
            _run_items(module, items, sink, resource_config, max_concurrent, checkpoint_dir, execution_id, profile)
        )
    except Exception as exc:
        raise fail(f"{type(exc).__name__}: {exc}") from None
    finally:
        if output is not None:
            sink.close()
    done = len(items) - failed
    err.print(f"{done}/{len(items)} items succeeded" + (f", {failed} failed" if failed else ""))
    if output is not None:
        err.print(f"results written to {output}")
    if failed:
        raise typer.Exit(1)


async def _run_items(
    module: Any,
    items: list[Any],
    sink: IO[str],
    resources: Any,
    max_concurrent: int,
    checkpoint_dir: Path | None,
    execution_id: str | None,
    profile: Path | None,
) -> int:
    from app.pipeline.execution.executor import run_items

    settings: dict[str, Any] = {"max_concurrent": max_concurrent}
    if resources is not None:
        settings["resources"] = resources
    if checkpoint_dir is not None:
        settings.update(checkpoint_dir=checkpoint_dir, execution_id=execution_id)
    if profile is not None:
        settings.update(profile=True, profile_path=profile)
    failed = 0
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=err, transient=False) as progress:
            bar = progress.add_task(type(module).__name__, total=len(items))
            stream = run_items(module, [(item.args, item.kwargs) for item in items], **settings)
            async for result in stream:
                item = items[result.index]
                record: dict[str, Any] = {"custom_id": item.custom_id}
                if result.ok:
                    record["status"] = "completed"
                    record["output"] = result.output
                else:
                    failed += 1
                    record["status"] = "failed"
                    record["error"] = {"type": type(result.error).__name__, "message": str(result.error)}
                sink.write(json.dumps(record, ensure_ascii=False, default=_json_default) + "\n")
                sink.flush()
                progress.advance(bar)
    finally:
        close = getattr(resources, "aclose", None)  # the in-process engine's manager (a config has none)
        if close is not None:
            await close()
    return failed


def _add_platform_commands() -> None:
    from app.cli.db import db_app
    from app.cli.files import register_file_commands
    from app.cli.jobs import register_job_commands
    from app.cli.learning import register_learning_commands
    from app.cli.serve import serve_command
    from app.cli.workers import register_worker_commands

    app.command("serve")(serve_command)
    app.add_typer(db_app, name="db")
    register_job_commands(app)
    register_file_commands(app)
    register_learning_commands(app)
    register_worker_commands(app)


_add_platform_commands()


def main() -> None:
    from app.settings import exit_on_bad_settings

    try:
        with exit_on_bad_settings():  # a setting first read inside a command fails the same way as in _root
            app()
    except ModuleNotFoundError as exc:  # an extra this install lacks (the engine's torch, Flower)
        message = missing_extra_message(exc, _command_name())
        if message is None:
            raise
        say_error(message)
        raise SystemExit(EXIT_BAD_INPUT) from None
    except ImportError as exc:  # e.g. a kombu without what the Celery transport patches
        if type(exc).__name__ != "KombuIncompatibleError":
            raise
        say_error(str(exc))
        raise SystemExit(EXIT_BAD_INPUT) from None


def _command_name() -> str:
    names = [a for a in sys.argv[1:] if not a.startswith("-")]
    return names[0] if names else "inf-engine"


if __name__ == "__main__":
    main()
