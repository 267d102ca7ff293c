"""pdb on generated code: `fxdebug debug FOLDER --break KEY`, passes.Breakpoint, real filenames."""

from __future__ import annotations

import bdb
import io
import linecache
import os
import pdb
import re
import shutil
import sys
import traceback

import pytest
import torch
import torchvision

import fxdebug
from subprocesses import child_env, python

ENV = child_env()


def _conv2_input_shape(x):
    """Ground truth from a forward pre-hook on the eager model."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    seen = []
    model.layer1[0].conv2.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    with torch.no_grad():
        model(x)
    return seen[0]


@pytest.fixture(scope="module")
def cli_folder(tmp_path_factory):
    """resnet18 written by `fxdebug dump`, then moved."""
    base = tmp_path_factory.mktemp("debug")
    proc = python(["-m", "fxdebug", "dump", "made", "--input", "1,3,64,64"], cwd=str(base), env=ENV)
    assert proc.returncode == 0, proc.stderr
    shutil.move(base / "made", base / "moved")
    (base / "elsewhere").mkdir()
    return base


def _debug(folder, *args, stdin, cwd):
    return python(["-m", "fxdebug", "debug", str(folder), *args], input=stdin, cwd=str(cwd), env=ENV)


def _debug_here(folder, *args, stdin, monkeypatch, capsys):
    """The same command in this process (faster): stdin patched, stdout captured."""
    from fxdebug.cli import main
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    status = main(["debug", str(folder), *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_scripted_pdb_session_stops_at_the_node(cli_folder):
    folder = cli_folder / "moved"
    x = torch.load(folder / "inputs.pt", weights_only=True)[0]
    result = _debug(folder, "--break", "layer1.0.conv2", stdin="p layer1_0_relu.shape\nc\n",
                    cwd=cli_folder / "elsewhere")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    code = (folder / "module.py").read_text().splitlines()
    line = next(i for i, text in enumerate(code, 1) if text.rstrip().endswith("# [layer1.0.conv2] "
                                                                               "torchvision/models/resnet.py:96"))
    assert f"fxdebug: breakpoint at module.py:{line}, before node 'layer1.0.conv2'" in out
    assert f"> {folder / 'module.py'}({line})forward()" in out
    assert "\n-> layer1_0_conv2 = getattr(self.layer1, \"0\").conv2(layer1_0_relu)" in out
    assert f"(Pdb) {_conv2_input_shape(x)}" in out  # p of the node's input
    assert "outputs: 1 equal" in out  # `c` ran to the end and run.py compared
    assert out.rstrip().endswith("ok: same results as when dumped")


def test_default_breakpoint_is_the_first_line_of_forward(cli_folder, monkeypatch, capsys):
    status, out, err = _debug_here(cli_folder / "moved", stdin="p x.shape\nn\nn\np begin_run\nc\n",
                                   monkeypatch=monkeypatch, capsys=capsys)
    assert status == 0, err
    assert "at the first line of forward" in out
    assert "-> fxdebug_recorder = self.fxdebug_recorder" in out
    assert "(Pdb) torch.Size([1, 3, 64, 64])" in out
    assert "(Pdb) None" in out  # begin_run's value, after two `n`
    assert "outputs: 1 equal" in out


def test_module_path_breaks_at_its_first_node_and_typos_are_explained(cli_folder, monkeypatch,
                                                                       capsys):
    folder = cli_folder / "moved"
    status, out, err = _debug_here(folder, "--backward", "--break", "layer2.0", stdin="c\n",
                                   monkeypatch=monkeypatch, capsys=capsys)
    assert status == 0, out + err
    assert "before node 'layer2.0.conv1' (the first node of layer2.0)" in out
    assert "gradients: 62 equal" in out  # --backward reaches run.py
    status, out, err = _debug_here(folder, "--break", "layer1.0.conv3", stdin="",
                                   monkeypatch=monkeypatch, capsys=capsys)
    assert status == 2 and "Traceback" not in err  # an error: trouble
    assert "no node or module with that key" in err and "'layer1.0.conv2'" in err
    status, out, err = _debug_here(cli_folder / "elsewhere", stdin="", monkeypatch=monkeypatch,
                                   capsys=capsys)
    assert status == 2 and "not a folder written by fxdebug dump" in err


def test_quitting_is_reported(cli_folder, monkeypatch, capsys):
    status, out, _ = _debug_here(cli_folder / "moved", "--break", "fc", stdin="q\n",
                                 monkeypatch=monkeypatch, capsys=capsys)
    assert status == 1
    assert "the pdb session ended before run.py finished" in out


# -- passes.Breakpoint ------------------------------------------------------------------------
def _resnet_with_breakpoint():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    gm = fxdebug.instrument(model, capture=[], passes=[fxdebug.passes.Breakpoint("layer1.0.conv2")])
    return model, gm, torch.randn(1, 3, 64, 64)


def test_breakpoint_pass_stops_before_the_node_with_its_inputs(monkeypatch, capsys):
    model, gm, x = _resnet_with_breakpoint()
    monkeypatch.delenv("PYTHONBREAKPOINT", raising=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO("p layer1_0_relu.shape\nn\np layer1_0_conv2.shape\nc\n"))
    with torch.no_grad():
        out_gm = gm(x)
    out = capsys.readouterr().out
    shape = _conv2_input_shape(x)
    assert (f"fxdebug: stopped before node 'layer1.0.conv2' (Conv2d); its inputs: layer1_0_relu "
            f"({'x'.join(map(str, shape))} float32)") in out
    assert re.search(r"> /fxdebug-generated/ResNet_[0-9a-f]{12}\.py\(\d+\)forward\(\)\n"
                     r"-> layer1_0_conv2 = getattr\(self.layer1, \"0\"\).conv2\(layer1_0_relu\)", out)
    assert f"(Pdb) {shape}" in out
    assert "(Pdb) torch.Size([1, 64, 16, 16])" in out.split("-> layer1_0_bn2")[1]  # after `n`
    with torch.no_grad():
        assert torch.equal(out_gm, model(x))


def test_quitting_pdb_at_a_breakpoint_passes_through_without_a_note(monkeypatch, capsys):
    _, gm, x = _resnet_with_breakpoint()
    monkeypatch.delenv("PYTHONBREAKPOINT", raising=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO("q\n"))
    with pytest.raises(bdb.BdbQuit) as quit_:
        with torch.no_grad():
            gm(x)
    assert not getattr(quit_.value, "__notes__", None)  # no "failed at node ... check the inputs"
    assert torch.is_grad_enabled()


@torch.fx.wrap
def _quit_debugger(x):
    raise bdb.BdbQuit  # what pdb raises from a node when the user types q


class _QuitsInNode(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        return _quit_debugger(self.lin(x))


class _UntraceableRoot(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _QuitsInNode()

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: the root runs eagerly, the part is traced
            x = x + 1
        return self.inner(x)


@pytest.mark.parametrize("make", [lambda: fxdebug.trace(_QuitsInNode()),
                                  lambda: fxdebug.instrument(_QuitsInNode(), grads=True),
                                  lambda: fxdebug.instrument(_UntraceableRoot())],
                         ids=["trace", "instrument", "partial"])
def test_bdbquit_raised_from_a_node_passes_through_without_the_inputs_note(make):
    module = make()
    with pytest.raises(bdb.BdbQuit) as quit_:
        module(torch.ones(1, 2))
    notes = getattr(quit_.value, "__notes__", [])
    assert not any("failed at node" in note or "Check that the model inputs" in note
                   for note in notes), notes
    with pytest.raises(RuntimeError) as failed:  # ground truth: a real failure gets the note
        fxdebug.trace(torch.nn.Linear(3, 2))(torch.ones(1, 2))
    assert any("failed at node" in note for note in getattr(failed.value, "__notes__", []))


def test_pythonbreakpoint_zero_disables_the_stop(monkeypatch, capsys):
    model, gm, x = _resnet_with_breakpoint()
    monkeypatch.setenv("PYTHONBREAKPOINT", "0")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))
    assert "(Pdb)" not in capsys.readouterr().out


def test_breakpoint_node_survives_dump_and_stops_in_module_py(tmp_path):
    torch.manual_seed(0)
    gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh()).eval(),
                            passes=[fxdebug.passes.Breakpoint("1")])
    folder = fxdebug.dump(gm, torch.randn(2, 3), folder=tmp_path / "seq")  # dump itself does not stop
    code = open(os.path.join(folder, "module.py")).read()
    assert "from fxdebug.runtime import stop as fxdebug_runtime_stop" in code
    result = python([os.path.join(folder, "run.py")], input="p _0.shape\nc\n", cwd=str(tmp_path),
                    env=ENV)
    assert result.returncode == 0, result.stderr
    assert f"> {os.path.join(folder, 'module.py')}(" in result.stdout
    assert "(Pdb) torch.Size([2, 4])" in result.stdout and "outputs: 1 equal" in result.stdout


def test_breakpoint_unknown_key():
    gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh()))
    with pytest.raises(fxdebug.SelectionError, match="no node or module has key '2'"):
        fxdebug.passes.Breakpoint("2")(gm)
    assert "breakpoint" in fxdebug.passes.BUILTIN_PASSES


# -- real filenames for generated code ----------------------------------------------------------
class AddMismatch(torch.nn.Module):
    def forward(self, x, y):
        z = x * 2
        return z + y


def test_generated_forward_has_a_stable_content_named_file():
    one, two = fxdebug.trace(AddMismatch()), fxdebug.trace(AddMismatch())
    name = type(one).forward.__code__.co_filename
    assert re.fullmatch(r"/fxdebug-generated/AddMismatch_[0-9a-f]{12}\.py", name)
    assert type(two).forward.__code__.co_filename == name, "same code, same file"
    assert "".join(linecache.getlines(name)) == one.code
    other = fxdebug.instrument(AddMismatch(), capture="all")
    assert type(other).forward.__code__.co_filename != name
    linecache.clearcache()  # even then the source comes back on the next call
    one(torch.ones(2), torch.ones(2))
    assert "".join(linecache.getlines(name)) == one.code


def test_tracebacks_keep_the_generated_frame_unlike_plain_fx(capsys):
    x, y = torch.ones(3), torch.ones(4)
    plain = torch.fx.symbolic_trace(AddMismatch())
    with pytest.raises(RuntimeError) as plain_error:
        plain(x, y)
    plain_files = [frame.filename for frame in traceback.extract_tb(plain_error.value.__traceback__)]
    assert not any("eval_with_key" in f for f in plain_files), "torch drops that frame"
    capsys.readouterr()

    gm = fxdebug.trace(AddMismatch())
    with pytest.raises(RuntimeError) as error:
        gm(x, y)
    frames = traceback.extract_tb(error.value.__traceback__)
    generated = [f for f in frames if f.filename == type(gm).forward.__code__.co_filename]
    assert generated and generated[-1].line.startswith("add = mul + y")
    assert any(str(note).startswith("fxdebug: failed at node 'add'") for note in error.value.__notes__)


def test_pdb_break_command_works_in_generated_code():
    gm = fxdebug.trace(torchvision.models.resnet18().eval())
    filename = type(gm).forward.__code__.co_filename
    lines = gm.code.splitlines()
    line = 1 + next(i for i, text in enumerate(lines) if text.strip().startswith("layer1_0_conv2 ="))
    commands = f"break {filename}:{line}\ncontinue\np layer1_0_relu.shape\ncontinue\n"
    output = io.StringIO()
    debugger = pdb.Pdb(stdin=io.StringIO(commands), stdout=output, readrc=False)
    debugger.use_rawinput = False
    with torch.no_grad():
        debugger.runcall(gm, torch.randn(1, 3, 64, 64))
    text = output.getvalue()
    assert re.search(rf"Breakpoint \d+ at {re.escape(filename)}:{line}\n", text)
    assert "-> layer1_0_conv2 = getattr(self.layer1, \"0\").conv2(layer1_0_relu)" in text
    assert "torch.Size([1, 64, 16, 16])" in text
