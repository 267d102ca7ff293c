"""fake_precision: its casts against torch's own (and against the float8 formats decoded by
hand), and the pass's forward and backward against the same arithmetic written out eagerly."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

import fxdebug
from fxdebug.errors import FxdebugError, SelectionError
from fxdebug.runtime.fake_casts import cast_scaled, round_to

FLOAT8 = ["float8_e4m3fn", "float8_e5m2"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _decode(dtype: str) -> list[float]:
    """Every finite value of a float8 format, from its bit layout (not from torch)."""
    exponent_bits, mantissa_bits, bias = (4, 3, 7) if dtype == "float8_e4m3fn" else (5, 2, 15)
    values = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
        mantissa = code & ((1 << mantissa_bits) - 1)
        if dtype == "float8_e4m3fn" and exponent == 15 and mantissa == 7:
            continue  # NaN
        if dtype == "float8_e5m2" and exponent == 31:
            continue  # inf, NaN
        if exponent == 0:  # subnormal
            values.append(sign * mantissa / 2 ** mantissa_bits * 2.0 ** (1 - bias))
        else:
            values.append(sign * (1 + mantissa / 2 ** mantissa_bits) * 2.0 ** (exponent - bias))
    return values


@pytest.mark.parametrize("dtype", FLOAT8)
def test_float8_cast_is_torchs_cast_with_the_same_scale_bit_for_bit(dtype):
    fp8 = getattr(torch, dtype)
    top, normal = torch.finfo(fp8).max, torch.finfo(fp8).smallest_normal
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(4000, generator=generator) * 10 ** (torch.rand(4000, generator=generator)
                                                             * 14 - 10)
    special = torch.tensor([0.0, -0.0, top, -top, 2 * top, -5 * top, normal, normal / 2,
                            -normal / 4, normal / 8, normal * 2 ** -6, 1e-30])
    x = torch.cat([spread, special])
    for scale in (torch.tensor(1.0), torch.tensor(37.5), torch.tensor(3e-3)):
        got = cast_scaled(x, dtype, scale)
        want = (x * scale).clamp(-top, top).to(fp8).to(x.dtype) / scale
        assert torch.equal(_bits(got), _bits(want))
        # torch alone: the same everywhere but past the largest value, where e5m2 becomes inf
        # (e4m3fn saturates on the CPU of recent torch releases, not on every release)
        plain = (x * scale).to(fp8).to(x.dtype) / scale
        beyond = (x * scale).abs() > top
        assert beyond.any() or scale < 1
        assert torch.equal(_bits(got[~beyond]), _bits(plain[~beyond]))
        if dtype == "float8_e5m2":
            assert not torch.isfinite(plain[(x * scale).abs() > 1.1 * top]).any()
        assert torch.equal(got[beyond].abs(), torch.full_like(got[beyond], top) / scale)
    subnormal = (cast_scaled(x, dtype, torch.tensor(1.0)).abs() < normal) & (x.abs() >= normal / 8)
    assert subnormal.sum() > 10  # subnormals are kept, not flushed to zero


@pytest.mark.parametrize("dtype", FLOAT8)
def test_float8_cast_rounds_to_the_nearest_value_of_the_format(dtype):
    grid = torch.tensor(sorted(set(_decode(dtype))), dtype=torch.float64)
    assert torch.equal(cast_scaled(grid, dtype, torch.tensor(1.0)), grid)  # representable: kept
    x = torch.linspace(-float(grid.max()), float(grid.max()), 20001, dtype=torch.float64)
    got = cast_scaled(x, dtype, torch.tensor(1.0))
    nearest = (x[:, None] - grid[None, :]).abs().min(dim=1).values
    assert torch.equal((got - x).abs(), nearest)  # within a tie, either neighbour is as near


def test_tensorwise_and_rowwise_scales_are_torchaos():
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(1)) * 3
    top = torch.finfo(torch.float8_e4m3fn).max
    scale = (top / x.abs().amax().double()).float()
    assert torch.equal(round_to(x, "float8_e4m3fn"), cast_scaled(x, "float8_e4m3fn", scale))
    rows = (top / x.abs().amax(dim=-1, keepdim=True).double()).float()
    assert torch.equal(round_to(x, "float8_e4m3fn", (-1,)), cast_scaled(x, "float8_e4m3fn", rows))
    torch.testing.assert_close(round_to(x, "float8_e4m3fn", (-1,)).abs().amax(dim=-1),
                               x.abs().amax(dim=-1), rtol=1e-6, atol=0)  # amax onto the max


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_rounding_is_a_cast_round_trip(dtype):
    x = torch.randn(1000) * 10 ** (torch.rand(1000) * 12 - 6)
    want = x.to(getattr(torch, dtype)).to(torch.float32)
    assert torch.equal(_bits(round_to(x, dtype)), _bits(want))


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _mlp():
    torch.manual_seed(0)
    return Mlp(), torch.randn(5, 8)


def test_bfloat16_node_is_the_eager_computation_in_bfloat16_forward_and_backward():
    net, x = _mlp()
    gm = fxdebug.fake_precision(net, ["fc1"], "bfloat16")
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    x1 = x.clone().requires_grad_()
    out = gm(x1)
    target = torch.randn_like(out)
    (out * target).sum().backward()
    # eager: inputs and output of fc1 in bfloat16, gradients through it rounded as well
    w = net.fc1.weight.detach().clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    h = bf(F.linear(bf(x2), bf(w), bf(net.fc1.bias.detach())))
    assert torch.equal(gm(x), net.fc2(torch.tanh(h)))
    grad_h = torch.autograd.grad((net.fc2(torch.tanh(h)) * target).sum(), h)[0]
    g = bf(grad_h)
    torch.testing.assert_close(net.fc1.weight.grad, bf(g.T @ bf(x)), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x1.grad, bf(g @ bf(net.fc1.weight.detach())), rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_float8_linear_casts_input_and_weight_with_amax_scales_and_the_output_gradient(scaling):
    net, x = _mlp()
    gm = fxdebug.fake_precision(net, ["fc1"], "float8_e4m3fn", scaling=scaling)
    top = torch.finfo(torch.float8_e4m3fn).max

    def fp8(t, dims, dtype=torch.float8_e4m3fn):
        amax = t.abs().amax() if dims is None else t.abs().amax(dim=dims, keepdim=True)
        scale = (torch.finfo(dtype).max / amax.double().clamp(min=1e-12)).float()
        return (t * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max) \
            .to(dtype).float() / scale

    rows = (-1,) if scaling == "rowwise" else None
    w = net.fc1.weight.detach()
    h = F.linear(fp8(x, rows), fp8(w, rows), net.fc1.bias.detach())  # matmul in float32
    assert torch.equal(gm(x), net.fc2(torch.tanh(h)))
    assert top == 448.0
    # backward: the gradient into fc1's output in e5m2 (tensorwise) / e4m3 by rows (rowwise)
    net.zero_grad()
    out = gm(x)
    target = torch.randn_like(out)
    (out * target).sum().backward()
    hh = h.clone().requires_grad_()
    grad_h = torch.autograd.grad((net.fc2(torch.tanh(hh)) * target).sum(), hh)[0]
    g = fp8(grad_h, None, torch.float8_e5m2) if scaling == "tensorwise" else fp8(grad_h, (-1,))
    torch.testing.assert_close(net.fc1.weight.grad, g.T @ fp8(x, rows), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(net.fc1.bias.grad, g.sum(0), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(net.fc1.weight.grad, grad_h.T @ fp8(x, rows), rtol=1e-4, atol=0)


def test_backward_false_leaves_gradients_unrounded():
    net, x = _mlp()
    gm = fxdebug.fake_precision(net, ["fc1"], "float8_e4m3fn", grads=False)
    assert "float8_e5m2" not in gm.code
    x1 = x.clone().requires_grad_()
    gm(x1).sum().backward()
    grad = x1.grad.clone()
    x2 = x.clone().requires_grad_()
    w8 = round_to(net.fc1.weight.detach(), "float8_e4m3fn")
    h = F.linear(round_to(x2, "float8_e4m3fn").detach() + (x2 - x2.detach()), w8, net.fc1.bias)
    net.fc2(torch.tanh(h)).sum().backward()
    torch.testing.assert_close(grad, x2.grad, rtol=1e-6, atol=1e-7)  # straight through the cast


def test_the_pass_shows_in_code_and_diff_and_survives_copies():
    net, x = _mlp()
    gm = fxdebug.fake_precision(net, ["fc2"], "float8_e5m2")
    assert gm.code.count("fake_cast(") == 3
    assert "'float8_e5m2'" in gm.code
    diff = fxdebug.diff(fxdebug.trace(net), gm)
    added = [row.key for row in diff.rows if row.mark == "+"]
    assert "fc2:fake" in added and any(key.startswith("fc2:") for key in added)
    assert "fake_cast" in diff.code_diff()
    for copied in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
        assert torch.equal(copied(x), gm(x))
    assert not torch.equal(gm(x), net(x))


def test_select_by_pattern_and_module_type():
    net, _ = _mlp()
    gm = fxdebug.fake_precision(net, [torch.nn.Linear], "bfloat16")
    assert "fc1_fake" in gm.code and "fc2_fake" in gm.code
    gm = fxdebug.fake_precision(net, "fc*", "bfloat16")
    assert "fc1_fake" in gm.code and "fc2_fake" in gm.code
    with pytest.raises(SelectionError, match="fc3"):
        fxdebug.fake_precision(net, ["fc3"], "bfloat16")
    with pytest.raises(FxdebugError, match="float8_e4m3fn"):
        fxdebug.fake_precision(net, ["fc1"], "int8")
    with pytest.raises(FxdebugError, match="rowwise"):
        fxdebug.fake_precision(net, ["fc1"], "float8_e4m3fn", scaling="blockwise")
