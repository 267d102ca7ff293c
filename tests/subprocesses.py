"""Fresh interpreters for tests: the fxdebug CLI, scripts, and runs under several hash seeds.

Determinism is tested across processes: the same script under PYTHONHASHSEED
0, 1 and 2 must print the same bytes. Every child imports fxdebug and the test
helpers from this checkout, whatever the working directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
HASH_SEEDS = ("0", "1", "2")


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with this checkout and ``tests/`` first on PYTHONPATH, plus ``extra``."""
    path = [REPO, TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), **extra)


def fxdebug_cli(*args: str, cwd: str = REPO, input: str | None = None,
                **env: str) -> subprocess.CompletedProcess:
    """``python -m fxdebug ARGS`` in ``cwd``; stdout and stderr captured as text."""
    return subprocess.run([sys.executable, "-m", "fxdebug", *args], cwd=cwd, env=child_env(**env),
                          input=input, capture_output=True, text=True, timeout=300)


def run_python(script: str, *args: str, cwd: str = REPO, **env: str) -> subprocess.CompletedProcess:
    """``python -c SCRIPT ARGS`` in ``cwd``; stdout and stderr captured as text."""
    return subprocess.run([sys.executable, "-c", script, *args], cwd=cwd, env=child_env(**env),
                          capture_output=True, text=True, timeout=300)


NOBODY = 65534


def run_python_unprivileged(script: str, *args: str) -> subprocess.CompletedProcess:
    """``run_python`` whose ``script`` calls ``become_unprivileged()`` once its imports are done.

    In a root process that makes the child the user ``nobody`` (root writes into read-only
    folders); otherwise it does nothing. A fresh interpreter, not a fork: forking a process
    whose torch thread pools hold locks can deadlock the child."""
    prologue = (f"import os\n"
                f"def become_unprivileged():\n"
                f"    if os.geteuid() == 0:\n"
                f"        os.setgroups([])\n"
                f"        os.setgid({NOBODY})\n"
                f"        os.setuid({NOBODY})\n")
    return run_python(prologue + script, *args)


def outputs_under_hash_seeds(script: str, args: Callable[[str], Sequence[str]] = lambda seed: (),
                             cwd: str = REPO, seeds: Sequence[str] = HASH_SEEDS,
                             **env: str) -> list[str]:
    """The stdout of ``script`` run once per hash seed (concurrently); each run must succeed.

    ``args(seed)`` gives the command-line arguments of the run with that seed.
    """
    runs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", script, *args(seed)],
                             cwd=cwd, env=child_env(PYTHONHASHSEED=seed, **env), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for seed in seeds]
    outputs = []
    for seed, run in zip(seeds, runs):
        stdout, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, f"PYTHONHASHSEED={seed}: exit {run.returncode}\n{stderr[-8000:]}"
        outputs.append(stdout)
    return outputs
