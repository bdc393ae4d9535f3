"""What every command shares: one stderr console, one exit-code table and one error path."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

EXIT_OK = 0
EXIT_FAILED = 1  # the work itself failed (a server error, a migration that broke, failed items)
EXIT_BAD_INPUT = 2  # the user's input or settings are wrong: one line says what to fix

err = Console(stderr=True)


class CommandError(Exception):
    """A failure to report in one line; ``code`` is the process exit status."""

    def __init__(self, message: str, code: int = EXIT_BAD_INPUT) -> None:
        super().__init__(message)
        self.code = code


def say_error(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)  # '[engine]' is text


def fail(message: str, code: int = EXIT_BAD_INPUT) -> typer.Exit:
    """Print ``error: message`` on stderr and return the Exit to raise (``raise fail(...)``)."""
    say_error(message)
    return typer.Exit(code)
