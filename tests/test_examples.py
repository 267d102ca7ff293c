"""Run every examples/*.py as a user would: ``python example.py``, outside the repo."""

from __future__ import annotations

import glob
import os
import sys

import pytest

from subprocesses import python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))


def test_examples_found():
    assert EXAMPLES, f"no examples found under {os.path.join(ROOT, 'examples')}"


@pytest.mark.parametrize("path", EXAMPLES, ids=[os.path.basename(p) for p in EXAMPLES])
def test_example_runs(path, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = python([path], cwd=str(tmp_path), env=env)
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)  # shown by pytest under "Captured stderr call"
    assert proc.returncode == 0, (
        f"{os.path.basename(path)} exited with {proc.returncode}\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    assert "ok:" in proc.stdout, f"{os.path.basename(path)} did not print its 'ok:' line"
