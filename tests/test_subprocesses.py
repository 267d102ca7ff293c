"""The test fork server's children behave as ``python ARGS`` does; ground truth: a new interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import subprocesses
from subprocesses import child_env, python

PROBE = textwrap.dedent("""
    import os, sys, warnings
    print(sys.argv, __name__, repr(sys.path[0]), os.getcwd() == os.path.realpath({cwd!r}))
    print(os.environ.get("FXDEBUG_PROBE"), sys.warnoptions, sys.flags.hash_randomization)
    print(repr(sys.stdin.read()), "fxdebug" in sys.modules)
    print("to stderr", file=sys.stderr)
    if sys.argv[-1] == "raise":
        {{}}["missing"]
    sys.exit(int(sys.argv[-1]))
""")


def _both(args, cwd, **kwargs):
    env = child_env(FXDEBUG_PROBE="yes")
    before = subprocesses.forked
    fresh = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=300, **kwargs)
    forked = python(args, cwd=cwd, env=env, **kwargs)
    assert subprocesses.forked == before + 1 or os.environ.get("FXDEBUG_TEST_FRESH") == "1"
    return forked, fresh


def _same(forked, fresh):
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), (forked, fresh)
    assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1], (forked, fresh)


def test_script_string_argv_exit_status_stdin_and_environment(tmp_path):
    code = PROBE.format(cwd=str(tmp_path))
    for last in ("0", "3", "raise"):
        forked, fresh = _both(["-W", "ignore", "-c", code, "a b", last], str(tmp_path),
                              input="typed\n")
        _same(forked, fresh)
    assert "KeyError: 'missing'" in forked.stderr and forked.returncode == 1
    assert forked.stderr.count("Traceback") == 1 and 'File "<string>"' in forked.stderr


def test_script_file_and_module(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(cwd=str(tmp_path)))
    _same(*_both([str(script), "x", "2"], str(tmp_path)))
    (tmp_path / "probe_module.py").write_text(PROBE.format(cwd=str(tmp_path)))
    forked, fresh = _both(["-m", "probe_module", "0"], str(tmp_path))
    _same(forked, fresh)
    assert "probe_module.py" in forked.stdout  # argv[0] is the module's file
