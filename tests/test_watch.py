"""watch_nonfinite: silent while finite; on the first bad step, names the node that made the NaN.

Ground truth is computed independently, in eager: which operation's output first
holds a non-finite value given finite inputs, the line it is on, and with
``retain_grad`` which activation's gradient first turns non-finite.
"""

import inspect

import torch
import torch.nn.functional as F

import fxdebug


class LogNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.out = torch.nn.Linear(3, 1)

    def forward(self, x):
        h = self.fc(x)
        h = torch.log(h)  # NaN where fc's output is negative
        return self.out(h)


class DropLog(torch.nn.Module):
    def forward(self, x):
        return torch.log(F.dropout(x, p=0.2, training=True))  # -inf where dropped


def line_of(cls, text):
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_forward_nan_named_with_its_line():
    torch.manual_seed(0)
    net = LogNet()
    with torch.no_grad():  # positive fc outputs for the first steps, then not
        net.fc.weight.copy_(torch.eye(3))
        net.fc.bias.zero_()
    watch = fxdebug.watch_nonfinite(net)
    steps = [torch.rand(2, 3) + 0.5, torch.rand(2, 3) + 0.5, torch.tensor([[1.0, -2.0, 3.0]])]
    reports = []
    for x in steps:
        net.zero_grad()
        watch(x).sum().backward()
        reports.append(watch.check())
    assert reports[:2] == [None, None]
    report = reports[2]
    # independent: the first operation with non-finite output, given finite inputs
    h = net.fc(steps[2])
    assert torch.isfinite(h).all() and not torch.isfinite(torch.log(h)).all()
    assert report.forward.key == "log" and report.forward.created
    assert report.forward.location.endswith(f"test_watch.py:{line_of(LogNet, 'torch.log')}")
    assert report.forward.nan == int(torch.isnan(torch.log(h)).sum())


def test_backward_inf_named():
    scale = torch.nn.Parameter(torch.ones(3))

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = scale

        def forward(self, x):
            return torch.sqrt(x * self.scale).sum()  # finite; d sqrt(m) / dm is inf at m == 0

    model = Scaled()
    watch = fxdebug.watch_nonfinite(model)
    watch(torch.tensor([1.0, 0.5, 2.0])).backward()
    assert watch.check() is None
    model.zero_grad()
    watch(torch.tensor([1.0, 0.0, 2.0])).backward()  # forward finite, backward inf
    report = watch.check()
    # independent: retain_grad on the product; its gradient is the first non-finite one
    m = torch.tensor([1.0, 0.0, 2.0]) * scale
    m.retain_grad()
    s = torch.sqrt(m)
    s.retain_grad()
    s.sum().backward()
    assert torch.isfinite(s.grad).all() and not torch.isfinite(m.grad).all()
    assert report.forward is None
    assert report.backward.key == "mul"
    assert [key for key, _, _ in report.backward.made_by] == ["sqrt"]


def test_replay_uses_the_steps_random_state():
    torch.manual_seed(3)
    watch = fxdebug.watch_nonfinite(DropLog())
    x = torch.rand(64) + 0.5
    for _ in range(10):
        out = watch(x)
        report = watch.check()
        if report is not None:
            break
    assert report is not None
    # the replay drew the same dropout mask as the step: the same number of -inf values
    assert report.forward.key == "log"
    assert report.forward.inf == int(torch.isinf(out).sum()) > 0
    assert watch.check() is report  # the first bad step's report, kept
