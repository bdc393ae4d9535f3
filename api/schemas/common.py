"""The ``responses=`` argument of a route that answers with one of the response models."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def ok(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route that answers 200 with ``model``."""
    return {200: {"model": model}}


def created(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route that answers 201 with ``model``."""
    return {201: {"model": model}}
