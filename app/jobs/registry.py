"""Finding pipelines by name: a ``module:Class`` import path or a short name of a shipped example."""

from __future__ import annotations

import importlib
from typing import Any

from app.examples import EXAMPLE_PIPELINES


class UnknownPipelineError(ValueError):
    """The pipeline name does not resolve to a Module class."""


def resolve_pipeline_path(name: str) -> str:
    return EXAMPLE_PIPELINES.get(name, name)


def load_pipeline_class(name: str) -> type[Any]:
    """The Module subclass named by ``name`` (``package.module:Class`` or an example's short name)."""
    from app.pipeline import Module

    path = resolve_pipeline_path(name)
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


def load_pipeline(name: str) -> Any:
    """An instance of the named pipeline (its constructor must take no arguments)."""
    cls = load_pipeline_class(name)
    try:
        return cls()
    except TypeError as exc:
        raise UnknownPipelineError(f"pipeline {name!r} must be constructible without arguments: {exc}") from None
