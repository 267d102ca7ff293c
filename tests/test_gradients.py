"""Gradient hooks, gradient edits, vjp and Jacobian norms against autograd ground truth."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torchvision

import fxdebug
from fxdebug.passes import GradHooks, GradTransform
from models import NestedOutputs, Reuse, SeedOneNet


def _retain_grad_truth(model, x, loss=lambda out: out.sum()):
    """Gradients of every module output by retain_grad(), keyed like fxdebug (n-th call: _n)."""
    outputs, calls, handles = {}, {}, []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(_m, _i, output, name=name):
            count = calls.get(name, 0)
            calls[name] = count + 1
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.retain_grad()
                outputs[name if count == 0 else f"{name}_{count}"] = output

        handles.append(module.register_forward_hook(hook))
    loss(model(x)).backward()
    for handle in handles:
        handle.remove()
    return {key: tensor.grad for key, tensor in outputs.items()}


def _without_inplace(model):
    """A copy whose in-place ReLUs are out of place: retain_grad then sees each value itself."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if hasattr(module, "inplace"):
            module.inplace = False
    return model


@pytest.mark.parametrize("factory, shape", [
    (torchvision.models.resnet18, (2, 3, 64, 64)),
    (Reuse, (3, 6)),
    (SeedOneNet, (1, 3, 8, 8)),
])
def test_every_activation_gradient_equals_retain_grad(factory, shape):
    model = factory().eval()
    x = torch.randn(shape)
    truth = _retain_grad_truth(_without_inplace(model), x)
    gm = fxdebug.instrument(model, grads=True)
    gm(x).sum().backward()
    grads = fxdebug.records(gm).grads
    assert set(grads.keys()) == set(truth)
    for key, expected in truth.items():
        torch.testing.assert_close(grads[key], expected, rtol=1e-5, atol=1e-6, msg=key)


def test_reused_module_gradients_are_per_call():
    model = Reuse().eval()
    gm = fxdebug.instrument(model, grads=True)
    gm(torch.randn(3, 6)).sum().backward()
    grads = fxdebug.records(gm).grads
    assert not torch.equal(grads["fc"], grads["fc_1"])
    assert grads.keys().index("fc_1") < grads.keys().index("fc"), "backward order"


def test_nested_outputs_get_gradients_per_leaf():
    gm = fxdebug.instrument(NestedOutputs(), grads=True)
    out = gm(torch.randn(2, 8))
    (out.logits.sum() + out.hidden.sum()).backward()
    keys = fxdebug.records(gm).grads.keys()
    assert "mix/value" in keys and "enc/1" in keys


def test_stats_mode_keeps_gradient_statistics_only():
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 64, 64)
    tensors = fxdebug.instrument(model, grads=True)
    tensors(x).sum().backward()
    stats = fxdebug.instrument(model, grads=True, mode="stats")
    stats(x).sum().backward()
    full, summary = fxdebug.records(tensors).grads, fxdebug.records(stats).grads
    assert summary.nbytes == 0 and summary.keys() == full.keys()
    for key in full:
        assert summary[key].norm == pytest.approx(full[key].norm().item(), rel=1e-5), key


def test_no_hooks_without_grad_and_no_saved_tensor_hooks():
    gm = fxdebug.instrument(Reuse(), grads=True)
    with torch.no_grad():
        gm(torch.randn(3, 6))
    assert len(fxdebug.records(gm).grads) == 0
    # PyTorch's own in-place check stays on: a real hazard still raises at backward
    x = torch.randn(4, requires_grad=True)

    class Hazard(torch.nn.Module):
        def forward(self, x):
            y = torch.sigmoid(x)
            y.mul_(2)
            return y

    hazard = fxdebug.instrument(Hazard(), grads=True, capture="all")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        hazard(x).sum().backward()


def test_first_nonfinite_gradient_is_visible_in_backward_order():
    class SqrtAtZero(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.out = torch.nn.Linear(3, 1)

        def forward(self, x):
            h = torch.relu(self.lin(x))
            return self.out(torch.sqrt(h))   # d sqrt(h)/dh = inf where h == 0

    model = SqrtAtZero()
    with torch.no_grad():
        model.lin.bias.fill_(-100.0)  # every h is 0
    gm = fxdebug.instrument(model, grads=True, capture="all")
    gm(torch.randn(2, 3)).sum().backward()
    rec = fxdebug.records(gm)
    assert rec.grads["out"].isfinite().all() and rec.grads["sqrt"].isfinite().all()
    assert rec.grads.record("relu").stats.nonfinite > 0
    assert "first non-finite gradient in backward order: relu" in rec.table()


def test_parameter_gradients_appear_in_the_table():
    model = SeedOneNet()
    gm = fxdebug.instrument(model, grads=True)
    gm(torch.randn(1, 3, 8, 8)).sum().backward()
    table = fxdebug.records(gm).table()
    expected = format(model.fc1.weight.grad.norm().item(), ".4g")
    row = next(line for line in table.splitlines() if line.startswith("fc1.weight"))
    assert row.split() == ["fc1.weight", "5x160", expected, "0"]


def _seed_one_by_hand(x):
    """Seed 001's hand-written hooks: clamp the conv-block gradient, zero the fc bias gradient."""

    class HookedNet(SeedOneNet):
        def forward(self, x):
            x = self.relu(self.conv(x))
            x.register_hook(lambda grad: torch.clamp(grad, min=0))
            return self.fc1(self.flatten(x))

    torch.manual_seed(1)
    net = HookedNet()
    handle = net.fc1.bias.register_hook(lambda grad: torch.zeros(grad.shape))
    (1 - net(x)).mean().backward()
    handle.remove()
    return {name: p.grad for name, p in net.named_parameters()}


def test_seed_001_gradient_edits_without_writing_hooks():
    x = torch.randn(1, 3, 8, 8)
    by_hand = _seed_one_by_hand(x)
    torch.manual_seed(1)
    net = SeedOneNet()
    gm = fxdebug.instrument(net, capture=[], passes=[
        GradTransform.clamp(min=0, include=["relu"]),
        GradTransform.zero(include=["fc1.bias"])])
    (1 - gm(x)).mean().backward()
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad, by_hand[name], rtol=0, atol=0, msg=name)
    assert torch.equal(net.fc1.bias.grad, torch.zeros(5))
    plain = {name: p.grad.clone() for name, p in net.named_parameters()}
    assert not torch.equal(plain["conv.weight"], _plain_grads(x)["conv.weight"]), \
        "the clamp must change something, or this test proves nothing"
    # the bias hook was one-shot: the original model's own backward is untouched
    net.zero_grad()
    (1 - net(x)).mean().backward()
    assert not torch.equal(net.fc1.bias.grad, torch.zeros(5))


def _plain_grads(x):
    torch.manual_seed(1)
    net = SeedOneNet()
    (1 - net(x)).mean().backward()
    return {name: p.grad for name, p in net.named_parameters()}


def test_grad_transform_scale_and_errors():
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    x = torch.randn(2, 3)
    net(x).sum().backward()
    expected = net[0].weight.grad.clone() * 3
    net.zero_grad()
    gm = fxdebug.instrument(net, capture=[], passes=[GradTransform.scale(3.0, include=["1"])])
    gm(x).sum().backward()
    torch.testing.assert_close(net[0].weight.grad, expected)
    with pytest.raises(fxdebug.SelectionError, match="needs include"):
        GradTransform.zero()
    with pytest.raises(fxdebug.SelectionError, match="Close parameter names: '0.bias'"):
        fxdebug.instrument(net, passes=[GradTransform.zero(include=["0.bais"])])


def test_grad_hooks_pass_is_a_pass():
    gm = fxdebug.trace(Reuse())
    result = GradHooks(capture=["fc*"])(gm)
    assert result.modified
    gm(torch.randn(3, 6)).sum().backward()
    assert fxdebug.records(gm).grads.keys() == ["fc_1", "fc"]


def test_vjp_equals_autograd_grad_on_live_tensors():
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 64, 64)
    live = {}
    hooks = [model.layer1[0].conv1.register_forward_hook(lambda m, i, o: live.setdefault("wrt", o)),
             model.layer2.register_forward_hook(lambda m, i, o: live.setdefault("of", o))]
    model(x)
    for hook in hooks:
        hook.remove()
    v = torch.randn_like(live["of"])
    (expected,) = torch.autograd.grad(live["of"], live["wrt"], grad_outputs=v)
    got = fxdebug.vjp(model, x, output="layer2", wrt="layer1.0.conv1", grad_outputs=v)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    ones = fxdebug.vjp(model, x, output="layer2", wrt="layer1.0.conv1")
    assert not torch.allclose(ones, got)


def test_vjp_wrt_a_value_later_overwritten_in_place():
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 64, 64)
    reference = _without_inplace(model)
    live = {}
    reference.bn1.register_forward_hook(lambda m, i, o: live.setdefault("bn1", o))
    out = reference(x)
    (expected,) = torch.autograd.grad(out.sum(), live["bn1"])
    torch.testing.assert_close(fxdebug.vjp(model, x, output="fc", wrt="bn1",
                                           grad_outputs=torch.ones(1, 1000)), expected)


def test_vjp_errors():
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 64, 64)
    with pytest.raises(fxdebug.FxdebugError, match="runs before"):
        fxdebug.vjp(model, x, output="layer1", wrt="layer2")
    with pytest.raises(fxdebug.SelectionError, match="Close keys: .*'layer1.0.conv1'"):
        fxdebug.vjp(model, x, output="layer2", wrt="layer1.0.conv")
    # the call shape of older releases, the inputs as one tuple: say what to pass
    with pytest.raises(fxdebug.FxdebugError) as caught:
        fxdebug.vjp(model, (x,), output="layer2", wrt="layer1.0.conv1")
    message = str(caught.value)
    assert "tuple of 1 tensor(s)" in message and "the model failed on it (TypeError: " in message
    assert "fxdebug.vjp(model, *inputs, output='layer2', wrt='layer1.0.conv1')" in message


def test_vjp_of_a_model_that_takes_a_tuple():
    """A model whose one input is a tuple gets it as it is (only a failure is explained)."""
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Tanh()

        def forward(self, pair):
            return self.b(self.a(pair[0]) + pair[1])

    model, pair = Pair(), (torch.randn(2, 3), torch.randn(2, 3))
    h = model.a(pair[0]).detach().requires_grad_(True)
    (want,) = torch.autograd.grad(model.b(h + pair[1]).sum(), h)
    torch.testing.assert_close(fxdebug.vjp(model, pair, output="b", wrt="a"), want)


def _exact_norms(layers, x):
    """||d(out)/d(h_i)||_F for h_i the output of layers[i], by torch.autograd.functional.jacobian."""
    norms, h = {}, x
    for i, layer in enumerate(layers):
        h = layer(h).detach()
        rest = torch.nn.Sequential(*layers[i + 1:])
        jac = torch.autograd.functional.jacobian(lambda t: rest(t), h)
        norms[str(i)] = jac.norm().item()
    return norms


@pytest.mark.parametrize("build, shape", [
    (lambda: torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                 torch.nn.ReLU(), torch.nn.Linear(16, 4)), (3, 6)),
    (lambda: torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.ReLU(),
                                 torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.Tanh(),
                                 torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 5)), (2, 2, 6, 6)),
])
def test_jacobian_norms_within_stated_error_of_exact_jacobian(build, shape):
    torch.manual_seed(0)
    net = build().eval()
    x = torch.randn(shape)
    exact = _exact_norms(list(net), x)
    samples = 512
    bound = math.sqrt(0.5 / samples)  # stated relative standard error of the norm
    estimate = fxdebug.jacobian_norms(net, x, samples=samples)
    assert set(estimate.norms) == set(exact)
    for key, true_norm in exact.items():
        relative = abs(estimate.norms[key] - true_norm) / true_norm
        assert relative < 4 * bound, (key, relative, bound)   # 4 sigma: 12.5% at 512 samples
        assert estimate.stderr[key] / true_norm <= 1.5 * bound, key
    last = str(len(net) - 1)
    assert estimate.norms[last] == pytest.approx(math.sqrt(exact[last] ** 2), rel=1e-6)


def test_jacobian_norms_batched_and_loop_agree():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    x = torch.randn(2, 4)
    loop = fxdebug.jacobian_norms(net, x, samples=16, batched=False)
    batched = fxdebug.jacobian_norms(net, x, samples=16, batched=True)
    assert batched.batched
    for key in loop.norms:
        assert batched.norms[key] == pytest.approx(loop.norms[key], rel=1e-5)


def test_jacobian_norms_of_an_intermediate_output():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x = torch.randn(2, 4)
    est = fxdebug.jacobian_norms(net, x, output="1", samples=256)
    exact = torch.autograd.functional.jacobian(torch.tanh, net[0](x).detach()).norm().item()
    assert est.norms["0"] == pytest.approx(exact, rel=0.15)
    assert est.norms["2"] == 0.0, "the output does not depend on later nodes"
    assert "Rademacher" in est.table()


class _MixedOutputs(torch.nn.Module):
    """Activations of every kind record_grads meets: float, integer, not requiring grad, a
    leaf (a parameter returned as is), one overwritten in place later."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)
        self.scale = torch.nn.Parameter(torch.full((6,), 2.0))
        self.pick = _Argmax()
        self.frozen = torch.nn.Linear(6, 6).requires_grad_(False)
        self.own = _ReturnsParameter()

    def forward(self, x):
        h = self.fc(x)
        index = self.pick(h)                       # integer: no gradient
        cold = self.frozen(x.detach())             # no grad: no hook
        y = h * self.own(self.scale) + cold        # a leaf: noted, not hooked
        y.mul_(3)                                  # in place, after fc's value was hooked
        return y.sum(1) + index.float()


class _Argmax(torch.nn.Module):
    def forward(self, h):
        return h.argmax(1)


class _ReturnsParameter(torch.nn.Module):
    def forward(self, p):
        return p


def test_every_kind_of_activation_and_a_user_hook_beside_fxdebugs():
    torch.manual_seed(0)
    model = _MixedOutputs()
    x = torch.randn(4, 6)
    h = model.fc(x)
    h.retain_grad()
    y = h * model.scale + model.frozen(x)
    y.mul_(3)
    (y.sum(1) + h.argmax(1).float()).sum().backward()
    fc_truth = h.grad
    model.zero_grad(set_to_none=True)

    gm = fxdebug.instrument(model, grads=True)
    seen, handles = [], []
    # a user's hooks on the same activation, one removed again: fxdebug's hook stays
    gm.get_submodule("fc").register_forward_hook(
        lambda _m, _i, out: handles.append(out.register_hook(lambda g: seen.append(g))))
    gm.get_submodule("fc").register_forward_hook(
        lambda _m, _i, out: out.register_hook(lambda g: seen.append(g * 0)).remove())
    out = gm(x)
    out.sum().backward(retain_graph=True)
    rec = fxdebug.records(gm)
    assert rec.grads.keys() == ["fc"], rec.grads.keys()  # pick: integer, frozen, own: a leaf
    torch.testing.assert_close(rec.grads["fc"], fc_truth)
    assert len(seen) == 1 and torch.equal(seen[0], fc_truth)
    assert any("own: a leaf tensor" in note for note in rec.notes), rec.notes
    handles[0].remove()  # the user's handle removes the user's hook only
    out.sum().backward()
    torch.testing.assert_close(fxdebug.records(gm).grads["fc"], fc_truth)
    assert len(seen) == 1


class _DoubleGradInPlace(torch.autograd.Function):
    """Identity whose backward doubles its incoming gradient in place (as fused kernels do)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.mul_(2)


class _WritesItsGradient(torch.nn.Module):
    def forward(self, x):
        return _DoubleGradInPlace.apply(x)


def test_stats_mode_gradients_are_those_the_hook_saw_even_when_backward_writes_them():
    """Small gradients are summarized together when backward ends, from copies: a gradient a
    backward function doubles in place afterwards still shows what reached its activation."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), _WritesItsGradient(), torch.nn.Tanh())
    x = torch.randn(4, 6)
    gm = fxdebug.instrument(model, grads=True, mode="stats")
    gm(x).sum().backward()
    grads = fxdebug.records(gm).grads
    with torch.no_grad():  # ground truth by hand: d sum(tanh(z)) / dz = 1 - tanh(z)^2
        z = model[0](x)
    expected = {"2": torch.ones(4, 5), "1": 1 - torch.tanh(z) ** 2,
                "0": 2 * (1 - torch.tanh(z) ** 2)}
    assert grads.keys() == ["2", "1", "0"]
    for key, value in expected.items():
        assert grads[key].mean == pytest.approx(value.mean().item(), rel=1e-6), key
        assert grads[key].norm == pytest.approx(value.norm().item(), rel=1e-6), key
        assert (grads[key].min, grads[key].max) == pytest.approx(
            (value.min().item(), value.max().item()), rel=1e-6), key


class _AddsParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(3))
        self.act = torch.nn.Tanh()

    def forward(self, x):
        return self.act(x + self.p) * 2


def test_an_activation_gradient_that_is_also_a_parameters_grad_survives_clipping():
    """``x + p``'s gradient is exactly ``p``'s: autograd hands that very tensor on as
    ``p.grad`` unless something else holds it, and clipping then scales it in place. The
    recorded gradient is what reached the activation, before and after clipping."""
    torch.manual_seed(0)
    model, x = _AddsParameter(), torch.randn(3)
    gm = fxdebug.instrument(model, grads=True, capture="all")
    gm(x).sum().backward()
    expected = 2 * (1 - torch.tanh(x) ** 2)  # d sum(2 tanh(h)) / dh, by hand (p is zero)
    grads = fxdebug.records(gm).grads
    torch.testing.assert_close(grads["add"], expected)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert model.p.grad.norm() <= 1e-3 + 1e-9
    torch.testing.assert_close(grads["add"], expected)
