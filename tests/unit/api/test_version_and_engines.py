"""GET /version, GET /v1/models/{id}, and /v1/engines(/{id}) as deprecated aliases of /v1/models (issue 17)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from app.settings import Settings
from app.version import version
from tests.support.serving_fakes import FakeBackend

KEY = "sk-engines"


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(api_keys=[KEY]), backend=FakeBackend())) as c:
        yield c


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_version_is_open_and_the_installed_one(client: TestClient) -> None:
    response = client.get("/version")
    assert response.status_code == 200
    assert response.json() == {"version": version()}
    assert version() == "0.1.0"  # pyproject.toml's, read from the installed distribution
    assert client.get("/openapi.json").json()["info"]["version"] == version()


def test_engines_is_the_models_list_with_a_deprecation_header(client: TestClient) -> None:
    models = client.get("/v1/models", headers=_auth())
    engines = client.get("/v1/engines", headers=_auth())
    assert engines.status_code == 200
    assert engines.json() == models.json()
    assert engines.headers["Deprecation"] == "true"
    assert 'rel="successor-version"' in engines.headers["Link"] and "/v1/models" in engines.headers["Link"]
    assert "Deprecation" not in models.headers


def test_engine_by_id_is_the_model_card(client: TestClient) -> None:
    model_id = client.get("/v1/models", headers=_auth()).json()["data"][0]["id"]
    card = client.get(f"/v1/models/{model_id}", headers=_auth())
    engine = client.get(f"/v1/engines/{model_id}", headers=_auth())
    assert card.status_code == engine.status_code == 200
    assert engine.json() == card.json() and card.json()["id"] == model_id
    assert engine.headers["Deprecation"] == "true"


def test_unknown_engine_is_an_openai_404(client: TestClient) -> None:
    for path in ("/v1/models/nope", "/v1/engines/nope"):
        response = client.get(path, headers=_auth())
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and "nope" in error["message"]


def test_engines_need_the_key_like_models(client: TestClient) -> None:
    assert client.get("/v1/engines").status_code == 401
    assert client.get("/v1/engines/x").status_code == 401


def test_engines_are_deprecated_in_openapi(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert paths["/v1/engines"]["get"]["deprecated"] is True
    assert paths["/v1/engines/{engine_id}"]["get"]["deprecated"] is True
    assert not paths["/v1/models"]["get"].get("deprecated", False)


def test_health_without_redis_has_no_platform_section(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
