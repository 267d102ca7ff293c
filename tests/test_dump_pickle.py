"""Loading a dump is honest about code: no pickled module unless asked for, and only the one written."""

from __future__ import annotations

import os

import pytest
import torch

import fxdebug
from dump_models import Gadgets, Opaque


def _load(folder):
    namespace = {"__file__": os.path.join(folder, "module.py"), "__name__": "dumped_gadgets"}
    with open(namespace["__file__"]) as handle:
        exec(compile(handle.read(), namespace["__file__"], "exec"), namespace)
    return namespace["load"](folder)


def test_modules_that_need_pickling_are_refused_unless_allowed(tmp_path):
    model = Gadgets().eval()
    gm = fxdebug.trace(model, leaf_modules=[Opaque])
    x = torch.randn(2, 6)
    with pytest.raises(fxdebug.FxdebugError) as caught:
        fxdebug.dump(gm, x, folder=tmp_path / "refused")
    message = str(caught.value)
    assert "'opaque' (Opaque)" in message and "allow_pickled_modules=True" in message
    assert "--allow-pickle" in message and "weights_only=False" in message
    assert os.listdir(tmp_path) == []
    folder = fxdebug.dump(gm, x, folder=tmp_path / "allowed", allow_pickled_modules=True)
    readme = open(os.path.join(folder, "README.md")).read()
    assert "## Opening this folder runs its code" in readme and "weights_only=False" in readme
    with torch.no_grad():
        assert torch.equal(_load(folder)(x), model(x))
    path = os.path.join(folder, "pickled_modules.pt")  # another pickle in its place
    torch.save({"opaque": Opaque(6)}, path)
    with pytest.raises(RuntimeError, match="not the file fxdebug.dump wrote"):
        _load(folder)


def test_a_folder_without_pickles_says_its_code_runs(tmp_path):
    folder = fxdebug.dump(torch.nn.Linear(3, 2), torch.ones(1, 3), folder=tmp_path / "lin")
    readme = open(os.path.join(folder, "README.md")).read()
    assert "Open only folders you trust" in readme and "nothing is unpickled" in readme
    assert "weights_only=False" not in open(os.path.join(folder, "module.py")).read()


def test_cli_refuses_then_allows_pickling(tmp_path, monkeypatch, capsys):
    from fxdebug.cli import main
    (tmp_path / "gadget_factory.py").write_text(
        "import torch, fxdebug\nfrom dump_models import Gadgets, Opaque\n"
        "def build():\n    return fxdebug.trace(Gadgets().eval(), leaf_modules=[Opaque])\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["dump", "gadget_factory:build", "out", "--input", "2,6"]) == 2
    assert "--allow-pickle" in capsys.readouterr().err and "out" not in os.listdir(tmp_path)
    assert main(["dump", "gadget_factory:build", "out", "--input", "2,6", "--allow-pickle"]) == 0
    assert os.path.isfile(tmp_path / "out" / "pickled_modules.pt")
