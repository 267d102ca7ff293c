"""Model, pass and loss files named on the command line import their neighbours.

``python path/to/s5_factory.py`` puts ``path/to`` first on ``sys.path``, so
``from s1_nan import TinyCNN`` finds ``s1_nan.py`` beside it; ``fxdebug dump
path/to/s5_factory.py:make`` must too, from any working directory, and a
library call leaves ``sys.path`` as it found it. Ground truth: the same files
run with plain ``python``.
"""

from __future__ import annotations

import os
import sys
import textwrap
import uuid

import torch

from fxdebug.cli import main
from fxdebug.cli.model_spec import load_model
from subprocesses import child_env, fxdebug_cli, python

TINY = textwrap.dedent("""
    import torch

    class TinyCNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.conv(x).mean((2, 3)))
""")


def _story_files(folder, tag=""):
    """s1_nan{tag}.py (the model), helper{tag}.py, s5_factory.py and a pass, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"s1_nan{tag}.py").write_text(TINY)
    (folder / f"helper{tag}.py").write_text("SCALE = 1.0\n")
    (folder / "s5_factory.py").write_text(textwrap.dedent(f"""
        import torch
        from s1_nan{tag} import TinyCNN

        def make():
            from helper{tag} import SCALE  # imported when the factory is called
            torch.manual_seed(0)
            return TinyCNN(), (SCALE * torch.randn(1, 3, 8, 8),)

        if __name__ == "__main__":
            model, (x,) = make()
            print(tuple(model(x).shape))
    """))
    (folder / "my_pass.py").write_text(textwrap.dedent(f"""
        from helper{tag} import SCALE

        def noop(gm):
            return gm
    """))
    return folder


def test_plain_python_runs_the_factory_file(tmp_path):  # the ground truth the CLI must match
    folder = _story_files(tmp_path / "stories")
    run = python([str(folder / "s5_factory.py")], cwd=str(tmp_path), env=child_env())
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "(1, 2)"


def test_dump_and_check_find_the_factory_files_neighbours_from_another_folder(tmp_path):
    folder = _story_files(tmp_path / "stories")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dumped = fxdebug_cli("dump", str(folder / "s5_factory.py") + ":make", "out", cwd=str(elsewhere))
    assert dumped.returncode == 0, dumped.stderr
    assert "TinyCNN, input 1x3x8x8" in dumped.stdout
    assert os.path.isfile(elsewhere / "out" / "run.py")
    checked = fxdebug_cli("check", "stories/s5_factory.py:make", "--pass", "stories/my_pass.py:noop",
                          cwd=str(tmp_path))
    assert "ModuleNotFoundError" not in checked.stderr, checked.stderr
    assert "verdict" in checked.stdout


def test_a_missing_neighbour_says_where_it_was_looked_for(tmp_path):
    folder = tmp_path / "lonely"
    folder.mkdir()
    (folder / "factory.py").write_text("from not_beside_me import Net\n\ndef make():\n    return Net()\n")
    result = fxdebug_cli("summary", "lonely/factory.py:make", cwd=str(tmp_path))
    assert result.returncode == 2  # an error: trouble
    assert "No module named 'not_beside_me'" in result.stderr
    assert "its folder searched first" in result.stderr and "factory.py:1" in result.stderr


def test_library_use_leaves_sys_path_as_it_found_it(tmp_path, capsys):
    tag = "_" + uuid.uuid4().hex[:8]
    folder = _story_files(tmp_path / "stories", tag)
    before = list(sys.path)
    try:
        model, inputs = load_model(f"{folder / 's5_factory.py'}:make")
        assert sys.path == before
        assert type(model).__name__ == "TinyCNN" and inputs[0].shape == (1, 3, 8, 8)
        assert main(["summary", f"{folder / 's5_factory.py'}:make", "--capture", "fc"]) == 0
        assert sys.path == before
        assert "fc" in capsys.readouterr().out
    finally:
        for name in (f"s1_nan{tag}", f"helper{tag}"):
            sys.modules.pop(name, None)
    assert torch.is_grad_enabled()
