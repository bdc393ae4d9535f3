"""Shared request-parameter types of the HTTP API: integers bounded by what the database stores, and the base of
the request bodies whose text is stored.

Everything here fails as a validation error, which ``api.errors`` answers with a 400 naming the parameter.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from fastapi import Path, Query
from pydantic import BaseModel, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from app import json_limits

#: the largest value of an INTEGER column (parameter versions, result sequence numbers): a larger cursor or
#: version cannot exist, and PostgreSQL would refuse to compare with it
DB_INT_MAX = 2**31 - 1

#: a ``{version}`` path segment: a parameter version number
VersionPath = Annotated[int, Path(ge=1, le=DB_INT_MAX, description="A parameter version number")]


def version_query(alias: str, description: str) -> Any:
    """A version number in the query string (``?from=``, ``?to=``)."""
    return Query(alias=alias, ge=1, le=DB_INT_MAX, description=description)


#: ``?cursor=``: results already read
ResultsCursor = Annotated[
    int, Query(ge=0, le=DB_INT_MAX, description="Results already read: start after the first CURSOR")
]


def nul_path(value: Any, where: str) -> str | None:
    """Where in ``value`` (parsed JSON) a string or key holds a NUL character, or None."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if "\x00" in node:
                return path
        elif isinstance(node, dict):
            for key, child in node.items():
                if isinstance(key, str) and "\x00" in key:
                    return path
                stack.append((child, f"{path}.{key}"))
        elif isinstance(node, list | tuple):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(node))
    return None


class RequestBody(BaseModel):
    """A JSON request body of the platform's routes: within ``app.json_limits`` (nesting depth, 64-bit integers),
    and without NUL characters in the text it stores (PostgreSQL's text and JSONB cannot hold U+0000, and changing
    a user's metadata or ids silently would be worse than refusing them). Items of the fields in ``data_lists``
    are pipeline data, which the job layer stores safely (``app.jobs.encoding.storable``): NULs are allowed
    there."""

    data_lists: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _within_json_limits(cls, data: Any) -> Any:
        return json_limits.validate(data)

    @field_validator("*", mode="after")
    @classmethod
    def _no_nul(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or "value"
        if name in cls.data_lists and isinstance(value, list):
            return value
        where = nul_path(value, name)
        if where is not None:
            raise PydanticCustomError(
                "nul_character",
                "{where} contains a NUL character (\\u0000), which cannot be stored: remove it",
                {"where": where},
            )
        return value
