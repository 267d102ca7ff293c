"""A user's forward hooks on a module fx traces through run at run time, as eager runs them.

Ground truth: the same model called eagerly, with the same hooks counting their calls and
keeping what they saw. Tracing must not call a hook at all.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fxdebug
from fxdebug.errors import FxdebugError


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, scale=1.0):
        return torch.relu(self.fc(x)) * scale + x


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Block(), Block()
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.b(self.a(x)) + self.a(x, scale=2.0))  # a is called twice


def hooked(net):
    """Hooks that edit values (pre: args and kwargs; post: output) and log what they saw."""
    log = []

    def pre(module, args, kwargs):
        log.append(("pre", args[0].clone(), dict(kwargs)))
        return (args[0] * 0.5,), kwargs

    def post(module, args, out):
        log.append(("post", args[0].clone(), out.clone()))
        return out - 1

    def root_post(module, args, out):
        log.append(("root", module is net, out.clone()))

    net.a.register_forward_pre_hook(pre, with_kwargs=True)
    net.a.register_forward_hook(post)
    net.register_forward_hook(root_post)
    return log


def test_forward_hooks_on_traced_through_modules_run_at_run_time_like_eager():
    torch.manual_seed(0)
    eager = Net()
    net = copy.deepcopy(eager)
    eager_log, log = hooked(eager), hooked(net)
    gm = fxdebug.instrument(net, capture="all")
    assert log == []  # tracing called no hook
    x = torch.randn(3, 4)
    for _ in range(2):
        out, expected = gm(x), eager(x)
        assert torch.equal(out, expected)
    assert [entry[0] for entry in log] == [entry[0] for entry in eager_log]
    assert [e[0] for e in log] == ["pre", "post", "pre", "post", "root"] * 2
    for mine, theirs in zip(log, eager_log):
        for a, b in zip(mine[1:], theirs[1:]):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    rec = fxdebug.records(gm)
    assert rec.keys()[:5] == ["x", "a.fc", "a.relu", "a.mul", "a.add"]  # the body is captured
    assert torch.equal(rec["a"], eager_log[-4][2] - 1)  # a's output: after its forward hook
    assert not any("hooks" in key for key in rec.keys())  # hook nodes are not captured
    assert "fxdebug_runtime_forward_pre_hooks" in gm.code


def test_hooks_added_to_or_removed_from_a_hooked_module_after_instrument_are_followed():
    torch.manual_seed(0)
    net = Net()
    net.b.register_forward_pre_hook(lambda m, args: None)
    gm = fxdebug.instrument(net)
    x = torch.randn(3, 4)
    before = gm(x)
    handle = net.b.register_forward_hook(lambda m, a, out: out * 0)
    assert torch.equal(gm(x), net(x)) and not torch.equal(gm(x), before)
    handle.remove()
    assert torch.equal(gm(x), before)


def test_a_hook_that_changes_the_structure_stops_with_the_module_named():
    net = Net()
    net.b.register_forward_hook(lambda m, a, out: (out, out))
    gm = fxdebug.instrument(net)
    with pytest.raises(FxdebugError, match="module 'b'.*leaf"):
        gm(torch.randn(3, 4))


def test_a_module_with_backward_hooks_runs_whole_with_its_hooks():
    torch.manual_seed(0)
    eager = Net()
    net = copy.deepcopy(eager)
    seen: dict[str, list] = {"eager": [], "gm": []}
    eager.b.register_full_backward_hook(lambda m, gi, go: seen["eager"].append(go[0].clone()))
    net.b.register_full_backward_hook(lambda m, gi, go: seen["gm"].append(go[0].clone()))
    gm = fxdebug.instrument(net)
    x = torch.randn(3, 4)
    gm(x).sum().backward()
    eager(x).sum().backward()
    assert len(seen["gm"]) == len(seen["eager"]) == 1
    assert torch.equal(seen["gm"][0], seen["eager"][0])
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"][1] == "b"  # b ran whole
    assert torch.equal(net.a.fc.weight.grad, eager.a.fc.weight.grad)


def test_a_sequential_root_with_hooks_runs_them_once_and_its_children_only():
    torch.manual_seed(0)
    net = torch.nn.Sequential(Block(), torch.nn.Linear(4, 2))
    calls = []
    net.register_forward_pre_hook(lambda m, args: calls.append("pre") or (args[0] + 1,))
    net.register_forward_hook(lambda m, args, out: calls.append("post") or out * 3)
    gm = fxdebug.instrument(net)
    x = torch.randn(3, 4)
    out = gm(x)
    assert calls == ["pre", "post"]
    assert torch.equal(out, net(x)) and calls == ["pre", "post"] * 2
    assert fxdebug.records(gm).keys() == ["0.fc", "0", "1"]


def test_hooks_registered_after_instrument_on_a_module_that_had_none_run_like_eager():
    """The graph was made for no hooks on ``a``: a forward hook, a global forward hook and a
    backward hook registered later all run, as eager runs them (the graph is made again)."""
    torch.manual_seed(0)
    eager = Net()
    net = copy.deepcopy(eager)
    gm = fxdebug.instrument(net)
    x = torch.randn(3, 4)
    assert torch.equal(gm(x), eager(x))
    for model in (net, eager):
        model.a.register_forward_hook(lambda m, a, out: out * 3)
    assert torch.equal(gm(x), eager(x))
    handles = [torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, out: out + 1 if isinstance(m, torch.nn.Linear) else None) for _ in range(1)]
    try:
        assert torch.equal(gm(x), eager(x))
    finally:
        for handle in handles:
            handle.remove()
    seen: dict[str, list] = {"eager": [], "gm": []}
    eager.b.register_full_backward_hook(lambda m, gi, go: seen["eager"].append(go[0].clone()))
    net.b.register_full_backward_hook(lambda m, gi, go: seen["gm"].append(go[0].clone()))
    gm(x).sum().backward()
    eager(x).sum().backward()
    assert len(seen["gm"]) == len(seen["eager"]) == 1 and torch.equal(seen["gm"][0], seen["eager"][0])
    assert torch.equal(net.a.fc.weight.grad, eager.a.fc.weight.grad)
    assert "a" in fxdebug.records(gm).keys()  # still captured
