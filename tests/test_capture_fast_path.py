"""The capture fast path (one plain tensor, Records.add_tensor) keeps what captures promise.

Ground truth is eager PyTorch: forward hooks that clone every module's output (so a later
in-place op cannot change what they hold), the version counter of the model's own tensors,
and the same model run eagerly in the mode it was switched to.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import torchvision

import fxdebug
from fxdebug.errors import StaleCaptureError
from fxdebug.runtime.records import Records
from hooks import hook_captures


@pytest.mark.parametrize("capture", ["modules", "all"])
def test_captures_equal_cloning_forward_hooks_on_resnet18(capture):
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(2, 3, 64, 64)
    # every module's output as a forward hook that clones sees it, grad mode on
    truth = hook_captures(model, x, grad_mode=True)
    expected_out = model(x)
    gm = fxdebug.instrument(model, capture=capture)
    out = gm(x)
    assert torch.equal(out, expected_out)
    rec = fxdebug.records(gm)
    hooked = [key for key in truth if key in rec]
    assert len(hooked) == len(truth)  # every module call was captured under the hook's key
    for key in hooked:
        assert torch.equal(rec[key], truth[key]), key
        assert not rec[key].requires_grad and rec.record(key).via == "graph"
    # bn1 is followed by an in-place ReLU: its capture is a copy holding what eager computed
    # before the ReLU wrote to it (a view would show the ReLU's output)
    assert rec.record("bn1").copied and (truth["bn1"] < 0).any()
    assert torch.equal(rec["bn1"], truth["bn1"])
    if capture == "all":  # functional ops too: the residual add before the block's ReLU
        assert rec.record("layer1.0.iadd").copied


def test_a_view_written_after_the_forward_is_stale():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    gm = fxdebug.instrument(model)
    out = gm(torch.randn(2, 3))
    rec = fxdebug.records(gm)
    assert torch.equal(rec["1"], out) and not rec.record("1").copied
    out.mul_(2)  # the user's code writes the model's output in place
    with pytest.raises(StaleCaptureError, match="'1'"):
        rec["1"]
    assert "stale" in rec.table()


def test_fast_record_has_every_field_add_gives():
    tensor = torch.randn(2, 3, requires_grad=True) * 2
    with torch.inference_mode():
        inference = torch.ones(2)  # no version counter
    for value, clone in ((tensor, False), (tensor, True), (inference, False)):
        slow, fast = Records(), Records()
        slow.add("k", "Op", value, clone=clone)
        fast.add_tensor("k", "Op", value, clone=clone)
        a, b = slow.record("k"), fast.record("k")
        for field in dataclasses.fields(a):
            left, right = getattr(a, field.name), getattr(b, field.name)
            if isinstance(left, torch.Tensor):
                assert torch.equal(left, right) and left.requires_grad == right.requires_grad
            else:
                assert left == right, field.name
        assert (b.value.data_ptr() == value.data_ptr()) is not clone  # a view unless copied
    fast.add_tensor("k", "Op", tensor)  # captured again: it moves to the end, as in add()
    fast.add_tensor("j", "Op", tensor)
    fast.add_tensor("k", "Op", tensor)
    assert fast.keys() == ["j", "k"]


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return F.dropout(self.fc(x), p=0.5, training=self.training)  # baked into the graph


def test_a_submodule_switched_directly_is_followed():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), torch.nn.ReLU(), _Block()).train()
    gm = fxdebug.instrument(model)
    x = torch.randn(4, 8)

    def same_as_eager(seed):
        torch.manual_seed(seed)
        got = gm(x)
        torch.manual_seed(seed)
        assert torch.equal(got, model(x))

    same_as_eager(1)
    model[2].training = False  # a plain assignment: no train()/eval() call anywhere
    same_as_eager(2)
    assert torch.equal(fxdebug.records(gm)["2"], model[2].fc(model[1](fxdebug.records(gm)["0"])))
    gm.get_submodule("0").eval()  # gm's side, a container of a traced-through module
    same_as_eager(3)
    assert not model[0].training
    model.train()
    same_as_eager(4)


def test_a_child_replaced_or_removed_on_the_instrumented_module():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    gm = fxdebug.instrument(model)
    x = torch.randn(2, 3)
    gm(x)
    setattr(gm, "1", torch.nn.Tanh())  # the generated code reads the child anew each call
    assert torch.equal(gm(x), torch.tanh(model[0](x)))
    delattr(gm, "1")
    with pytest.raises(AttributeError, match="'1'"):
        getattr(gm, "1")


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_of_an_instrumented_module_keeps_its_capture_ops(strict):
    if strict and fxdebug.base.torch_compat.torch_version() < (2, 14):
        pytest.skip("strict torch.export before torch 2.14 refuses the capture ops' token "
                    "tensor (a module global); non-strict export works")
    # torch.export traces with fake tensors (non-strict) or through dynamo (strict): neither
    # may take the eager fast path, each capture becomes fxdebug's op in the exported graph
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    gm = fxdebug.instrument(model, capture="all")
    exported = torch.export.export(gm, (torch.randn(1, 2),), strict=strict)
    captures = [node for node in exported.graph.nodes
                if node.target is torch.ops.fxdebug.capture.default]
    assert len(captures) == 3  # input, 0, 1
    x = torch.randn(1, 2)  # (exported for this batch size)
    assert torch.equal(exported.module()(x), model(x))
    assert torch.equal(fxdebug.records(gm)["1"], model(x))  # the exported ops recorded the run
