"""The composition of a server process's jobs: its database, endpoints and who runs the node tasks (Celery
workers, or the in-process queue of the embedded mode)."""

from app.jobs.runtime.server import JobsRuntime

__all__ = ["JobsRuntime"]
