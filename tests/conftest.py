from __future__ import annotations

import os
import sys

import pytest
import torch

from hooks import hook_captures


# pytest-xdist's workers start with COLUMNS=80 and LINES=24 in their environment; fxdebug fits
# tables to COLUMNS, so each worker gets back the values (or their absence) of the pytest command.
_TERMINAL = ("COLUMNS", "LINES")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["fxdebug_terminal_env"] = {name: os.environ.get(name) for name in _TERMINAL}


def pytest_configure(config):
    for name, value in getattr(config, "workerinput", {}).get("fxdebug_terminal_env", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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
