"""The installed version of inf-engine (``inf-engine --version``, ``GET /version``, the OpenAPI document)."""

from __future__ import annotations

from functools import cache
from importlib import metadata

DISTRIBUTION = "inf-engine"


@cache
def version() -> str:
    """The version of the installed distribution (a checkout installed with ``pip install -e`` has one too)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # imported from a bare source tree that was never installed
        return "0+unknown"
