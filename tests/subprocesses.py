"""Python processes for tests: the fxdebug CLI, scripts, and runs under several hash seeds.

Determinism is tested across processes: the same script under PYTHONHASHSEED
0, 1 and 2 must print the same bytes. Every child imports fxdebug and the test
helpers from this checkout, whatever the working directory.

Importing torch and torchvision costs a new interpreter seconds of CPU, more than most
children spend on their work, so ``python()`` forks children from a server: an interpreter
that imported torch and torchvision once (nothing else: not fxdebug, not the tests' modules) and
ran no tensor operation, so it has no thread that could hold a lock in the child. A child is set up as
``python ARGS`` would be (argv, ``__main__``, sys.path[0], working directory, environment,
stdin, stdout and stderr, exit status, atexit); its interpreter-wide settings (hash seed,
``-W`` options, thread and library variables, PYTHONPATH) are those its server was started
with, so every such combination gets a server of its own. ``FXDEBUG_TEST_FRESH=1`` runs
every child in a new interpreter instead.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import time
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
    return python(["-m", "fxdebug", *args], cwd=cwd, env=child_env(**env), input=input)


def run_python(script: str, *args: str, cwd: str = REPO, **env: str) -> subprocess.CompletedProcess:
    """``python -c SCRIPT ARGS`` in ``cwd``; stdout and stderr captured as text."""
    return python(["-c", script, *args], cwd=cwd, env=child_env(**env))


NOBODY = 65534


def run_python_unprivileged(script: str, *args: str) -> subprocess.CompletedProcess:
    """``run_python`` whose ``script`` calls ``become_unprivileged()`` once its imports are done.

    In a root process that makes the child the user ``nobody`` (root writes into read-only
    folders); otherwise it does nothing."""
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
    runs = [start_python(["-W", "ignore", "-c", script, *args(seed)], cwd=cwd,
                         env=child_env(PYTHONHASHSEED=seed, **env))
            for seed in seeds]
    outputs = []
    for seed, run in zip(seeds, runs):
        result = run(600)
        assert result.returncode == 0, (f"PYTHONHASHSEED={seed}: exit {result.returncode}\n"
                                        f"{result.stderr[-8000:]}")
        outputs.append(result.stdout)
    return outputs


# -- the fork server ---------------------------------------------------------------------------
# Startup settings: a child forked from a server keeps the server's, so they pick the server.
_STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "CUDA", "LD_",
                     "MALLOC", "NUMEXPR_", "TRITON")
_MAX_SERVERS = 5  # the least recently used one beyond these ends (each holds torch's memory)

_SERVER = r'''
import io, json, os, runpy, sys, traceback, types
import torch, torchvision  # what costs every child seconds: imported once, here, and nothing else

def _threads():
    return set(os.listdir("/proc/self/task"))

# numpy's OpenBLAS starts its thread pool on import and ends it around every fork
# (pthread_atfork); any other thread (torch's OpenMP pool after a tensor operation, say) could
# hold a lock the child then waits for forever, so a server with one refuses to fork.
_IMPORTED = _threads()

def _child(request):
    """Become ``python ARGS`` for ``request``; return the exit status."""
    for fd, (path, flags) in enumerate(((request["stdin"], os.O_RDONLY),
                                        (request["stdout"], os.O_WRONLY),
                                        (request["stderr"], os.O_WRONLY))):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    kind, target, args = request["kind"], request["target"], request["args"]
    try:
        if kind == "-c":
            sys.argv = ["-c", *args]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            main.__builtins__ = __builtins__
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        elif kind == "-m":
            sys.argv = [target, *args]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:  # as the interpreter would: the traceback, then exit 1
        tb = exc.__traceback__
        while tb is not None and (tb.tb_frame.f_globals is globals() or
                                  "runpy" in tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next  # the server's own frames are not the child's
        sys.excepthook(type(exc), exc, tb)
        return 1
    return 0

_requests = open(0, "rb", closefd=False)
_replies = os.fdopen(os.dup(1), "w")
for _line in _requests:
    _request = json.loads(_line)
    if not _threads() <= _IMPORTED:
        _replies.write(json.dumps({"refused": f"threads {sorted(_threads() - _IMPORTED)}"}) + "\n")
        _replies.flush()
        continue
    sys.stdout.flush()
    sys.stderr.flush()
    _pid = os.fork()
    if _pid == 0:
        _replies.close()
        _requests.close()
        sys.exit(_child(_request))
    _replies.write(json.dumps({"pid": _pid}) + "\n")
    _replies.flush()
    _, _status = os.waitpid(_pid, 0)
    _replies.write(json.dumps({"exit": os.waitstatus_to_exitcode(_status)}) + "\n")
    _replies.flush()
'''


class _Server:
    def __init__(self, flags: tuple[str, ...], env: dict[str, str]) -> None:
        self.errors = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, *flags, "-c", _SERVER], env=env,
                                        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.errors, bufsize=0)  # select() sees every line
        self.busy = False

    def reply(self, deadline: float) -> dict | None:
        """The server's next line, or None when ``deadline`` (time.monotonic()) passed."""
        while not select.select([self.process.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            if time.monotonic() >= deadline:
                return None
        line = self.process.stdout.readline()
        if not line:
            self.errors.seek(0)
            raise RuntimeError("the test fork server ended: "
                               + self.errors.read().decode(errors="replace")[-4000:])
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()
        self.errors.close()


forked = 0  # children forked from a server so far
_servers: dict[tuple, list[_Server]] = {}  # by startup settings, least recently used first


def _server(flags: tuple[str, ...], env: dict[str, str]) -> _Server:
    key = (flags, tuple(sorted((name, value) for name, value in env.items()
                               if name.startswith(_STARTUP_PREFIXES))))
    pool = _servers.pop(key, [])
    _servers[key] = pool  # now the most recently used
    idle = [server for server in pool if not server.busy and server.process.poll() is None]
    if idle:
        return idle[0]
    server = _Server(flags, env)
    pool.append(server)
    idle = [(servers, old) for servers in _servers.values() for old in servers
            if not old.busy and old is not server]
    for servers, old in idle[:max(0, sum(map(len, _servers.values())) - _MAX_SERVERS)]:
        servers.remove(old)  # the least recently used first
        old.close()
    return server


@atexit.register
def _close_servers() -> None:
    for servers in _servers.values():
        for server in servers:
            server.close()
    _servers.clear()


def start_python(args: Sequence[str], cwd: str, env: dict[str, str], input: str | None = None
                 ) -> Callable[[float], subprocess.CompletedProcess]:
    """Start ``python ARGS``; call the result with a timeout in seconds for its CompletedProcess.

    Forked from a server (see the module's docstring) when ARGS are ``[-W OPTION]... (-c SCRIPT |
    -m MODULE | PATH) ...``; otherwise, or with FXDEBUG_TEST_FRESH=1, a new interpreter.
    """
    argv = [sys.executable, *args]
    flags: list[str] = []
    rest = list(args)
    while len(rest) >= 2 and rest[0] == "-W":
        flags += rest[:2]
        rest = rest[2:]
    if rest[:1] in (["-c"], ["-m"]) and len(rest) >= 2:
        kind, target, rest = rest[0], rest[1], rest[2:]
    elif rest and not rest[0].startswith("-"):
        kind, target, rest = "path", rest[0], rest[1:]
    else:
        kind = None
    if kind is None or os.environ.get("FXDEBUG_TEST_FRESH") == "1":
        return _fresh(argv, cwd, env, input)
    files = tempfile.mkdtemp(prefix="fxdebug-test-child-")
    paths = {name: os.path.join(files, name) for name in ("stdin", "stdout", "stderr")}
    for name, path in paths.items():
        with open(path, "w") as handle:
            handle.write((input or "") if name == "stdin" else "")
    server = _server(tuple(flags), env)
    server.busy = True
    request = dict(paths, cwd=os.path.abspath(cwd), env=env, kind=kind, target=target, args=rest)
    data = (json.dumps(request) + "\n").encode()
    while data:
        data = data[os.write(server.process.stdin.fileno(), data):]
    started = server.reply(time.monotonic() + 600)
    if started is None or "refused" in started:
        server.busy = False
        _remove(files)
        return _fresh(argv, cwd, env, input)
    global forked
    forked += 1

    def wait(timeout: float) -> subprocess.CompletedProcess:
        try:
            done = server.reply(time.monotonic() + timeout)
            if done is None:
                os.kill(started["pid"], 9)
                server.reply(time.monotonic() + 60)
                raise subprocess.TimeoutExpired(argv, timeout)
            outputs = {}
            for name in ("stdout", "stderr"):
                with open(paths[name], errors="replace") as handle:  # newlines as text=True has them
                    outputs[name] = handle.read()
            return subprocess.CompletedProcess(argv, done["exit"], **outputs)
        finally:
            server.busy = False
            _remove(files)
    return wait


def python(args: Sequence[str], cwd: str, env: dict[str, str], input: str | None = None,
           timeout: float = 300) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], ..., capture_output=True, text=True)``, forked
    from a server where it can be (see ``start_python``)."""
    return start_python(args, cwd, env, input)(timeout)


def _fresh(argv: list[str], cwd: str, env: dict[str, str], input: str | None
           ) -> Callable[[float], subprocess.CompletedProcess]:
    process = subprocess.Popen(argv, cwd=cwd, env=env, text=True, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def wait(timeout: float) -> subprocess.CompletedProcess:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
        return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
    return wait


def _remove(folder: str) -> None:
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)
