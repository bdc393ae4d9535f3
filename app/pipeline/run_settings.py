"""ExecutionSettings: run configuration for every module call inside a ``with`` block (they nest)."""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Self

#: names accepted by bind(), ExecutionSettings and as keyword arguments of a module call / run()
SETTING_NAMES = frozenset(
    {
        "resources",
        "checkpoint_dir",
        "execution_id",
        "max_concurrent",
        "scheduler",
        "on_task_complete",
        "on_task_failed",
        "task_timeout",
        "max_task_retries",
        "task_retry_delay",
        "streaming",
        "preserve_order",
        "on_progress",
        "profile",
        "profile_path",
        "profile_counters",
        "profile_include_args",
        "profiler",
        "record",
    }
)


def validate_setting_names(settings: dict[str, Any]) -> None:
    unknown = sorted(set(settings) - SETTING_NAMES)
    if unknown:
        raise TypeError(f"unknown execution setting(s) {unknown}; known: {sorted(SETTING_NAMES)}")


@dataclass
class RunConfig:
    """The effective settings of one call, after precedence: call kwargs > bind > ExecutionSettings > defaults."""

    resources: Any = None
    checkpoint_dir: Path | str | None = None
    execution_id: str | None = None
    max_concurrent: int = 100
    scheduler: Any = None
    on_task_complete: Any = None
    on_task_failed: Any = None
    task_timeout: float | None = None
    max_task_retries: int | None = None  # None: each endpoint's max_retries for LLM nodes, 0 for the rest
    task_retry_delay: float = 1.0
    streaming: bool = False
    preserve_order: bool = False
    on_progress: Any = None
    profile: bool = False
    profile_path: Path | str | None = None
    profile_counters: bool = True
    profile_include_args: bool = True
    profiler: Any = None
    record: bool = False

    def updated(self, values: dict[str, Any]) -> RunConfig:
        validate_setting_names(values)
        return replace(self, **{k: v for k, v in values.items() if v is not None})

    def validate(self) -> RunConfig:
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {self.max_concurrent}")
        if self.task_timeout is not None and self.task_timeout <= 0:
            raise ValueError(f"task_timeout must be positive, got {self.task_timeout}")
        if self.max_task_retries is not None and self.max_task_retries < 0:
            raise ValueError(f"max_task_retries must be >= 0, got {self.max_task_retries}")
        if self.task_retry_delay < 0:
            raise ValueError(f"task_retry_delay must be >= 0, got {self.task_retry_delay}")
        return self


def is_manager(resources: Any) -> bool:
    """A ResourceManager, or anything that answers ``await complete(alias, LLMRequest)`` (a scripted fake)."""
    return callable(getattr(resources, "complete", None))


def make_manager(resources: Any) -> Any:
    from app.pipeline.resources.manager import ResourceManager

    return ResourceManager(resources)


_CURRENT: ContextVar[ExecutionSettings | None] = ContextVar("inf_engine_execution_settings", default=None)


class ExecutionSettings:
    """``with ExecutionSettings(resources=..., max_concurrent=...):`` (or ``async with``) sets defaults for every
    module call inside. Nested blocks override the outer one's values they set. Within one block the resource
    manager (clients, rate limiters) and a profiler (``profile=True``) are shared by all calls."""

    def __init__(self, **settings: Any) -> None:
        validate_setting_names(settings)
        self.values = {k: v for k, v in settings.items() if v is not None}
        self._token: Token[ExecutionSettings | None] | None = None
        self._parent: ExecutionSettings | None = None
        self._manager: Any = None
        self._own_profiler: Any = None

    def __getattr__(self, name: str) -> Any:
        if name in SETTING_NAMES:
            return self.merged().get(name)
        raise AttributeError(name)

    def merged(self) -> dict[str, Any]:
        base = self._parent.merged() if self._parent is not None else {}
        return {**base, **self.values}

    def run_config(self) -> RunConfig:
        merged = self.merged()
        if self.values.get("resources") is None and self._parent is not None:
            merged["resources"] = self._parent.shared_resources()
        else:
            merged["resources"] = self.shared_resources()
        if merged.get("profile") and merged.get("profiler") is None:
            merged["profiler"] = self.shared_profiler()
        return RunConfig().updated(merged)

    def shared_resources(self) -> Any:
        """A ResourceManager for this block's resources, created once so limits are shared by all calls."""
        resources = self.values.get("resources")
        if resources is None:
            return self._parent.shared_resources() if self._parent is not None else None
        if is_manager(resources):
            return resources
        if self._manager is None:
            self._manager = make_manager(resources)
        return self._manager

    def shared_profiler(self) -> Any:
        if self._own_profiler is None:
            from app.pipeline.profiling.recording import TraceProfiler

            merged = self.merged()
            self._own_profiler = TraceProfiler(
                include_counters=merged.get("profile_counters", True),
                include_args=merged.get("profile_include_args", True),
            )
            self._own_profiler.start()
        return self._own_profiler

    # -- context management ---------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        self._parent = _CURRENT.get()
        self._token = _CURRENT.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._finish_profile()
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None
        manager, self._manager = self._manager, None
        if manager is not None:
            _close_soon(manager)

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        manager = self._manager
        self._manager = None
        self.__exit__(*exc)
        if manager is not None:
            await manager.aclose()

    def _finish_profile(self) -> None:
        if self._own_profiler is None:
            return
        self._own_profiler.stop()
        path = self.merged().get("profile_path")
        if path is not None:
            self._own_profiler.save(path)

    @property
    def profiler(self) -> Any:
        return self._own_profiler


_closing: set[Any] = set()


def _close_soon(manager: Any) -> None:
    """A sync ``with`` block cannot await: close the manager's connections on the running loop, or right away."""
    import asyncio

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(manager.aclose())
        return
    task = loop.create_task(manager.aclose())
    _closing.add(task)
    task.add_done_callback(_closing.discard)


def get_execution_settings() -> ExecutionSettings | None:
    return _CURRENT.get()


def setting_field_names() -> list[str]:
    return [f.name for f in fields(RunConfig)]
