"""watch_nonfinite checks the parameters the model has at each step, however they changed.

The watch plans its per-step gradient check once per parameter list and keeps the
plan while the walk at each step finds the same parameters. Each route by which torch
or a user changes parameters between steps is taken here, then a NaN is put into the
gradient of one parameter the model now has; ground truth is the model's own
``named_parameters()``: the one parameter whose gradient holds a NaN must be flagged
and named.
"""

import gc

import pytest
import torch

import fxdebug


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(),
                                        torch.nn.Linear(4, 2))
        self.scale = torch.nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.body(x) * self.scale


def _fresh(tensor):
    return torch.nn.Parameter(tensor.detach().clone())


@pytest.fixture
def future_flags():
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    yield
    torch.__future__.set_overwrite_module_params_on_conversion(overwrite)
    torch.__future__.set_swap_module_params_on_conversion(swap)


def _setattr(net):
    net.body[0].weight = _fresh(net.body[0].weight)
    return "body.0.weight"


def _registry_write(net):  # no registration hook runs
    vars(net.body[2])["_parameters"]["bias"] = _fresh(net.body[2].bias)
    return "body.2.bias"


def _registry_replaced(net):  # the registry dict itself replaced
    vars(net.body[0])["_parameters"] = {"weight": _fresh(net.body[0].weight),
                                        "bias": _fresh(net.body[0].bias)}
    return "body.0.bias"


def _delete_and_register(net):
    fresh = _fresh(net.scale)
    del net.scale
    net.register_parameter("scale", fresh)
    return "scale"


def _to_overwriting(net):  # _apply writes new Parameters into the registries directly
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    net.double()
    return "body.2.weight"


def _to_swapping(net):  # same Parameter objects, new dtype
    torch.__future__.set_swap_module_params_on_conversion(True)
    net.double()
    return "body.0.weight"


def _to_in_place(net):  # param.data = ... : same objects, new dtype
    net.double()
    return "scale"


def _module_inserted(net):  # Sequential.insert writes _modules directly
    net.body.insert(2, torch.nn.Linear(4, 4))
    return "body.2.weight"


def _module_deleted(net):  # Sequential.__delitem__ replaces _modules
    del net.body[1]
    return "body.1.bias"


def _state_dict_assigned(net):
    net.load_state_dict({k: v.detach().clone() for k, v in net.state_dict().items()},
                        assign=True)
    return "body.2.weight"


ROUTES = [_setattr, _registry_write, _registry_replaced, _delete_and_register,
          _to_overwriting, _to_swapping, _to_in_place, _module_inserted, _module_deleted,
          _state_dict_assigned]


def _step(watch, net, x):
    net.zero_grad(set_to_none=True)
    watch(x).sum().backward()


@pytest.mark.parametrize("route", ROUTES, ids=[r.__name__.strip("_") for r in ROUTES])
def test_nan_in_a_parameter_changed_between_steps_is_caught_and_named(route, future_flags):
    torch.manual_seed(0)
    net = Net()
    watch = fxdebug.watch_nonfinite(net)
    x = torch.randn(5, 3)
    for _ in range(2):  # the check planned and used for the model as built
        _step(watch, net, x)
        assert watch.check() is None
    before = {name: p for name, p in net.named_parameters()}
    target = route(net)
    changed = [name for name, p in net.named_parameters()
               if before.get(name) is not p or p.dtype != torch.float32]
    assert target in changed  # the route did change the parameter the NaN goes into
    x = x.to(next(net.parameters()).dtype)
    _step(watch, net, x)
    assert watch.check() is None  # the changed model, all finite
    _step(watch, net, x)
    with torch.no_grad():
        dict(net.named_parameters())[target].grad.view(-1)[0] = float("nan")
    # ground truth: the model's own parameters, the one gradient with a NaN
    assert [name for name, p in net.named_parameters()
            if p.grad is not None and torch.isnan(p.grad).any()] == [target]
    report = watch.check()
    assert report is not None and report.flagged == "gradients NaN"
    assert report.flagged_detail == f"gradients of 1 parameter(s): {target}"
    watch.remove()


def test_frozen_parameters_and_a_nan_beside_them():
    """Gradients that are None (frozen) sit in the same group as the one with a NaN."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)])
    watch = fxdebug.watch_nonfinite(net)
    x = torch.randn(2, 3)
    _step(watch, net, x)
    assert watch.check() is None
    for layer in (net[0], net[2]):
        layer.requires_grad_(False)
    _step(watch, net, x)
    assert net[0].weight.grad is None and watch.check() is None
    _step(watch, net, x)
    with torch.no_grad():
        net[3].weight.grad[1, 2] = float("inf")
    report = watch.check()
    assert report is not None and report.flagged == "gradients Inf"
    assert report.flagged_detail == "gradients of 1 parameter(s): 3.weight"


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.scale = torch.nn.Parameter(torch.ones(4))  # planned with fc.bias, 1-D

    def forward(self, x):
        return self.fc(x) * self.scale


def test_parameter_reshaped_in_place_between_steps():
    """``p.data = `` with a new number of dimensions: the planned concatenation refuses it."""
    torch.manual_seed(0)
    net = Scaled()
    watch = fxdebug.watch_nonfinite(net)
    x = torch.randn(2, 3)
    _step(watch, net, x)
    assert watch.check() is None
    net.scale.data = torch.ones(1, 4)  # broadcasts as before; now 2-D
    _step(watch, net, x)  # the first step after: the plan's concatenation is refused
    assert net.scale.grad.shape == (1, 4)
    with torch.no_grad():
        net.scale.grad[0, 3] = float("nan")
    report = watch.check()
    assert report is not None and report.flagged_detail == "gradients of 1 parameter(s): scale"


def test_sparse_gradient_nan_is_confirmed_and_named():
    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3, sparse=True)
            self.fc = torch.nn.Linear(3, 1)

        def forward(self, index):
            return self.fc(self.embed(index))

    torch.manual_seed(0)
    net = Bag()
    watch = fxdebug.watch_nonfinite(net)
    index = torch.tensor([1, 2])
    _step(watch, net, index)
    assert watch.check() is None
    _step(watch, net, index)
    assert net.embed.weight.grad.layout is torch.sparse_coo
    with torch.no_grad():
        net.embed.weight.grad._values()[0, 0] = float("nan")
    report = watch.check()
    assert report is not None and report.flagged == "gradients NaN"
    assert report.flagged_detail == "gradients of 1 parameter(s): embed.weight"


def test_registration_hooks_go_with_the_watch():
    """Held from the first step while the watch lives; gone once it is garbage collected."""
    from torch.nn.modules import module as torch_module
    tables = [vars(torch_module).get(name, {}) for name in
              ("_global_parameter_registration_hooks", "_global_module_registration_hooks")]
    watch = fxdebug.watch_nonfinite(torch.nn.Linear(2, 2))
    watch(torch.ones(1, 2)).sum().backward()
    assert watch.check() is None
    registrations = watch._registrations  # the hook object (it does not hold the watch)
    assert all(any(hook is registrations for hook in table.values()) for table in tables)
    del watch
    gc.collect()
    assert not any(hook is registrations for table in tables for hook in table.values())


def test_the_walk_finds_what_parameters_and_buffers_find():
    """The watch's walk of the module tree (torch_compat.parameters_and_buffers): the same
    tensors in the same order as torch's parameters() and buffers(), on trees with shared
    modules, tied parameters, None slots and cycles."""
    import random

    import torchvision

    from fxdebug.base.torch_compat import parameters_and_buffers

    def ids(tensors):
        return [id(t) for t in tensors]

    random.seed(0)
    models = [torchvision.models.resnet18()]
    for _ in range(100):
        modules = [torch.nn.Module() for _ in range(6)]
        for module in modules:
            if random.random() < 0.5:
                module.register_parameter("p", torch.nn.Parameter(torch.ones(1)))
            if random.random() < 0.3:
                module.register_buffer("b", torch.ones(1))
            if random.random() < 0.2:
                module.register_parameter("none", None)
        for module in modules:
            for slot in range(random.randint(0, 3)):  # shared children, cycles, None slots
                child = modules[random.randrange(6)] if random.random() < 0.9 else None
                module.register_module(f"c{slot}", child)
            tied = [m.p for m in modules if "p" in vars(m)["_parameters"]]
            if tied and random.random() < 0.2:
                module.register_parameter("tied", random.choice(tied))
            shared = [m.b for m in modules if "b" in vars(m)["_buffers"]]
            if shared and random.random() < 0.2:
                module.register_buffer("shared", random.choice(shared))
        models.append(modules[0])
    for model in models:
        parameters, buffers = parameters_and_buffers(model)
        assert ids(parameters) == ids(model.parameters())
        assert ids(buffers) == ids(model.buffers())
