"""The ``inf-engine`` command line: one package, one console and one exit-code table (``console``).

``main`` runs the root command (``app.cli.main``); the subcommands live by topic: ``db``, ``jobs`` (submit, jobs
list/get/cancel/trace, results), ``files`` (files and batches), ``learning`` (train, eval) and ``workers`` (worker,
beat, flower). The commands that talk to a server do it through ``app.client`` (``remote`` builds it from the
settings and turns its errors into one line)."""

from app.cli.main import app, main

__all__ = ["app", "main"]
