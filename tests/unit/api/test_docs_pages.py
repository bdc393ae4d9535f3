"""``/docs`` and ``/redoc`` work on an air-gapped server: their HTML names only same-origin URLs, and every asset
it names is served from the vendored copies (nothing from a CDN or Google Fonts)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from app.settings import Settings
from tests.support.serving_fakes import FakeBackend

#: src/href attributes and the URLs the pages' inline scripts give the bundles
_ATTRIBUTE = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
_SCRIPT_URL = re.compile(r"""(?:url|spec-url)\s*[:=]\s*["']([^"']+)["']""", re.IGNORECASE)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    config = Settings(data_dir=tmp_path_factory.mktemp("docs"), api_keys=["sk-docs"])
    with TestClient(create_app(config, backend=FakeBackend())) as test_client:
        yield test_client


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_fetch_nothing_from_another_origin(client: TestClient, page: str) -> None:
    response = client.get(page)  # open, like /openapi.json: no key needed to read the documentation
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html = response.text
    urls = _ATTRIBUTE.findall(html) + _SCRIPT_URL.findall(html)
    assert urls, html
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), f"{page} names {url}"
    assert "googleapis" not in html and "jsdelivr" not in html and "http://" not in html and "https://" not in html
    for url in urls:
        asset = client.get(url)
        assert asset.status_code == 200, url
        assert asset.content, url
    assert "/openapi.json" in urls
    # what a bundle asks for by itself (ReDoc's sidebar logo from cdn.redoc.ly) the browser must not fetch
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "img-src 'self' data:;" in policy and "http" not in policy


def test_swagger_ui_shows_no_validator_badge(client: TestClient) -> None:
    assert '"validatorUrl": null' in client.get("/docs").text


def test_the_vendored_bundles_ship_with_their_licenses() -> None:
    vendor = Path(__file__).resolve().parents[3] / "app" / "console" / "static" / "vendor"
    for name in ("swagger-ui/swagger-ui-bundle.js", "swagger-ui/swagger-ui.css", "swagger-ui/favicon-32x32.png",
                 "swagger-ui/LICENSE", "swagger-ui/NOTICE", "redoc/redoc.standalone.js", "redoc/LICENSE"):
        assert (vendor / name).stat().st_size > 0, name
