"""Every python block of the README runs as written, alone, in a fresh interpreter.

A reader pastes one block into a new session: it must import and build what it
uses, so each block runs in its own ``python -c`` with nothing defined before
it (two at a time, in a temporary working directory). The quick commands of
the README's bash blocks (lines starting with ``fxdebug `` and holding no
``[OPTION]`` placeholder) run too. A block that needs a package the
environment lacks is skipped, naming the package.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from subprocesses import REPO, child_env

README = pathlib.Path(REPO) / "README.md"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\w*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.M | re.S)
# pdb opened by a Breakpoint block reads these and goes on
PDB_INPUT = "c\n" * 20
TIMEOUT = 240


def blocks(lang: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of every fenced block of ``lang``, in README order."""
    text = README.read_text()
    found = []
    for match in FENCE.finditer(text):
        if match.group("lang") == lang:
            indent = match.group("indent")
            body = "".join(line[len(indent):] if line.startswith(indent) else line
                           for line in match.group("body").splitlines(keepends=True))
            found.append((text.count("\n", 0, match.start()) + 1, body))
    return found


def quick_commands() -> list[tuple[int, str]]:
    """``fxdebug ...`` lines of the bash blocks, without placeholders."""
    found = []
    for line_number, body in blocks("bash"):
        for offset, line in enumerate(body.splitlines()):
            if line.startswith("fxdebug ") and "[" not in line:
                found.append((line_number + 1 + offset, line))
    return found


PYTHON_BLOCKS = blocks("python")
COMMANDS = quick_commands()


def _run_block(code: str, workdir: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=workdir, input=PDB_INPUT,
                          env=child_env(MPLBACKEND="Agg", OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def block_results(tmp_path_factory):
    """Every python block run once, two interpreters at a time."""
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        for line_number, code in PYTHON_BLOCKS:
            workdir = str(tmp_path_factory.mktemp(f"readme_line_{line_number}"))
            jobs[line_number] = pool.submit(_run_block, code, workdir)
        return {line_number: job.result() for line_number, job in jobs.items()}


def _missing_package(stderr: str) -> str | None:
    found = re.search(r"ModuleNotFoundError: No module named '([^'.]+)", stderr)
    if found and found.group(1) not in ("fxdebug", "torch", "torchvision"):
        return found.group(1)
    return None


def test_readme_has_blocks():
    assert len(PYTHON_BLOCKS) >= 10 and len(COMMANDS) >= 2


@pytest.mark.parametrize("line_number", [line for line, _ in PYTHON_BLOCKS],
                         ids=[f"README.md:{line}" for line, _ in PYTHON_BLOCKS])
def test_python_block_runs_alone(block_results, line_number):
    result = block_results[line_number]
    missing = _missing_package(result.stderr)
    if result.returncode and missing:
        pytest.skip(f"README.md:{line_number} needs {missing}, which is not installed")
    assert result.returncode == 0, (
        f"README.md:{line_number}: the block failed in a fresh interpreter (exit "
        f"{result.returncode}); each block must import and build what it uses.\n"
        f"{result.stderr[-3000:]}")


@pytest.mark.parametrize("line_number, command", COMMANDS,
                         ids=[f"README.md:{line}" for line, _ in COMMANDS])
def test_quick_command_runs(line_number, command):
    args = shlex.split(command, comments=True)[1:]
    result = subprocess.run([sys.executable, "-m", "fxdebug", *args], cwd=REPO,
                            env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                            timeout=TIMEOUT)
    missing = _missing_package(result.stderr)
    if result.returncode and missing:
        pytest.skip(f"README.md:{line_number} needs {missing}, which is not installed")
    assert result.returncode == 0, f"README.md:{line_number}: `{command}` failed:\n{result.stderr}"
    assert result.stdout.strip(), f"README.md:{line_number}: `{command}` printed nothing"
