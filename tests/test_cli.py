"""The fxdebug command line: working defaults, one-paragraph errors, no tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from subprocesses import REPO, fxdebug_cli



def _fxdebug(*args, cwd=REPO):
    return fxdebug_cli(*args, cwd=cwd)


def test_summary_default_model_prints_the_table():
    result = _fxdebug("summary", "--input", "1,3,64,64")
    assert result.returncode == 0, result.stderr
    assert "torchvision.models:resnet18: ResNet, input 1x3x64x64" in result.stdout
    lines = result.stdout.splitlines()
    assert lines[1].split()[:4] == ["key", "op", "shape", "dtype"]
    assert any(line.startswith("layer1.0.conv1 ") and "Conv2d" in line for line in lines)
    assert "tensors captured" in result.stdout


def test_summary_title_fits_the_columns(tmp_path):
    folder = tmp_path / "a_folder_with_a_rather_long_name" / "and_another_one_below_it"
    folder.mkdir(parents=True)
    (folder / "tiny_model_factory_file.py").write_text(
        "import torch\n\ndef make_a_small_linear_model():\n    return torch.nn.Linear(4, 3)\n")
    spec = f"{folder / 'tiny_model_factory_file.py'}:make_a_small_linear_model"
    assert len(spec) > 80
    for columns in (80, 40):
        result = fxdebug_cli("summary", spec, "--input", "2,4", cwd=tmp_path,
                             COLUMNS=str(columns))
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        header = lines.index(next(line for line in lines if line.split()[:1] == ["key"]))
        checked = lines if columns == 80 else lines[:header]  # the totals line is 47 wide
        assert all(len(line) <= columns for line in checked), checked
        title = "".join(line.strip() for line in lines[:header])
        assert title.replace(" ", "").startswith(spec.replace(" ", ""))  # wrapped, not cut
        assert "Linear" in title and "input2x4" in title.replace(" ", "")


def test_summary_options():
    result = _fxdebug("summary", "torchvision.models:mobilenet_v3_small", "--input", "1,3,64,64",
                      "--capture", "features.*.block,classifier", "--mode", "stats", "--depth", "2")
    assert result.returncode == 0, result.stderr
    keys = [line.split()[0] for line in result.stdout.splitlines()[3:] if line and
            not line[0].isdigit() and not line.startswith("note")]
    assert keys and all(k.startswith(("features.", "classifier")) for k in keys)
    assert all(k.count(".") <= 2 for k in keys)


def test_summary_grads_loss_and_plot(tmp_path):
    (tmp_path / "losses.py").write_text("def first(out):\n    return out[0, 0]\n")
    result = _fxdebug("summary", "torchvision.models:resnet18", "--input", "1,3,64,64", "--depth",
                      "0", "--grads", "--loss", "losses.py:first", "--plot", "norms.png",
                      cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[1]
    assert header.split()[-4:] == ["grad", "norm", "grad", "non-finite"]
    assert "fc.weight" in result.stdout and "grads of losses.py:first" in result.stdout
    assert (tmp_path / "norms.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.modules['matplotlib'] = None  # as if it were not installed\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    result = subprocess.run([sys.executable, "-m", "fxdebug", "summary", "--plot", "x.png"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    _assert_one_paragraph_error(result, "pip install 'fxdebug[plot]'")
    assert not (tmp_path / "x.png").exists()


def test_factory_needing_a_missing_package_names_it(tmp_path):
    # examples/transformer_layers.py without transformers: the factory says which package to
    # install, as "No module named ..." (what the doc-command tests skip on), not AttributeError.
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.modules['transformers'] = None  # as if it were not installed\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    result = subprocess.run([sys.executable, "-m", "fxdebug", "summary",
                             "examples/transformer_layers.py:gpt2"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2  # an error: trouble
    first = result.stderr.splitlines()[0]
    assert first.startswith("fxdebug: error: ModuleNotFoundError: No module named 'transformers'")
    assert "pip install transformers" in first and "transformer_layers.py:gpt2" in first

def test_model_from_a_file_with_inputs(tmp_path):
    (tmp_path / "net.py").write_text(textwrap.dedent("""
        import torch
        def make():
            return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    """))
    result = _fxdebug("summary", "net.py:make", "--input", "2,5:int64", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "2x5x2" in result.stdout


def _assert_one_paragraph_error(result, *fragments):
    assert result.returncode == 2  # an error: trouble
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("fxdebug: error: ")
    assert len(result.stderr.strip().splitlines()) == 1
    for fragment in fragments:
        assert fragment in result.stderr


def test_bad_model_names(tmp_path):
    _assert_one_paragraph_error(_fxdebug("summary", "resnet18"), "package.module:factory")
    _assert_one_paragraph_error(_fxdebug("summary", "torchvision.models:resnet1000"),
                                "no callable 'resnet1000'")
    _assert_one_paragraph_error(_fxdebug("summary", "nowhere_pkg:make"), "cannot import")
    _assert_one_paragraph_error(_fxdebug("summary", "missing.py:make", cwd=tmp_path),
                                "does not exist")


def test_bad_input_and_wrong_shape():
    _assert_one_paragraph_error(_fxdebug("summary", "--input", "1,three"), "is not a shape")
    _assert_one_paragraph_error(_fxdebug("summary", "--input", "1,1,64,64"),
                                "failed at node 'conv1'", "resnet.py:")


def test_untraceable_model_names_the_line(tmp_path):
    (tmp_path / "branchy.py").write_text(textwrap.dedent("""
        import torch
        class Branchy(torch.nn.Module):
            def forward(self, x):
                if x.sum() > 0:
                    return x
                return -x
        def make():
            return Branchy()
    """))
    result = _fxdebug("summary", "branchy.py:make", "--input", "3", cwd=tmp_path)
    _assert_one_paragraph_error(result, "branchy.py:5", "control flow on a traced value",
                                "torch.where")
    assert "concrete_args" not in result.stderr  # advice that would freeze the input


def test_bad_arguments_exit_2():
    result = _fxdebug("summary", "--mode", "loud")
    assert result.returncode == 2 and "invalid choice" in result.stderr
    result = _fxdebug()
    assert result.returncode == 2


def test_comparing_commands_exit_0_same_1_different_2_trouble(tmp_path):
    """As diff and cmp: check and passes --check say 1 only for a difference, 2 for trouble."""
    (tmp_path / "net.py").write_text(textwrap.dedent("""
        import torch
        def make():
            return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
        def relu_to_sigmoid(gm):
            for node in gm.graph.nodes:
                if node.op == "call_module" and node.target == "1":  # the ReLU
                    node.op, node.target = "call_function", torch.sigmoid
            gm.recompile()
            return gm
    """))
    same = _fxdebug("passes", "net.py:make", "--input", "2,3", "--pass", "capture", "--check",
                    cwd=tmp_path)
    assert same.returncode == 0, same.stdout + same.stderr
    for command in ("passes", "check"):
        args = [command, "net.py:make", "--input", "2,3", "--pass", "net.py:relu_to_sigmoid"]
        different = _fxdebug(*args, *(["--check"] if command == "passes" else []), cwd=tmp_path)
        assert different.returncode == 1, (command, different.stdout + different.stderr)
        trouble = _fxdebug(command, "net.py:make", "--input", "2,7", cwd=tmp_path)  # wrong shape
        assert trouble.returncode == 2, (command, trouble.stdout + trouble.stderr)
        assert trouble.stderr.startswith("fxdebug: error: ")
