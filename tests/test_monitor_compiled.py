"""fxdebug.monitor on a torch.compile module: at every logged step the series equal float64
statistics of forward hooks, retain_grad and parameter copies on an eager replica of the step;
one compiled graph per cadence (no recompilation as steps pass); remove() gives the compiled
forward back; what is not supported says what to do."""

from __future__ import annotations

import copy

import pytest
import torch

import fxdebug
from fxdebug.errors import FxdebugError

from test_monitor import assert_stats, hooked, pooled, reference


class Net(torch.nn.Module):
    """A tiny MLP with a BatchNorm whose output a later in-place ReLU overwrites."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.act = torch.nn.ReLU(inplace=True)
        self.fc2 = torch.nn.Linear(width, 3)

    def forward(self, x):
        return self.fc2(self.act(self.bn(self.fc1(x))))


class Wide(torch.nn.Module):
    """Activations of 4096 values and more: inductor's float32 summaries."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 256)
        self.act = torch.nn.Tanh()

    def forward(self, x):
        return self.act(self.fc(x))


def counting(backend: str, graphs: list):
    """A dynamo backend that counts the graphs it compiles, then compiles them with ``backend``."""
    from torch._dynamo.backends.registry import lookup_backend

    def compile_graph(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)
    return compile_graph


def eager_reference(net, x) -> dict[str, dict[str, float]]:
    """float64 statistics of one training step of an eager replica of ``net`` (same parameters,
    same buffers): forward hooks with retain_grad, parameters and their gradients."""
    replica = copy.deepcopy(net)
    replica.__dict__.pop("forward", None)  # the monitor's forward wrapper, when it is on net
    for module in replica.modules():  # the same math, each output kept as the module made it
        if getattr(module, "inplace", False):
            module.inplace = False
    names = [name for name, _ in replica.named_modules() if name]
    kept = hooked(replica, names)
    replica(x).pow(2).mean().backward()
    found = {}
    for name in names:
        found[f"{name}.out"] = reference(kept[name])
        found[f"{name}.grad"] = reference(kept[name].grad)
        own = list(dict(replica.named_modules())[name].parameters(recurse=False))
        if own:
            found[f"{name}.param"] = reference(pooled(own))
            found[f"{name}.param_grad"] = reference(pooled(p.grad for p in own))
    return found


def run(net, mon, batches, seen, check=True) -> dict[int, dict]:
    """SGD steps through ``mon.model``; the eager replica's statistics of each logged step."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    expected = {}
    for step, x in enumerate(batches):
        if mon._logging and check:
            expected[step] = eager_reference(net, x)
        loss = mon.model(x).pow(2).mean()
        loss.backward()
        mon.step(loss)
        optimizer.step()
        optimizer.zero_grad()
    return expected


def assert_series(seen, expected):
    for step, found in expected.items():
        for name, stats in found.items():
            got = {stat: seen[step][f"{name}.{stat}"] for stat in stats}
            assert_stats(got, stats, f"step {step} {name}")


def test_compiled_series_equal_float64_statistics_without_recompiling():
    torch.manual_seed(0)
    net = Net()
    graphs: list = []
    compiled = torch.compile(net, backend=counting("aot_eager", graphs))
    seen: dict[int, dict] = {}
    batches = [torch.randn(16, 6) for _ in range(52)]
    keep = (lambda s, v: seen.setdefault(s, {}).update(v))
    with fxdebug.monitor(compiled, every=5, callback=keep) as mon:
        assert mon.model is compiled
        expected = run(net, mon, batches[:2], seen)  # the first logged step, the first off-step
        assert len(graphs) == 2  # the user's graph and the logged copy's
        expected.update({step + 2: e for step, e in run(net, mon, batches[2:], seen).items()})
        assert len(graphs) == 2, "a step recompiled"  # 50 steps, 10 logged: nothing new
    assert sorted(expected) == list(range(0, 52, 5))
    assert_series(seen, expected)
    assert "bn.grad.kurtosis" in seen[50] and "act.out.kurtosis" in seen[50]


def test_remove_gives_back_the_compiled_forward():
    torch.manual_seed(0)
    net = Net()
    graphs: list = []
    compiled = torch.compile(net, backend=counting("aot_eager", graphs))
    own = compiled.forward
    x = torch.randn(4, 6)
    compiled(x)
    mon = fxdebug.monitor(compiled, every=2)
    for _ in range(3):
        mon.model(x).sum().backward()
        mon.step()
    mon.remove()
    assert compiled.forward is own and "forward" not in net.__dict__
    count = len(graphs)
    assert torch.equal(compiled(x), net(x))
    assert len(graphs) == count  # the user's compiled graph, as before


def test_mon_model_compiled_after_attaching():
    torch.manual_seed(1)
    net = Net()
    seen: dict[int, dict] = {}
    keep = (lambda s, v: seen.setdefault(s, {}).update(v))
    with fxdebug.monitor(net, every=3, callback=keep) as mon:
        mon.model = torch.compile(mon.model, backend="aot_eager")
        expected = run(net, mon, [torch.randn(16, 6) for _ in range(4)], seen)
        assert mon._compiled is not None  # the logged copy is the graph-op one
    assert sorted(expected) == [0, 3]
    assert_series(seen, expected)


def test_inductor_summaries_in_float32_equal_float64_statistics():
    torch.manual_seed(2)
    net = Wide()
    graphs: list = []
    seen: dict[int, dict] = {}
    compiled = torch.compile(net, backend=counting("inductor", graphs))
    batches = [torch.randn(32, 16) for _ in range(2)]
    keep = (lambda s, v: seen.setdefault(s, {}).update(v))
    with fxdebug.monitor(compiled, every=1, callback=keep) as mon:
        expected = run(net, mon, batches, seen)  # every step logged: the copy's graph only
    assert len(graphs) == 1 and sorted(expected) == [0, 1]
    scaled = ("mean", "std", "min", "max", "absmax", "rms")
    for step, found in expected.items():  # float32 sums of 8192 values: 1e-4 of the scale
        for name, stats in found.items():
            for stat, value in stats.items():
                got = seen[step][f"{name}.{stat}"]
                scale = stats["rms"] if stat in scaled else abs(value)
                assert abs(got - value) <= 1e-4 * max(scale, 1e-12), (step, name, stat, got)


def test_what_is_not_supported_says_what_to_do():
    net = Net()
    net.compile(backend="aot_eager")
    with pytest.raises(FxdebugError, match=r"torch.compile\(model\)"):
        fxdebug.monitor(net)
    with pytest.raises(FxdebugError, match="Monitor the eager model under DataParallel"):
        fxdebug.monitor(torch.compile(torch.nn.DataParallel(Net()), backend="aot_eager"))

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x) if x.sum() > 0 else -self.fc(x)
    with pytest.raises(FxdebugError, match="Monitor the eager model"):
        fxdebug.monitor(torch.compile(Branchy(), backend="aot_eager"))
