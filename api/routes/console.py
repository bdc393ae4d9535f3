"""``/console``: the browser console's pages (one HTML shell for every page; the script routes by path) and its
static assets under ``/console/static``. No data passes here: the pages read ``/v1`` with the user's key."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response

from app.console import static_root

# the console's own assets only: nothing from another origin, no inline script
CONSOLE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
router = APIRouter(include_in_schema=False)


def _shell() -> FileResponse:
    return FileResponse(
        static_root() / "index.html",
        media_type="text/html",
        headers={"Content-Security-Policy": CONSOLE_CSP, "Cache-Control": "no-cache", "X-Frame-Options": "DENY"},
    )


@router.get("/console")
def console_home() -> FileResponse:
    return _shell()


@router.get("/console/")
def console_slash() -> RedirectResponse:
    return RedirectResponse("/console", status_code=308)


@router.get("/console/{page:path}")
def console_page(page: str) -> FileResponse:
    """Any console page (``jobs``, ``jobs/{id}``, ...): the same shell; the script shows the page named by the
    path, or says that it does not exist."""
    return _shell()


class _Revalidated(StaticFiles):
    """The assets with ``Cache-Control: no-cache``: a browser keeps them but asks (ETag) before each use, so after
    an upgrade it never runs old modules beside new ones."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


def mount_console(app: FastAPI) -> None:
    """The assets first (a mount is matched before the pages' catch-all), then the pages."""
    app.mount("/console/static", _Revalidated(directory=static_root()), name="console-static")
    app.include_router(router)
