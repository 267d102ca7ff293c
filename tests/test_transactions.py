"""trace and instrument are transactions: whatever fails, at any step, leaves the model as it was.

A failure is injected at each step of ``instrument`` (and of ``trace`` with the export front
end), after the step has done every kind of harm a model can suffer: an attribute set, a hook
registered (on a module and process-wide), requires_grad cleared, a training flag flipped, a
module's class swapped, a submodule registered, a parameter and a buffer replaced, ``.data``
and ``.grad`` replaced, the state of an object a hook is bound to changed. Ground truth is
another snapshot than fxdebug's (state_dict tensors bitwise and where they live,
named_parameters identity, every module's ``__dict__`` by identity, hook dictionaries, class)
and a twin that was never instrumented: the model's eager outputs and gradients equal the
twin's bitwise. A trace that succeeds leaves nothing either (forward hooks run on Proxies while
fx traces), and an FSDP2 model on a gloo world of 1 keeps working after a failed instrument.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

import fxdebug
import fxdebug.tracing.export as export_module
import fxdebug.tracing.fx_tracer as fx_tracer
from fxdebug.passes import Capture, EagerRegions, GradHooks
from ranks import on_ranks

instrument_module = importlib.import_module("fxdebug.instrumenting")


class Scale:
    """A user's hook with state of its own, the way FSDP's and DDP's hooks are bound to theirs."""

    def __init__(self) -> None:
        self.factor = 1.0

    def hook(self, module, args, output):
        return output * self.factor


class Net(nn.Module):
    def __init__(self, branch_at_root: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.act = nn.ReLU()
        self.head = nn.Linear(8, 3)
        self.scale = Scale()
        self.fc.register_forward_hook(self.scale.hook)
        self.branch_at_root = branch_at_root

    def forward(self, x):
        if self.branch_at_root and x.sum() > 1e9:  # the root cannot be traced: part by part
            x = x * 0
        return self.head(self.act(self.bn(self.fc(x))))


class _Tanh(nn.ReLU):
    def forward(self, x):
        return torch.tanh(x)


def vandalize(model: Net, done: list) -> None:
    """Every kind of change a step of fxdebug could make to the user's model."""
    model.fc.cache = object()
    model.fc.register_forward_hook(lambda module, args, output: output * 2)
    model.head.weight.requires_grad_(False)
    model.bn.eval()
    model.act.__class__ = _Tanh
    model.add_module("extra", nn.Linear(1, 1))
    model.head.bias = nn.Parameter(torch.zeros(3))
    model.fc.weight.data = torch.zeros(8, 6)
    model.fc.weight.grad = torch.ones(8, 6)
    model.bn.register_buffer("running_mean", torch.ones(8))
    model.scale.factor = 3.0
    head = model.head
    done.append(torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: output + 1 if module is head else None))


class InjectedFault(RuntimeError):
    pass


def snapshot(model: nn.Module) -> dict:
    """The model's state as the test sees it, independently of fxdebug's snapshot."""
    modules = {}
    for path, module in model.named_modules(remove_duplicate=False):
        state = {name: (id(value), tuple((k, id(v)) for k, v in value.items())
                        if isinstance(value, dict) else None)
                 for name, value in vars(module).items()}
        modules[path] = (type(module), state)
    parameters = [(name, id(p), p.requires_grad, id(p.grad), p.data_ptr(), tuple(p.shape))
                  for name, p in model.named_parameters()]
    tensors = {name: (t.data_ptr(), t.detach().clone())
               for name, t in model.state_dict(keep_vars=True).items()}
    return {"modules": modules, "parameters": parameters, "tensors": tensors,
            "hook state": dict(vars(model.scale)) if hasattr(model, "scale") else None}


def assert_same_snapshot(before: dict, after: dict) -> None:
    assert after["modules"] == before["modules"]
    assert after["parameters"] == before["parameters"]
    assert after["hook state"] == before["hook state"]
    assert list(after["tensors"]) == list(before["tensors"])
    for name, (pointer, tensor) in before["tensors"].items():
        assert after["tensors"][name][0] == pointer, name
        assert torch.equal(after["tensors"][name][1], tensor), name


def assert_runs_like_twin(model: nn.Module, twin: nn.Module, x: torch.Tensor) -> None:
    for step in range(2):
        out, expected = model(x), twin(x)
        assert torch.equal(out, expected), step
        out.square().sum().backward()
        expected.square().sum().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)


def _fail_after_harm(model, done, original=None):
    def step(*args, **kwargs):
        if original is not None:
            original(*args, **kwargs)
        vandalize(model, done)
        raise InjectedFault("a step of fxdebug failed")
    return step


def _method(cls):
    return lambda model, done, monkeypatch: monkeypatch.setattr(
        cls, "apply", lambda self, gm: _fail_after_harm(model, done)())


STAGES = {
    "tracing": lambda model, done, monkeypatch: monkeypatch.setattr(
        fx_tracer, "lower_inplace_operators", _fail_after_harm(model, done)),
    "capture pass": _method(Capture),
    "grads pass": _method(GradHooks),
    "eager regions pass": _method(EagerRegions),
    "recorder setup": lambda model, done, monkeypatch: monkeypatch.setattr(
        instrument_module, "capture_locations", _fail_after_harm(model, done)),
    "save_to writer setup": lambda model, done, monkeypatch: monkeypatch.setattr(
        instrument_module, "RunWriter", _fail_after_harm(model, done)),
    "partial path": lambda model, done, monkeypatch: monkeypatch.setattr(
        instrument_module, "instrument_parts",
        _fail_after_harm(model, done, instrument_module.instrument_parts)),
}


def _user_pass(model, done):
    def harmful(gm):
        _fail_after_harm(model, done)()
    return harmful


def _graph_breaking_pass(model, done):
    def breaks_the_graph(gm):  # a node reading a node of another graph: graph.lint() fails
        vandalize(model, done)
        stranger = torch.fx.Graph().placeholder("stranger")
        output = next(node for node in gm.graph.nodes if node.op == "output")
        with gm.graph.inserting_before(output):
            gm.graph.call_function(torch.neg, (stranger,))
        return gm
    return breaks_the_graph


@pytest.mark.parametrize("stage", [*STAGES, "user pass", "recompile/lint"])
def test_a_failure_at_any_step_of_instrument_leaves_the_model_as_it_was(stage, monkeypatch,
                                                                         tmp_path):
    torch.manual_seed(0)
    model = Net(branch_at_root=stage == "partial path")
    twin = copy.deepcopy(model)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    done: list = []
    passes = []
    if stage == "user pass":
        passes = [_user_pass(model, done)]
    elif stage == "recompile/lint":
        passes = [_graph_breaking_pass(model, done)]
    else:
        STAGES[stage](model, done, monkeypatch)
    before = snapshot(model)
    try:
        with pytest.raises(Exception) as failure:
            fxdebug.instrument(model, grads=True, passes=passes,
                               folder=tmp_path / "runs" if stage == "save_to writer setup"
                               else None)
        assert done, "the injected harm never ran: the test would prove nothing"
        if stage != "recompile/lint":
            assert failure.type is InjectedFault
        assert_same_snapshot(before, snapshot(model))
        assert_runs_like_twin(model, twin, x)
    finally:
        for handle in done:
            handle.remove()


def test_a_failure_in_the_export_front_end_leaves_the_model_as_it_was(monkeypatch):
    torch.manual_seed(0)
    model, done = Net(), []
    twin = copy.deepcopy(model)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(export_module, "_assign_keys", _fail_after_harm(model, done))
    before = snapshot(model)
    try:
        with pytest.raises(InjectedFault):
            fxdebug.trace(model, x, frontend="export")
        assert done
        assert_same_snapshot(before, snapshot(model))
        assert_runs_like_twin(model, twin, x)
    finally:
        for handle in done:
            handle.remove()


def test_what_runs_under_a_successful_trace_is_put_back(monkeypatch):
    torch.manual_seed(0)
    model, done = Net(), []
    twin = copy.deepcopy(model)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    real_trace = fx_tracer._Tracer.trace

    def trace_that_writes(self, root, concrete_args=None):  # a forward or hook writing state
        graph = real_trace(self, root, concrete_args)
        vandalize(model, done)
        return graph

    monkeypatch.setattr(fx_tracer._Tracer, "trace", trace_that_writes)
    before = snapshot(model)
    try:
        gm = fxdebug.instrument(model)
        assert done
        assert_same_snapshot(before, snapshot(model))
        assert torch.equal(gm(x), twin(x))  # the instrumented module runs the model as it was
        twin.zero_grad()
        assert_runs_like_twin(model, twin, x)
    finally:
        for handle in done:
            handle.remove()


class _Keeper:
    """A hook's state that reads a parameter by attribute, as FSDP's lazy init does."""

    def __init__(self, block: nn.Module) -> None:
        self.weight = block.fc.weight

    def pre_hook(self, module, args):
        self.weight = module.fc.weight  # under torch.fx's tracing, a Proxy of it


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu()


def test_a_hook_reading_parameters_under_tracing_keeps_the_real_parameter():
    net = nn.Sequential(_Block(), nn.Linear(4, 2))
    keeper = _Keeper(net[0])
    net[0].register_forward_pre_hook(keeper.pre_hook)
    gm = fxdebug.instrument(net)
    assert keeper.weight is net[0].fc.weight  # not a Proxy whose attributes are Proxies too
    x = torch.randn(3, 4)
    assert torch.equal(gm(x), net(x))


# -- FSDP2 on a gloo world of 1 --------------------------------------------------------------
def _sharded(world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    mesh = init_device_mesh("cpu", (world,))
    for block in (net[0], net[2], net[4], net):
        fully_shard(block, mesh=mesh)
    return net


def _runs_like_twin(net: nn.Module, twin: nn.Module) -> bool:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        out, expected = net(x), twin(x)
        if not torch.equal(out, expected):
            return False
        out.sum().backward()
        expected.sum().backward()
        if not all(torch.equal(p.grad.full_tensor(), q.grad.full_tensor())
                   for p, q in zip(net.parameters(), twin.parameters())):
            return False
    return True


def _module_dicts(net: nn.Module) -> list:
    return [(path, type(m), [(k, id(v)) for k, v in vars(m).items()])
            for path, m in net.named_modules()]


def _fsdp2_world_of_one(rank, world):
    found = {}
    net, twin = _sharded(world), _sharded(world)
    before = _module_dicts(net)
    fxdebug.instrument(net)  # FSDP2 is traced: no hook of FSDP's runs at trace time
    found["instrumented: unchanged"] = _module_dicts(net) == before
    found["instrumented: runs like twin"] = _runs_like_twin(net, twin)
    net, twin = _sharded(world), _sharded(world)
    fxdebug.trace(net)
    found["traced: runs like twin"] = _runs_like_twin(net, twin)

    def fails(gm):
        raise InjectedFault("a pass failed after the trace")

    net, twin = _sharded(world), _sharded(world)
    try:
        fxdebug.instrument(net, passes=[fails])
    except InjectedFault:
        found["failed pass: runs like twin"] = _runs_like_twin(net, twin)
    try:
        fxdebug.trace(_sharded(world), torch.randn(2, 4), frontend="export")
    except fxdebug.FxdebugError as error:
        found["export"] = str(error)
    return found


def test_fsdp2_model_keeps_working_after_instrument_and_after_a_failed_one():
    found = on_ranks(_fsdp2_world_of_one, 1)[0]
    error = found.pop("export")
    assert "frontend='export'" in error and "fully_shard" in error and "'', '0', '2', '4'" in error
    assert "test_transactions.py:" in error  # the user's line that asked
    assert found == {"instrumented: unchanged": True, "instrumented: runs like twin": True,
                     "traced: runs like twin": True, "failed pass: runs like twin": True}


def _instrument_then_shard(rank, world):
    """Instrumenting first and sharding the result works too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    plain = copy.deepcopy(net)  # the eager model, never sharded
    gm = fxdebug.instrument(net)
    mesh = init_device_mesh("cpu", (world,))
    for path in ("0", "2", "4"):
        fully_shard(gm.get_submodule(path), mesh=mesh)
    fully_shard(gm, mesh=mesh)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    out = gm(x)
    hidden = plain[:2](x)  # what the eager model's first block and ReLU give
    return (torch.equal(out, plain(x)), fxdebug.records(gm).keys(),
            torch.equal(fxdebug.records(gm)["1"], hidden))


def test_instrument_first_then_shard():
    same_output, keys, same_capture = on_ranks(_instrument_then_shard, 1)[0]
    assert same_output and same_capture
    assert keys == ["0", "1", "2", "3", "4"]
