from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from hooks import hook_captures  # noqa: E402


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
