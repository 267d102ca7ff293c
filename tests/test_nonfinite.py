"""find_nonfinite: the first node making a NaN/Inf in the forward and the backward.

Ground truth comes from eager runs: forward hooks on the real modules,
``retain_grad()`` on the real activations, ``torch.autograd.grad``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxdebug
from faults import image, insert_after, one_thread, resnet  # noqa: F401 (fixtures)
from subprocesses import fxdebug_cli





def test_finite_model_is_ok(resnet, image):
    out = resnet(image)
    grads = torch.autograd.grad(out.sum(), list(resnet.parameters()))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    report = fxdebug.find_nonfinite(resnet, image)
    assert report.ok and report.forward is None and report.backward is None
    assert report.backward_ran and report.parameter_grads == []
    assert report.table().splitlines()[-1] == "verdict: all finite"


def test_nan_from_log_of_a_negative_is_found_where_it_is_made(resnet, image):
    gm = fxdebug.trace(resnet)
    log = insert_after(gm, "layer2.0.bn1", torch.log, keyed=True).meta["fxdebug_key"]
    # ground truth: bn1's output is finite but has negative values; the model output is NaN
    seen = {}
    handle = gm.get_submodule("layer2.0.bn1").register_forward_hook(
        lambda m, a, out: seen.update(bn1=out))
    with torch.no_grad():
        out = gm(image)
    handle.remove()
    assert torch.isfinite(seen["bn1"]).all() and (seen["bn1"] < 0).any()
    assert torch.isnan(out).any()

    report = fxdebug.find_nonfinite(gm, image, grads=False)
    hit = report.forward
    assert hit.key == log and hit.op == "torch.log" and hit.created
    assert hit.nan == int((seen["bn1"] < 0).sum()) and hit.inf == int((seen["bn1"] == 0).sum())
    assert [(v.name, v.stats.nonfinite) for v in hit.inputs] == [("layer2.0.bn1", 0)]
    assert hit.inputs[0].stats.min == pytest.approx(float(seen["bn1"].min()))
    # the later nodes it poisons are listed as later, never as the first
    assert log not in report.later_forward
    assert report.later_forward[:3] == ["layer2.0.relu", "layer2.0.conv2", "layer2.0.bn2"]
    assert report.later_forward[-1] == "fc"
    assert not report.backward_ran and "forward only" in report.table()


class Block(nn.Module):
    def __init__(self, log: bool):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.log = log

    def forward(self, x):
        h = self.fc(x)
        if self.log:
            h = torch.log(h)  # NaN wherever fc gives a negative value
        return torch.tanh(h)


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(False), Block(True), Block(False))

    def forward(self, x):
        return self.blocks(x)


def test_nan_inside_a_block_names_the_block_path_and_line():
    model = Blocks()
    x = torch.randn(4, 8)
    outputs = {}
    for name, block in model.blocks.named_children():
        block.register_forward_hook(lambda m, a, out, name=name: outputs.update({name: out}))
    model(x)
    assert torch.isfinite(outputs["0"]).all() and not torch.isfinite(outputs["1"]).all()
    report = fxdebug.find_nonfinite(model, x)
    assert report.forward.key == "blocks.1.log" and report.forward.created
    assert report.forward.location == "tests/test_nonfinite.py:%d" % (
        Block.forward.__code__.co_firstlineno + 3)
    assert report.later_forward == ["blocks.1.tanh", "blocks.2.fc", "blocks.2.tanh"]
    plain = torch.fx.symbolic_trace(model)  # no keys: found on a keyed copy, plain left alone
    assert fxdebug.find_nonfinite(plain, x).forward.key == "blocks.1.log"
    assert not any("fxdebug_key" in n.meta for n in plain.graph.nodes)
    traced = fxdebug.trace(model)  # keyed: used as it is, nothing changed
    code = traced.code
    assert fxdebug.find_nonfinite(traced, x).forward.key == "blocks.1.log"
    assert traced.code == code


def test_nan_in_a_weight_is_received_not_created(resnet, image):
    model = copy.deepcopy(resnet)
    with torch.no_grad():
        model.layer3[0].conv1.weight[0, 0, 0, 0] = float("nan")
    report = fxdebug.find_nonfinite(model, image)
    hit = report.forward
    assert hit.key == "layer3.0.conv1" and not hit.created
    assert all(v.finite for v in hit.inputs)
    bad = [(v.name, v.stats.nonfinite) for v in hit.parameters if not v.finite]
    assert bad == [("layer3.0.conv1.weight", 1)]
    assert "it RECEIVED them" in report.table()


def test_nan_made_by_an_in_place_op_is_created_there():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x):
            h = self.fc(x)
            h.log_()  # in place: what it received is gone once it ran
            return h * 2

    model = InPlace()
    x = torch.randn(5, 6)
    with torch.no_grad():
        received = model.fc(x)
    report = fxdebug.find_nonfinite(model, x, grads=False)
    hit = report.forward
    assert hit.key == "log_" and hit.created
    assert hit.nan == int((received < 0).sum())
    assert hit.inputs[0].name == "fc" and hit.inputs[0].stats.nonfinite == 0
    assert hit.inputs[0].stats.min == pytest.approx(float(received.min()))


def test_gradient_made_non_finite_is_found_in_backward(resnet, image):
    gm = fxdebug.trace(resnet)
    sqrt = insert_after(gm, "layer3.1.relu_1", torch.sqrt, keyed=True).meta["fxdebug_key"]  # sqrt'(0) = inf
    # ground truth by retain_grad on the real activations of the candidate
    acts = {}

    def keep(name):
        def hook(module, args, out):
            out.retain_grad()
            acts[name] = out
        return hook

    def keep_input(module, args):
        args[0].retain_grad()
        acts["sqrt"] = args[0]

    handles = [gm.get_submodule("layer3.1.relu").register_forward_hook(keep("relu")),  # twice
               gm.get_submodule("layer4.0.conv1").register_forward_pre_hook(keep_input)]
    out = gm(image)
    out.sum().backward()
    for handle in handles:
        handle.remove()
    resnet.zero_grad(set_to_none=True)
    assert torch.isfinite(out).all()
    assert not torch.isfinite(acts["relu"].grad).all()  # relu_1: the second call
    assert torch.isfinite(acts["sqrt"].grad).all()

    report = fxdebug.find_nonfinite(gm, image)
    assert report.forward is None
    grad = report.backward
    assert grad.key == "layer3.1.relu_1" and grad.op == "ReLU"
    assert grad.nonfinite == int((~torch.isfinite(acts["relu"].grad)).sum())
    assert grad.shape == "1x256x4x4" and grad.numel == 4096
    assert [key for key, _, _ in grad.made_by] == [sqrt]
    assert report.later_backward == []  # relu's backward zeroes the infinities again
    assert report.parameter_grads == []
    assert all(p.grad is None for p in resnet.parameters())  # .grad left alone


def test_non_finite_gradient_flows_to_earlier_nodes_and_parameters():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            h = self.b(torch.relu(self.a(x)))
            return torch.sqrt(h - h.detach())  # value 0, gradient inf everywhere

    model = Net()
    x = torch.randn(3, 4)
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    expected = [(n, int((~torch.isfinite(g)).sum()), g.numel()) for n, g in zip(names, grads)
                if not torch.isfinite(g).all()]
    report = fxdebug.find_nonfinite(model, x)
    assert report.forward is None
    assert report.backward.key == "sub" and [k for k, _, _ in report.backward.made_by] == ["sqrt"]
    assert report.later_backward == ["b", "relu", "a"]
    assert report.parameter_grads == expected and expected


def test_a_finite_tensor_whose_sum_overflows_is_not_reported():
    class Huge(nn.Module):
        def forward(self, x):
            big = x * 1e38  # finite, but its float32 sum overflows to inf
            return torch.log(big - 2e38)  # NaN where big < 2e38

    x = torch.tensor([3.0, 1.0, 3.0], requires_grad=True)
    with torch.no_grad():
        assert torch.isfinite(x * 1e38).all() and not torch.isfinite((x * 1e38).sum())
    report = fxdebug.find_nonfinite(Huge(), x)
    assert report.forward.key == "log" and (report.forward.nan, report.forward.inf) == (1, 0)
    assert report.later_forward == []
    assert fxdebug.find_nonfinite(Huge(), torch.tensor([3.0, 3.0])).ok

    class Scale(nn.Module):
        def forward(self, x):
            return (x * 1e38).sum(dtype=torch.float64)

    ones = torch.ones(4, requires_grad=True)  # its gradient, 1e38 each, sums to inf in float32
    grad, = torch.autograd.grad(Scale()(ones), ones)
    assert torch.isfinite(grad).all() and not torch.isfinite(grad.sum())
    assert fxdebug.find_nonfinite(Scale(), ones).ok


def test_values_of_several_dtypes_are_checked_each_in_their_own_dtype():
    """float64, float32, bfloat16 and complex values in one graph: the first node that makes a
    NaN is found among them, and the nodes before it (found finite by hand) are not."""
    class Mixed(nn.Module):
        def forward(self, x):
            wide = x.double() * 3.0
            narrow = wide.to(torch.bfloat16) + 1
            turned = torch.polar(narrow.float(), narrow.float())  # complex64
            return torch.log(turned.abs() - 2.5).sum()  # NaN where |narrow| < 2.5

    x = torch.tensor([0.1, 2.0, 3.0])
    eager = {"mul": x.double() * 3.0}
    eager["add"] = eager["mul"].to(torch.bfloat16) + 1
    assert [bool(torch.isfinite(v).all()) for v in eager.values()] == [True, True]
    report = fxdebug.find_nonfinite(Mixed(), x, grads=False)
    assert report.forward.key == "log" and report.forward.nan == 1, report.table()
    assert fxdebug.find_nonfinite(Mixed(), torch.tensor([2.0, 3.0]), grads=False).ok


def test_state_is_left_as_it_was():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.3)).train()
    x = torch.randn(6, 4)
    running = model[1].running_mean.clone()
    rng = torch.get_rng_state()
    report = fxdebug.find_nonfinite(model, x)
    assert report.ok and report.mode == "train"
    assert torch.equal(model[1].running_mean, running) and torch.equal(torch.get_rng_state(), rng)
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(not p._backward_hooks for p in model.parameters())


def test_ignore_allows_intended_infinities():
    class Masked(nn.Module):
        def forward(self, scores, mask):
            return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)

    scores = torch.randn(2, 5, requires_grad=True)
    mask = torch.tensor([[False, True, False, False, True]] * 2)
    assert fxdebug.find_nonfinite(Masked(), scores, mask).forward.key == "masked_fill"
    report = fxdebug.find_nonfinite(Masked(), scores, mask, ignore=["masked_fill"])
    assert report.ok and report.backward_ran


def test_no_inputs_is_an_error():
    with pytest.raises(fxdebug.FxdebugError, match="needs example inputs"):
        fxdebug.find_nonfinite(nn.ReLU())


NAN_MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.log(self.fc(x)).sum()


def build():
    return Net()
'''


def test_cli_nonfinite(tmp_path):
    (tmp_path / "nan_model.py").write_text(NAN_MODEL)
    result = fxdebug_cli("nonfinite", "nan_model.py:build", "--input", "4,16", cwd=str(tmp_path),
                         OMP_NUM_THREADS="1")
    assert result.returncode == 1, result.stderr
    assert "forward: first non-finite output at log (torch.log, nan_model.py:12)" in result.stdout
    assert "it CREATED them" in result.stdout
    fine = fxdebug_cli("nonfinite", "--input", "1,3,64,64", cwd=str(tmp_path), OMP_NUM_THREADS="1")
    assert fine.returncode == 0, fine.stderr
    assert fine.stdout.splitlines()[-1] == "verdict: all finite"
