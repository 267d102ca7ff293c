"""fxdebug passes and torch's pass infrastructure (``torch.fx.passes.infra``) work together.

Ground truth is the eager model (outputs) and forward hooks (captures).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torchvision
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.fx.passes.infra.pass_manager import PassManager as TorchPassManager

import fxdebug
from fxdebug.passes import Capture


class DoubleOutput(PassBase):
    """A torch pass (not an fxdebug one): multiply the module's output by two."""

    def call(self, gm):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        value = output.args[0]
        with gm.graph.inserting_before(output):
            doubled = gm.graph.call_function(torch.mul, (value, 2))
        output.args = (doubled,)
        return PassResult(gm, True)


def _resnet():
    return torchvision.models.resnet18().eval()


def test_an_fxdebug_pass_runs_in_torch_pass_manager(hooks):
    model, x = _resnet(), torch.randn(1, 3, 64, 64)
    gm = fxdebug.trace(model)
    result = TorchPassManager([Capture("modules")])(gm)
    assert result.modified
    with torch.no_grad():
        out = result.graph_module(x)
        expected = hooks(model, x)
        assert torch.equal(out, model(x))
    records = fxdebug.records(result.graph_module)
    assert set(expected) <= set(records.keys())
    for key, value in expected.items():
        assert torch.equal(records[key], value), key


def test_fxdebug_pass_manager_runs_a_torch_pass_base():
    model, x = _resnet(), torch.randn(1, 3, 64, 64)
    result = fxdebug.PassManager([DoubleOutput(), Capture()]).run(model)
    gm, report = result.graph_module, result.report
    with torch.no_grad():
        assert torch.equal(gm(x), model(x) * 2)
    assert [(s.name, s.modified) for s in report.stages[1:]] == [("DoubleOutput", True),
                                                                  ("capture", True)]
    assert "layer1.0" in fxdebug.records(gm).keys()


@pytest.mark.parametrize("returns", ["PassResult", "gm", "None"])
def test_fxdebug_pass_manager_accepts_functions_returning(returns):
    model, x = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()), torch.randn(2, 3)

    def negate(gm):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(output):
            neg = gm.graph.call_function(torch.neg, (output.args[0],))
        output.args = (neg,)
        return {"PassResult": PassResult(gm, True), "gm": gm, "None": None}[returns]

    def unchanged(gm):
        return {"PassResult": PassResult(gm, False), "gm": gm, "None": None}[returns]

    with pytest.warns(UserWarning, match="pass 'unchanged' changed nothing in the graph"):
        result = fxdebug.PassManager([negate, unchanged]).run(model)
        gm, report = result.graph_module, result.report
    assert torch.equal(gm(x), -model(x))
    assert [(s.name, s.modified) for s in report.stages[1:]] == [("negate", True),
                                                                  ("unchanged", False)]


def test_pass_manager_recompiles_once_per_run_not_once_per_pass(monkeypatch):
    model = _resnet()
    calls = []
    recompile = fx.GraphModule.recompile

    def counting(self):
        calls.append(type(self).__name__)
        return recompile(self)

    passes = [Capture("modules"), DoubleOutput(), fxdebug.passes.GradHooks(), lambda gm: gm]
    traced = fxdebug.trace(model)  # tracing recompiles too: count from here
    monkeypatch.setattr(fx.GraphModule, "recompile", counting)
    with pytest.warns(UserWarning, match="pass '<lambda>' changed nothing in the graph"):
        result = fxdebug.PassManager(passes).run(traced)
        gm, report = result.graph_module, result.report
    assert sum(stage.modified for stage in report.stages) == 3
    # one for the copy of the input GraphModule, one after all the passes
    assert len(calls) == 2, calls
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(gm(x), model(x) * 2)
