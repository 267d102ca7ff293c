"""check_equivalence on a plain torch.fx fusion pass: Conv+BN folded by hand, keys not inherited.

The fused conv keeps the conv's module path (and so its key) but computes
what the batch norm computed. Ground truth: forward hooks on the unfused
model and on the candidate, and ``torch.allclose`` of the two outputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torchvision

import fxdebug
from hooks import hook_captures


def fold_conv_bn(model, sqrt=True, inherit=False):
    """A plain-fx Conv+BN fusion pass; ``sqrt=False`` is the bug of dividing by the variance."""
    gm = fx.symbolic_trace(copy.deepcopy(model))
    modules = dict(gm.named_modules())
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(modules[node.target], torch.nn.BatchNorm2d):
            continue
        conv_node = node.args[0]
        if conv_node.op != "call_module" or len(conv_node.users) > 1:
            continue
        conv, bn = modules[conv_node.target], modules[node.target]
        var = bn.running_var + bn.eps
        scale = bn.weight / (var.sqrt() if sqrt else var)
        bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        conv.weight = torch.nn.Parameter(conv.weight * scale[:, None, None, None])
        conv.bias = torch.nn.Parameter((bias - bn.running_mean) * scale + bn.bias)
        node.replace_all_uses_with(conv_node)
        if inherit:
            fxdebug.passes.inherit_key(conv_node, node)
        gm.graph.erase_node(node)
    gm.recompile()
    return gm


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    with torch.no_grad():  # batch norms that do something, so folding them matters
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-1, 1)
    return model, torch.randn(2, 3, 32, 32)


def _conv_keys(model):
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]


def test_a_correct_fusion_is_equivalent_and_names_no_divergence(resnet):
    model, x = resnet
    candidate = fold_conv_bn(model)
    with torch.no_grad():
        assert torch.allclose(candidate(x), model(x), rtol=1e-4, atol=1e-4)  # ground truth
    report = fxdebug.check_equivalence(model, candidate, x, localize=True)
    table = report.table()
    assert report.ok and "verdict: EQUIVALENT" in table
    assert report.first_divergence is None and report.divergences == []
    assert "first divergence" not in table and "first divergence" not in repr(report)
    # a fused conv is never compared with the unfused conv of its key ...
    assert not [row for row in report.nodes if row.key in _conv_keys(model)]
    # ... but with the batch norm whose value its users read
    bn1 = next(row for row in report.nodes if row.key == "bn1")
    assert (bn1.candidate_key, bn1.match) == ("conv1", "position")
    truth = (hook_captures(candidate, x)["conv1"] - hook_captures(model, x)["bn1"]).abs().max()
    assert bn1.max_abs == pytest.approx(truth.item(), rel=1e-6, abs=1e-12)
    assert "conv1 (compared as bn1)" in table and "fxdebug.passes.inherit_key" in table
    assert "no counterpart in the candidate: conv1" not in table


def test_a_fusion_missing_the_sqrt_is_named_after_the_batch_norm(resnet):
    model, x = resnet
    candidate = fold_conv_bn(model, sqrt=False)
    with torch.no_grad():
        assert not torch.allclose(candidate(x), model(x), rtol=1e-4, atol=1e-4)
    report = fxdebug.check_equivalence(model, candidate, x)
    first = report.first_divergence
    assert not report.ok
    assert (first.key, first.candidate_key, first.op) == ("bn1", "conv1", "BatchNorm2d")
    truth = (hook_captures(candidate, x)["conv1"] - hook_captures(model, x)["bn1"]).abs().max()
    assert first.max_abs == pytest.approx(truth.item(), rel=1e-6)
    assert "first divergence: bn1 (BatchNorm2d" in report.table()


def test_inherited_keys_are_trusted(resnet):
    model, x = resnet
    report = fxdebug.check_equivalence(model, fold_conv_bn(model, sqrt=False, inherit=True), x)
    first = report.first_divergence
    assert (first.key, first.candidate_key, first.match) == ("bn1", "bn1", "key")
    assert "inherit_key(new_node" not in report.table()  # the pass already uses it


def test_a_reweighted_module_is_compared_where_its_users_read_it(resnet):
    model, x = resnet
    candidate = fx.symbolic_trace(copy.deepcopy(model))
    with torch.no_grad():
        candidate.get_submodule("layer2.0.conv2").weight.mul_(1.01)  # a faulty re-weighting
    report = fxdebug.check_equivalence(model, candidate, x)
    first = report.first_divergence
    assert (first.key, first.candidate_key, first.match) == ("layer2.0.conv2", "layer2.0.conv2",
                                                             "position")
    truth = (hook_captures(candidate, x)["layer2.0.conv2"]
             - hook_captures(model, x)["layer2.0.conv2"]).abs().max()
    assert first.max_abs == pytest.approx(truth.item(), rel=1e-6)
