"""Functionalize: after it, backward runs, and outputs and gradients equal a hand-fixed model.

Ground truth: eager PyTorch (the original model's forward values, its backward
error) and hand-fixed twins in ``inplace_models`` written out of place.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision

import fxdebug
from fxdebug.passes import Functionalize
from inplace_models import (DataZeroed, DetachZeroed, EmbeddingMaxNorm, FixedEmbeddingMaxNorm,
                            FixedHarmlessInplaceRelu, FixedMatmulThenSetitem,
                            FixedReluThenInplaceAdd, FixedSigmoidZeroed, HarmlessInplaceRelu,
                            MatmulThenSetitem, ReluThenInplaceAdd, SigmoidZeroed, hazard_line)
from models import ViewAugAssign

# model, hand-fixed twin, inputs, key of the rewritten node, whether eager backward fails
CASES = {
    "sigmoid_zeroed": (SigmoidZeroed, FixedSigmoidZeroed, lambda: (torch.randn(3, 4),),
                       "masked_fill_", True),
    "setitem_after_matmul": (MatmulThenSetitem, FixedMatmulThenSetitem,
                             lambda: (torch.tensor([1.0, 2.0]),), "setitem", True),
    "embedding_max_norm": (EmbeddingMaxNorm, FixedEmbeddingMaxNorm,
                           lambda: (torch.tensor([1, 2]),), "embedding.weight", True),
    "relu_then_iadd": (ReluThenInplaceAdd, FixedReluThenInplaceAdd, lambda: (torch.randn(3, 4),),
                       "iadd", True),
    "harmless_inplace_relu": (HarmlessInplaceRelu, FixedHarmlessInplaceRelu,
                              lambda: (torch.randn(2, 3, 8, 8),), "relu", False),
}


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def _backward(model, *inputs):
    outs = _outputs(model(*inputs))
    sum(o.sum() for o in outs).backward()
    return outs, {name: p.grad for name, p in model.named_parameters()}


def _functionalized(model):
    gm = fxdebug.trace(model)
    step = Functionalize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every seed case must be rewritten, without warnings
        assert step(gm).modified
    return gm, step


@pytest.mark.parametrize("case", list(CASES))
def test_backward_runs_and_matches_the_hand_fixed_model(case):
    cls, fixed_cls, make_inputs, key, eager_fails = CASES[case]
    original = cls().train()
    inputs = make_inputs()
    fixed = fixed_cls().train()
    fixed.load_state_dict(original.state_dict())
    eager = copy.deepcopy(original)
    functional = copy.deepcopy(original)

    with torch.no_grad():
        expected = _outputs(copy.deepcopy(original)(*inputs))
    if eager_fails:  # ground truth: the hazard is real
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _backward(eager, *inputs)

    gm, step = _functionalized(functional)
    assert key in [k for k, _, _ in step.rewritten]
    assert step.not_rewritten == []
    outs, grads = _backward(gm, *inputs)
    fixed_outs, fixed_grads = _backward(fixed, *inputs)
    for out, want, hand in zip(outs, expected, fixed_outs):
        assert torch.equal(out, want), "Functionalize changed the forward values"
        assert torch.equal(out, hand)
    assert list(grads) == list(fixed_grads)
    for name in grads:
        assert torch.allclose(grads[name], fixed_grads[name], rtol=1e-6, atol=1e-7), name
    assert fxdebug.lint_inplace(gm, *make_inputs()).errors == []


def test_rewritten_nodes_keep_their_key_and_source_line():
    gm, step = _functionalized(SigmoidZeroed())
    node = next(n for n in gm.graph.nodes if n.meta.get("fxdebug_key") == "masked_fill_")
    assert (node.op, node.target) == ("call_method", "masked_fill")
    assert node.meta["fxdebug_source"] == hazard_line(SigmoidZeroed)
    assert step.rewritten == [("masked_fill_", "Tensor.masked_fill_", "Tensor.masked_fill")]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.args[0] is node, "the returned value must be the rewritten one"


@pytest.mark.parametrize("cls, via", [(DataZeroed, ".data"), (DetachZeroed, ".detach()")])
def test_writes_through_data_or_detach_are_reported_not_rewritten(cls, via):
    model, x = cls(), torch.randn(2, 3)
    with torch.no_grad():
        expected = model(x)
    gm = fxdebug.trace(model)
    step = Functionalize()
    with pytest.warns(UserWarning, match="Functionalize left 1 in-place op") as caught:
        assert step(gm).modified is False
    assert [u.key for u in step.not_rewritten] == ["zero_"]
    assert via in step.not_rewritten[0].reason and "'sigmoid'" in step.not_rewritten[0].reason
    assert step.not_rewritten[0].location in str(caught[0].message)
    with torch.no_grad():
        assert torch.equal(gm(x), expected)


def test_write_through_a_view_used_later_is_reported():
    model, x = ViewAugAssign(), torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
    gm = fxdebug.trace(model)
    step = Functionalize()
    with pytest.warns(UserWarning, match="Functionalize left 2"):
        step(gm)
    assert [u.key for u in step.not_rewritten] == ["iadd", "imul"]
    assert "'lin'" in step.not_rewritten[0].reason
    with torch.no_grad():
        assert torch.equal(gm(x), expected)


def test_write_to_an_input_stays_and_earlier_readers_get_a_clone():
    class ScalesInput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x):
            y = self.fc(x)      # Linear saves x for its weight gradient
            x.mul_(2)           # the caller's tensor changes: that must stay
            return y + x.sum()

    class Fixed(ScalesInput):
        def forward(self, x):
            y = self.fc(x.clone())
            x.mul_(2)
            return y + x.sum()

    model = ScalesInput()
    fixed = Fixed()
    fixed.load_state_dict(model.state_dict())
    x = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        copy.deepcopy(model)(x.clone()).sum().backward()

    gm, step = _functionalized(model)
    assert step.rewritten == [("x", "placeholder", "clone for earlier readers")]
    x_gm, x_fixed = x.clone(), x.clone()
    gm(x_gm).sum().backward()
    fixed(x_fixed).sum().backward()
    assert torch.equal(x_gm, x * 2), "the write to the input must still happen"
    assert torch.equal(x_gm, x_fixed)
    assert torch.equal(model.fc.weight.grad, fixed.fc.weight.grad)


def test_functional_inplace_flag_by_position_and_keyword():
    class Net(torch.nn.Module):
        def forward(self, x):
            a = torch.sigmoid(x)
            F.relu(a, True)
            b = torch.sigmoid(a)
            return F.hardtanh(b, inplace=True) + a

    x = torch.randn(5, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        Net()(x).sum().backward()
    gm, step = _functionalized(Net())
    assert [key for key, _, _ in step.rewritten] == ["relu", "hardtanh"]
    assert all(n.kwargs.get("inplace") is False for n in gm.graph.nodes
               if n.op == "call_function" and n.target in (F.relu, F.hardtanh))
    x.grad = None
    gm(x).sum().backward()
    grad = x.grad.clone()

    def by_hand(x):
        a = F.relu(torch.sigmoid(x))
        return F.hardtanh(torch.sigmoid(a)) + a

    x.grad = None
    by_hand(x).sum().backward()
    assert torch.allclose(grad, x.grad)


def test_resnet18_becomes_free_of_inplace_ops_with_equal_gradients():
    model = torchvision.models.resnet18().train()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 64, 64)
    gm, step = _functionalized(model)
    assert len(step.rewritten) == 17  # the ReLUs; tracing made `out += identity` out of place
    assert all(m.inplace for m in model.modules() if isinstance(m, torch.nn.ReLU)), \
        "the user's ReLU modules must stay as they were"
    assert list(gm.state_dict()) == list(model.state_dict())
    out = gm(x)
    out.sum().backward()
    ref = reference(x)
    ref.sum().backward()
    assert torch.equal(out, ref)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert fxdebug.lint_inplace(gm, x) == []


def test_check_equivalence_holds_for_resnet18_and_the_seed_cases():
    model, x = torchvision.models.resnet18(), torch.randn(2, 3, 64, 64)
    gm, _ = _functionalized(model)
    report = fxdebug.check_equivalence(model, gm, x, grads=True, train=True)
    assert report.ok, report.table()
    for case in ("sigmoid_zeroed", "setitem_after_matmul", "relu_then_iadd"):
        cls, _, make_inputs, _, _ = CASES[case]
        model = cls()
        gm, _ = _functionalized(copy.deepcopy(model))
        report = fxdebug.check_equivalence(model, gm, *make_inputs())  # forward values
        assert report.ok, (case, report.table())
