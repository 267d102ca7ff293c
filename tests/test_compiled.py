"""check_compiled and fxdebug.backend: compiled models against eager, forward hooks and by-hand errors.

Most tests use cheap backends ("eager", "aot_eager", a user's function); one
test compiles with inductor (the system C++ compiler). CUDA variants skip
without a GPU.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import fxdebug
from fxdebug.cli import main as cli_main

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


def relu_to_sigmoid(gm, example_inputs):
    """A faulty user backend: every torch.relu becomes torch.sigmoid."""
    for node in gm.graph.nodes:
        if node.target is torch.relu:
            node.target = torch.sigmoid
    gm.recompile()
    return gm.forward


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.norm = torch.nn.LayerNorm(6)

    def forward(self, x):
        h = self.norm(self.fc(x))
        return torch.relu(h) * 2.0  # RELU_LINE


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 6)
        self.block = Block()
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.out(self.block(torch.tanh(self.inp(x))))


def _line(marker: str) -> int:
    with open(__file__) as handle:
        return next(i for i, line in enumerate(handle, 1) if line.rstrip().endswith(marker)
                    and "def _line" not in line and "marker" not in line)


def _net(device):
    torch.manual_seed(0)
    return Net().to(device).eval(), torch.randn(5, 4, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_user_backend_breaking_one_op_is_localized(device, hooks, tmp_path, capsys):
    model, x = _net(device)
    report = fxdebug.check_compiled(model, x, backend=relu_to_sigmoid)
    assert not report.ok
    first = report.first_divergence
    assert (first.key, first.op, first.graph) == ("block.relu", "torch.relu", 0)
    assert first.source == (os.path.abspath(__file__), _line("# RELU_LINE"))
    assert first.piece == ("block.relu",)  # the smallest divergent subgraph: the op alone
    # ground truth by hand: the error of sigmoid for relu on the value forward hooks see
    h = hooks(model, x)["block.norm"].double()
    expected = (torch.sigmoid(h) - torch.relu(h)).abs().max().item()
    assert first.max_abs == pytest.approx(expected, rel=1e-5)
    assert "first divergence: block.relu (torch.relu" in report.table()

    folder = report.dump(str(tmp_path / "repro"))
    assert "# [block.relu]" in open(os.path.join(folder, "module.py")).read()
    # run.py on its own (in this process: examples/compiled_divergence.py runs it in a fresh one)
    spec = importlib.util.spec_from_file_location("repro_run", os.path.join(folder, "run.py"))
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    capsys.readouterr()
    assert run.main([]) == 0  # the miscompile reproduces: what the folder is for
    out = capsys.readouterr().out
    assert "output/0: DIFFERENT" in out and "REPRODUCED: this run differs from what backend" in out
    assert "FAILED" not in out


def test_correct_backend_is_equivalent_and_has_nothing_to_dump(tmp_path):
    model, x = _net("cpu")
    report = fxdebug.check_compiled(model, x, backend="aot_eager", grads=True)
    assert report.ok and report.first_divergence is None, report.table()
    assert len(report.grads) == len(list(model.parameters()))
    with pytest.raises(fxdebug.FxdebugError, match="nothing to dump"):
        report.dump(str(tmp_path / "none"))
    with pytest.raises(fxdebug.FxdebugError, match="inductor backend only"):
        fxdebug.check_compiled(model, x, backend=relu_to_sigmoid, mode="max-autotune")


class Printing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x):
        x = self.a(x)
        print("halfway")  # PRINT_LINE
        return self.b(torch.relu(x))


def test_graph_break_is_listed_with_the_user_line_and_later_graph_localized(capsys):
    model, x = Printing().eval(), torch.randn(3, 4)
    report = fxdebug.check_compiled(model, x, backend="eager")
    assert report.ok and report.graphs == 2
    (brk,) = report.graph_breaks
    assert brk.source == (os.path.abspath(__file__), _line("# PRINT_LINE"))
    assert "print" in brk.reason
    # the faulty op lies in the second graph (after the break): found there, keyed, with its line
    broken = fxdebug.check_compiled(model, x, backend=relu_to_sigmoid)
    assert (broken.first_divergence.key, broken.first_divergence.graph) == ("relu", 1)
    assert broken.first_divergence.source[1] == _line("# PRINT_LINE") + 1


class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(3)
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.bn(self.conv(x))) + x


class Reused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Conv()
        self.other = Conv()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x):
        x = self.block(x)
        print("graph break")
        x = self.other(self.block(x))
        return self.fc(x.mean((2, 3)))


@pytest.mark.parametrize("device", DEVICES)
def test_backend_records_equal_forward_hooks(device, hooks):
    torch.manual_seed(0)
    model, x = Reused().to(device).eval(), torch.randn(2, 3, 8, 8, device=device)
    expected = hooks(model, x)
    be = fxdebug.backend(inner="aot_eager")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=be)
        with torch.no_grad():
            compiled(x)
            compiled(x)  # a second forward replaces the first run's records
    finally:
        torch._dynamo.reset()
    rec = fxdebug.records(be)
    assert rec.keys() == list(expected)  # b.conv ... block_1 (second call) ... fc
    for key, value in expected.items():
        assert torch.equal(rec[key], value), key
    assert len(be.graphs) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_inductor_judges_small_cnn_and_tiny_transformer_equivalent(device):
    torch.manual_seed(0)
    cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                              torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(4, 2)).to(device).eval()
    report = fxdebug.check_compiled(cnn, torch.randn(1, 3, 8, 8, device=device))
    assert report.ok and report.graph_breaks == [], report.table()
    # train mode with dropout 0: no fused fast path, inductor generates its own kernels
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                             batch_first=True).to(device).train()
    report = fxdebug.check_compiled(layer, torch.randn(2, 5, 16, device=device))
    assert report.ok and report.first_divergence is None, report.table()
    assert report.outputs[0].max_abs < 1e-5


def test_cli_check_compiled(capsys, tmp_path):
    spec = f"{__file__}:Printing"
    assert cli_main(["check", spec, "--input", "3,4", "--compiled", "--backend", "eager"]) == 0
    out = capsys.readouterr().out
    assert "verdict: EQUIVALENT" in out and f"test_compiled.py:{_line('# PRINT_LINE')}" in out
    code = cli_main(["check", f"{__file__}:Net", "--input", "5,4", "--compiled", "--backend",
                     f"{__file__}:relu_to_sigmoid", "--dump", str(tmp_path / "repro")])
    out = capsys.readouterr().out
    assert code == 1 and "first divergence: block.relu (torch.relu" in out
    assert os.path.isfile(tmp_path / "repro" / "run.py")


class ComplexOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 6)

    def forward(self, x):
        return torch.view_as_complex(self.fc(x).view(-1, 3, 2))


def test_gradients_of_a_complex_output_are_compared():
    """grads=True differentiates the loss check_equivalence uses: a complex output's real part."""
    torch.manual_seed(0)
    model, x = ComplexOut(), torch.randn(5, 4)
    report = fxdebug.check_compiled(model, x, backend="aot_eager", grads=True)
    assert report.ok and len(report.grads) == len(list(model.parameters())), report.table()
