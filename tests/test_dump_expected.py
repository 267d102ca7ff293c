"""dump's expected results come from a light copy of the model: the user's model stays bit for bit.

The copy shares the parameters' storage (copying every weight cost as much as
the rest of the dump), so a model that writes into a parameter must be caught
before the write; the outputs and gradients must be those of a full deep copy.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import fxdebug
from fxdebug.dumping import expected as expected_module
from fxdebug.dumping.expected import light_copy
from subprocesses import run_python


class ClipsItsWeight(nn.Module):
    """Weight clipping inside forward (as WGAN critics do): a graph op writes into a parameter."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        self.lin.weight.data.clamp_(-0.1, 0.1)
        return self.drop(self.bn(self.lin(x))).relu()


class Plain(nn.Module):
    """Train mode: batch norm writes its running statistics, dropout draws from the RNG."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.drop(self.bn(self.conv(x)).relu()).mean((2, 3)))


def _bits(module: nn.Module) -> dict:
    """Every parameter and buffer as raw bytes, its dtype, grad and training flags."""
    state = {name: (t.dtype, t.detach().clone().contiguous().view(-1).view(torch.uint8))
             for name, t in module.state_dict(keep_vars=True).items()}
    flags = {name: m.training for name, m in module.named_modules()}
    grads = {name: p.grad for name, p in module.named_parameters()}
    return {"state": state, "flags": flags, "grads": grads}


def _same_bits(before: dict, after: dict) -> bool:
    return (before["flags"] == after["flags"] and before["grads"] == after["grads"]
            and before["state"].keys() == after["state"].keys()
            and all(before["state"][k][0] == after["state"][k][0]
                    and torch.equal(before["state"][k][1], after["state"][k][1]) for k in before["state"]))


def _reference(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Outputs and gradients of a deep copy, seed 0: what expected.pt must hold."""
    twin = copy.deepcopy(model)
    torch.manual_seed(0)
    out = twin(x.clone())
    out.sum().backward()
    return out.detach(), {name: p.grad for name, p in twin.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("weights", ["shared and guarded", "copied"])
@pytest.mark.parametrize("model_cls", [Plain, ClipsItsWeight])
def test_dump_leaves_the_model_unchanged_and_records_a_deep_copys_results(tmp_path, model_cls,
                                                                          weights, monkeypatch):
    # Small weights are copied for the run; large ones shared, every op checked for writes.
    monkeypatch.setattr(expected_module, "COPIED_WEIGHT_BYTES", 0 if weights == "shared and guarded"
                        else expected_module.COPIED_WEIGHT_BYTES)
    torch.manual_seed(1)
    model = model_cls().train()
    gm = fxdebug.trace(model)
    x = torch.randn(3, 3, 6, 6) if model_cls is Plain else torch.randn(5, 4)
    assert light_copy(gm) is not None  # the light copy is what runs first
    before = _bits(model)
    want, want_grads = _reference(model, x)
    assert _same_bits(before, _bits(model))
    folder = fxdebug.dump(gm, x, folder=tmp_path / "dumped")
    assert _same_bits(before, _bits(model)), "dump changed the user's model"
    expected = torch.load(os.path.join(folder, "expected.pt"), weights_only=True)
    assert torch.equal(expected["outputs"]["output"], want)
    assert sorted(expected["grads"]) == sorted(want_grads)
    assert all(torch.equal(expected["grads"][k], want_grads[k]) for k in want_grads)
    if model_cls is ClipsItsWeight:  # the folder reproduces them, clipping its own weights
        other = 2 if torch.get_num_threads() == 1 else 1  # run.py sets the dump's thread count
        done = run_python(f"import runpy, sys, torch; torch.set_num_threads({other}); "
                          "sys.argv = ['run.py', '--backward']; "
                          "runpy.run_path('run.py', run_name='__main__')", cwd=folder)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "outputs: 1 equal" in done.stdout


def test_dump_leaves_an_instrumented_models_records_alone(tmp_path):
    gm = fxdebug.instrument(Plain().eval())
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        gm(x)
    records = fxdebug.records(gm)
    kept = {key: records[key].clone() for key in records.keys()}
    fxdebug.dump(gm, x, folder=tmp_path / "dumped")
    assert fxdebug.records(gm) is records
    assert list(records.keys()) == list(kept)
    assert all(torch.equal(records[key], kept[key]) for key in kept)


def test_identical_modules_are_each_checked_against_their_constructor(tmp_path):
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])
    model[2].note = "extra attribute"  # Linear(3, 3) no longer rebuilds this one
    folder = fxdebug.dump(fxdebug.trace(model), torch.randn(2, 3), folder=tmp_path / "dumped",
                          allow_pickled_modules=True)
    readme = open(os.path.join(folder, "README.md")).read()
    assert "* `2` (Linear)" in readme and "`0`" not in readme and "`3`" not in readme
    code = open(os.path.join(folder, "module.py")).read()
    assert code.count(", torch.nn.Linear(in_features=3, out_features=3, bias=True))") == 3
