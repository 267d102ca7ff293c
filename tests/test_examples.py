"""Run every examples/*.py as a user would: ``python example.py``, outside the repo.

Where the README shows what an example prints (a ``bash`` block ``python examples/x.py``
followed by a ``text`` block), that text must be what it prints: its lines in order,
``...`` standing for any lines, spacing and the checkout's own path aside.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import subprocess
import sys
import tempfile

import pytest

from subprocesses import python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))
SHOWN = re.compile(r"^```bash\npython (examples/\S+\.py)[^\n]*\n```\s*\n```text\n(.*?)^```",
                   re.M | re.S)


@functools.lru_cache(maxsize=None)
def run_example(path: str) -> subprocess.CompletedProcess:
    """``python path`` in a fresh temporary folder, once per test process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return python([path], cwd=tempfile.mkdtemp(prefix="fxdebug-example-"), env=env)


def test_examples_found():
    assert EXAMPLES, f"no examples found under {os.path.join(ROOT, 'examples')}"


@pytest.mark.parametrize("path", EXAMPLES, ids=[os.path.basename(p) for p in EXAMPLES])
def test_example_runs(path):
    proc = run_example(path)
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)  # shown by pytest under "Captured stderr call"
    assert proc.returncode == 0, (
        f"{os.path.basename(path)} exited with {proc.returncode}\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    assert "ok:" in proc.stdout, f"{os.path.basename(path)} did not print its 'ok:' line"


def _plain(line: str) -> str:
    """A line as compared: the checkout's path dropped, spaces and rules of dashes collapsed."""
    line = line.replace(ROOT + os.sep, "")
    return re.sub(r"-{2,}", "--", " ".join(line.split()))


def shown_lines_missing(shown: str, printed: str) -> list[str]:
    """The lines of ``shown`` (``...``: any lines) not found in order in ``printed``.

    >>> shown_lines_missing("a\\n...\\nc", "a\\nb\\nc"), shown_lines_missing("a\\nc", "a\\nb\\nc")
    ([], ['c'])
    """
    lines = [_plain(line) for line in printed.splitlines()]
    at, missing, skip = 0, [], False
    for want in shown.splitlines():
        if want.strip() == "...":
            skip = True
            continue
        found = next((i for i in range(at, len(lines) if skip else min(at + 1, len(lines)))
                      if lines[i] == _plain(want)), None)
        if found is None:
            missing.append(want)
        else:
            at, skip = found + 1, False
    return missing


README_SHOWN = SHOWN.findall(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read())


def test_readme_shows_examples():
    assert "examples/tp_divergence.py" in [example for example, _ in README_SHOWN]


@pytest.mark.parametrize("example, shown", README_SHOWN, ids=[e for e, _ in README_SHOWN])
def test_readme_shows_what_the_example_prints(example, shown):
    proc = run_example(os.path.join(ROOT, example))
    assert proc.returncode == 0, proc.stderr[-4000:]
    missing = shown_lines_missing(shown, proc.stdout)
    assert not missing, (f"README.md shows lines {example} does not print (in that order):\n"
                         + "\n".join(missing) + f"\n--- it printed ---\n{proc.stdout}")
