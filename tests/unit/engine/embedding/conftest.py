"""Fixtures: one intra-op thread for this package (as tests/unit/engine/models does)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The encoders here are small; on a shared, oversubscribed machine a second thread's spinning barriers make
    the tests many times slower. Ours and the references run alike, so results do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
