"""What the response models share: the ``responses=`` argument of a route, and the page fields of listings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

#: a time in seconds since the epoch (UTC), as every view gives times
Unix = int


def ok(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route that answers 200 with ``model``."""
    return {200: {"model": model}}


def created(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route that answers 201 with ``model``."""
    return {201: {"model": model}}


class Page(BaseModel):
    """A page of a listing, newest first; ``after=last_id`` asks for the next one."""

    object: Literal["list"]
    first_id: str | None
    last_id: str | None
    has_more: bool
