"""Fixtures shared by the kernel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Run the test on two threads (the kernels split work across threads), then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
