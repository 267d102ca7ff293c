from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile

import pytest
import torch

from hooks import hook_captures


# Artifacts an older fxdebug wrote (tests/test_old_artifacts.py reads them): a dumped folder's
# run.py carries that fxdebug's doctests, which are not this code's to run.
collect_ignore = ["fixtures"]

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
    _private_temp_folder_start()


def pytest_unconfigure(config):
    _private_temp_folder_end()


# Temporary files. The docstring examples, the examples in examples/ and the Pythons the tests
# start make folders with tempfile.mkdtemp() and leave them, as a user who wants to look at the
# result would: each run of the suite left about 50 folders (150 MB) in /tmp. Every pytest process
# (the controller and each worker) sends tempfile, and through TMPDIR every process it starts,
# to a folder of its own, removed when it ends. Two caches stay where they would be without this:
# pytest's own (PYTEST_DEBUG_TEMPROOT: tmp_path, and the last runs' failures kept to look at) and
# inductor's (compiled kernels shared by the workers and with the next run).
_TEMP_SETTINGS = ("TMPDIR", "PYTEST_DEBUG_TEMPROOT", "TORCHINDUCTOR_CACHE_DIR")
_temp_state: dict = {}


def _private_temp_folder_start() -> None:
    root = tempfile.gettempdir()
    _temp_state.update(environ={name: os.environ.get(name) for name in _TEMP_SETTINGS},
                       tempdir=tempfile.tempdir)
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", root)
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch: its cache moves into the private folder (slower only)
        pass
    else:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    folder = tempfile.mkdtemp(prefix="fxdebug-tests-", dir=root)
    os.chmod(folder, 0o711)  # tests that run a child as ``nobody`` give it folders in here
    _temp_state["folder"] = folder
    os.environ["TMPDIR"] = tempfile.tempdir = folder


def _private_temp_folder_end() -> None:
    folder = _temp_state.pop("folder", None)
    if folder is None:
        return
    for name, value in _temp_state["environ"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = _temp_state["tempdir"]

    for parent, folders, _ in os.walk(folder):  # a failed test may have left folders read-only
        for name in folders:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, stat.S_IRWXU)
    left: list[str] = []
    if sys.version_info >= (3, 12):  # (onerror: deprecated there)
        shutil.rmtree(folder, onexc=lambda _, path, error: left.append(f"{path}: {error}"))
    else:
        shutil.rmtree(folder, onerror=lambda _, path, error: left.append(f"{path}: {error[1]}"))
    if left:  # said, not raised: a child still writing there must not fail a finished run
        sys.stderr.write(f"fxdebug tests: {len(left)} temporary file(s) could not be removed, "
                         f"e.g. {left[0]}\n")


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
