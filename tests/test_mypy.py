"""``python -m mypy fxdebug`` is clean at the level pyproject.toml's [tool.mypy] states."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

from subprocesses import child_env

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install -e '.[test]' installs it)")
def test_mypy_is_clean_on_the_package():
    result = subprocess.run([sys.executable, "-m", "mypy", "fxdebug"], cwd=REPO,
                            env=child_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "Success: no issues found" in result.stdout
