"""Fixtures every test package may use."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from app.jobs.registry import configure_registry
from app.settings import get_settings


@pytest.fixture
def register_modules() -> Iterator[Callable[..., None]]:
    """``register_modules("pkg.mod", ...)`` declares modules as the operator would (INF_ENGINE_PIPELINE_MODULES):
    their pipelines, LOSSES and METRICS become names a request may use."""

    def register(*modules: str) -> None:
        configure_registry(modules)

    yield register
    configure_registry(None)


@pytest.fixture(autouse=True)
def _settings_registry() -> Iterator[None]:
    """A test that configured a registry (by creating an app, say) leaves the next test the settings' one."""
    yield
    configure_registry(None)


@pytest.fixture
def settings_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str | None], None]]:
    """``settings_env("INF_ENGINE_X", "1")`` sets a variable the cached settings read (``None`` unsets it) and
    drops the cached settings, so that ``get_settings()`` reads it; the variable is restored and the cache dropped
    again after the test."""

    def set_variable(name: str, value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        get_settings.cache_clear()

    yield set_variable
    monkeypatch.undo()
    get_settings.cache_clear()
