"""Per-tenant quotas: the settings (defaults, overrides, validation) and ``quota_for``."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.jobs.limits.quotas import QuotaTable, TenantQuota, quota_for
from app.settings import Settings, settings_error_message


@pytest.fixture(autouse=True)
def _no_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)


def _error(**env: str) -> str:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        with pytest.raises(ValidationError) as caught:
            Settings()
    message = settings_error_message(caught.value)
    assert message is not None
    return message


def test_unlimited_by_default() -> None:
    settings = Settings()
    assert settings.tenant_max_queued_items == 0 and settings.tenant_max_inflight_nodes == 0
    assert settings.tenant_quotas == {}
    assert quota_for(settings, "acme") == TenantQuota(0, 0)


def test_overrides_replace_the_defaults_key_by_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INF_ENGINE_TENANT_MAX_QUEUED_ITEMS", "3000")
    monkeypatch.setenv("INF_ENGINE_TENANT_MAX_INFLIGHT_NODES", "16")
    monkeypatch.setenv("INF_ENGINE_TENANT_QUOTAS",
                       '{"acme": {"max_queued_items": 50000, "max_inflight_nodes": 64}, "beta": {"max_queued_items": 0}}')
    settings = Settings()
    assert quota_for(settings, "acme") == TenantQuota(max_queued_items=50_000, max_inflight_nodes=64)
    assert quota_for(settings, "beta") == TenantQuota(max_queued_items=0, max_inflight_nodes=16)  # 0: unlimited
    assert quota_for(settings, "gamma") == TenantQuota(max_queued_items=3000, max_inflight_nodes=16)
    table = QuotaTable.from_settings(settings)
    assert table.source("acme", "max_queued_items") == "INF_ENGINE_TENANT_QUOTAS, acme.max_queued_items"
    assert table.source("beta", "max_inflight_nodes") == "INF_ENGINE_TENANT_MAX_INFLIGHT_NODES"


def test_toml_tables(tmp_path: Path) -> None:
    (tmp_path / "inf-engine.toml").write_text("[tenant_quotas.acme]\nmax_queued_items = 10\n")
    assert quota_for(Settings(), "acme") == TenantQuota(max_queued_items=10)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ('{"acme": {"max_items": 5}}', "unknown key 'max_items'; the keys are max_queued_items and max_inflight_nodes"),
        ('{"acme": {"max_queued_items": -1}}', "must be 0 (unlimited) or more, not -1"),
        ('{"acme": {"max_queued_items": "many"}}', "valid integer"),
        ('{"acme": {"max_queued_items": 1.5}}', "valid integer"),
        ('{"acme": {"max_queued_items": true}}', "valid integer"),
        ('{"acme": 5}', "valid dictionary"),
        ('{" ": {"max_queued_items": 5}}', "empty name"),
    ],
)
def test_bad_overrides_name_the_variable(value: str, says: str) -> None:
    message = _error(INF_ENGINE_TENANT_QUOTAS=value)
    assert message.startswith("INF_ENGINE_TENANT_QUOTAS: ") and says in message, message


def test_bad_json_and_negative_defaults_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INF_ENGINE_TENANT_QUOTAS", "{acme")
    with pytest.raises(Exception) as caught:
        Settings()
    assert (settings_error_message(caught.value) or "").startswith("INF_ENGINE_TENANT_QUOTAS is not valid JSON")
    monkeypatch.delenv("INF_ENGINE_TENANT_QUOTAS")
    assert _error(INF_ENGINE_TENANT_MAX_QUEUED_ITEMS="-3").startswith("INF_ENGINE_TENANT_MAX_QUEUED_ITEMS: ")
    assert _error(INF_ENGINE_TENANT_MAX_INFLIGHT_NODES="-1").startswith("INF_ENGINE_TENANT_MAX_INFLIGHT_NODES: ")
