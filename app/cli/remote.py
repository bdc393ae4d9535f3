"""What the commands that talk to a server share: ``--url``/``--api-key``, one :class:`app.client.Client` built
from the settings, its errors as one line and an exit status (2: the request was refused, 1: the server failed or
could not be reached), and the printing of answers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated, Any

import typer
from pydantic import BaseModel

from app.cli.console import EXIT_BAD_INPUT, EXIT_FAILED, CommandError, fail
from app.client import APIConnectionError, APIError, APIStatusError, Client

UrlOption = Annotated[str | None, typer.Option("--url", help="Server URL (default: settings.api_url)")]
KeyOption = Annotated[str | None, typer.Option("--api-key", help="Bearer key (default: settings.api_key)")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of a table")]


def inherited(ctx: typer.Context, url: str | None, api_key: str | None) -> tuple[str | None, str | None]:
    """``--url``/``--api-key`` of a subcommand, else those given to its group (``inf-engine jobs --url U cancel``)."""
    parent = ctx.parent.params if ctx.parent is not None else {}
    return url or parent.get("url"), api_key or parent.get("api_key")


@contextmanager
def connect(url: str | None, api_key: str | None) -> Iterator[Client]:
    """A client for ``url`` with ``api_key`` (default: the settings' ``api_url``/``api_key``); any error inside
    the block, of the client or a :class:`CommandError`, is printed in one line and exits."""
    from app.settings import get_settings

    client = Client.from_settings(get_settings(), base_url=url, api_key=api_key)
    try:
        yield client
    except CommandError as exc:
        raise fail(str(exc), exc.code) from None
    except APIError as exc:
        message, code = describe_error(exc)
        raise fail(message, code) from None
    except ValueError as exc:  # an argument the client refuses before sending (an empty id)
        raise fail(str(exc)) from None
    finally:
        client.close()


def describe_error(exc: APIError) -> tuple[str, int]:
    """The line to print for a client error, and the exit status."""
    if isinstance(exc, APIStatusError):
        hint = " (set INF_ENGINE_API_KEY or --api-key)" if exc.status_code == 401 else ""
        code = EXIT_BAD_INPUT if exc.status_code < 500 else EXIT_FAILED
        return f"HTTP {exc.status_code}: {exc.message}{hint}", code
    if isinstance(exc, APIConnectionError):
        return (f"{exc.message}: start it with `inf-engine serve`, or point INF_ENGINE_API_URL (or --url) at it",
                EXIT_FAILED)
    return exc.message, EXIT_FAILED


def print_json(value: BaseModel | dict[str, Any] | list[Any], *, indent: int | None = 2) -> None:
    """An answer as JSON on stdout, with the API's keys (``from`` rather than ``from_``)."""
    data = value.model_dump(mode="json", by_alias=True) if isinstance(value, BaseModel) else value
    typer.echo(json.dumps(data, indent=indent, ensure_ascii=False))


def when(timestamp: int | None) -> str:
    return "-" if timestamp is None else datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")
