"""Property: no request body, however odd, makes the server answer 5xx; errors keep the OpenAI shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings

from api.main import create_app
from app.settings import Settings
from tests.support.serving_fakes import FakeBackend
from tests.support.strategies import any_body, chat_bodies, completion_bodies

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(Settings(), backend=FakeBackend())) as c:
        yield c


def check(client: TestClient, path: str, body: Any) -> None:
    raw = json.dumps(body)  # Python's json writes NaN/Infinity, which the server must refuse politely
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in r.text, r.text


@FUZZ
@given(body=chat_bodies)
def test_chat_never_5xx(client: TestClient, body: dict[str, Any]) -> None:
    check(client, "/v1/chat/completions", body)


@FUZZ
@given(body=completion_bodies)
def test_completions_never_5xx(client: TestClient, body: dict[str, Any]) -> None:
    check(client, "/v1/completions", body)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=any_body)
def test_any_json_on_any_route_never_5xx(client: TestClient, body: Any) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"):
        check(client, path, body)
