"""find_nonfinite when the NaN/Inf was there before forward ran: in the data, or in a tensor of
the model read as it is. The report names that input or parameter and says no node created it.

Ground truth: ``torch.isnan`` / ``torch.isinf`` on the tensors themselves, and the eager model's
own outputs (forward hooks) turning non-finite.
"""

from __future__ import annotations

import torch
import torchvision

import fxdebug
from hooks import hook_captures


def test_nan_in_the_input_data_is_named_as_the_input():
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 32, 32)
    x[0, 1, 3, 4] = float("nan")
    x[0, 2, 5, 5] = float("inf")
    assert torch.isnan(hook_captures(model, x)["conv1"]).any()  # eager spreads it from conv1 on
    report = fxdebug.find_nonfinite(model, x)
    hit = report.forward
    assert (hit.key, hit.kind, hit.created) == ("x", "input", False)
    assert (hit.nan, hit.inf) == (int(torch.isnan(x).sum()), int(torch.isinf(x).sum()))
    assert report.creators == [] and report.sources == ["x"]
    table = report.table()
    assert "the input x of forward already holds non-finite values: 1 NaN and 1 Inf" in table
    assert "it CREATED them" not in table and "no node created them" in table
    assert "input x already holds NaN/Inf" in repr(report)
    assert not report.ok


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, bias):
        return self.fc(x).log() + bias


def test_the_input_holding_the_nan_is_named_among_several_and_a_creator_is_kept():
    model, x, bias = TwoInputs(), torch.randn(2, 4), torch.randn(2, 4)
    bias[1, 2] = float("nan")
    with torch.no_grad():
        assert torch.isnan(model.fc(x).log()).any()  # the log of a negative value: a creator
    report = fxdebug.find_nonfinite(model, x, bias, grads=False)
    assert (report.forward.key, report.forward.kind) == ("bias", "input")
    assert report.forward.nan == int(torch.isnan(bias).sum())
    assert report.sources == ["bias"] and report.creators == ["log"]
    assert "the input bias of forward already holds" in report.table()


class FunctionalWeight(torch.nn.Module):
    """A parameter and a buffer read as they are (get_attr nodes), not through a module call."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.register_buffer("shift", torch.zeros(4))

    def forward(self, x):
        return x @ self.w + self.shift


def test_a_parameter_that_is_already_nan_is_named_as_the_parameter():
    model = FunctionalWeight()
    with torch.no_grad():
        model.w[0, 0] = float("inf")
    report = fxdebug.find_nonfinite(model, torch.randn(3, 4))
    assert (report.forward.key, report.forward.kind, report.forward.inf) == ("w", "parameter", 1)
    assert "parameter w of the model already holds non-finite values" in report.table()
    assert report.sources == ["w"]

    model = FunctionalWeight()
    model.shift[1] = float("nan")
    report = fxdebug.find_nonfinite(model, torch.randn(3, 4), grads=False)
    assert (report.forward.key, report.forward.kind) == ("shift", "buffer")
