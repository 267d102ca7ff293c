"""Tracing keeps ``x += y`` in place only where that matters (issue 11, item 8).

Ground truth is eager: outputs and gradients bitwise, and, for a plain-fx pass,
the eager model with the pass's substitution made by hand.
"""

from __future__ import annotations

import copy
import operator
import textwrap
import types
import warnings

import pytest
import torch
import torchvision
from torch import nn

import fxdebug
from subprocesses import outputs_under_hash_seeds

LOWERED = "fxdebug_lowered_from"


def _targets(gm, key_part="iadd"):
    """``{key: (target, lowered_from)}`` for the nodes a ``+=`` made."""
    return {n.meta["fxdebug_key"]: (n.target, n.meta.get(LOWERED)) for n in gm.graph.nodes
            if n.op == "call_function" and key_part in n.meta["fxdebug_key"]}


def add_to_sub(gm):
    """A pass written against torch.fx.symbolic_trace: it only knows operator.add."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.add:
            node.target = torch.sub
    gm.recompile()
    return gm


def _basic_block_with_sub(self, x):
    """torchvision's BasicBlock.forward with `out += identity` written `torch.sub` by hand."""
    identity = x
    out = self.relu(self.bn1(self.conv1(x)))
    out = self.bn2(self.conv2(out))
    if self.downsample is not None:
        identity = self.downsample(x)
    out = torch.sub(out, identity)
    return self.relu(out)


def test_plain_fx_pass_rewrites_resnet18_residual_adds_as_eager_by_hand():
    torch.manual_seed(0)
    model, x = torchvision.models.resnet18().eval(), torch.randn(2, 3, 64, 64)
    gm = fxdebug.trace(model)
    residuals = _targets(gm)
    assert len(residuals) == 8
    assert set(residuals.values()) == {(operator.add, "operator.iadd")}, residuals
    assert "layer1.0.iadd" in residuals  # keys (and node names) stay as they were
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the pass changes something: no "changed nothing"
        gm = fxdebug.PassManager([add_to_sub]).run(gm).graph_module
    assert [n.meta["fxdebug_key"] for n in gm.graph.nodes if n.target is torch.sub] == list(residuals)
    by_hand = copy.deepcopy(model)
    for block in by_hand.modules():
        if isinstance(block, torchvision.models.resnet.BasicBlock):
            block.forward = types.MethodType(_basic_block_with_sub, block)
    with torch.no_grad():
        assert torch.equal(gm(x), by_hand(x))
        assert not torch.equal(gm(x), model(x))  # the pass did change the numbers


class Lowerable(nn.Module):
    """Every ``+=``/``-=``/``*=``/``/=`` here writes a tensor nothing else reads."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1)
        self.down = nn.Conv2d(3, 6, 1, stride=2)
        self.conv3 = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.bn, self.bn_down = nn.BatchNorm2d(6), nn.BatchNorm2d(6)
        self.lin = nn.Linear(6, 5)

    def forward(self, x):
        a = self.conv1(x)
        a += self.conv2(x)           # same dtype and shape (stride 1, padding 1)
        b = self.bn(self.conv3(a))
        b -= self.bn_down(self.down(a))  # both halve the spatial size the same way and are
        #                                  batch-normed (float32 under MPS autocast, conv: half)
        c = b * 2.0
        c *= 3                       # a Python number into a floating tensor
        d = self.lin(c.mean((2, 3)))
        d /= 2.5
        return d


@pytest.mark.parametrize("train", [False, True])
def test_lowered_graph_equals_eager_bitwise_with_gradients(train):
    torch.manual_seed(0)
    model = Lowerable().train(train)
    reference = copy.deepcopy(model)
    gm = fxdebug.trace(model)
    assert _targets(gm, "i") == {"iadd": (operator.add, "operator.iadd"),
                                 "isub": (operator.sub, "operator.isub"),
                                 "imul": (operator.mul, "operator.imul"),
                                 "itruediv": (operator.truediv, "operator.itruediv")}
    for _ in range(2):
        x = torch.randn(2, 3, 8, 8, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        out, ref = gm(x), reference(x_ref)
        assert torch.equal(out, ref)
        out.square().sum().backward()
        ref.square().sum().backward()
        assert torch.equal(x.grad, x_ref.grad)
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            assert torch.equal(p.grad, q.grad), name
    assert torch.equal(model.bn.running_mean, reference.bn.running_mean)


def test_resnet18_lowered_equals_eager_bitwise_in_training():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 64, 64)
    gm = fxdebug.trace(model)
    out, ref = gm(x), reference(x)
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_mobilenet_v3_residuals_lower_through_squeeze_excitation_and_equal_eager():
    """`result += input` after a squeeze-excitation block (a broadcast multiply) lowers too."""
    model = torchvision.models.mobilenet_v3_small(num_classes=10).train()
    reference = copy.deepcopy(model)
    gm = fxdebug.trace(model)
    residuals = _targets(gm)
    assert len(residuals) == 6 and set(residuals.values()) == {(operator.add, "operator.iadd")}
    x = torch.randn(2, 3, 64, 64)
    torch.manual_seed(1)  # the classifier's dropout draws the same mask for both
    out = gm(x)
    torch.manual_seed(1)
    ref = reference(x)
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), name


# -- writes that stay in place ---------------------------------------------------------------
class ReluOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.relu(self.lin(x))
        y += 1                       # ReluBackward saved y
        return y


class InputWrite(nn.Module):
    def forward(self, x):
        x += 1                       # the caller's tensor
        return x * 2


class BufferWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        total = self.total
        total += x.sum(0)            # the module's buffer
        return x + total


class ViewWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        head = y[:, :2]
        head += 100                  # writes y through a view
        return y


class MixedDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.low = nn.Linear(4, 4).to(torch.bfloat16)
        self.full = nn.Linear(4, 4)

    def forward(self, x):
        a = self.low(x.to(torch.bfloat16))
        a += self.full(x)            # stays bfloat16 in place; a + b would be float32
        return a


class ReadAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        kept = y
        y += 1
        return kept * 3              # the same tensor: it sees the write


class ReadBefore(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        total = y.sum()
        y += 1
        return y, total


class InsideAutocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y += self.b(x)           # y float32, b(x) bfloat16
        return y


class Leaf(nn.Module):
    def forward(self, x):
        return x * 2


class LeafOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.leaf = Leaf()

    def forward(self, x):
        y = self.leaf(x)             # code fx does not see (a leaf): may return its input
        y += 1
        return y


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []
        self.lin.register_forward_hook(lambda m, i, o: self.seen.append(o))

    def forward(self, x):
        y = self.lin(x)              # a hook kept a reference: it sees the write
        y += 1
        return y


STAYS = {
    "relu_output": (ReluOutput, {}),
    "input": (InputWrite, {}),
    "buffer": (BufferWrite, {}),
    "view": (ViewWrite, {}),
    "mixed_dtypes": (MixedDtypes, {}),
    "read_after": (ReadAfter, {}),
    "read_before": (ReadBefore, {}),
    "autocast": (InsideAutocast, {}),
    "leaf_output": (LeafOutput, {"leaf_modules": [Leaf]}),
    "hooked": (Hooked, {}),
}


@pytest.mark.parametrize("case", list(STAYS))
def test_writes_that_matter_stay_in_place_and_equal_eager(case):
    cls, trace_kwargs = STAYS[case]
    torch.manual_seed(0)
    model, reference = cls(), cls()
    reference.load_state_dict(model.state_dict())
    gm = fxdebug.trace(model, **trace_kwargs)
    assert not any(LOWERED in n.meta for n in gm.graph.nodes)
    assert any(n.target in (operator.iadd, "add_") for n in gm.graph.nodes)  # fx: buffer.add_
    x = torch.randn(3, 4)
    with torch.no_grad():
        out, ref = gm(x.clone()), reference(x.clone())
    for a, b in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(ref)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for (name, mine), (_, theirs) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(mine, theirs), name
    if case == "hooked":
        assert torch.equal(model.seen[-1], reference.seen[-1])


class LinearPlusNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x):
        y = self.lin(x)
        y += self.norm(x)            # float32 + float32, but under autocast bfloat16 + float32
        return y


def test_under_the_callers_autocast_lowered_and_kept_writes_equal_eager():
    torch.manual_seed(0)
    for model, x in ((torchvision.models.resnet18(num_classes=10).eval(), torch.randn(1, 3, 64, 64)),
                     (LinearPlusNorm(), torch.randn(3, 4))):
        gm = fxdebug.trace(model)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out, ref = gm(x), model(x)
        assert out.dtype == ref.dtype and torch.equal(out, ref)
    assert set(_targets(gm).values()) == {(operator.iadd, None)}  # LinearPlusNorm stays
    assert ref.dtype == torch.bfloat16


def test_relu_output_write_still_fails_backward_as_in_eager():
    model = ReluOutput()
    gm = fxdebug.trace(model)
    for module in (model, gm):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            module(torch.randn(2, 4)).sum().backward()


def test_a_backward_hook_makes_the_output_a_view_the_write_fails_as_in_eager():
    model = ReadBefore()  # any Linear output written in place
    model.lin.register_full_backward_hook(lambda module, grad_in, grad_out: None)

    class Written(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = model.lin

        def forward(self, x):
            y = self.lin(x)
            y += 1
            return y

    gm = fxdebug.trace(Written())
    assert set(_targets(gm).values()) == {(operator.iadd, None)}
    x = torch.randn(2, 4, requires_grad=True)
    for module in (Written(), gm):
        with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
            module(x)


def test_a_broadcast_that_would_grow_the_tensor_stays_in_place_and_fails_as_eager():
    class Grows(nn.Module):
        def __init__(self):
            super().__init__()
            self.narrow, self.wide = nn.Linear(4, 1), nn.Linear(4, 4)

        def forward(self, x):
            y = self.narrow(x)
            y += self.wide(x)        # 3x1 += 3x4: an error in place, 3x4 out of place
            return y

    model = Grows()
    gm = fxdebug.trace(model)
    assert set(_targets(gm).values()) == {(operator.iadd, None)}
    for module in (model, gm):
        with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
            module(torch.randn(3, 4))


def test_parts_of_partial_instrumentation_are_lowered_too():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            y = self.a(x)
            y += self.b(x)
            return y

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Residual()

        def forward(self, x):
            if x.sum() > 0:          # a branch on values: the root runs eagerly
                x = -x
            return self.block(x)

    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inst = fxdebug.instrument(model)
        out = inst(x)
    assert torch.equal(out, model(x))
    part = fxdebug.traced_parts(inst)["block"]
    assert set(_targets(part).values()) == {(operator.add, "operator.iadd")}
    assert torch.equal(fxdebug.records(inst)["block"], model.block(-x if x.sum() > 0 else x))


SCRIPT = textwrap.dedent("""
    import sys, torch, torchvision, fxdebug
    from test_inplace_lowering import Lowerable, ViewWrite
    for model in (torchvision.models.resnet18(), Lowerable(), ViewWrite()):
        gm = fxdebug.trace(model)
        print(gm.code)
        print([(n.name, n.meta.get("fxdebug_lowered_from")) for n in gm.graph.nodes])
""")


def test_lowering_is_the_same_under_every_hash_seed():
    outputs = outputs_under_hash_seeds(SCRIPT)
    assert outputs[0] == outputs[1] == outputs[2]
    assert "iadd = layer1_0_bn2 + maxpool" in outputs[0]  # name kept, computed out of place
    assert "('iadd', 'operator.iadd')" in outputs[0] and "getitem += 100" in outputs[0]
