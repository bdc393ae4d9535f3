"""``inf-engine train`` and ``inf-engine eval``: submit a training or an evaluation to a running server over HTTP
(``Settings.api_url``/``api_key``, or ``--url``/``--api-key``) and follow it with a progress bar.

They talk to the server, as ``inf-engine submit`` does, rather than running locally: the server keeps the
parameter versions, the evaluation history and the schedules in its database, runs the work on its endpoints
(its own model when no resources file is set), and human feedback reaches a training through its REST API.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from app.cli.console import EXIT_BAD_INPUT, CommandError, err
from app.cli.remote import KeyOption, UrlOption, connect
from app.client.types import TERMINAL, Evaluation, Training

POLL_SECONDS = 0.5
Run = TypeVar("Run", Training, Evaluation)

DatasetOption = Annotated[Path, typer.Option("--dataset", "-d", help="JSONL file: one example per line, "
                                             '{"input": ..., "target": ...}')]
LossOption = Annotated[str | None, typer.Option(
    "--loss", help='Loss spec as JSON or @file.json, e.g. \'{"type": "rubric", "criteria": "...", "rubric": {...}}\'')]
MetricOption = Annotated[str | None, typer.Option(
    "--metric", help="A verifier check instead of --loss: exact, contains, regex, number, fields, or a registered metric name")]
DetachOption = Annotated[bool, typer.Option("--detach", help="Print the id and return without following")]


def _examples(path: Path) -> list[Any]:
    if not path.is_file():
        raise CommandError(f"dataset file {path} does not exist")
    examples = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise CommandError(f"dataset file {path} is not UTF-8 text") from None
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                examples.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise CommandError(f"{path}: line {number} is not valid JSON ({exc.msg})") from None
    if not examples:
        raise CommandError(f"dataset file {path} has no examples")
    return examples


def _json_option(value: str | None, name: str) -> Any:
    if value is None:
        return None
    text = value
    if value.startswith("@"):
        file = Path(value[1:])
        if not file.is_file():
            raise CommandError(f"{name} file {file} does not exist")
        text = file.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CommandError(f"{name} is not valid JSON ({exc.msg}); give a JSON object or @file.json") from None


def _loss_fields(loss: str | None, metric: str | None) -> dict[str, Any]:
    if loss is None and metric is None:
        raise CommandError("give --loss (a loss spec) or --metric (e.g. exact)")
    if loss is not None and metric is not None:
        raise CommandError("give either --loss or --metric, not both")
    return {"loss": _json_option(loss, "--loss")} if loss is not None else {"metric": metric}


def _follow(get: Callable[[], Run], progress_of: Callable[[Run], tuple[int, int]], label: str) -> Run:
    """Poll a training or an evaluation until it is terminal, advancing a progress bar."""
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[note]}"))
    with Progress(*columns, console=err, transient=False) as progress:
        view = get()
        bar = progress.add_task(label, total=progress_of(view)[1] or None, note="")
        while True:
            done, total = progress_of(view)
            progress.update(bar, completed=done, total=total or None, note=_note(view))
            if view.status in TERMINAL:
                return view
            time.sleep(POLL_SECONDS)
            view = get()


def _note(view: Training | Evaluation) -> str:
    steps = (view.steps or []) if isinstance(view, Training) else []
    if steps and steps[-1].score is not None:
        return f"step {steps[-1].step} score {steps[-1].score:.3f}"
    if isinstance(view, Evaluation) and view.score is not None:
        return f"score {view.score:.3f}"
    return str(view.status)


def _fmt(score: Any) -> str:
    return "-" if score is None else f"{score:.3f}"


def train_command(
    pipeline: Annotated[str, typer.Argument(help="A registered pipeline: an example's name or see INF_ENGINE_PIPELINE_MODULES")],
    dataset: DatasetOption,
    loss: LossOption = None,
    metric: MetricOption = None,
    eval_dataset: Annotated[Path | None, typer.Option(help="Held-out JSONL: scored before and after each epoch")] = None,
    validation_dataset: Annotated[Path | None, typer.Option(
        help="JSONL the gepa optimizer chooses on (default: a third of the dataset held out)")] = None,
    optimizer: Annotated[str | None, typer.Option(
        help='Optimizer settings as JSON, e.g. \'{"type": "gepa", "budget": 600}\' (the default) or \'{"type": "sfa"}\'')] = None,
    epochs: Annotated[int, typer.Option(min=1, help="Passes over the dataset")] = 1,
    batch_size: Annotated[int, typer.Option(min=1, help="Examples per optimizer step")] = 4,
    seed: Annotated[int | None, typer.Option(help="Shuffling seed (reproducible batches)")] = None,
    activate: Annotated[bool, typer.Option(help="Make the final version the pipeline's active parameters")] = True,
    detach: DetachOption = False,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """Train a pipeline's learnable parameters on the server; each optimizer step stores a parameter version."""
    with connect(url, api_key) as client:
        created = client.trainings.create(
            pipeline, _examples(dataset), **_loss_fields(loss, metric), epochs=epochs, batch_size=batch_size,
            seed=seed, activate=activate,
            eval_dataset=None if eval_dataset is None else _examples(eval_dataset),
            validation_dataset=None if validation_dataset is None else _examples(validation_dataset),
            optimizer=None if optimizer is None else _json_option(optimizer, "--optimizer"),
        )
        typer.echo(created.id)
        if detach:
            err.print(f"submitted {created.id}: {created.progress.total_steps} steps; follow it with "
                       f"GET /v1/trainings/{created.id}", highlight=False, soft_wrap=True)
            return
        final = _follow(lambda: client.trainings.get(created.id),
                        lambda v: (v.progress.completed_steps, v.progress.total_steps), created.id)
    _training_summary(final)
    if final.status != "completed":
        raise typer.Exit(1)


def _training_summary(view: Training) -> None:
    table = Table(show_edge=False, header_style="bold")
    for column in ("STEP", "EPOCH", "SCORE", "VERSION", "CHANGED"):
        table.add_column(column)
    for step in view.steps or []:
        changed = ", ".join(u["name"] for u in step.updates if isinstance(u, dict) and u.get("changed")) or "-"
        table.add_row(str(step.step), str(step.epoch), _fmt(step.score), str(step.version or "-"), changed)
    err.print(table)
    result = view.result or {}
    line = f"{view.id}: {view.status}"
    if view.status == "completed":
        line += f", versions {view.base_version} → {view.final_version}"
        line += " (active)" if result.get("activated") else ""
        if result.get("val_scores"):
            line += ", validation " + " → ".join(_fmt(s) for s in result["val_scores"][:1] + result["val_scores"][-1:])
            line += f" ({result.get('metric_calls')} metric calls, {result.get('accepted')} candidates accepted)"
        if result.get("eval_scores"):
            line += ", held-out " + " → ".join(_fmt(s) for s in result["eval_scores"])
    elif view.error:
        line += f": {view.error.get('message')}"
    err.print(line, highlight=False, soft_wrap=True)


def eval_command(
    pipeline: Annotated[str, typer.Argument(help="A registered pipeline: an example's name or see INF_ENGINE_PIPELINE_MODULES")],
    dataset: DatasetOption,
    loss: LossOption = None,
    metric: MetricOption = None,
    version: Annotated[int | None, typer.Option(min=1, help="Evaluate this parameter version (default: the active)")] = None,
    schedule: Annotated[str | None, typer.Option(
        help="Instead of running now, create a schedule with this five-field cron (UTC), e.g. '0 3 * * *'")] = None,
    margin: Annotated[float, typer.Option(min=0, help="With --schedule: a drop above this flags a regression")] = 0.0,
    detach: DetachOption = False,
    url: UrlOption = None,
    api_key: KeyOption = None,
) -> None:
    """Score a pipeline on a dataset with a loss or a metric on the server (or schedule it with --schedule)."""
    with connect(url, api_key) as client:
        examples, scoring = _examples(dataset), _loss_fields(loss, metric)
        if schedule is not None:
            planned = client.schedules.create(pipeline, examples, **scoring, version=version, cron=schedule,
                                              margin=margin)
            typer.echo(planned.id)
            err.print(f"scheduled {planned.id} ({planned.cron}, UTC); runs: GET "
                       f"/v1/evaluations/schedules/{planned.id}/runs", highlight=False, soft_wrap=True)
            return
        created = client.evaluations.create(pipeline, examples, **scoring, version=version)
        typer.echo(created.id)
        if detach:
            return
        final = _follow(lambda: client.evaluations.get(created.id),
                        lambda v: (v.progress.completed_examples, v.progress.total_examples), created.id)
    details = final.details or {}
    line = f"{final.id}: {final.status}, score {_fmt(final.score)}"
    if final.parameter_version:
        line += f" (parameter version {final.parameter_version})"
    if details.get("failures"):
        line += f", {details['failures']} example(s) failed"
    if final.error:
        line += f": {final.error.get('message')}"
    err.print(line, highlight=False, soft_wrap=True)
    if final.status != "completed":
        raise typer.Exit(1)


def register_learning_commands(app: typer.Typer) -> None:
    app.command("train")(train_command)
    app.command("eval")(eval_command)


__all__ = ["EXIT_BAD_INPUT", "register_learning_commands"]
