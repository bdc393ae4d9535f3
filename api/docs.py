"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) over ``/openapi.json``, from copies of their bundles shipped
with the console's static assets (``app/console/static/vendor/swagger-ui`` and ``.../redoc``): servers are often
air-gapped, so the pages fetch nothing from another origin (no CDN, no Google Fonts, no validator badge)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, swagger_ui_default_parameters
from starlette.responses import HTMLResponse

#: where api.routes.console mounts the console's static assets
VENDOR = "/console/static/vendor"
SWAGGER_JS = f"{VENDOR}/swagger-ui/swagger-ui-bundle.js"
SWAGGER_CSS = f"{VENDOR}/swagger-ui/swagger-ui.css"
FAVICON = f"{VENDOR}/swagger-ui/favicon-32x32.png"
REDOC_JS = f"{VENDOR}/redoc/redoc.standalone.js"
#: Swagger UI would show a badge fetched from validator.swagger.io
SWAGGER_PARAMETERS = {**swagger_ui_default_parameters, "validatorUrl": None}
#: the browser may fetch nothing from another origin: ReDoc's sidebar always asks cdn.redoc.ly for its logo (the
#: image is then left out); inline script and styles are the pages' own (Swagger UI's start, ReDoc's styles)
DOCS_CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)


def mount_docs(app: FastAPI) -> None:
    """Serve the two documentation pages for the app's OpenAPI document (kept out of the document itself)."""
    openapi_url = app.openapi_url or "/openapi.json"
    title = app.title

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        page = get_swagger_ui_html(openapi_url=openapi_url, title=f"{title} - API explorer", swagger_js_url=SWAGGER_JS,
                                   swagger_css_url=SWAGGER_CSS, swagger_favicon_url=FAVICON,
                                   swagger_ui_parameters=SWAGGER_PARAMETERS)
        return _same_origin(page)

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        page = get_redoc_html(openapi_url=openapi_url, title=f"{title} - API reference", redoc_js_url=REDOC_JS,
                              redoc_favicon_url=FAVICON, with_google_fonts=False)
        return _same_origin(page)


def _same_origin(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = DOCS_CSP
    return page
