"""Checkpoint: same outputs, parameter gradients and BatchNorm statistics as the model itself.

Ground truth: the eager model (a deep copy with the same weights), run with the
same seed; saved-tensor bytes counted with ``saved_tensors_hooks`` in the test
only, to show that the pass really drops activations.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torchvision
from torch import nn

import fxdebug
from fxdebug.passes import Checkpoint
from models import NestedOutputs, Reuse
from subprocesses import outputs_under_hash_seeds


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.3)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.drop(torch.relu(self.fc(x))))


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block(), Block())
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.drop(self.blocks(x)))


def _run(model, call, *inputs, seed=123):
    """Forward + backward with a fixed seed; outputs, parameter grads and buffers."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = call(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    sum(o.float().sum() for o in outs if isinstance(o, torch.Tensor)).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    return [o.detach() for o in outs], grads, buffers


def _assert_same(got, want):
    for a, b in zip(got[0], want[0]):
        assert torch.equal(a, b), "outputs differ"
    assert list(got[1]) == list(want[1])
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), f"gradient of {name} differs"
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name]), f"buffer {name} differs"


def _saved_bytes(call, *inputs):
    """Bytes of the tensors autograd keeps outside checkpointed segments (test-only hooks)."""
    total = [0]

    def pack(tensor):
        total[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        call(*inputs)
    return total[0]


def test_resnet18_train_outputs_gradients_and_bn_statistics_equal():
    model = torchvision.models.resnet18().train()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 64, 64)
    gm = fxdebug.trace(model)
    step = Checkpoint()  # default: every top-level container call
    assert step(gm).modified
    assert step.segments == ["layer1", "layer2", "layer3", "layer4"]
    assert "checkpointed(fxdebug_checkpoint_layer1" in gm.code
    _assert_same(_run(model, gm, x), _run(reference, reference, x))
    assert list(gm.state_dict()) == list(model.state_dict())
    assert len(list(gm.parameters())) == len(list(model.parameters()))
    assert _saved_bytes(gm, x) < _saved_bytes(reference, x) / 3


@pytest.mark.parametrize("include", [["blocks.*"], ["blocks"], "blocks.1"])
def test_dropout_in_train_mode_equal_when_rng_state_is_preserved(include):
    model = DropoutNet().train()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    gm = fxdebug.trace(model)
    Checkpoint(include=include, preserve_rng_state=True)(gm)
    _assert_same(_run(model, gm, x), _run(reference, reference, x))


def test_without_preserved_rng_state_dropout_masks_differ():
    model = DropoutNet().train()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    gm = fxdebug.trace(model)
    Checkpoint(include=["blocks.*"], preserve_rng_state=False)(gm)
    got, want = _run(model, gm, x), _run(reference, reference, x)
    assert torch.equal(got[0][0], want[0][0]), "the forward itself is unchanged"
    assert not torch.equal(got[1]["blocks.0.fc.weight"], want[1]["blocks.0.fc.weight"]), \
        "recomputation drew new dropout masks, so the gradients must differ"


def test_outermost_calls_nested_patterns_and_exclude():
    gm = fxdebug.trace(torchvision.models.resnet18())
    step = Checkpoint(include=["layer1", "layer1.0.conv1", "layer2.*"], exclude=["layer2.1"])
    step(gm)
    assert step.segments == ["layer1", "layer2.0"]

    gm = fxdebug.trace(torchvision.models.resnet18())
    step = Checkpoint(include=["layer2.0.conv1", "layer2.0.bn1", "layer3"], exclude=["layer3.0.*"])
    step(gm)
    assert step.segments == ["layer2.0.conv1", "layer2.0.bn1", "layer3.1"]


def test_reused_module_calls_and_tuple_outputs():
    model, x = Reuse().train(), torch.randn(3, 6)
    reference = copy.deepcopy(model)
    gm = fxdebug.trace(model)
    step = Checkpoint(include=["block*"])
    step(gm)
    assert step.segments == ["block", "block_1"]
    _assert_same(_run(model, gm, x), _run(reference, reference, x))

    model = NestedOutputs()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8)
    gm = fxdebug.trace(model)
    step = Checkpoint(include=["enc", "mix"])
    step(gm)
    assert step.segments == ["enc", "mix"]

    def outputs(out):
        return (out.logits, out.hidden)
    _assert_same(_run(model, lambda v: outputs(gm(v)), x),
                 _run(reference, lambda v: outputs(reference(v)), x))


def test_calls_that_recomputation_would_change_are_skipped_with_a_warning():
    gm = fxdebug.trace(torchvision.models.resnet18())
    step = Checkpoint(include=["relu", "layer1.0.relu_1", "layer1.1"])
    with pytest.warns(UserWarning, match="Checkpoint left 2 selected call"):
        step(gm)
    assert step.segments == ["layer1.1"]
    assert [s.key for s in step.skipped] == ["relu", "layer1.0.relu_1"]
    assert "writes in place to its input 'bn1'" in step.skipped[0].reason
    assert "Functionalize" in step.skipped[0].reason

    functional = fxdebug.trace(torchvision.models.resnet18())
    fxdebug.passes.Functionalize()(functional)
    step = Checkpoint(include=["relu"])
    step(functional)
    assert step.segments == ["relu"] and step.skipped == []


def test_capture_nodes_inside_a_segment_are_refused():
    gm = fxdebug.instrument(torchvision.models.resnet18(), capture=["layer1.0.conv1"])
    step = Checkpoint(include=["layer1", "layer2"])
    with pytest.warns(UserWarning, match="inserted by pass capture"):
        step(gm)
    assert step.segments == ["layer2"]


def test_unknown_pattern_lists_close_keys():
    gm = fxdebug.trace(torchvision.models.resnet18())
    with pytest.raises(fxdebug.SelectionError, match="'layer1'"):
        Checkpoint(include=["layr1"])(gm)


def test_survives_deepcopy_save_load_retracing_and_keeps_parameters_registered():
    model = DropoutNet().train()
    x = torch.randn(8, 16)
    gm = fxdebug.trace(model)
    Checkpoint(include=["blocks.*"])(gm)
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    want = _run(gm, gm, x)
    for other in (copy.deepcopy(gm), loaded, torch.fx.symbolic_trace(gm), fxdebug.trace(gm)):
        assert "checkpointed" in other.code
        assert list(other.state_dict()) == list(model.state_dict())
        assert len(list(other.parameters())) == len(list(model.parameters()))
        _assert_same(_run(other, other, x), want)


def test_module_outputs_still_captured_after_checkpointing(hooks):
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 64, 64)
    gm = fxdebug.trace(model)
    Checkpoint(include=["layer2", "layer3.0.conv1"])(gm)
    instrumented = fxdebug.instrument(gm, capture="modules")
    with torch.no_grad():
        instrumented(x)
    rec = fxdebug.records(instrumented)
    truth = hooks(model, x)
    keys = rec.keys()
    assert {"layer1", "layer2", "layer3.0.conv1", "layer3", "fc"} <= set(keys)
    assert "layer2.0.conv1" not in keys, "values inside a checkpointed segment are recomputed"
    for key in keys:
        assert torch.equal(rec[key], truth[key]), key
    assert fxdebug.lint_inplace(gm, x).errors == []


def test_functionalize_then_checkpoint_is_equivalent_with_gradients():
    model, x = torchvision.models.resnet18(), torch.randn(2, 3, 32, 32)
    manager = fxdebug.PassManager([fxdebug.passes.Functionalize(), Checkpoint(include=["layer*"])],
                                  check_inputs=(x,))
    result = manager.run(model)
    gm, report = result.graph_module, result.report
    assert [stage.name for stage in report.stages[1:]] == ["functionalize", "checkpoint"]
    assert gm.code.count("checkpointed(") == 4
    result = fxdebug.check_equivalence(model, gm, x, grads=True, train=True)
    assert result.ok, result.table()


SCRIPT = """
import sys, warnings, torch, fxdebug
from inplace_models import HarmlessInplaceRelu
from models import NestedOutputs
warnings.simplefilter("ignore")
for model, include in ((HarmlessInplaceRelu(), ["relu", "fc"]), (NestedOutputs(), ["enc", "mix"])):
    gm = fxdebug.trace(model)
    functionalize = fxdebug.passes.Functionalize()
    checkpoint = fxdebug.passes.Checkpoint(include=include)
    functionalize(gm)
    checkpoint(gm)
    print(gm.code)
    print(functionalize.rewritten, checkpoint.segments)
    print(getattr(gm, "fxdebug_checkpoint_" + include[0]).body.code)
"""


def test_generated_code_identical_across_hash_seeds():
    outputs = outputs_under_hash_seeds(SCRIPT)
    assert outputs[0] == outputs[1] == outputs[2]
    assert "checkpointed(fxdebug_checkpoint_relu" in outputs[0] and "0x" not in outputs[0]
