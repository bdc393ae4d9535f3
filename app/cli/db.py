"""``inf-engine db``: run the database migrations against ``Settings.database_url``."""

from __future__ import annotations

from typing import Annotated

import typer

from app.cli.console import EXIT_FAILED, err

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
