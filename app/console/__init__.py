"""The browser console served at ``/console``: static assets only (HTML, CSS, JavaScript and vendored libraries,
shipped in the wheel). The pages call the public ``/v1`` API with the user's key, so a tenant sees in the console
exactly what its key may read through the API."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

STATIC_PACKAGE = "app.console"
STATIC_DIR = "static"


def static_root() -> Path:
    """The folder of the console's assets (inside the installed package)."""
    return Path(str(files(STATIC_PACKAGE) / STATIC_DIR))
