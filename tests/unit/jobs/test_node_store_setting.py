"""``node_store_group_commit`` reaches a worker's node store (nothing connects: pools open on first use)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.db.repository.node_store import PsycopgNodeStore
from app.jobs.distributed.worker import build_node_worker
from app.settings import Settings

URL = "postgresql+psycopg://nobody@127.0.0.1:1/none"


@pytest.mark.parametrize("value", ["true", "false"])
def test_the_setting_turns_the_stores_group_commit_on_and_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("INF_ENGINE_NODE_STORE_GROUP_COMMIT", value)
    settings = Settings(database_url=URL)
    assert settings.node_store_group_commit is (value == "true")
    worker = build_node_worker(settings, dispatcher=None, submit=lambda coro: None, resources_for=lambda aliases: None)  # type: ignore[arg-type,return-value]
    store = worker.store
    assert isinstance(store, PsycopgNodeStore)
    assert (store.group is not None) is (value == "true")
    store.close()
