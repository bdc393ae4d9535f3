"""The ``inf-engine`` command line: one package, one console and one exit-code table (``console``).

``main`` runs the root command (``app.cli.main``); the subcommands live by topic: ``db``, ``jobs`` (submit, jobs,
results), ``learning`` (train, eval) and ``workers`` (worker, beat, flower)."""

from app.cli.main import app, main

__all__ = ["app", "main"]
