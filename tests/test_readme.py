"""Every python block of the README and of docs/*.md runs as written, alone, in a fresh
interpreter, and every relative link of those pages leads somewhere.

A reader pastes one block into a new session: it must import and build what it
uses, so each block runs in its own ``python -c`` with nothing defined before
it (two at a time, in a temporary working directory, forked from the test
helpers' server that has imported torch and nothing of fxdebug's, see
``tests/subprocesses.py``; a block that appears on several pages runs once). The quick commands of the bash blocks (lines starting
with ``fxdebug `` and holding no ``[OPTION]`` placeholder) run too. A block that
needs a package the environment lacks is skipped, naming the package.

Links: every relative link (``[text](docs/capture.md)``, images included) must
name a file that exists, and a ``#anchor`` a heading of the page it points to,
slugged as GitHub slugs headings.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import shlex
import subprocess
import sys
from typing import Callable

import pytest

from subprocesses import REPO, child_env, python, start_python

ROOT = pathlib.Path(REPO).resolve()
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>\w*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.M | re.S)
# pdb opened by a Breakpoint block reads these and goes on
PDB_INPUT = "c\n" * 20
TIMEOUT = 240

# Link targets that may be missing for now: pages another change adds. Remove an
# entry once its file is in the repository (from then on it is checked like any other).
MISSING_LINK_TARGETS_ALLOWED: set[str] = set()


def _name(page: pathlib.Path) -> str:
    return page.relative_to(ROOT).as_posix()


def blocks(lang: str, pages=PAGES) -> list[tuple[str, int, str]]:
    """``(page, line number, code)`` of every fenced block of ``lang``, in page order."""
    found = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            if match.group("lang") == lang:
                indent = match.group("indent")
                body = "".join(line[len(indent):] if line.startswith(indent) else line
                               for line in match.group("body").splitlines(keepends=True))
                found.append((_name(page), text.count("\n", 0, match.start()) + 1, body))
    return found


def quick_commands() -> list[tuple[str, int, str]]:
    """``fxdebug ...`` lines of the bash blocks, without placeholders."""
    found = []
    for page, line_number, body in blocks("bash"):
        for offset, line in enumerate(body.splitlines()):
            if line.startswith("fxdebug ") and "[" not in line:
                found.append((page, line_number + 1 + offset, line))
    return found


PYTHON_BLOCKS = blocks("python")
COMMANDS = quick_commands()


@pytest.fixture(scope="module")
def block_results(tmp_path_factory):
    """Every distinct python block run once, by its code, two interpreters at a time."""
    results: dict[str, subprocess.CompletedProcess] = {}
    running: list[tuple[str, Callable[[float], subprocess.CompletedProcess]]] = []
    for page, line_number, code in PYTHON_BLOCKS:
        if code in results or any(code == started for started, _ in running):
            continue
        if len(running) == min(2, os.cpu_count() or 1):
            done, wait = running.pop(0)
            results[done] = wait(TIMEOUT)
        workdir = str(tmp_path_factory.mktemp(re.sub(r"\W", "_", f"{page}_{line_number}")))
        running.append((code, start_python(["-c", code], cwd=workdir, input=PDB_INPUT,
                                           env=child_env(MPLBACKEND="Agg", OMP_NUM_THREADS="1"))))
    for code, wait in running:
        results[code] = wait(TIMEOUT)
    return results


def _missing_package(stderr: str) -> str | None:
    found = re.search(r"ModuleNotFoundError: No module named '([^'.]+)", stderr)
    if found and found.group(1) not in ("fxdebug", "torch", "torchvision"):
        return found.group(1)
    return None


def test_pages_have_blocks():
    readme = [block for block in PYTHON_BLOCKS if block[0] == "README.md"]
    assert len(readme) >= 10 and len(PYTHON_BLOCKS) >= 30 and len(COMMANDS) >= 4


@pytest.mark.parametrize("page, line_number, code", PYTHON_BLOCKS,
                         ids=[f"{page}:{line}" for page, line, _ in PYTHON_BLOCKS])
def test_python_block_runs_alone(block_results, page, line_number, code):
    result = block_results[code]
    missing = _missing_package(result.stderr)
    if result.returncode and missing:
        pytest.skip(f"{page}:{line_number} needs {missing}, which is not installed")
    assert result.returncode == 0, (
        f"{page}:{line_number}: the block failed in a fresh interpreter (exit "
        f"{result.returncode}); each block must import and build what it uses.\n"
        f"{result.stderr[-3000:]}")


@functools.lru_cache(maxsize=None)
def _run_command(command: str) -> subprocess.CompletedProcess:
    args = shlex.split(command, comments=True)[1:]
    return python(["-m", "fxdebug", *args], cwd=REPO, env=child_env(OMP_NUM_THREADS="1"),
                  timeout=TIMEOUT)


@pytest.mark.parametrize("page, line_number, command", COMMANDS,
                         ids=[f"{page}:{line}" for page, line, _ in COMMANDS])
def test_quick_command_runs(page, line_number, command):
    result = _run_command(command)
    missing = _missing_package(result.stderr)
    if result.returncode and missing:
        pytest.skip(f"{page}:{line_number} needs {missing}, which is not installed")
    assert result.returncode == 0, f"{page}:{line_number}: `{command}` failed:\n{result.stderr}"
    assert result.stdout.strip(), f"{page}:{line_number}: `{command}` printed nothing"


# --- links -----------------------------------------------------------------------------

INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^[ \t]*\[[^\]]+\]:[ \t]*<?(\S+?)>?(?:[ \t]+\"[^\"]*\")?[ \t]*$", re.M)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//")


def _blank(match: re.Match) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


def _prose(text: str, inline_code: bool = False) -> str:
    """``text`` without fenced blocks, HTML comments and (unless kept) inline code.

    Line numbers stay as they were: what is removed becomes spaces.
    """
    text = re.sub(r"<!--.*?-->", _blank, FENCE.sub(_blank, text), flags=re.S)
    return text if inline_code else re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", _blank, text)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: ``Compiled models`` -> ``compiled-models``.

    >>> github_slug("Dump to a folder, step through it in pdb")
    'dump-to-a-folder-step-through-it-in-pdb'
    >>> github_slug("`fxdebug.records(gm)`")
    'fxdebugrecordsgm'
    """
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(page: pathlib.Path) -> frozenset[str]:
    """Every heading anchor of ``page``, repeated headings numbered ``-1``, ``-2`` as on GitHub."""
    seen: dict[str, int] = {}
    found = []
    for match in HEADING.finditer(_prose(page.read_text(encoding="utf-8"), inline_code=True)):
        slug = github_slug(match.group(2))
        found.append(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return frozenset(found)


def links(page: pathlib.Path) -> list[tuple[int, str]]:
    """``(line number, target)`` of every inline and reference link of ``page``."""
    text = _prose(page.read_text(encoding="utf-8"))
    found = [(text.count("\n", 0, match.start()) + 1, match.group(1))
             for pattern in (INLINE_LINK, REFERENCE_LINK) for match in pattern.finditer(text)]
    return sorted(found)


def _link_problem(page: pathlib.Path, target: str) -> str | None:
    path, _, anchor = target.partition("#")
    destination = (page.parent / path).resolve() if path else page
    inside = destination.is_relative_to(ROOT)
    name = destination.relative_to(ROOT).as_posix() if inside else str(destination)
    if not destination.exists():
        if name in MISSING_LINK_TARGETS_ALLOWED:
            return None
        return f"{name} does not exist"
    if anchor and destination.suffix == ".md" and anchor not in anchors(destination):
        return f"{name} has no heading whose anchor is #{anchor}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=[_name(page) for page in PAGES])
def test_relative_links_lead_somewhere(page):
    problems = []
    for line_number, target in links(page):
        if SCHEME.match(target):
            continue
        problem = _link_problem(page, target)
        if problem:
            problems.append(f"{_name(page)}:{line_number}: ({target}): {problem}")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_link_checker_finds_broken_links(tmp_path, monkeypatch):
    tmp_path = tmp_path.resolve()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# Dump to a folder, step through it in pdb\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#dump-to-a-folder-step-through-it-in-pdb) [ok](docs/a.md#twice-1)\n"
                    "[gone](docs/b.md) [bad anchor](docs/a.md#nowhere) `[code](docs/c.md)`\n"
                    "```\n[fenced](docs/d.md)\n```\n[web](https://example.com/x.md) [self](#nowhere)\n")
    anchors.cache_clear()
    try:
        found = [(line, target, _link_problem(page, target)) for line, target in links(page)
                 if not SCHEME.match(target)]
    finally:
        anchors.cache_clear()
    assert found == [
        (1, "docs/a.md#dump-to-a-folder-step-through-it-in-pdb", None),
        (1, "docs/a.md#twice-1", None),
        (2, "docs/a.md#nowhere", "docs/a.md has no heading whose anchor is #nowhere"),
        (2, "docs/b.md", "docs/b.md does not exist"),
        (6, "#nowhere", "README.md has no heading whose anchor is #nowhere"),
    ]


def test_the_eager_values_promise_states_its_compiled_exception():
    """Wherever the docs promise only values eager ``forward`` computed, the same paragraph says
    that a model the user compiles (``torch.compile(fxdebug.instrument(m))``) records the
    compiled code's values instead."""
    promise = "never shows a value that eager `forward` did not compute"
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    found = []
    for page in pages:
        for paragraph in page.read_text(encoding="utf-8").split("\n\n"):
            if promise in " ".join(paragraph.split()):
                found.append(page.name)
                assert "exception" in paragraph and "torch.compile(fxdebug.instrument(model))" in \
                    " ".join(paragraph.split()), (page.name, paragraph)
    assert "README.md" in found and "guarantees.md" in found


def test_the_front_page_stays_under_300_lines():
    """The README is the front page: the quick start, one example per job and the guides; the
    detail lives in docs/."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"
