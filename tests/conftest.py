"""Fixtures every test package may use."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from app.jobs.registry import configure_registry


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
