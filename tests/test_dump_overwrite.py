"""dump(..., overwrite=True) replaces only what a dump wrote; killed dumps leave nothing for ever."""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import py_compile
import signal
import shutil
import tempfile

import pytest
import torch

import fxdebug
from models import SeedOneNet
from subprocesses import NOBODY, run_python_unprivileged
from test_dump import _DUMP_AS_NOBODY


def _tree(root) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256), hidden ones included: the ground truth."""
    tree = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as handle:
                tree[os.path.relpath(path, root)] = hashlib.sha256(handle.read()).hexdigest()
    return tree


def _gm(capture="modules"):
    return fxdebug.instrument(SeedOneNet().eval(), capture=capture)


X = torch.randn(1, 3, 8, 8)


def test_user_files_in_an_earlier_dump_are_never_deleted(tmp_path):
    earlier = tmp_path / "earlier"
    fxdebug.dump(_gm(), X, folder=earlier)
    (earlier / "notes.txt").write_text("what I found")
    before = _tree(tmp_path)
    with pytest.raises(fxdebug.FxdebugError, match=r"files the dump did not write: notes\.txt"):
        fxdebug.dump(_gm("all"), X, folder=earlier, overwrite=True)
    assert _tree(tmp_path) == before
    os.unlink(earlier / "notes.txt")
    fxdebug.dump(_gm("all"), X, folder=earlier, overwrite=True)
    assert "capture_view" in (earlier / "module.py").read_text()  # replaced
    assert sorted(os.listdir(tmp_path)) == ["earlier"]


def test_a_project_folder_with_the_same_file_names_is_not_a_dump(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    for name, text in [("run.py", "print('train')"), ("breakpoints.json", "{}"),
                       ("train.py", "..."), ("data.csv", "a,b\n1,2\n")]:
        (project / name).write_text(text)
    before = _tree(tmp_path)
    with pytest.raises(fxdebug.FxdebugError) as caught:
        fxdebug.dump(_gm(), X, folder=project, overwrite=True)
    assert "not an fxdebug dump" in str(caught.value)
    assert all(name in str(caught.value) for name in ("data.csv", "train.py"))
    assert _tree(tmp_path) == before


def test_an_edited_dump_is_not_replaced_but_one_that_ran_is(tmp_path):
    earlier = tmp_path / "earlier"
    fxdebug.dump(_gm(), X, folder=earlier)
    manifest = (earlier / "manifest.json").read_text()
    assert sorted(fxdebug.dumping.FILES) == sorted(os.listdir(earlier))
    for name in fxdebug.dumping.FILES[:-1]:
        assert f'"{name}"' in manifest
    for name in ("module.py", "__init__.py"):  # what importing the dump writes
        py_compile.compile(str(earlier / name), doraise=True)
    assert len(os.listdir(earlier / "__pycache__")) == 2
    code = (earlier / "module.py").read_text()
    (earlier / "module.py").write_text(code + "\n# my edit\n")
    before = _tree(tmp_path)
    with pytest.raises(fxdebug.FxdebugError, match=r"module\.py changed since it was dumped"):
        fxdebug.dump(_gm("all"), X, folder=earlier, overwrite=True)
    assert _tree(tmp_path) == before
    (earlier / "module.py").write_text(code)
    fxdebug.dump(_gm("all"), X, folder=earlier, overwrite=True)  # its own bytecode does not block it
    assert "__pycache__" not in os.listdir(earlier)
    assert sorted(os.listdir(tmp_path)) == ["earlier"]


# -- a dump killed at a chosen point (test_dump_kill.py kills at many) ----------------------
EVENTS = ("open", "mkdir", "rename", "unlink", "rmdir")


class _AskedWrites:
    """A file opened for writing whose every ``write`` asks ``when("write", path)`` first."""

    def __init__(self, handle, path, when):
        self.handle, self.path, self.when = handle, path, when

    def write(self, data):
        if self.when("write", self.path):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.handle.write(data)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)


def killed_dump(gm, folder, when, inputs=None, writes=False) -> int:
    """Dump ``gm`` in a forked child that SIGKILLs itself when ``when(event, path)`` says so.

    ``when`` is asked before every file system change (``EVENTS``: a file opened,
    a folder made, a rename (its destination), a file or folder removed), and with
    ``writes`` before every ``write`` into a file it opened (event ``"write"``: a kill
    there leaves the file cut short). Returns the child's wait status; a child that was
    not killed exits with the number of file system changes it saw (at most 255).
    """
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        seen = [0]
        try:
            torch.set_num_threads(1)

            def hooked(real, event):
                def call(path, *args, **kwargs):
                    target = args[0] if event == "rename" else path
                    opens_to_write = event == "open" and args and "w" in args[0]
                    if event != "open" or opens_to_write:
                        seen[0] += 1
                        if when(event, os.fspath(target)):
                            os.kill(os.getpid(), signal.SIGKILL)
                    result = real(path, *args, **kwargs)
                    return _AskedWrites(result, os.fspath(path), when) if writes and opens_to_write \
                        else result
                return call

            builtins.open = hooked(builtins.open, "open")
            for event in EVENTS[1:]:
                setattr(os, event, hooked(getattr(os, event), event))
            fxdebug.dump(gm, X if inputs is None else inputs, folder=folder, overwrite=True)
        finally:
            os._exit(min(seen[0], 255))
    return os.waitpid(pid, 0)[1]


POINTS = {
    "writing": lambda event, path: event == "open" and path.endswith(".tmp/weights.pt"),
    "between_renames": lambda event, path: event == "rename" and path.endswith("/earlier"),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_the_next_dump_finishes_what_a_killed_one_left(tmp_path, point):
    earlier = tmp_path / "earlier"
    fxdebug.dump(_gm(), X, folder=earlier)
    dumped = _tree(earlier)
    status = killed_dump(_gm("all"), str(earlier), POINTS[point])
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    hidden = [name for name in os.listdir(tmp_path) if name.startswith(".")]
    assert hidden, "the killed dump left its work behind"
    if point == "between_renames":
        assert not earlier.exists() and any(name.endswith(".old") for name in hidden)
    with pytest.raises(fxdebug.FxdebugError, match="already exists"):
        fxdebug.dump(_gm(), X, folder=earlier)  # the earlier dump is back (and kept: no overwrite)
    assert sorted(os.listdir(tmp_path)) == ["earlier"]
    assert _tree(earlier) == dumped
    fxdebug.dump(_gm("all"), X, folder=earlier, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["earlier"]


def test_leftovers_of_an_older_fxdebug_are_restored_too(tmp_path):
    """Before manifests a killed overwrite left the earlier dump in ``.NAME.T.old/NAME``."""
    made = tmp_path / "made"
    fxdebug.dump(_gm(), X, folder=made)
    dumped = _tree(made)
    (tmp_path / ".out.k3j9x0a1.old").mkdir()
    os.rename(made, tmp_path / ".out.k3j9x0a1.old" / "out")
    (tmp_path / ".out.p0q8r7s6.tmp").mkdir()
    (tmp_path / ".out.p0q8r7s6.tmp" / "run.py").write_text("half written")
    with pytest.raises(fxdebug.FxdebugError, match=r"already exists \(restored the earlier dump"):
        fxdebug.dump(_gm(), X, folder=tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["out"] and _tree(tmp_path / "out") == dumped


def test_leftovers_holding_foreign_files_are_kept(tmp_path):
    stale = tmp_path / ".out.abcd1234.tmp"
    stale.mkdir()
    (stale / "module.py").write_text("x = 1")
    (stale / "mine.txt").write_text("not a dump file")
    with pytest.warns(UserWarning, match=r"mine\.txt"):
        fxdebug.dump(_gm(), X, folder=tmp_path / "out")
    assert sorted(os.listdir(stale)) == ["mine.txt"]  # the dump's file went, the user's stayed


# -- permissions ---------------------------------------------------------------------------
def test_overwriting_a_read_only_dump_is_an_fxdebug_error():
    """Root writes into read-only folders: the earlier dump is handed to ``nobody``, and the
    overwrite runs in a child process as ``nobody``."""
    uid = NOBODY if os.geteuid() == 0 else -1
    parent = tempfile.mkdtemp(prefix="fxdebug-ro-")
    folder = os.path.join(parent, "earlier")
    fxdebug.dump(_gm(), X, folder=folder)
    for path in [parent, folder] + [os.path.join(folder, name) for name in os.listdir(folder)]:
        if uid >= 0:
            os.chown(path, uid, uid)
    os.chmod(folder, 0o555)
    proc = run_python_unprivileged(_DUMP_AS_NOBODY, folder, "overwrite")
    message = proc.stdout
    try:
        assert proc.returncode == 3, message + proc.stderr[-3000:]
        assert f"cannot replace the earlier dump {folder!r}: Permission denied" in message
        assert "chmod -R u+w" in message
        assert sorted(os.listdir(parent)) == ["earlier"]  # nothing left beside it
        assert sorted(os.listdir(folder)) == sorted(fxdebug.dumping.FILES)
    finally:
        os.chmod(folder, 0o755)
        shutil.rmtree(parent)


def test_manifest_sizes_and_hashes_equal_the_files_written(tmp_path):
    # Blocks of 1 MiB and more are hashed on a second thread while they are written.
    model = torch.nn.Sequential(torch.nn.Linear(1024, 768), torch.nn.ReLU(), torch.nn.Linear(768, 4))
    fxdebug.dump(fxdebug.instrument(model), torch.randn(2, 1024), folder=tmp_path / "d")
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())["files"]
    tree = _tree(tmp_path / "d")
    assert os.path.getsize(tmp_path / "d" / "weights.pt") > 3 << 20
    for name, entry in manifest.items():
        assert entry["sha256"] == tree[name], name
        assert entry["size"] == os.path.getsize(tmp_path / "d" / name), name
