"""Fixtures of the pipeline frontend tests: a scripted resource manager."""

from __future__ import annotations

import pytest

from tests.support.fakes import ScriptedResources


@pytest.fixture
def resources() -> ScriptedResources:
    return ScriptedResources()
