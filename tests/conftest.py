from __future__ import annotations

import sys

import pytest
import torch

from hooks import hook_captures


@pytest.fixture(scope="session", autouse=True)
def _end_ranks():
    """Processes that tests/ranks.py started for distributed tests end with the session."""
    yield
    ranks = sys.modules.get("ranks")
    if ranks is not None:
        ranks.close_all()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def hooks():
    return hook_captures
