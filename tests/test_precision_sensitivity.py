"""precision_sensitivity and choose(): a planted sensitive node ranked first, errors and the
chosen set's error recomputed against an eager float64 run, the filter torchao takes."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import fxdebug
from fxdebug.errors import FxdebugError

OUTLIER = 1e6


class Planted(torch.nn.Module):
    """``big`` reads an outlier channel (with zero weight) next to ordinary activations: with
    one amax scale for the whole tensor, float8 cannot hold both, and the small ones vanish."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.big = torch.nn.Linear(33, 32)
        self.c = torch.nn.Linear(32, 4)
        with torch.no_grad():
            self.big.weight[:, -1] = 0

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.cat([h, torch.full_like(h[:, :1], OUTLIER)], dim=1)
        return self.c(torch.tanh(self.big(h)))


LABELS = torch.arange(8) % 4


def _loss(out):
    return F.cross_entropy(out, LABELS)


@pytest.fixture(scope="module")
def planted():
    torch.manual_seed(0)
    net, x = Planted(), torch.randn(8, 16)
    return net, x, fxdebug.precision_sensitivity(net, x, loss=_loss)


def _float64_step(net, x):
    """The step in float64, eagerly: the loss and the parameter gradients."""
    net64 = copy.deepcopy(net).double()
    loss = _loss(net64(x.double()))
    return loss.detach(), torch.autograd.grad(loss, list(net64.parameters()))


def _errors(gm, net, x):
    """Loss and gradient errors of ``gm`` (sharing ``net``'s parameters) against float64."""
    loss64, grads64 = _float64_step(net, x)
    loss = _loss(gm(x))
    grads = torch.autograd.grad(loss, list(net.parameters()))
    loss_error = abs(loss.double() - loss64).item() / abs(loss64).item()
    difference = sum(float((g.double() - r).square().sum()) for g, r in zip(grads, grads64))
    norm = sum(float(r.square().sum()) for r in grads64)
    return loss_error, (difference / norm) ** 0.5


def test_planted_node_is_ranked_first_with_range_as_its_cause(planted):
    net, x, rep = planted
    top = rep.entries[0]
    assert (top.key, top.dtype, top.cause) == ("big", "float8_e4m3fn", "range")
    # the underflow fraction, counted from the activation a forward hook sees
    seen = []
    handle = net.big.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    net(x)
    handle.remove()
    scale = torch.finfo(torch.float8_e4m3fn).max / seen[0].abs().max()
    zeros = ((seen[0] * scale).to(torch.float8_e4m3fn).float() == 0) & (seen[0] != 0)
    assert top.underflow == pytest.approx(zeros.float().mean().item())
    assert top.underflow > 0.9 and top.amax == OUTLIER
    assert all(e.cause == "resolution" for e in rep.entries if e.key != "big")


def test_entry_errors_match_an_eager_float64_step(planted):
    net, x, rep = planted
    for entry in (rep.entries[0], rep.entries[-1]):
        gm = fxdebug.fake_precision(net, [entry.key], entry.dtype)
        loss_error, grad_error = _errors(gm, net, x)
        assert entry.loss_error == pytest.approx(loss_error, rel=1e-3)
        assert entry.grad_error == pytest.approx(grad_error, rel=1e-3)
    loss_error, grad_error = _errors(fxdebug.trace(net), net, x)  # the float32 model as it is
    assert rep.float32["loss"] == pytest.approx(loss_error, rel=1e-3, abs=1e-12)
    assert rep.entries[0].loss_vs_float32 == rep.entries[0].loss_error / rep.float32["loss"]
    with torch.autocast("cpu", torch.bfloat16):
        loss = _loss(net(x))
    loss64, _ = _float64_step(net, x)
    autocast = abs(loss.double() - loss64).item() / abs(loss64).item()
    assert rep.autocast["loss"] == pytest.approx(autocast, rel=1e-3)


def test_chosen_set_is_within_the_budget_measured_independently(planted):
    net, x, rep = planted
    choice = rep.choose(budget=20, relative_to="autocast")
    assert choice.budget == pytest.approx(20 * rep.autocast["loss"])
    assert "big" not in choice.keys and choice.keys
    gm = fxdebug.fake_precision(net, list(choice.keys), choice.dtype)
    loss_error, grad_error = _errors(gm, net, x)
    assert loss_error <= choice.budget
    assert choice.measured["loss"] == pytest.approx(loss_error, rel=1e-3)
    assert choice.ok
    # converting everything passes the budget at the planted node, and says why
    assert choice.first_beyond is not None and choice.first_beyond.key == "big"
    assert choice.first_beyond.cause == "range"
    assert "underflow" in choice.first_beyond.text()
    everything = fxdebug.fake_precision(net, list(rep.keys), choice.dtype)
    assert _errors(everything, net, x)[0] > choice.budget


def test_first_beyond_is_the_earliest_prefix_over_the_budget_measured_independently(planted):
    """Every graph-order prefix converted (fake_precision) and measured against an eager
    float64 step here: the node named is the first whose prefix is over the budget, for budgets
    between each prefix's error (whichever node that makes first)."""
    net, x, rep = planted
    keys = list(rep.keys)
    errors = [_errors(fxdebug.fake_precision(net, keys[:k], "float8_e4m3fn"), net, x)[0]
              for k in range(1, len(keys) + 1)]
    levels = sorted(set(errors))
    budgets = [(a + b) / 2 for a, b in zip(levels, levels[1:]) if b > 1.01 * a
               and (a + b) / 2 > rep.float32["loss"]]
    assert budgets, errors  # the prefixes' errors differ (the planted node's range)
    for budget in budgets:
        first = next(k for k, error in enumerate(errors) if error > budget)
        found = rep.first_beyond(budget, dtype="float8_e4m3fn")
        assert found is not None and found.key == keys[first], (budget, errors)
        assert found.at == pytest.approx(errors[first], rel=1e-3)
    assert rep.first_beyond(max(errors) * 1.01, dtype="float8_e4m3fn") is None


def test_choice_by_gradient_error_and_bfloat16_recipe(planted):
    net, x, rep = planted
    choice = rep.choose(budget=1.0, relative_to="autocast", metric="grad", dtype="bfloat16")
    gm = fxdebug.fake_precision(net, list(choice.keys), "bfloat16")
    assert _errors(gm, net, x)[1] <= choice.budget
    assert choice.module_filter_fn(net.a, "a") == ("a" in choice.keys)
    assert choice.module_filter_fn(torch.nn.ReLU(), "a") is False
    recipe = choice.autocast_recipe(device="cpu")
    namespace = {"model": copy.deepcopy(net), "inputs": (x,), "loss_fn": _loss}
    exec(recipe, namespace)  # the recipe runs as written
    assert torch.isfinite(namespace["loss"])
    with pytest.raises(FxdebugError, match="module_filter_fn"):
        rep.choose(budget=1.0).autocast_recipe()


def test_table_fits_80_columns_and_report_is_plain_data(planted, monkeypatch):
    _, _, rep = planted
    monkeypatch.delenv("COLUMNS", raising=False)
    text = rep.table()
    assert max(map(len, text.splitlines())) <= 80
    assert "big" in text and "range" in text
    json.dumps(rep.to_dict())
    assert rep.to_dict()["entries"][0]["key"] == "big"
    assert "\n" not in repr(rep) and "big" in repr(rep)
    choice = rep.choose(budget=1e-2)
    assert max(map(len, choice.table().splitlines())) <= 80
    json.dumps(choice.to_dict())


def test_errors_a_user_can_hit(planted):
    net, x, rep = planted
    with pytest.raises(FxdebugError, match="below the float32 model"):
        rep.first_beyond(rep.float32["loss"] / 10)
    with pytest.raises(FxdebugError, match="relative_to"):
        rep.choose(budget=1, relative_to="bf16")
    with pytest.raises(FxdebugError, match="float16"):
        rep.choose(budget=1, dtype="float16")
    with pytest.raises(FxdebugError, match="inputs"):
        fxdebug.precision_sensitivity(net)


def test_module_filter_is_accepted_by_torchao(planted):
    torchao_float8 = pytest.importorskip(
        "torchao.float8", reason="torchao is not installed (pip install torchao)")
    net, _, rep = planted
    choice = rep.choose(budget=20, relative_to="autocast")
    converted = torchao_float8.convert_to_float8_training(
        copy.deepcopy(net), module_filter_fn=choice.module_filter_fn)
    kinds = {name: type(module).__name__ for name, module in converted.named_children()}
    assert kinds["big"] == "Linear"
    assert all(kinds[key] == "Float8Linear" for key in choice.linear_modules)


def test_the_callers_model_and_rng_are_left_as_they_were():
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(6, 4)
    state = torch.get_rng_state()
    rep = fxdebug.precision_sensitivity(net, x, dtypes=("bfloat16",))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in net.parameters())
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert rep.float32["loss"] < 1e-5  # dropout drew the same mask in float32 and float64


def test_float16_overflow_is_a_range_cause():
    torch.manual_seed(0)
    net, x = Planted(), torch.randn(8, 16)
    rep = fxdebug.precision_sensitivity(net, x, loss=_loss, dtypes=("float16", "float8_e5m2"))
    top = rep.entry("big", "float16")
    assert top.overflow == pytest.approx(1 / 33)  # the outlier channel: 1e6 > 65504
    assert top.cause == "range" and rep.entries[0] == top
    assert not torch.isfinite(fxdebug.fake_precision(net, ["big"], "float16")(x)).any()
    assert top.loss_error == float("inf") and "3%" in rep.table()
    assert json.loads(json.dumps(rep.to_dict()))["entries"][0]["loss_error"] == "inf"
    # e5m2's wider range holds the outlier and the small values together
    assert rep.entry("big", "float8_e5m2").cause == "resolution"
