"""Property-based fuzzing of the whole HTTP API from its own OpenAPI schema (schemathesis): whatever a client sends,
valid or not, the server never answers 5xx, and every error is an OpenAI error body.

Each operation of ``app.openapi()`` gets a fixed, derandomized budget of generated requests (positive and negative
data), against uvicorn on PostgreSQL with the fake backend and a scripted LLM behind the jobs; twice: with API keys
configured (the valid key is sent) and on an open server. Half of the generated requests are then made hostile
(``hostile``): a NUL character in a path parameter, a query value or a body string, an integer past 64 bits, a
body nested past the depth limit, a lone surrogate in a body string. Hostile cases found this way have their own focused tests in
test_hostile_input.py.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from api.main import create_app  # noqa: E402
from app.db.migrate import upgrade  # noqa: E402
from app.jobs.runtime import JobsRuntime  # noqa: E402
from app.json_limits import MAX_JSON_DEPTH  # noqa: E402
from app.settings import Settings  # noqa: E402
from tests.support.fakes import ScriptedLM  # noqa: E402
from tests.support.postgres import temporary_database  # noqa: E402
from tests.support.server_helpers import ServerThread  # noqa: E402
from tests.support.serving_fakes import FakeBackend  # noqa: E402

KEY = "sk-fuzz"
#: generated requests per operation and configuration (42 operations, two configurations)
EXAMPLES = 60


def _schema() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:  # an app only to read its schema: nothing starts
        return create_app(Settings(data_dir=Path(folder)), backend=FakeBackend()).openapi()


schema = schemathesis.openapi.from_dict(_schema())


# -- hostile mutations of generated cases -------------------------------------------------------------------------
def _first(value: Any, kind: type) -> tuple[Any, Any] | None:
    """(container, key) of the first leaf of ``kind`` in a JSON-like value (bools are not ints)."""
    stack = [value]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            if isinstance(child, kind) and not isinstance(child, bool):
                return node, key
            stack.append(child)
    return None


def _nul(case: Any) -> Any:
    for container in (case.path_parameters, case.query, case.body):
        found = _first(container, str) if isinstance(container, dict | list) else None
        if found is not None:
            parent, key = found
            parent[key] = parent[key][:3] + "\x00" + parent[key][3:]
            return case
    return case


def _surrogate(case: Any) -> Any:
    """A lone surrogate in a JSON body string (a client cannot put one in a URL or a multipart form at all)."""
    if "json" not in (case.media_type or "application/json"):
        return case
    found = _first(case.body, str) if isinstance(case.body, dict | list) else None
    if found is not None:
        parent, key = found
        parent[key] = "\ud800" + parent[key]
    return case


def _huge(case: Any) -> Any:
    for container in (case.path_parameters, case.query, case.body):
        found = _first(container, int) if isinstance(container, dict | list) else None
        if found is not None:
            parent, key = found
            parent[key] = 2**70 if parent[key] >= 0 else -(2**70)
            return case
    return case


def _deep(case: Any) -> Any:
    nested: list[Any] = []
    for _ in range(MAX_JSON_DEPTH + 20):  # past the limit; a failure report must still be able to print it
        nested = [nested]
    if isinstance(case.body, dict) and case.body:
        case.body[next(iter(case.body))] = nested
    elif isinstance(case.body, list):
        case.body.append(nested)
    return case


def _same(case: Any) -> Any:
    return case


@schema.hook("flatmap_case")
def hostile(context: Any, case: Any) -> Any:
    """Half the cases as generated, the others with one hostile mutation."""
    return st.sampled_from([_same, _same, _same, _same, _nul, _huge, _deep, _surrogate]).map(
        lambda mutate: mutate(case))


class Target:
    """Where the server listens, and the headers every request carries (the valid key, when keys are set)."""

    def __init__(self, root: str, headers: dict[str, str]) -> None:
        self.root = root
        self.headers = headers


@pytest.fixture(scope="module", params=["with-keys", "open"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    keyed = request.param == "with-keys"
    with temporary_database("infe_fuzz") as url:
        upgrade(url)
        config = Settings(database_url=url, api_keys=[KEY] if keyed else [], jobs_poll_interval=0.05,
                          jobs_max_bytes=256 * 1024, max_request_bytes=1024 * 1024)
        app = create_app(config, backend=FakeBackend(), jobs=JobsRuntime(config, resources=ScriptedLM()))
        with ServerThread(app) as server:
            yield Target(server.root, {"Authorization": f"Bearer {KEY}"} if keyed else {})


@schema.parametrize()
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, print_blob=False,
          phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
def test_no_request_makes_the_server_fail(case: Any, target: Target) -> None:
    response = case.call(base_url=target.root, headers=target.headers, timeout=30)
    assert response.status_code < 500, f"{response.status_code} {response.text[:500]}\n{case.as_curl_command()}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text
