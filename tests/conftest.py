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
    workerinput = getattr(config, "workerinput", {})
    for name, value in workerinput.get("fxdebug_terminal_env", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    workers = len(config.getoption("tx") or ()) if config.getoption("dist", "no") != "no" else 0
    if workers and not workerinput and "OMP_NUM_THREADS" not in os.environ:
        # The workers share the cores: each gets its share of intra-op threads, and so do the
        # Pythons its tests start (they inherit the variable). Threads beyond the cores spin
        # waiting for each other: on 2 cores with 2 workers, 2 threads each cost 2-3 times the
        # CPU. Set here, before the workers start, every thread of theirs has the same count.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))


# The files that take longest, longest first (seconds on 2 cores, roughly). pytest-xdist hands
# out files largest test count first; a long file with few tests handed out last keeps one
# worker busy while the other has nothing left, so these go out first. The order only changes
# when each file runs, never what runs.
LONGEST_FILES = (
    "tests/test_examples.py",  # 130
    "tests/test_readme.py",  # 80
    "tests/test_dump_portable.py",  # 70
    "tests/test_zoo.py",  # 55
    "tests/test_tensor_parallel.py",  # 50-90 (2 and 4 gloo ranks)
    "tests/test_watch_sharded.py",  # 40 (2 gloo ranks)
    "tests/test_compare_configs.py",  # 15-35 (4 gloo ranks, 6 configurations)
    "tests/test_modes.py",  # 40
    "tests/test_reference.py",  # 35
    "tests/test_watch.py",  # 15-60 (a compiled model: the inductor cache decides)
    "tests/test_lint.py",  # 40
    "tests/test_dump.py",  # 36
    "tests/test_equivalence.py",  # 33
    "tests/test_subprocesses.py",  # 28
    "tests/test_runs.py",  # 24
    "tests/test_determinism.py",  # 24
    "tests/test_inplace_lowering.py",  # 23
    "tests/test_dump_kill.py",  # 20
    "tests/test_mypy.py",  # 20
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling
    if not hasattr(LoadFileScheduling, "_assign_work_unit"):  # another pytest-xdist: its order
        return None

    class LongestFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            for scope in LONGEST_FILES:
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
                    break
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


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
