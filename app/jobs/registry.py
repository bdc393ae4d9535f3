"""What a request may name: the pipelines, losses, metrics and datasets the operator declared, and nothing else.

A request is data. Its ``pipeline``, a ``python`` loss's ``name``, a verifier ``metric`` and a named ``dataset``
are looked up here; a name that is not registered is refused (listing what is), and nothing is imported (or read
from a path) because a request said so. The operator declares names in three ways:

* the examples shipped with inf-engine (``review-compare``, ``sentiment``) and their labelled splits
  (``sentiment:train``, ``review-extract:test``, ...: ``app.examples.datasets``);
* Python entry points of installed packages, in the groups ``inf_engine.pipelines``, ``inf_engine.losses``,
  ``inf_engine.metrics`` and ``inf_engine.datasets`` (``name = "package.module:attr"``);
* modules listed in the setting ``pipeline_modules`` (``INF_ENGINE_PIPELINE_MODULES=pkg.a,pkg.b``): every
  pipeline ``Module`` class they define (or their ``PIPELINES`` dict, name -> class), their ``LOSSES`` dict
  (name -> Loss, Loss class or factory), their ``METRICS`` dict (name -> verifier function) and their
  ``DATASETS`` dict (name -> a list of ``{"input", "target"}`` examples, or a function returning one).

A pipeline is accepted by its registered name or by the ``package.module:Class`` path of a registered class
(how earlier versions named them); both resolve to that path, which the database stores. ``inf-engine run`` on
the user's own machine may still import any ``module:Class`` (see :func:`import_pipeline_class`).
"""

from __future__ import annotations

import importlib
import inspect
import threading
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from app.examples import EXAMPLE_PIPELINES
from app.examples.datasets import shipped_datasets

ENTRY_POINT_GROUPS = {
    "pipeline": "inf_engine.pipelines",
    "loss": "inf_engine.losses",
    "metric": "inf_engine.metrics",
    "dataset": "inf_engine.datasets",
}


#: pipelines the platform itself submits (the Batch API's one-call pipeline): accepted by path, never listed
INTERNAL_PIPELINES = frozenset({"app.jobs.batches.pipeline:BatchRequest",
                                "app.jobs.batches.pipeline:BatchEmbeddingRequest"})
#: where internal pipelines stored by earlier versions now live (jobs in flight across an upgrade still run)
MOVED_PIPELINES = {"app.jobs.batch_pipeline:BatchRequest": "app.jobs.batches.pipeline:BatchRequest"}


class UnknownPipelineError(ValueError):
    """The pipeline name is not registered, or does not resolve to a Module class."""


class UnknownNameError(ValueError):
    """A loss, metric or dataset name that the operator did not register."""


class RegistryError(ValueError):
    """The operator's declaration is broken (a listed module does not import): fix the settings."""


@dataclass
class Registry:
    """Registered names per kind: ``pipeline`` maps a name to an import path, the other kinds to objects (or
    to an entry point, loaded on first use)."""

    pipelines: dict[str, str] = field(default_factory=dict)
    losses: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    datasets: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- pipelines --------------------------------------------------------------------------------------------
    def pipeline_path(self, name: str) -> str:
        """The import path a request's pipeline name stands for, or UnknownPipelineError listing the names."""
        if isinstance(name, str):
            if name in self.pipelines:
                return self.pipelines[name]
            if name in self.pipelines.values() or name in INTERNAL_PIPELINES:
                return name
            if name in MOVED_PIPELINES:
                return MOVED_PIPELINES[name]
        raise UnknownPipelineError(
            f"unknown pipeline {_shown(name)}: the server runs only registered pipelines; registered: "
            f"{', '.join(sorted(self.pipelines)) or '(none)'} (an operator registers more with "
            "INF_ENGINE_PIPELINE_MODULES or an 'inf_engine.pipelines' entry point)"
        )

    def pipeline_names(self) -> list[str]:
        return sorted(self.pipelines)

    # -- losses and metrics -----------------------------------------------------------------------------------
    def loss(self, name: Any) -> Any:
        return self._named("loss", self.losses, name)

    def metric(self, name: Any) -> Any:
        return self._named("metric", self.metrics, name)

    def dataset(self, name: Any) -> list[Any]:
        """The examples of a registered dataset (a function registered for it is called each time)."""
        value = self._named("dataset", self.datasets, name)
        return list(value() if callable(value) else value)

    def _named(self, kind: str, table: dict[str, Any], name: Any) -> Any:
        if not isinstance(name, str) or name not in table:
            known = ", ".join(sorted(table)) or "(none)"
            plural = "losses" if kind == "loss" else kind + "s"
            raise UnknownNameError(
                f"unknown {kind} {_shown(name)}: registered {plural}: {known} (an operator registers more with "
                f"INF_ENGINE_PIPELINE_MODULES or an '{ENTRY_POINT_GROUPS[kind]}' entry point)"
            )
        value = table[name]
        if isinstance(value, metadata.EntryPoint):
            with self._lock:
                value = table[name] = value.load()
        return value


def _shown(name: Any) -> str:
    text = repr(name)
    return text if len(text) <= 80 else text[:77] + "..."


# -- building the registry from the operator's declaration -------------------------------------------------------
def build_registry(modules: list[str] | tuple[str, ...] = ()) -> Registry:
    """The registry of the shipped examples, the installed entry points and ``modules`` (imported here)."""
    registry = Registry(pipelines=dict(EXAMPLE_PIPELINES), datasets=dict(shipped_datasets()))
    for kind, group in ENTRY_POINT_GROUPS.items():
        for entry in metadata.entry_points(group=group):
            if kind == "pipeline":
                registry.pipelines[entry.name] = entry.value.replace(" ", "")
            else:
                getattr(registry, kind + "s")[entry.name] = entry
    for module_name in modules:
        _register_module(registry, module_name)
    return registry


def _register_module(registry: Registry, module_name: str) -> None:
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the operator's own setting: say which module and why
        raise RegistryError(
            f"INF_ENGINE_PIPELINE_MODULES lists {module_name!r}, which cannot be imported "
            f"({type(exc).__name__}: {exc}); fix the module or remove it from the setting"
        ) from exc
    declared = getattr(module, "PIPELINES", None)
    if isinstance(declared, dict):
        for name, cls in declared.items():
            registry.pipelines[str(name)] = _class_path(cls, module_name)
    else:
        for cls in _module_classes(module):
            path = _class_path(cls, module_name)
            registry.pipelines[path] = path
    for kind in ("losses", "metrics", "datasets"):
        table = getattr(module, kind.upper(), None)
        if isinstance(table, dict):
            getattr(registry, kind).update({str(k): v for k, v in table.items()})


def _module_classes(module: Any) -> list[type[Any]]:
    from app.pipeline import Module

    return [
        value for _, value in inspect.getmembers(module, inspect.isclass)
        if issubclass(value, Module) and value is not Module and value.__module__ == module.__name__
    ]


def _class_path(cls: Any, module_name: str) -> str:
    if isinstance(cls, str):
        return cls
    if not inspect.isclass(cls):
        raise RegistryError(f"{module_name}.PIPELINES must map names to Module classes, not {type(cls).__name__}")
    return f"{cls.__module__}:{cls.__qualname__}"


_cache: dict[tuple[str, ...], Registry] = {}
_cache_lock = threading.Lock()
_configured: tuple[str, ...] | None = None


def _registry_for(modules: tuple[str, ...]) -> Registry:
    with _cache_lock:
        registry = _cache.get(modules)
        if registry is None:
            registry = _cache[modules] = build_registry(modules)
    return registry


def configure_registry(modules: list[str] | tuple[str, ...] | None) -> Registry:
    """Build the registry of ``modules`` now (a broken module fails here, at start) and make it the process's;
    ``None`` goes back to the settings' ``pipeline_modules``. The server and the workers call it at start."""
    global _configured
    if modules is None:
        _configured = None
        return current_registry()
    registry = _registry_for(tuple(modules))
    _configured = tuple(modules)
    return registry


def current_registry() -> Registry:
    """The process's registry: the one configured at start, else that of the settings' ``pipeline_modules``."""
    if _configured is not None:
        return _registry_for(_configured)
    from app.settings import get_settings

    return _registry_for(tuple(get_settings().pipeline_modules))


# -- loading a registered pipeline -------------------------------------------------------------------------------
def resolve_pipeline_path(name: str) -> str:
    """The import path of a registered pipeline name (or of a registered path)."""
    return current_registry().pipeline_path(name)


def load_pipeline_class(name: str) -> type[Any]:
    """The Module subclass registered under ``name``; nothing is imported for an unregistered name."""
    return import_pipeline_class(resolve_pipeline_path(name), shown=name)


def load_pipeline(name: str) -> Any:
    """An instance of the registered pipeline (its constructor must take no arguments)."""
    return instantiate(load_pipeline_class(name), name)


def load_local_pipeline(name: str) -> Any:
    """For ``inf-engine run`` (the user runs their own code on their own machine): a registered name, or any
    ``package.module:Class`` path."""
    try:
        path = resolve_pipeline_path(name)
    except UnknownPipelineError:
        path = name
    return instantiate(import_pipeline_class(path, shown=name), name)


def instantiate(cls: type[Any], name: str) -> Any:
    try:
        return cls()
    except TypeError as exc:
        raise UnknownPipelineError(f"pipeline {name!r} must be constructible without arguments: {exc}") from None


def import_pipeline_class(path: str, *, shown: str | None = None) -> type[Any]:
    """The Module class at ``package.module:Class``. Only for paths the operator or the local user chose (the
    registry, ``inf-engine run``): never call it with a string from a request."""
    from app.pipeline import Module

    name = shown or path
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        known = ", ".join(sorted(EXAMPLE_PIPELINES))
        raise UnknownPipelineError(
            f"unknown pipeline {name!r}: give an import path like 'package.module:Class' or one of: {known}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownPipelineError(f"unknown pipeline {name!r}: cannot import {module_name!r} ({exc})") from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise UnknownPipelineError(f"unknown pipeline {name!r}: {module_name!r} has no attribute {attr!r}")
    if not (isinstance(target, type) and issubclass(target, Module)):
        raise UnknownPipelineError(f"{name!r} is not a pipeline Module class")
    return target
