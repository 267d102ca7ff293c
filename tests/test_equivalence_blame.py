"""Blame on the right node: a pass that rewires arguments is named at the node it rewired.

The story: a Linear+ReLU fusion pass hands the users of both pattern nodes to
the fused node, so the skip connection ``fc2 + fc1`` reads ``relu(fc1)``. The
fused module is right; ``add``'s arguments are wrong. Ground truth: forward
hooks and eager outputs of the reference and the candidate, and the candidate's
graph itself (what ``add`` reads).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxdebug
from hooks import hook_captures


class Skip(nn.Module):
    """fc1 -> relu -> fc2, with a skip connection from before the relu: fc2 + fc1."""

    def __init__(self):
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(self.relu(h)) + h


class LinearReLU(nn.Module):
    """The fused module; ``offset`` is a bug in it (0: right)."""

    def __init__(self, linear, offset=0.0):
        super().__init__()
        self.linear, self.offset = linear, offset

    def forward(self, x):
        return torch.relu(self.linear(x)) + self.offset


def fuse_linear_relu(gm, rewire_skip=True, offset=0.0):
    """Fuse every Linear -> ReLU pair into one LinearReLU module.

    ``rewire_skip=True`` is the bug: every node of the pattern hands all its
    users to the fused node, so a skip connection that read the Linear's
    output now reads the fused (relu'd) one.
    """
    for relu in [n for n in gm.graph.nodes if n.op == "call_module"
                 and isinstance(gm.get_submodule(n.target), nn.ReLU)]:
        linear = relu.args[0]
        name = f"{linear.target}_relu"
        gm.add_submodule(name, LinearReLU(gm.get_submodule(linear.target), offset))
        with gm.graph.inserting_after(linear):
            fused = gm.graph.call_module(name, linear.args)
        relu.replace_all_uses_with(fused)
        gm.graph.erase_node(relu)
        if rewire_skip:
            linear.replace_all_uses_with(fused)
            gm.graph.erase_node(linear)
    gm.graph.lint()
    gm.recompile()
    return gm


@pytest.fixture
def story():
    torch.manual_seed(0)
    return Skip().eval(), torch.randn(4, 8)


def _reads(gm, key):
    node = next(n for n in gm.graph.nodes if n.meta.get("fxdebug_key", n.name) == key)
    return tuple(arg.name for arg in node.args)


def test_a_rewired_skip_connection_is_blamed_on_the_node_whose_arguments_changed(story):
    model, x = story
    candidate = fuse_linear_relu(fx.symbolic_trace(copy.deepcopy(model)))
    # ground truth: the fused module computes exactly what relu computed ...
    ref_hooks, cand_hooks = hook_captures(model, x), hook_captures(candidate, x)
    assert torch.equal(cand_hooks["fc1_relu"], ref_hooks["relu"])
    assert not torch.allclose(cand_hooks["fc1_relu"], ref_hooks["fc1"])
    # ... and the skip connection reads it where the model reads fc1
    assert _reads(candidate, "add") == ("fc2", "fc1_relu")
    with torch.no_grad():
        wrong = (candidate(x) - model(x)).abs().max().item()
    assert wrong > 0.1

    report = fxdebug.check_equivalence(model, candidate, x)
    first, table = report.first_divergence, report.table()
    assert not report.ok
    assert (first.key, first.candidate_key, first.match) == ("add", "add", "key")
    assert first.arguments == "(fc2, fc1) -> (fc2, fc1_relu)"
    assert first.max_abs == pytest.approx(wrong, rel=1e-6)  # add is the output
    assert ("first divergence: add (operator.add, " in table
            and "its arguments changed (fc2, fc1) -> (fc2, fc1_relu)" in table)
    assert "it reads 'fc1_relu' (the candidate's counterpart of 'relu') where the reference " \
           "reads 'fc1'" in first.describe()
    assert "first divergence add (operator.add): its arguments changed (fc2, fc1) -> " \
           "(fc2, fc1_relu)" in repr(report)
    # the fused node is not called divergent: it is compared as relu, and agrees
    assert [row.key for row in report.divergences] == ["add"]
    relu = next(row for row in report.nodes if row.key == "relu")
    assert (relu.candidate_key, relu.ok, relu.max_abs) == ("fc1_relu", True, 0.0)
    assert not [row for row in report.nodes if row.key == "fc1"]
    assert report.unmatched_reference == ["fc1"]
    assert "'fc1_relu' reads what 'fc1' reads but computes the value of 'relu'" in table


def test_pass_manager_blames_the_same_node(story):
    model, x = story
    pm = fxdebug.PassManager([fuse_linear_relu], check_inputs=(x,))
    with pytest.raises(fxdebug.errors.PassEquivalenceError) as caught:
        pm.run(model)
    message = str(caught.value)
    assert ("first divergent node: add (operator.add, " in message
            and "its arguments changed (fc2, fc1) -> (fc2, fc1_relu)" in message)
    assert "candidate node 'fc1_relu'" not in message
    report = caught.value.report
    verdict = report.stages[-1].equivalence
    assert (report.stages[-1].name, verdict.first_divergence.key) == ("fuse_linear_relu", "add")
    assert ("pass 'fuse_linear_relu' changed the outputs; first divergence add: its arguments "
            "changed (fc2, fc1) -> (fc2, fc1_relu)") in repr(report)
    # the pass diff shows the same change
    changed = {row.key: row.changes for row in report.stages[-1].diff.changed}
    assert changed["add"] == ("args (fc2, fc1) -> (fc2, fc1_relu)",)


def test_a_right_fusion_is_equivalent(story):
    model, x = story
    candidate = fuse_linear_relu(fx.symbolic_trace(copy.deepcopy(model)), rewire_skip=False)
    assert _reads(candidate, "add") == ("fc2", "fc1")
    report = fxdebug.check_equivalence(model, candidate, x, localize=True)
    assert report.ok and report.divergences == [] and report.first_divergence is None
    assert not [row for row in report.nodes if row.arguments]


@pytest.mark.parametrize("rewire_skip", [False, True], ids=["right-wiring", "rewired-skip"])
def test_a_wrong_fused_module_is_blamed_on_the_fused_node(story, rewire_skip):
    model, x = story
    candidate = fuse_linear_relu(fx.symbolic_trace(copy.deepcopy(model)),
                                 rewire_skip=rewire_skip, offset=0.5)
    ref_hooks, cand_hooks = hook_captures(model, x), hook_captures(candidate, x)
    report = fxdebug.check_equivalence(model, candidate, x)
    first = report.first_divergence
    assert not report.ok and first.candidate_key == "fc1_relu" and first.arguments == ""
    # with the skip from fc1 kept, the fused node is where relu was; with the skip rewired
    # its value is neither fc1's nor relu's, and it is compared as fc1 (same inputs)
    expected = "fc1" if rewire_skip else "relu"
    assert (first.key, first.match) == (expected, "inputs" if rewire_skip else "position")
    truth = (cand_hooks["fc1_relu"] - ref_hooks[expected]).abs().max().item()
    assert first.max_abs == pytest.approx(truth, rel=1e-6)
    assert "arguments changed" not in first.describe()


@pytest.mark.parametrize("change", ["skip-from-relu", "swapped"])
def test_arguments_rewired_between_kept_nodes(story, change):
    model, x = story
    candidate = fxdebug.trace(model)
    add = next(n for n in candidate.graph.nodes if n.meta["fxdebug_key"] == "add")
    fc2, fc1 = add.args
    relu = fc2.args[0]
    add.args = (fc2, relu) if change == "skip-from-relu" else (fc1, fc2)
    candidate.recompile()
    report = fxdebug.check_equivalence(model, candidate, x, atol=0, rtol=0)
    first = report.first_divergence
    if change == "swapped":  # fc1 + fc2 == fc2 + fc1 exactly: nothing to blame
        assert report.ok and first is None
        assert fxdebug.check_equivalence(model, candidate, x, localize=True).nodes[-1].arguments \
            == "(fc2, fc1) -> (fc1, fc2)"
        return
    with torch.no_grad():
        truth = (candidate(x) - model(x)).abs().max().item()
    assert (first.key, first.arguments) == ("add", "(fc2, fc1) -> (fc2, relu)")
    assert first.max_abs == pytest.approx(truth, rel=1e-6)
    assert [row.key for row in report.divergences] == ["add"]
    assert "it reads 'relu' where the reference reads 'fc1'" in first.describe()
