"""``inf-engine db``: run the database migrations against ``Settings.database_url``, and check that they ran."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from app.cli.console import EXIT_BAD_INPUT, EXIT_FAILED, err, fail

db_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Database migrations (Alembic)")


def _url() -> str:
    from app.db.session import database_url
    from app.settings import get_settings

    return database_url(get_settings())


def _shown(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _run(action: str, revision: str) -> None:
    from app.db import migrate

    url = _url()
    try:
        if action == "upgrade":
            migrate.upgrade(url, revision)
        else:
            migrate.downgrade(url, revision)
    except Exception as exc:
        err.print(f"[bold red]error:[/] {action} to {revision} failed on {_shown(url)}: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_FAILED) from None
    err.print(f"{_shown(url)}: now at revision {migrate.current_revision(url) or 'base (empty)'}", highlight=False, soft_wrap=True)


@db_app.command("upgrade")
def upgrade_command(
    revision: Annotated[str, typer.Argument(help="Target revision (default: the newest)")] = "head",
) -> None:
    """Create or update the tables (INF_ENGINE_DATABASE_URL, or SQLite in INF_ENGINE_DATA_DIR)."""
    _run("upgrade", revision)


@db_app.command("downgrade")
def downgrade_command(
    revision: Annotated[str, typer.Argument(help="Target revision: an id, -1 (one step), or base (empty)")] = "-1",
) -> None:
    """Undo migrations down to REVISION (default: one step)."""
    _run("downgrade", revision)


@db_app.command("current")
def current_command() -> None:
    """Print the database's current revision."""
    from app.db import migrate

    url = _url()
    try:
        revision = migrate.current_revision(url)
    except Exception as exc:
        err.print(f"[bold red]error:[/] cannot read {_shown(url)}: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_FAILED) from None
    typer.echo(f"{revision or 'base'} (head: {migrate.head_revision(url)})")


#: seconds between two checks of ``db check --wait``
CHECK_EVERY_S = 2.0


@db_app.command("check")
def check_command(
    wait: Annotated[
        float, typer.Option("--wait", min=0, help="Keep checking for up to SECONDS until the schema is at head")
    ] = 0.0,
) -> None:
    """Exit 0 when the database's schema is at the newest revision; otherwise exit 2 with one line saying why
    (unreachable, or behind: run `inf-engine db upgrade`). Init containers wait with --wait."""
    from app.db import migrate

    url = _url()
    deadline = time.monotonic() + wait
    said = None
    while True:
        status = migrate.schema_status(url)
        if status.at_head:
            typer.echo(f"{_shown(url)}: at head {status.head}")
            return
        if time.monotonic() + CHECK_EVERY_S > deadline:
            raise fail(f"{_shown(url)}: {status.problem}", EXIT_BAD_INPUT)
        if status.problem != said:  # one line per new reason while waiting
            said = status.problem
            err.print(f"waiting: {_shown(url)}: {status.problem}", highlight=False, soft_wrap=True, markup=False)
        time.sleep(CHECK_EVERY_S)
