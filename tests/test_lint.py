"""lint_inplace: seed 003's hazards found with node and line before any backward.

Ground truth for "is this a real hazard": eager PyTorch itself (backward raises
"modified by an inplace operation"), or, for ``.data`` writes that PyTorch
cannot see, gradients computed by hand from the values before the write.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision

import fxdebug
from fxdebug.base.formatting import format_location
from inplace_models import (DataZeroed, DetachZeroed, EmbeddingMaxNorm, EmbeddingTwice,
                            HarmlessInplaceRelu, MatmulThenSetitem, ReluThenInplaceAdd,
                            SigmoidZeroed, hazard_line)
from subprocesses import REPO, fxdebug_cli, outputs_under_hash_seeds


# model, inputs, key of the write, node whose saved value it destroys, node that saved it
REAL_HAZARDS = {
    "sigmoid_zeroed": (SigmoidZeroed, lambda: (torch.randn(2, 4),),
                       "masked_fill_", "sigmoid", "sigmoid"),
    "setitem_after_matmul": (MatmulThenSetitem, lambda: (torch.tensor([1.0, 2.0]),),
                             "setitem", "matmul", "matmul_1"),
    "embedding_max_norm": (EmbeddingMaxNorm, lambda: (torch.tensor([1, 2]),),
                           "embedding", "embedding.weight", "matmul"),
    "detach_zeroed": (DetachZeroed, lambda: (torch.randn(2, 3),), "zero_", "sigmoid", "sigmoid"),
    "relu_then_iadd": (ReluThenInplaceAdd, lambda: (torch.randn(2, 4),), "iadd", "relu", "relu"),
}


def _loss(out):
    outs = out if isinstance(out, tuple) else (out,)
    return sum(o.sum() for o in outs)


def _grads_untouched(model):
    return all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("case", list(REAL_HAZARDS))
def test_real_hazard_found_with_node_and_line_before_backward(case):
    cls, make_inputs, key, destroys, saved_by = REAL_HAZARDS[case]
    model, inputs = cls(), make_inputs()
    state = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()

    hazards = fxdebug.lint_inplace(model, *inputs)

    assert _grads_untouched(model), "the lint must not run backward"
    assert torch.equal(torch.get_rng_state(), rng), "the lint must leave the global RNG alone"
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), f"the lint changed {name} of the user's model"
    assert len(hazards.errors) == 1, hazards.table()
    error = hazards.errors[0]
    assert (error.key, error.destroys, error.saved_by) == (key, destroys, saved_by)
    assert error.source == hazard_line(cls)
    assert error.location == format_location(hazard_line(cls))
    assert "modified by an inplace operation" in error.problem
    assert error.fix

    # ground truth: eager PyTorch fails at backward, exactly as the lint said it would
    out = model(*inputs)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _loss(out).backward()


def test_data_write_on_saved_output_is_an_error_pytorch_never_reports():
    model, x = DataZeroed(), torch.randn(2, 3)
    hazards = fxdebug.lint_inplace(model, x)
    assert _grads_untouched(model)
    assert [(h.severity, h.key, h.destroys, h.saved_by) for h in hazards] == [
        ("error", "zero_", "sigmoid", "sigmoid")]
    assert hazards[0].source == hazard_line(DataZeroed)
    assert "silently" in hazards[0].problem and ".data" in hazards[0].problem

    # ground truth: eager backward "works" and gives zero gradients; the correct ones,
    # from sigmoid' = s (1 - s) with s the value before the write, are not zero
    model(x).sum().backward()
    with torch.no_grad():
        s = model.fc(x).sigmoid()
    correct_bias_grad = (s * (1 - s)).sum(0)
    assert torch.count_nonzero(model.fc.bias.grad) == 0
    assert not torch.allclose(model.fc.bias.grad, correct_bias_grad)


def test_harmless_inplace_relu_and_iadd_are_warnings():
    model, x = HarmlessInplaceRelu().train(), torch.randn(2, 3, 8, 8)
    hazards = fxdebug.lint_inplace(model, x)
    assert hazards.errors == []
    assert [(h.key, h.op) for h in hazards.warnings] == [("iadd", "operator.iadd"),
                                                         ("relu", "ReLU")]
    relu = hazards.warnings[1]
    assert relu.source == hazard_line(HarmlessInplaceRelu)
    assert "inplace=False" in relu.fix
    model(x).sum().backward()  # ground truth: eager backward is fine


def test_embedding_max_norm_called_twice_without_direct_use_is_a_warning():
    model = EmbeddingTwice()
    a, b = torch.tensor([1, 2]), torch.tensor([0, 1])
    weight = model.embedding.weight.detach().clone()
    hazards = fxdebug.lint_inplace(model, a, b)
    assert hazards.errors == []
    assert [h.key for h in hazards.warnings] == ["embedding", "embedding_1"]
    assert all("max_norm=1" in h.problem for h in hazards.warnings)
    assert torch.equal(model.embedding.weight, weight), "the lint renormalised the user's weight"
    model(a, b).backward()  # ground truth: fine


def test_resnet18_train_has_only_warnings():
    model, x = torchvision.models.resnet18().train(), torch.randn(2, 3, 64, 64)
    running_mean = model.bn1.running_mean.clone()
    hazards = fxdebug.lint_inplace(model, x)
    assert hazards.errors == []
    inplace_relu_calls = 1 + 8 * 2  # stem relu, two per BasicBlock
    # `out += identity` is traced out of place (nothing else reads `out`): no hazard left there
    assert sorted(h.op for h in hazards) == ["ReLU"] * inplace_relu_calls
    assert all(h.location.startswith("torchvision/models/resnet.py:") for h in hazards)
    assert torch.equal(model.bn1.running_mean, running_mean)
    model(x).sum().backward()


def test_graph_module_input_gives_the_same_hazards():
    model, x = ReluThenInplaceAdd(), torch.randn(2, 4)
    assert fxdebug.lint_inplace(fxdebug.trace(model), x) == fxdebug.lint_inplace(model, x)


def test_inplace_write_to_a_parameter_raises_in_forward_and_is_reported():
    class Bumps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            self.w.add_(1)
            return x * self.w

    hazards = fxdebug.lint_inplace(Bumps(), torch.randn(3))
    assert [(h.severity, h.key) for h in hazards] == [("error", "add_")]
    assert "raises in the forward" in hazards[0].problem and "leaf" in hazards[0].problem


def test_a_model_error_names_the_node():
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    with pytest.raises(RuntimeError) as info:
        fxdebug.lint_inplace(model, torch.randn(1, 3))
    assert any("lint_inplace" in note and "'0'" in note for note in info.value.__notes__)


def test_hazard_str_and_table():
    hazards = fxdebug.lint_inplace(MatmulThenSetitem(), torch.tensor([1.0, 2.0]))
    text = str(hazards[0])
    assert text.startswith("error: setitem (operator.setitem, ")
    assert "'matmul'" in text and "'matmul_1'" in text and "Fix: " in text
    table = hazards.table(wide=True)
    assert table.splitlines()[0].split()[:5] == ["severity", "key", "op", "line", "destroys"]
    assert table.endswith("1 error(s), 0 warning(s)")


SCRIPT = """
import sys, torch, fxdebug
import inplace_models as m
torch.manual_seed(0)
for model, inputs in ((m.DataZeroed(), (torch.randn(2, 3),)),
                      (m.EmbeddingMaxNorm(), (torch.tensor([1, 2]),)),
                      (m.MatmulThenSetitem(), (torch.tensor([1.0, 2.0]),)),
                      (m.HarmlessInplaceRelu(), (torch.randn(2, 3, 4, 4),))):
    hazards = fxdebug.lint_inplace(model, *inputs)
    print(hazards.table())
    print(*hazards, sep=chr(10))
"""


def test_tables_identical_across_hash_seeds():
    outputs = outputs_under_hash_seeds(SCRIPT)
    assert outputs[0] == outputs[1] == outputs[2]
    assert "embedding.weight" in outputs[0] and "0x" not in outputs[0]


def _fxdebug(*args, cwd=REPO):
    return fxdebug_cli(*args, cwd=cwd)


def test_cli_lint_default_model_and_a_hazardous_file(tmp_path):
    result = _fxdebug("lint", "--input", "2,3,32,32")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("torchvision.models:resnet18: ResNet, input 2x3x32x32, train")
    assert "layer1.0.relu_1" in result.stdout and "0 error(s), 17 warning(s)" in result.stdout

    (tmp_path / "net.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(3, 3)\n"
        "    def forward(self, x):\n"
        "        out = self.fc(x).sigmoid()\n"
        "        out.data.zero_()\n"
        "        return out\n"
        "def make():\n"
        "    return Net()\n")
    result = _fxdebug("lint", "net.py:make", "--input", "2,3", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "net.py:8" in result.stdout and "1 error(s)" in result.stdout
    assert "silently compute wrong gradients" in result.stdout


class _HiddenWrite(torch.nn.Module):
    """Untraceable (a branch on a tensor), so fxdebug keeps it as one leaf node."""

    def forward(self, x):
        y = x.sigmoid()
        if y.sum() > 0:
            y.mul_(2)  # SigmoidBackward needs y
        return y


class _HasHiddenWrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.hidden = _HiddenWrite()

    def forward(self, x):
        return self.hidden(self.fc(x)) * 2


def test_a_write_inside_an_opaque_node_is_found_by_the_run():
    model, x = _HasHiddenWrite(), torch.randn(2, 3)
    with pytest.warns(UserWarning, match="as leaves"):
        hazards = fxdebug.lint_inplace(model, x)
    assert [(h.severity, h.key, h.op) for h in hazards] == [("error", "hidden", "_HiddenWrite")]
    assert "inside this node" in hazards[0].problem
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
